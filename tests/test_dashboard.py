"""`agentrl dashboard` on the database of a real run (the session's `minirl_example.sh` run: engine, sampler,
trainer, evaluations), started with the very command the example prints: the JSON API's fields and status codes,
the token and security rules, and every page loaded in a real headless Chromium (screenshots in bench/results/)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentrl.dashboard.tokens import calls_views
from agentrl.store import sync_client
from agentrl.store.embedded import embedded_server
from browser import CHROMIUM, Browser
from example_fixtures import RUN_NAME, ExampleRun

pytestmark = pytest.mark.slow(start_rank=1)

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "bench" / "results"
BIN = Path(sys.executable).parent


def start_dashboard(command: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Run a shell command that starts `agentrl dashboard`; returns the process and the URL it prints."""
    process = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True,
                               env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})})
    seen = []
    for line in process.stdout:
        seen.append(line)
        found = re.search(r"dashboard: (http://\S+/) ", line)
        if found:
            return process, found.group(1)
    raise AssertionError("the dashboard did not start:\n" + "".join(seen))


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=20)


@pytest.fixture(scope="module")
def run(minirl_example_run: ExampleRun) -> Iterator[tuple[str, ExampleRun]]:
    """The dashboard URL, started as the example's summary says (on a free port instead of 8080)."""
    done = minirl_example_run.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = next(line for line in done.stdout.splitlines() if line.strip().startswith("dashboard:"))
    process, url = start_dashboard(printed.split("dashboard:", 1)[1].strip() + " --port 0")
    try:
        yield url, minirl_example_run
    finally:
        stop(process)
        embedded_server(minirl_example_run.db_dir).stop()


