"""`agentrl dashboard` on a big run: how long each page and API call takes, against reading the same documents
straight from the database (the floor), and how long headless Chromium takes to build the token view of a
30,000-token trajectory.

    .venv/bin/python bench/dashboard.py [--records 12000] [--long_tokens 30000] [--repeats 7]

A fresh embedded database (NX-27017) gets one run written through the store's document models: ``--records``
trajectories in groups of 4 (two LLM calls each, half of them made into training samples), 500 trainer steps of
metrics, two evaluations, and one trajectory of ``--long_tokens`` tokens over 40 turns with its training sample.
`agentrl dashboard` serves it; every figure is the median of ``--repeats`` requests after one warm-up request (the
cold figure, with the tokenizer's first decode of the long trajectory, is reported too). Baseline: the same
documents read with PyMongo in this process (no rendering, no HTTP). Browser: headless Chromium loads the record page;
the page notes when its token view is built (``performance.now()``, from navigation start: request, HTML and JSON
parsing, 30,000 spans). Results: ``--out`` (JSON) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx
from pymongo import MongoClient

ROOT = Path(__file__).resolve().parent.parent
RUN = "bench-dashboard"
LONG_ID = "train:long/0/0"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=12_000)
    parser.add_argument("--long_tokens", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dashboard.json")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def populate(db, records: int, long_tokens: int) -> None:
    """One run: tasks, records, calls, samples, metrics, evaluations, and one long trajectory."""
    from agentrl.store.indexes import ensure_indexes_sync
    from agentrl.store.models import utcnow

    rng = random.Random(0)
    ensure_indexes_sync(db)
    start = utcnow() - timedelta(hours=2)
    write_run(db, rng, start)
    write_groups(db, rng, start, records // 4)
    write_long_trajectory(db, rng, start, long_tokens)
    write_evals(db, start)


def write_run(db, rng: random.Random, start: datetime) -> None:
    """The Run document and 500 trainer steps of metrics."""
    from agentrl.store.models import Metric, Run, RunStatus

    db.Run.insert_one(Run(id="run", name=RUN, status=RunStatus.RUNNING, policy_version=500, created_at=start,
                          config={"model_name_or_path": None, "loss_calculater": "GRPO"}).to_mongo())
    db.Metric.insert_many([Metric(id=f"train/{s}", step=s, values={
        "loss": rng.gauss(0, 0.3), "reward_mean": min(1.0, s / 500 + rng.random() * 0.2),
        "clip_fraction": rng.random() * 0.02, "masked_fraction": 0.0, "staleness_mean": rng.random(),
        "staleness_max": 1.0, "tokens_per_s": 900 + rng.random() * 100,
        "logprob_mismatch_mean": 1e-3 * rng.random(), "grad_norm": rng.random() * 5},
        sample_ids=[f"s{s}-{i}" for i in range(16)]).to_mongo() for s in range(1, 501)])


def write_groups(db, rng: random.Random, start: datetime, groups: int) -> None:
    """``groups`` tasks with their groups of 4 records, written in batches of 2000 documents per collection."""
    batches: dict[str, list[dict]] = {"Task": [], "Record": [], "DispatchedSamplingTask": [], "DBRecordData": []}

    def flush(force: bool = False) -> None:
        for name, batch in batches.items():
            if batch and (force or len(batch) >= 2000):
                db[name].insert_many(batch, ordered=False)
                batch.clear()

    for index in range(groups):
        for name, docs in group_documents(rng, start, index, groups).items():
            batches[name].extend(docs)
        flush()
    flush(force=True)


def group_documents(rng: random.Random, start: datetime, index: int, groups: int) -> dict[str, list[dict]]:
    """Task ``index``, its 4 records with two LLM calls each, and the training samples of those trained."""
    from agentrl.store.models import DBRecordData, DispatchedSamplingTask, Record, RecordStatus, Task

    statuses = [RecordStatus.TRAINED, RecordStatus.ABANDONED, RecordStatus.READY, RecordStatus.FAILED]
    task_id = f"train:t{index:05d}"
    docs: dict[str, list[dict]] = {"Task": [], "Record": [], "DispatchedSamplingTask": [], "DBRecordData": []}
    docs["Task"].append(Task(id=task_id, query=f"What is {index} + 1?", answer=str(index + 1), content_hash=task_id,
                             num_generations=4, unclaimed=0, remaining=0, status="completed",
                             group_stage_done=True, order=index).to_mongo())
    for slot in range(4):
        record_id = f"{task_id}/{slot}/0"
        score = float(rng.random() < 0.5)
        status = statuses[(index + slot) % len(statuses)]
        created = start + timedelta(seconds=index * 4 + slot)
        docs["Record"].append(Record(
            id=record_id, task_id=task_id, slot=slot, attempt=0, lease_id="l", lease_owner="s", leased=False,
            lease_expires_at=created, status=status, num_turns=2, outcome="answer", score=score,
            advantage=score - 0.5, group_decision="kept", policy_version=index * 500 // groups, created_at=created,
            finished_at=created + timedelta(seconds=3)).to_mongo())
        prompt = [rng.randrange(49152) for _ in range(60)]
        outputs = [[rng.randrange(49152) for _ in range(30)] for _ in range(2)]
        for turn in range(2):
            docs["DispatchedSamplingTask"].append(DispatchedSamplingTask(
                id=f"{record_id}#{turn}", record_id=record_id, task_id=task_id, turn=turn, status="completed",
                input_ids=prompt if turn == 0 else None, prompt_delta_ids=[] if turn == 0 else prompt[:10],
                output_ids=outputs[turn], output_logprobs=[-rng.random() for _ in outputs[turn]],
                output_text=f"turn {turn} of {record_id}", weight_version=0, latency_s=1.0).to_mongo())
        if status == RecordStatus.TRAINED:
            ids = prompt + outputs[0] + prompt[:10] + outputs[1]
            mask = [0] * 60 + [1] * 30 + [0] * 10 + [1] * 30
            docs["DBRecordData"].append(DBRecordData(
                id=f"{record_id}#b0", record_id=record_id, task_id=task_id, seq=index * 4 + slot, input_ids=ids,
                loss_mask=mask, logprobs=[-rng.random() * m for m in mask], versions=[0 if m else -1 for m in mask],
                advantages=[(score - 0.5) * m for m in mask], num_tokens=len(ids), status="trained").to_mongo())
    return docs


def write_long_trajectory(db, rng: random.Random, start: datetime, long_tokens: int) -> None:
    """The long trajectory: 40 turns of prompt delta + output, with its task, record and training sample."""
    from agentrl.store.models import DBRecordData, DispatchedSamplingTask, Record, RecordStatus, Task

    turns = 40
    per_turn = long_tokens // turns
    ids, mask, lps, calls = [], [], [], []
    for turn in range(turns):
        prompt = [rng.randrange(49152) for _ in range(per_turn // 3)]
        output = [rng.randrange(49152) for _ in range(per_turn - len(prompt))]
        logprobs = [-rng.random() * 3 for _ in output]
        calls.append(DispatchedSamplingTask(
            id=f"{LONG_ID}#{turn}", record_id=LONG_ID, task_id="train:long", turn=turn, status="completed",
            input_ids=prompt if turn == 0 else None, prompt_delta_ids=[] if turn == 0 else prompt,
            output_ids=output, output_logprobs=logprobs, output_text=f"output of turn {turn}",
            prompt_delta_text=f"tool result {turn}", weight_version=turn // 10, latency_s=2.0,
            tool_calls=[{"id": f"c{turn}", "name": "calculate", "arguments": {"expression": "1+1"}}],
            tool_results=[{"id": f"c{turn}", "name": "calculate", "status": "ok", "content": "2"}]).to_mongo())
        ids += prompt + output
        mask += [0] * len(prompt) + [1] * len(output)
        lps += [0.0] * len(prompt) + logprobs
    db.Task.insert_one(Task(id="train:long", query="a long agent episode", content_hash="long", unclaimed=0,
                            remaining=0).to_mongo())
    db.Record.insert_one(Record(id=LONG_ID, task_id="train:long", slot=0, attempt=0, lease_id="l", lease_owner="s",
                                leased=False, lease_expires_at=start, status=RecordStatus.TRAINED, num_turns=turns,
                                score=1.0, advantage=0.5, policy_version=0, created_at=start).to_mongo())
    db.DispatchedSamplingTask.insert_many(calls)
    db.DBRecordData.insert_one(DBRecordData(
        id=f"{LONG_ID}#b0", record_id=LONG_ID, task_id="train:long", seq=0, input_ids=ids, loss_mask=mask,
        logprobs=lps, versions=[0 if m else -1 for m in mask], advantages=[0.5 * m for m in mask],
        trainer_logprobs=[lp + 0.01 * m for lp, m in zip(lps, mask)], trainer_version=3, num_tokens=len(ids),
        status="trained").to_mongo())


def write_evals(db, start: datetime) -> None:
    """Two evaluations: before (accuracy 0.2) and after (0.6)."""
    from agentrl.store.evals import Eval

    for name, accuracy in (("before", 0.2), ("after", 0.6)):
        db.Eval.insert_one(Eval(id=name, name=f"{RUN} {name}", status="completed", split=f"eval:{name}",
                                num_tasks=64, metrics={"accuracy": accuracy, "mean_reward": accuracy},
                                created_at=start, started_at=start, finished_at=start).to_mongo())


def timed(fn, repeats: int) -> tuple[float, float]:
    """(cold: the first call, median of ``repeats`` later calls) in milliseconds."""
    started = time.perf_counter()
    fn()
    cold = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return cold, statistics.median(times)


def start_dashboard(uri: str, port: int) -> subprocess.Popen:
    """`agentrl dashboard` on ``port``, once it says it serves."""
    command = [str(ROOT / ".venv" / "bin" / "agentrl"), "dashboard", "--db_connection_string", uri,
               "--port", str(port)]
    dashboard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in dashboard.stdout:
        if line.startswith("dashboard:"):
            break
    return dashboard


def raw_reads(db) -> dict:
    """The baseline per case: the documents each page reads, straight from the database."""
    from agentrl.store.summary import count  # what the dashboard counts with ($count, fast on NX-27017)

    records = db.Record
    return {
        "runs": lambda: (list(db.Run.find()), list(db.Metric.find({}, sort=[("step", -1)], limit=1))),
        "run": lambda: (list(db.Metric.find({"split": "train"}, sort=[("step", 1)])),
                        list(records.aggregate([{"$group": {"_id": "$status", "n": {"$sum": 1}}}]))),
        "records": lambda: (list(records.find({}, sort=[("created_at", -1)], limit=50)),
                            count(records, {})),
        "records_filtered": lambda: (list(records.find({"status": "trained", "score": {"$gte": 0.5}},
                                                       sort=[("created_at", -1)], limit=50)),
                                     count(records, {"status": "trained", "score": {"$gte": 0.5}})),
        "records_deep": lambda: (list(records.find({}, sort=[("created_at", -1)], skip=10_000, limit=50)),
                                 count(records, {})),
        "record_long": lambda: (records.find_one({"_id": LONG_ID}),
                                list(db.DispatchedSamplingTask.find({"record_id": LONG_ID})),
                                list(db.DBRecordData.find({"record_id": LONG_ID}))),
        "task": lambda: (db.Task.find_one({"_id": "train:t00010"}),
                         list(records.find({"task_id": "train:t00010"})),
                         list(db.DispatchedSamplingTask.find({"task_id": "train:t00010"}))),
    }


def cases(long_tokens: int) -> list[tuple[str, str, str]]:
    """(baseline key, label, path) of every request measured."""
    return [
        ("runs", "runs page", "/"),
        ("run", "run page (500 steps)", f"/runs/{RUN}"),
        ("records", "records page 1 (50)", f"/runs/{RUN}/records"),
        ("records", "API records page 1", f"/api/runs/{RUN}/records"),
        ("records_filtered", "records, state + score filter",
         f"/runs/{RUN}/records?status=trained&min_score=0.5"),
        ("records_deep", "records at offset 10,000", f"/runs/{RUN}/records?offset=10000"),
        ("record_long", f"record page, {long_tokens:,} tokens", f"/runs/{RUN}/records/{LONG_ID}"),
        ("record_long", f"API record, {long_tokens:,} tokens", f"/api/runs/{RUN}/records/{LONG_ID}"),
        ("task", "task page (group of 4)", f"/runs/{RUN}/tasks/train:t00010"),
    ]


def measure_requests(http: httpx.Client, db, long_tokens: int, repeats: int) -> list[dict]:
    """One row per case: the dashboard's cold and median times against the database-only baseline."""

    def page(path: str):
        def fetch() -> None:
            response = http.get(path)
            response.raise_for_status()
        return fetch

    raw = raw_reads(db)
    rows = []
    for key, label, path in cases(long_tokens):
        cold, median = timed(page(path), repeats)
        _, floor = timed(raw[key], repeats)
        size = len(http.get(path).content)
        rows.append({"case": label, "path": path, "cold_ms": round(cold, 1), "median_ms": round(median, 1),
                     "db_only_ms": round(floor, 1), "ratio": round(median / floor, 2) if floor else None,
                     "bytes": size})
        print(f"{label:34} {median:8.1f} ms (cold {cold:7.1f}) db only {floor:7.1f} ms  {size / 1024:8.0f} KiB")
    return rows


