"""Sampler overhead: ``agentrl sample`` against the same engine driven by a plain client, in the same run.

    .venv/bin/python bench/rollout.py [--concurrency 1 4 8] [--repeats 3] [--generations 8] [--max_new_tokens 40]
                                      [--model_name_or_path DIR] [--num_threads 1]

One embedded NX-27017 database (free port, temporary directory) and one ``agentrl engine`` subprocess serve
every measurement. The model is the scripted tiny model of ``tests/scripted_model.py`` (trained once to make
real calculator tool calls, then cached under ``--cache_dir``), so trajectories are real multi-turn tool use:
question → ``<tool_call>`` → calculator result → ``\\boxed{answer}``. The tasks are its ``SCRIPTS`` (4 questions,
one with a schema-violating call), ``--generations`` samples each, greedy decoding (``--temperature 0``).

* **sampler**: the real ``agentrl sample`` CLI as a subprocess (``--max_concurrent_samples_per_process C``,
  ``--exit_when_done true``, calculator MCP server over stdio, ``math`` scorer, ``--zero_variance_threshold 0
  --drop_zero_advantage false`` so every trajectory goes through the whole group stage and is queued for the
  trainer, ``--train_batch_size`` large enough that admission control never blocks) on a fresh database.
  Timed from the first slot claim (earliest ``Record.created_at``) to the last write of the run (latest
  ``Record.updated_at`` / ``Task.updated_at``, i.e. the end of the last group stage): process start-up, imports,
  tokenizer load, MCP server spawn and the exit are excluded (the start-up is printed separately).
  Generated tokens: the sum of ``len(output_ids)`` over its ``DispatchedSamplingTask`` documents.
* **baseline**: ``SGLangClient.generate`` from C asyncio workers in this process (same loop type as the CLI:
  uvloop when installed), replaying the token workload of a reference sampler run (the untimed warm-up):
  for each trajectory, in claim order, turn 0 sends the stored first prompt; every later turn sends
  ``previous prompt + its own previous output ids + the stored tool-result delta ids``, for as many turns as
  the reference trajectory had, with the sampler's sampling parameters. No database, leases, chat template,
  tool-call parsing, tool calls, scoring or group stage. Timed from the start of the workers to the last reply.

The ratio sampler / baseline (trajectories/s and generated tokens/s) is the sampler's throughput left after its
overhead (target >= 0.9). A second table gives the sampler's database round trips per trajectory, as ``agentrl
sample`` counts them (PyMongo command monitoring): from a trajectory's claim to its settlement, and in all. With
greedy decoding both sides generate the same tokens; the table says whether the token counts matched in every run.
Figures are medians over ``--repeats`` runs per concurrency; the order of the two sides alternates between repeats.
Results are also written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
SCRIPTED_STEPS = 150  # as the test fixture: greedy decoding follows every script


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scripted_model(cache_dir: Path) -> Path:
    """The scripted tiny model, built once per version of ``tests/scripted_model.py`` (about a minute)."""
    source = (TESTS / "scripted_model.py").read_bytes()
    key = hashlib.sha256(source + str(SCRIPTED_STEPS).encode()).hexdigest()[:12]
    path = cache_dir / f"scripted-{key}"
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    sys.path.insert(0, str(TESTS))
    from scripted_model import build_scripted_model

    log(f"building the scripted tiny model into {path} (once) ...")
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir))
    build_scripted_model(tmp, steps=SCRIPTED_STEPS)
    for item in tmp.iterdir():
        item.replace(path / item.name)
    tmp.rmdir()
    return path


def write_inputs(workdir: Path, generations: int) -> tuple[Path, Path]:
    """The task file (``SCRIPTS``) and the MCP config (built-in calculator over stdio)."""
    sys.path.insert(0, str(TESTS))
    from scripted_model import SCRIPTS, calculator_config

    tasks = workdir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": s.task_id, "question": s.question, "answer": s.answer,
                                         "num_generations": generations}) + "\n" for s in SCRIPTS))
    mcp = workdir / "mcp.json"
    mcp.write_text(json.dumps({"servers": [s.model_dump(exclude_none=True) for s in calculator_config().servers]}))
    return tasks, mcp


def upload(uri: str, tasks: Path, **defaults) -> None:
    """Upload ``tasks`` (``defaults``: further ``UploadDefaults`` fields, e.g. ``max_attempts``)."""
    from agentrl.store import database_name, sync_client
    from agentrl.store.indexes import ensure_indexes_sync
    from agentrl.store.task_files import UploadDefaults, upload_tasks

    client = sync_client(uri)
    try:
        db = client[database_name(uri)]
        ensure_indexes_sync(db)
        upload_tasks(db, tasks, UploadDefaults(scorer="math", answer_schema="boxed", **defaults))
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------------- measurement


def cpu_seconds(pid: int, tree: bool = False) -> float | None:
    """User + system CPU seconds of ``pid`` (and, with ``tree``, of its live descendants); Linux only."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        if tree:
            for task in Path(f"/proc/{pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    total += cpu_seconds(int(child), tree=True) or 0.0
        return total
    except (OSError, ValueError, IndexError):
        return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CpuMonitor:
    """Samples the CPU seconds of named processes every ``interval_s`` in a thread, so that the CPU each used
    within a time window (known only afterwards, e.g. from database timestamps) can be interpolated."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.pids: dict[str, tuple[int, bool]] = {}
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-monitor", daemon=True)

    def watch(self, name: str, pid: int, tree: bool = False) -> None:
        self.samples[name] = []
        self.pids[name] = (pid, tree)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.time()
            for name, (pid, tree) in list(self.pids.items()):
                value = cpu_seconds(pid, tree)
                if value is not None:
                    self.samples[name].append((now, value))

    def between(self, name: str, start: float, end: float) -> float | None:
        """CPU seconds ``name`` used from ``start`` to ``end`` (epoch seconds), linearly interpolated."""
        points = self.samples.get(name) or []
        if len(points) < 2 or points[0][0] > start:
            return None

        def at(t: float) -> float:
            previous = points[0]
            for point in points:
                if point[0] >= t:
                    span = point[0] - previous[0]
                    return previous[1] + (point[1] - previous[1]) * ((t - previous[0]) / span if span else 1.0)
                previous = point
            return points[-1][1]

        return at(end) - at(start)

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Turn:
    input_ids: list[int] | None  # a whole prompt (first turn of a branch), else ...
    delta_ids: list[int]  # ... the tool-result delta appended to the previous prompt + output
    output_len: int


@dataclass
class RunResult:
    trajectories: int
    tokens: int
    seconds: float
    startup_s: float = 0.0
    started: float = 0.0  # epoch seconds of the start of the timed window
    cpu: dict[str, float | None] = field(default_factory=dict)  # CPU seconds in the window, by process
    call_latency_s: float = 0.0  # mean seconds per LLM call
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # trajectory key -> output ids per turn
    commands: float | None = None  # the sampler's database commands per trajectory, claim to settlement (median)
    commands_all: float | None = None  # ... and all its commands per trajectory

    @property
    def traj_rate(self) -> float:
        return self.trajectories / self.seconds

    @property
    def token_rate(self) -> float:
        return self.tokens / self.seconds


def sampling_params(args: argparse.Namespace, slot: int, turn: int) -> dict:
    """What ``run_trajectory`` sends for ``slot``'s ``turn``."""
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": 1.0, "top_k": -1}
    if args.seed is not None:
        params["sampling_seed"] = args.seed * 100_003 + slot * 1009 + turn
    return params


def timestamp(value) -> float:
    """Seconds since the epoch of a stored date. NX-27017 0.8.1 returns dates written by ``$set`` updates as
    naive UTC strings (inserted ones as datetimes), so both are accepted."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def read_run(uri: str) -> tuple[RunResult, list[tuple[str, int, list[Turn]]]]:
    """The sampler run stored in ``uri``: its figures and its workload (trajectories in claim order)."""
    from agentrl.store import sync_client

    client = sync_client(uri)
    try:
        db = client.get_default_database()
        tasks = {t["_id"]: t for t in db.Task.find({})}
        records = list(db.Record.find({}))
        calls = list(db.DispatchedSamplingTask.find({}))
    finally:
        client.close()
    if not records or any(r["status"] not in ("ready", "abandoned") for r in records):
        raise SystemExit(f"sampler run incomplete: {sorted(r['status'] for r in records)}")
    start = min(timestamp(r["created_at"]) for r in records)
    end = max(timestamp(d["updated_at"]) for d in [*records, *tasks.values()])
    by_record: dict[str, list[dict]] = {}
    for call in calls:
        by_record.setdefault(call["record_id"], []).append(call)
    workload, outputs = [], {}
    for record in sorted(records, key=lambda r: (tasks[r["task_id"]]["order"], r["slot"], r["attempt"])):
        own = sorted(by_record.get(record["_id"], []), key=lambda c: c["turn"])
        key = f"{record['task_id']}/{record['slot']}"
        turns = [Turn(list(c["input_ids"]) if c.get("input_ids") else None, list(c.get("prompt_delta_ids") or []),
                      len(c["output_ids"])) for c in own]
        workload.append((key, record["slot"], turns))
        outputs[key] = [list(c["output_ids"]) for c in own]
    result = RunResult(trajectories=len(records), tokens=sum(len(c["output_ids"]) for c in calls),
                       seconds=end - start, started=start, outputs=outputs,
                       call_latency_s=statistics.fmean(c.get("latency_s") or 0.0 for c in calls))
    return result, workload


def run_sampler(args: argparse.Namespace, server_uri: str, database: str, model: Path, engine_url: str,
                tasks: Path, mcp: Path, concurrency: int, total: int, workdir: Path, monitor: CpuMonitor
                ) -> tuple[RunResult, list[tuple[str, int, list[Turn]]]]:
    """One ``agentrl sample`` run on a fresh database; returns its figures and workload."""
    from agentrl.store import with_database

    uri = with_database(server_uri, database)
    upload(uri, tasks)
    command = [sys.executable, "-m", "agentrl.cli.main", "sample", "--db_connection_string", uri,
               "--model_name_or_path", str(model), "--inference_urls", engine_url, "--mcp_config", str(mcp),
               "--max_turns", str(args.max_turns), "--max_new_tokens", str(args.max_new_tokens),
               "--temperature", str(args.temperature), "--max_concurrent_samples_per_process", str(concurrency),
               "--exit_when_done", "true", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false",
               "--train_batch_size", str(total)]
    if args.seed is not None:
        command += ["--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.num_threads), "TOKENIZERS_PARALLELISM": "false"}
    with open(workdir / f"{database}.log", "w") as output:
        started = time.time()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        monitor.watch("sampler", process.pid, tree=True)  # with its MCP server
        try:
            returncode = process.wait(1800)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    if returncode != 0:
        raise SystemExit(f"agentrl sample failed ({returncode}); see {workdir / f'{database}.log'}:\n"
                         + (workdir / f"{database}.log").read_text()[-3000:])
    result, workload = read_run(uri)
    output = (workdir / f"{database}.log").read_text()
    counted = re.search(r"database commands per trajectory: ([\d.]+) \(median\).*?, ([\d.]+) in all", output)
    if counted:
        result.commands, result.commands_all = float(counted.group(1)), float(counted.group(2))
    result.startup_s = result.started - started
    end = result.started + result.seconds
    result.cpu = {name: monitor.between(name, result.started, end) for name in ("engine", "database", "sampler")}
    return result, workload


async def baseline(args: argparse.Namespace, url: str, workload: list[tuple[str, int, list[Turn]]],
                   concurrency: int) -> RunResult:
    """Replay ``workload`` with ``concurrency`` plain-client workers (see the module docstring)."""
    from agentrl.inference import SGLangClient

    outputs: dict[str, list[list[int]]] = {}
    latencies: list[float] = []
    async with SGLangClient(url, timeout_s=600.0, max_retries=1) as client:
        queue = iter(workload)

        async def worker() -> None:
            for key, slot, turns in queue:
                prompt: list[int] = []
                produced: list[list[int]] = []
                for index, turn in enumerate(turns):
                    prompt = turn.input_ids if turn.input_ids is not None else [*prompt, *produced[-1],
                                                                                 *turn.delta_ids]
                    sent = time.perf_counter()
                    result = await client.generate(prompt, sampling_params(args, slot, index))
                    latencies.append(time.perf_counter() - sent)
                    produced.append(result.output_ids)
                outputs[key] = produced

        started, wall, cpu = time.perf_counter(), time.time(), time.thread_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
    return RunResult(trajectories=len(outputs), tokens=sum(len(o) for turns in outputs.values() for o in turns),
                     seconds=elapsed, started=wall, cpu={"client": cpu}, outputs=outputs,
                     call_latency_s=statistics.fmean(latencies))


def run_baseline(args: argparse.Namespace, url: str, workload, concurrency: int, monitor: CpuMonitor
                 ) -> RunResult:
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(baseline(args, url, workload, concurrency))
    time.sleep(2 * monitor.interval_s)  # a CPU sample after the window
    result.cpu["engine"] = monitor.between("engine", result.started, result.started + result.seconds)
    return result


# ---------------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None,
                        help="model served and used as tokenizer (default: the scripted tiny model, built once)")
    parser.add_argument("--cache_dir", default=str(Path.home() / ".cache" / "agentrl" / "bench"),
                        help="where the scripted tiny model is kept between runs")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8],
                        help="concurrent trajectories (the sampler's --max_concurrent_samples_per_process)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generations", type=int, default=8, help="samples per task (4 tasks)")
    parser.add_argument("--max_new_tokens", type=int, default=40)
    parser.add_argument("--max_turns", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same per slot and turn on both sides)")
    parser.add_argument("--num_threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--output", default=None, help="JSON file (default: bench/results/rollout-<time>.json)")
    return parser.parse_args()


def measure_concurrency(args: argparse.Namespace, concurrency: int, server_uri: str, model: Path, engine_url: str,
                        inputs: tuple[Path, Path], workload, total: int, workdir: Path, monitor: CpuMonitor) -> dict:
    """``args.repeats`` runs of the sampler and of the plain client at one concurrency, alternating which goes
    first; the row of the results table (per-repeat figures of both sides)."""
    tasks, mcp = inputs
    row = {"concurrency": concurrency, "sampler": [], "baseline": [], "same_tokens": True, "same_outputs": True}
    for repeat in range(args.repeats):
        sides = ("sampler", "baseline") if repeat % 2 == 0 else ("baseline", "sampler")
        results = {}
        for side in sides:
            if side == "sampler":
                results[side], _ = run_sampler(args, server_uri, f"c{concurrency}_r{repeat}", model, engine_url,
                                               tasks, mcp, concurrency, total, workdir, monitor)
            else:
                results[side] = run_baseline(args, engine_url, workload, concurrency, monitor)
            r = results[side]
            log(f"  C={concurrency} repeat {repeat + 1}/{args.repeats} {side:<8} "
                f"{r.trajectories} traj, {r.tokens} tokens in {r.seconds:.2f}s: "
                f"{r.traj_rate:.2f} traj/s, {r.token_rate:.1f} tok/s"
                + (f" (start-up {r.startup_s:.1f}s excluded)" if side == "sampler" else ""))
        s, b = results["sampler"], results["baseline"]
        row["same_tokens"] &= s.tokens == b.tokens and s.trajectories == b.trajectories
        row["same_outputs"] &= s.outputs == b.outputs
        for side in ("sampler", "baseline"):
            r = results[side]
            row[side].append({"trajectories": r.trajectories, "tokens": r.tokens, "seconds": r.seconds,
                              "startup_s": r.startup_s, "cpu_s": r.cpu, "call_latency_s": r.call_latency_s,
                              "db_commands": r.commands, "db_commands_all": r.commands_all})
    return row


def measure(args: argparse.Namespace, model: Path) -> tuple[list[dict], list[int], int]:
    """Start a database and an engine, warm up, and measure every concurrency: (rows, turns per trajectory of the
    workload, trajectories per run)."""
    from agentrl.inference.process import EngineProcess
    from agentrl.store.embedded import EmbeddedServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-rollout-") as tmp, CpuMonitor() as monitor:
        workdir = Path(tmp)
        inputs = write_inputs(workdir, args.generations)
        total = 4 * args.generations
        server = EmbeddedServer(data_dir=workdir / "db", port=free_port())
        server_uri = server.start()
        monitor.watch("database", server.pid() or 0)
        engine = None
        try:
            engine = EngineProcess(model, "--num_threads", str(args.num_threads), "--no_register",
                                   "--max_total_tokens", "16384", "--weight_version", "0",
                                   env={"OMP_NUM_THREADS": str(args.num_threads), "TOKENIZERS_PARALLELISM": "false"})
            monitor.watch("engine", engine.pid)
            log(f"engine {engine.url} (pid {engine.pid}), database {server_uri} (pid {server.pid()})")
            log(f"warm-up: reference sampler run at concurrency {max(args.concurrency)} ...")
            reference, workload = run_sampler(args, server_uri, "warmup", model, engine.url, *inputs,
                                              max(args.concurrency), total, workdir, monitor)
            turns = [len(t) for _, _, t in workload]
            log(f"  {reference.trajectories} trajectories, {reference.tokens} tokens, "
                f"{statistics.mean(turns):.2f} turns each, start-up {reference.startup_s:.1f}s")
            run_baseline(args, engine.url, workload, max(args.concurrency), monitor)  # warms the client side too
            for concurrency in args.concurrency:
                rows.append(measure_concurrency(args, concurrency, server_uri, model, engine.url, inputs, workload,
                                                total, workdir, monitor))
        finally:
            if engine is not None:
                engine.stop()
            server.stop()
    return rows, turns, total


def rates(row: dict, side: str, key: str) -> list[float]:
    return [r[key] / r["seconds"] for r in row[side]]


def cpu_ms(row: dict, side: str, name: str) -> str:
    values = [r["cpu_s"].get(name) for r in row[side]]
    values = [1000 * v / r["trajectories"] for v, r in zip(values, row[side]) if v is not None]
    return f"{statistics.median(values):.1f}" if values else "n/a"


def print_rates(rows: list[dict]) -> None:
    """The sampler-vs-plain-client table (sets each row's ``traj_ratio`` and ``token_ratio``)."""
    print("| concurrency | baseline traj/s | sampler traj/s | ratio | baseline tok/s | sampler tok/s | ratio "
          "| same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        bt, st = rates(row, "baseline", "trajectories"), rates(row, "sampler", "trajectories")
        bk, sk = rates(row, "baseline", "tokens"), rates(row, "sampler", "tokens")
        row["traj_ratio"] = statistics.median(s / b for s, b in zip(st, bt))
        row["token_ratio"] = statistics.median(s / b for s, b in zip(sk, bk))
        same = "yes" if row["same_tokens"] else "NO"
        if row["same_tokens"] and not row["same_outputs"]:
            same = "count only"
        print(f"| {row['concurrency']} | {statistics.median(bt):.2f} | {statistics.median(st):.2f} | "
              f"{row['traj_ratio']:.2f} | {statistics.median(bk):.1f} | {statistics.median(sk):.1f} | "
              f"{row['token_ratio']:.2f} | {same} |")
    startup = statistics.median(r["startup_s"] for row in rows for r in row["sampler"])
    print(f"\nlowest token-rate ratio {min(row['token_ratio'] for row in rows):.2f} (target >= 0.90); sampler "
          f"process start-up (excluded) {startup:.1f}s median")


def print_round_trips_and_costs(rows: list[dict]) -> None:
    print("\nDatabase round trips of the sampler per trajectory (medians over the repeats): from its claim to its "
          "settlement (the median trajectory), and all the sampler's commands (admission control, group stages, "
          "polling, the inference pool's load syncs) divided by its trajectories")
    print("| concurrency | claim to settlement | in all |")
    print("|---:|---:|---:|")
    for row in rows:
        counts = {key: [r[key] for r in row["sampler"] if r[key] is not None] for key in ("db_commands",
                                                                                           "db_commands_all")}
        print(f"| {row['concurrency']} | " + " | ".join(
            f"{statistics.median(values):.1f}" if values else "n/a" for values in counts.values()) + " |")
    print("\nWhere the time goes (medians): mean LLM call latency, and CPU per trajectory (ms) within the timed "
          "window of the engine and of each side")
    print("| concurrency | call ms baseline | call ms sampler | engine CPU baseline | engine CPU sampler "
          "| plain client CPU | sampler + MCP server CPU | database CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        latency = {side: statistics.median(r["call_latency_s"] for r in row[side]) * 1000
                   for side in ("baseline", "sampler")}
        print(f"| {row['concurrency']} | {latency['baseline']:.0f} | {latency['sampler']:.0f} | "
              f"{cpu_ms(row, 'baseline', 'engine')} | {cpu_ms(row, 'sampler', 'engine')} | "
              f"{cpu_ms(row, 'baseline', 'client')} | {cpu_ms(row, 'sampler', 'sampler')} | "
              f"{cpu_ms(row, 'sampler', 'database')} |")


def main() -> int:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.num_threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = Path(args.model_name_or_path) if args.model_name_or_path else scripted_model(Path(args.cache_dir))
    load_before = os.getloadavg()
    if load_before[0] > (os.cpu_count() or 1) / 2:
        log(f"warning: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs before the run: other processes "
            "compete with the engine and the sampler, expect noisy figures")
    rows, turns, total = measure(args, model)
    print(f"\nmodel {model.name}; engine on CPU ({platform.processor() or platform.machine()}), {args.num_threads} "
          f"thread(s), {os.cpu_count()} CPUs (load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} "
          f"after); {total} trajectories per run (4 tasks x {args.generations}), {statistics.mean(turns):.2f} turns "
          f"each, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}; median of {args.repeats} "
          f"runs; ratio: median of the per-repeat ratios sampler/baseline\n")
    print_rates(rows)
    print_round_trips_and_costs(rows)
    output = Path(args.output) if args.output else (
        REPO / "bench" / "results" / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"model": str(model), "args": vars(args), "trajectories_per_run": total,
                                  "rows": rows}, indent=2))
    print(f"written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