def get(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.get(url.rstrip("/") + path, timeout=30, **kwargs)


def test_the_api_lists_runs_and_describes_a_run(run) -> None:
    url, _ = run
    runs = {r["run"]: r for r in get(url, "/api/runs").json()["runs"]}
    assert set(runs) == {RUN_NAME, f"{RUN_NAME}-warmup"}  # the RL run and its SFT warm-up
    rl = runs[RUN_NAME]
    assert rl["status"] == "finished" and rl["policy_version"] == 1 and rl["steps"] == 1
    assert rl["records"] >= 4 and rl["tokens_per_s"] > 0 and rl["reward_mean"] is not None
    assert runs[f"{RUN_NAME}-warmup"]["steps"] >= 1 and runs[f"{RUN_NAME}-warmup"]["reward_mean"] is None

    info = get(url, f"/api/runs/{RUN_NAME}").json()
    assert info["config"]["loss_calculater"] == "MINIRL" and "db_connection_string" not in info["config"]
    assert info["counts"]["DBRecordData"]["trained"] == 4
    assert sum(info["counts"]["Record"].values()) == rl["records"]
    assert [e["name"] for e in info["evals"]] == [f"{RUN_NAME} {label}" for label in ("before", "warmup", "after")]
    assert info["evals"][0]["metrics"]["accuracy"] == 1.0
    assert info["reward_by_version"][0]["policy_version"] == 0
    not_trained = sum(info["counts"]["Record"][state] for state in ("failed", "abandoned"))
    assert sum(info["failures"].values()) == not_trained
    assert "train" in info["splits"] and any(s.startswith("eval:") for s in info["splits"])

    (step,) = get(url, f"/api/runs/{RUN_NAME}/metrics").json()["metrics"]
    assert step["step"] == 1 and step["samples_trained"] == 4
    assert {"loss", "reward_mean", "clip_fraction", "staleness_mean", "logprob_mismatch_mean",
            "tokens_per_s"} <= set(step["values"])
    assert get(url, f"/api/runs/{RUN_NAME}/metrics?split=nothing").json()["metrics"] == []


def test_records_filter_and_paginate(run) -> None:
    url, _ = run
    every = get(url, f"/api/runs/{RUN_NAME}/records?limit=500").json()
    total = every["total"]
    assert total == len(every["records"]) >= 6
    row = every["records"][0]
    assert {"id", "task_id", "split", "status", "outcome", "score", "advantage", "group_decision",
            "policy_version", "num_turns", "finished_at"} <= set(row)
    assert "meta" not in row and "score_details" not in row  # lists carry no heavy fields
    pages = [get(url, f"/api/runs/{RUN_NAME}/records?limit=2&offset={offset}").json()
             for offset in range(0, total, 2)]
    assert [r["id"] for page in pages for r in page["records"]] == [r["id"] for r in every["records"]]
    assert all(page["total"] == total for page in pages)

    trained = get(url, f"/api/runs/{RUN_NAME}/records?status=trained&split=train").json()
    assert trained["total"] >= 1 and {r["status"] for r in trained["records"]} == {"trained"}
    assert trained["filters"] == {"status": "trained", "split": "train"}
    scored = get(url, f"/api/runs/{RUN_NAME}/records?min_score=0.5&max_score=1").json()
    assert all(0.5 <= r["score"] <= 1 for r in scored["records"])
    assert scored["total"] == sum(1 for r in every["records"] if r["score"] is not None and 0.5 <= r["score"] <= 1)
    task_id = trained["records"][0]["task_id"]
    by_task = get(url, f"/api/runs/{RUN_NAME}/records?task_id={task_id}&policy_version=0").json()
    assert by_task["total"] >= 1 and {r["task_id"] for r in by_task["records"]} == {task_id}
    decision = trained["records"][0]["group_decision"]
    assert get(url, f"/api/runs/{RUN_NAME}/records", params={"group_decision": decision}).json()["total"] >= 1
    assert get(url, f"/api/runs/{RUN_NAME}/records?outcome=nothing-like-this").json()["total"] == 0
    info = get(url, f"/api/runs/{RUN_NAME}").json()
    for failure, n in info["failures"].items():  # the run page's per-class counts link to these lists
        listed = get(url, f"/api/runs/{RUN_NAME}/records", params={"failure_class": failure, "limit": 500}).json()
        assert listed["total"] == n and {r.get("failure_class") or "unknown" for r in listed["records"]} == {failure}
    run_page = get(url, f"/runs/{RUN_NAME}")
    assert run_page.status_code == 200 and "Not trained, by failure class" in run_page.text
    page = get(url, f"/runs/{RUN_NAME}/records", params={"failure_class": "cancelled"})
    assert page.status_code == 200 and '<select name="failure_class">' in page.text

    for query, field in (("colour=red", "colour: unknown filter"), ("min_score=high", "min_score"),
                         ("status=sleeping", "status"), ("failure_class=bad_luck", "failure_class"),
                         ("limit=0", "limit"), ("limit=100000", "limit"),
                         ("offset=-1", "offset"), ("policy_version=v2", "policy_version")):
        response = get(url, f"/api/runs/{RUN_NAME}/records?{query}")
        assert response.status_code == 400 and field in response.json()["detail"], (query, response.text)


def test_a_record_comes_with_its_calls_and_training_sample(run) -> None:
    url, _ = run
    (row,) = get(url, f"/api/runs/{RUN_NAME}/records?status=trained&limit=1").json()["records"]
    record = get(url, f"/api/runs/{RUN_NAME}/records/{row['id']}").json()
    assert record["id"] == row["id"] and record["task"]["query"] == "What is 9 + 10?"
    first = record["calls"][0]
    assert first["turn"] == 0 and first["input_ids"] and first["output_ids"] and first["output_text"]
    assert len(first["output_logprobs"]) == len(first["output_ids"])
    (sample,) = record["samples"]
    assert sample["status"] == "trained" and sample["trainer_version"] == 0
    assert len(sample["trainer_logprobs"]) == len(sample["logprobs"]) == len(sample["input_ids"])
    # version 0 trained these tokens: the trainer's logprobs are the engine's (token-exact merging), within the
    # precision bound of a bf16 trainer (--dtype auto on a CPU with bf16 units; fp32 elsewhere: ~1e-6); a token
    # merged one position off would be off by nats
    gaps = [abs(t - e) for t, e, m in zip(sample["trainer_logprobs"], sample["logprobs"], sample["loss_mask"]) if m]
    assert sum(gaps) / len(gaps) < 0.02 and max(gaps) < 0.1, gaps

    # without its sample, the same tokens come back rebuilt from the calls by the trainer's prefix merge
    (rebuilt,) = calls_views(record["calls"])
    assert rebuilt["ids"][:len(sample["input_ids"])] == sample["input_ids"]
    assert all(ours >= theirs for ours, theirs in zip(rebuilt["mask"], sample["loss_mask"]))
    assert rebuilt["turn_starts"][:len(sample["turn_boundaries"])] == sample["turn_boundaries"]

    group = get(url, f"/api/runs/{RUN_NAME}/tasks/{record['task_id']}").json()
    assert group["id"] == record["task_id"] and len({(r["slot"]) for r in group["records"]}) == 4
    assert all(r["calls"] and r["calls"][0]["output_text"] for r in group["records"])


def test_unknown_things_are_404_and_the_api_is_read_only(run) -> None:
    url, _ = run
    for path in ("/api/runs/no_such_run", "/api/runs/no_such_run/metrics", "/api/runs/no_such_run/records",
                 f"/api/runs/{RUN_NAME}/records/no/such/record", f"/api/runs/{RUN_NAME}/tasks/no-such-task",
                 "/runs/no_such_run", f"/runs/{RUN_NAME}/records/no/such/record"):
        response = get(url, path)
        assert response.status_code == 404, path
    assert "no_such_run" in get(url, "/api/runs/no_such_run").json()["detail"]
    assert httpx.post(url + f"api/runs/{RUN_NAME}", timeout=10).status_code == 405
    assert httpx.delete(url + f"api/runs/{RUN_NAME}/records", timeout=10).status_code == 405


def test_a_token_guards_an_exposed_dashboard_and_secrets_are_never_printed(run) -> None:
    _, example = run
    db = embedded_server(example.db_dir).uri()
    refused = subprocess.run([str(BIN / "agentrl"), "dashboard", "--db_connection_string", db, "--host", "0.0.0.0",
                              "--port", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--auth_token_env" in refused.stderr
    unset = subprocess.run([str(BIN / "agentrl"), "dashboard", "--db_connection_string", db, "--auth_token_env",
                            "AGENTRL_TEST_UNSET_TOKEN", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert unset.returncode == 2 and "AGENTRL_TEST_UNSET_TOKEN" in unset.stderr

    nobody = subprocess.run([str(BIN / "agentrl"), "dashboard", "--db_connection_string",
                             "mongodb://auditor:hunter2@127.0.0.1:9/", "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 2 and "no MongoDB server answers at mongodb://***@127.0.0.1:9/" in nobody.stderr
    assert "hunter2" not in nobody.stdout + nobody.stderr

    process, guarded = start_dashboard(f"agentrl dashboard --db_connection_string {db} --port 0 "
                                       "--auth_token_env DASH_TOKEN", env={"DASH_TOKEN": "s3cret-token"})
    try:
        assert get(guarded, "/api/runs").status_code == 401
        assert get(guarded, "/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert get(guarded, "/api/runs", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
        with httpx.Client(base_url=guarded, timeout=30, follow_redirects=True) as browser:
            assert browser.get(f"/runs/{RUN_NAME}?token=wrong").status_code == 401
            page = browser.get(f"/runs/{RUN_NAME}?token=s3cret-token")  # sets the cookie, drops ?token
            assert page.status_code == 200 and str(page.url).endswith(f"/runs/{RUN_NAME}")
            assert browser.get("/api/runs").status_code == 200
    finally:
        stop(process)
        output = process.stdout.read()
    assert "s3cret-token" not in output


def chromium(url: str, tmp_path: Path, *, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (or a screenshot of it) from headless Chromium."""
    args = [CHROMIUM, "--headless", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000",
            f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=5000"]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to sandbox itself as root
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run(args + [url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: scripts/test.sh installs the Debian package as root")
def test_every_page_in_a_headless_browser(run, tmp_path: Path) -> None:
    url, _ = run
    (row,) = get(url, f"/api/runs/{RUN_NAME}/records?status=trained&limit=1").json()["records"]
    record = get(url, f"/api/runs/{RUN_NAME}/records/{row['id']}").json()
    pages = {
        "runs": ("", [f'href="/runs/{RUN_NAME}"', "finished"]),
        "run": (f"runs/{RUN_NAME}", ["Learning curves", 'aria-label="reward"', 'aria-label="loss"',
                                      "Mean score per policy version", f"{RUN_NAME} before", "DBRecordData",
                                      "Not trained, by failure class"]),
        "records": (f"runs/{RUN_NAME}/records?split=train", [row["id"], "group decision", "of "]),
        "record": (f"runs/{RUN_NAME}/records/{row['id']}", ["Conversation", "What is 9 + 10?",
                                                            "trainer logprobs of policy v0"]),
        "task": (f"runs/{RUN_NAME}/tasks/{row['task_id']}", ["Its group, side by side", row["id"]]),
    }
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name, (path, expected) in pages.items():
        dom = chromium(url + path, tmp_path)
        for text in expected:
            assert text in dom, (name, text)
        chromium(url + path, tmp_path, screenshot=SCREENSHOTS / f"dashboard_{name}.png")
        assert (SCREENSHOTS / f"dashboard_{name}.png").stat().st_size > 10_000, name
    # the token view is built by the page's script: one span per token of the training sample, coloured
    dom = chromium(url + pages["record"][0], tmp_path)
    assert len(re.findall(r'<span data-i="\d+"', dom)) == len(record["samples"][0]["input_ids"])
    assert re.search(r'<span data-i="\d+"[^>]* style="background: rgba', dom)  # trained tokens coloured by logprob
    # an evaluation's record has no training sample: its page shows the tokens rebuilt from its calls
    split = next(s for s in get(url, f"/api/runs/{RUN_NAME}").json()["splits"] if s.startswith("eval:"))
    (evaluated,) = get(url, f"/api/runs/{RUN_NAME}/records", params={"split": split, "limit": 1}).json()["records"]
    calls = get(url, f"/api/runs/{RUN_NAME}/records/{evaluated['id']}").json()["calls"]
    dom = chromium(url + f"runs/{RUN_NAME}/records/{evaluated['id']}", tmp_path)
    assert "rebuilt from the LLM calls" in dom
    assert len(re.findall(r'<span data-i="\d+"', dom)) == sum(len(v["ids"]) for v in calls_views(calls))


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: scripts/test.sh installs the Debian package as root")
def test_a_running_runs_page_refreshes_itself_until_the_run_ends(run, tmp_path: Path) -> None:
    url, example = run
    client = sync_client(embedded_server(example.db_dir).uri(RUN_NAME))
    runs = client.get_default_database().Run
    saved = runs.find_one({"_id": "run"}, {"status": 1, "policy_version": 1})
    browser = Browser(tmp_path / "profile")
    try:
        runs.update_one({"_id": "run"}, {"$set": {"status": "running"}})
        browser.open(url + f"runs/{RUN_NAME}")
        assert browser.evaluate("document.querySelector('#live .live') !== null")  # the "live" badge
        runs.update_one({"_id": "run"}, {"$set": {"status": "finished", "policy_version": 77}})
        # within a refresh (every 5 s) the page shows the new state, without reloading the document
        browser.evaluate("window.notReloaded = true")
        browser.wait_for("document.querySelector('#live').innerText.includes('policy version 77')", timeout_s=15)
        assert browser.evaluate("window.notReloaded === true && document.querySelector('#live .live') === null")
    finally:
        browser.close()
        runs.update_one({"_id": "run"}, {"$set": {"status": saved["status"],
                                                  "policy_version": saved["policy_version"]}})
        client.close()