def measure_browser(base: str, tmp: str, repeats: int) -> dict:
    """How long headless Chromium takes to build the long record's token view ({} without Chromium)."""
    chromium = shutil.which("chromium")
    if not chromium:
        return {}

    def dom(path: str) -> str:
        cmd = [chromium, "--headless", "--disable-gpu", f"--user-data-dir={tmp}/chromium", "--dump-dom",
               base + path] + (["--no-sandbox"] if os.geteuid() == 0 else [])
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout

    page = dom(f"/runs/{RUN}/records/{LONG_ID}")
    spans = len(re.findall(r'<span data-i="', page))
    built = []
    for _ in range(repeats):
        found = re.search(r'data-token-view-ms="(\d+)"', dom(f"/runs/{RUN}/records/{LONG_ID}"))
        built.append(int(found.group(1)))
    print(f"Chromium: the record page's token view ({spans:,} spans) is built "
          f"{statistics.median(built):.0f} ms after navigation starts (median)")
    return {"token_spans": spans, "token_view_ready_ms": statistics.median(built)}


def report(args: argparse.Namespace, rows: list[dict], browser: dict) -> None:
    """Write ``--out`` and print the table."""
    result = {"records": args.records, "long_tokens": args.long_tokens, "repeats": args.repeats,
              "server": "NX-27017 (embedded)", "rows": rows, "browser": browser}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| request | median ms | cold ms | database only ms | ratio | size KiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['case']} | {row['median_ms']:.0f} | {row['cold_ms']:.0f} | {row['db_only_ms']:.0f} | "
              f"{row['ratio']:.1f} | {row['bytes'] / 1024:.0f} |")
    print(f"\nresults in {args.out}")


def main() -> int:
    args = parse_args()
    from agentrl.store.embedded import EmbeddedServer

    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        server = EmbeddedServer(data_dir=Path(tmp) / "db", port=free_port())
        server.start()
        dashboard = None
        try:
            db = MongoClient(server.uri(), tz_aware=True)[RUN]
            started = time.perf_counter()
            populate(db, args.records, args.long_tokens)
            written = {name: db[name].estimated_document_count()
                       for name in ("Record", "DispatchedSamplingTask", "DBRecordData")}
            print(f"wrote {written['Record']} records, {written['DispatchedSamplingTask']} calls, "
                  f"{written['DBRecordData']} samples in {time.perf_counter() - started:.0f} s")
            port = free_port()
            dashboard = start_dashboard(server.uri(), port)
            base = f"http://127.0.0.1:{port}"
            http = httpx.Client(base_url=base, timeout=120)
            time.sleep(8)  # the dashboard loads transformers and the tokenizer in the background at start
            rows = measure_requests(http, db, args.long_tokens, args.repeats)
            report(args, rows, measure_browser(base, tmp, args.repeats))
        finally:
            if dashboard is not None:
                dashboard.terminate()
                dashboard.wait(timeout=30)
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
