"""`agentrl eval` end to end: the real command, a real engine on the scripted tiny model (started by the
evaluation, or live), the real calculator MCP server over stdio, the embedded database. Stored results are
reused, ``--force`` recomputes, repeats and per-type metrics agree with the Records, bad task files write nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from agentrl.eval.metrics import pass_at_k
from rollout_fixtures import agentrl_cmd, documents, run_env, upload, write_mcp_config
from scripted_model import SCRIPTS

pytestmark = pytest.mark.slow(start_rank=11)

TYPES = {"add": "sum", "mul": "product", "coin": "sum", "bad": "difference"}


def write_tasks(path: Path, ids: tuple[str, ...]) -> Path:
    rows = [{"id": s.task_id, "question": s.question, "answer": s.answer, "task_type": TYPES[s.task_id]}
            for s in SCRIPTS if s.task_id in ids]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(*args: str, expect: int = 0, timeout: float = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(agentrl_cmd("eval", *args), capture_output=True, text=True, env=run_env(), timeout=timeout)
    assert done.returncode == expect, done.stdout + done.stderr
    return done


def common(db_uri: str, tmp_path: Path) -> list[str]:
    return ["--db_connection_string", db_uri, "--mcp_config", str(write_mcp_config(tmp_path / "mcp.json")),
            "--scorer", "math", "--answer_schema", "boxed", "--max_turns", "3", "--max_new_tokens", "40"]


def test_greedy_eval_of_a_checkpoint_is_stored_reused_and_forced(db_uri: str, tmp_path: Path,
                                                                 scripted_model_dir: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", ("add", "mul", "bad"))
    out = tmp_path / "out" / "eval.json"
    args = [*common(db_uri, tmp_path), "--tasks", str(tasks), "--model_name_or_path", str(scripted_model_dir),
            "--engine_args", "--num_threads 1 --max_total_tokens 8192", "--num_samples_per_task", "2",
            "--output", str(out)]
    done = run_eval(*args)
    result = json.loads(out.read_text())
    assert not result["reused"] and result["status"] == "completed" and result["generation"] == 0
    rows = {row["id"]: row for row in result["per_task"]}
    # Greedy: the scripted model calls the calculator, reads the result and answers right.
    for task in ("add", "mul"):
        assert rows[task] == {"id": task, "type": TYPES[task], "valid": 2, "correct": 2, "errors": 0,
                              "mean_reward": 1.0}
    metrics = result["metrics"]
    assert metrics["samples"] == 6 and metrics["errors"] == 0 and metrics["k"] == 2
    correct = sum(r["correct"] for r in rows.values())
    assert metrics["accuracy"] == pytest.approx(correct / 6)
    assert metrics["pass@2"] == pytest.approx(sum(r["correct"] > 0 for r in rows.values()) / 3)
    assert set(result["by_type"]) == {"sum", "product", "difference"}
    assert result["by_type"]["product"]["pass@1"] == 1.0
    assert "pass@2" in done.stdout and "product" in done.stdout  # the table

    [stored] = documents(db_uri, "Eval")
    assert stored["_id"] == result["key"] and stored["metrics"]["accuracy"] == metrics["accuracy"]
    records = documents(db_uri, "Record")
    assert len(records) == 6 and {r["split"] for r in records} == {result["split"]}
    assert {r["status"] for r in records} == {"ready"}
    assert documents(db_uri, "InferenceService") == []  # the evaluation's engine is never offered to the run
    assert documents(db_uri, "DBRecordData") == []  # nothing is queued for training

    started = time.monotonic()
    again = run_eval(*args)
    assert "reused" in again.stdout and time.monotonic() - started < 30
    assert json.loads(out.read_text())["reused"] and len(documents(db_uri, "Record")) == 6

    forced = run_eval(*args, "--force", "--json")
    fresh = json.loads(forced.stdout)
    assert not fresh["reused"] and fresh["generation"] == 1 and fresh["key"] == result["key"]
    assert fresh["split"] != result["split"] and fresh["metrics"]["accuracy"] == metrics["accuracy"]
    assert len(documents(db_uri, "Record")) == 12 and len(documents(db_uri, "Eval")) == 1


def test_sampled_eval_of_a_stored_split_on_a_live_service_with_repeats(db_uri: str, tmp_path: Path,
                                                                         scripted_model_dir: Path,
                                                                         scripted_engine_url: str) -> None:
    upload(db_uri, write_tasks(tmp_path / "tasks.jsonl", ("add", "coin")), "--split", "heldout")
    args = [*common(db_uri, tmp_path), "--split", "heldout", "--inference_urls", scripted_engine_url,
            "--model_name_or_path", str(scripted_model_dir), "--num_samples_per_task", "2", "--repeats", "2",
            "--temperature", "1.0", "--json"]
    result = json.loads(run_eval(*args, "--seed", "7").stdout)
    assert result["model"]["weight_version"] == "0" and result["tasks_source"] == "split:heldout"
    records = documents(db_uri, "Record", {"split": result["split"]})
    assert len(records) == 8 and all(r["score"] is not None for r in records)
    by_task: dict[str, list[dict]] = {}
    for record in records:
        by_task.setdefault(record["task_id"].rsplit(":", 1)[1], []).append(record)
    correct = {t: sum(r["score"] >= 0.5 for r in rs) for t, rs in by_task.items()}
    metrics = result["metrics"]
    # pass@k and avg@k use all k × R = 4 samples of each task.
    assert metrics["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in correct.values()) / 2)
    assert metrics["pass@1"] == pytest.approx(sum(c / 4 for c in correct.values()) / 2)
    assert metrics["avg@2"] == metrics["pass@1"] and metrics["accuracy"] == pytest.approx(sum(correct.values()) / 8)
    assert len(metrics["by_repeat"]) == 2
    for r, repeat in enumerate(metrics["by_repeat"]):
        mine = [rec for rec in records if rec["slot"] // 2 == r]
        assert repeat["accuracy"] == pytest.approx(sum(rec["score"] >= 0.5 for rec in mine) / 4)
    assert result["by_type"]["sum"]["tasks"] == 2
    # The stored split itself is untouched: the evaluation worked on its own copy.
    assert {t["status"] for t in documents(db_uri, "Task", {"split": "heldout"})} == {"created"}

    assert json.loads(run_eval(*args, "--seed", "7").stdout)["reused"]
    other = json.loads(run_eval(*args, "--seed", "8").stdout)  # another seed: another evaluation
    assert not other["reused"] and other["key"] != result["key"] and len(documents(db_uri, "Eval")) == 2


def test_bad_task_file_names_file_and_line_and_writes_nothing(db_uri: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "ok", "question": "1 + 1?", "answer": "2"}\n{"id": "x", "question": \n'
                   '{"id": "y", "question": "2 + 2?"}\n')
    done = run_eval("--db_connection_string", db_uri, "--tasks", str(bad), "--scorer", "math",
                    "--inference_urls", "http://127.0.0.1:9", expect=2)
    assert f"{bad}:2: invalid JSON" in done.stderr and f"{bad}:3: no answer" in done.stderr
    assert "nothing was evaluated" in done.stderr
    for collection in ("Eval", "Task", "Record"):
        assert documents(db_uri, collection) == []
    missing = run_eval("--db_connection_string", db_uri, "--tasks", str(tmp_path / "nope.jsonl"), expect=2)
    assert "nope.jsonl: no such file" in missing.stderr
