"""Chaos run: the whole loop under random SIGKILLs and database restarts, against the same run without faults.

    .venv/bin/python bench/faults.py [--samplers 2] [--copies 3] [--generations 4] [--batch 4]
                                     [--fault_every_s 20] [--outage_s 8] [--seed 0] [--cache_dir DIR]

Each run gets its own embedded NX-27017 database (free port, temporary directory, restartable on the same port),
one registered ``agentrl engine`` serving the scripted tiny model of ``tests/scripted_model.py`` (real calculator
tool calls, cached as in ``bench/rollout.py``), ``--samplers`` ``agentrl sample`` processes and one trainer
(``python -m agentrl.train``, checkpoint every step, publishing every step to the engine). The tasks are the
scripts' questions, ``--copies`` times each with ``--generations`` samples, greedy decoding and no group-stage
drops, so every slot becomes exactly one trained sample: the trainer runs ``slots / batch`` steps.

A supervisor restarts any process that exits before the end (a trainer with ``--resume_from_checkpoint latest``),
as systemd or Kubernetes would. In the faulted run it injects, every ``--fault_every_s`` on average (exponential
intervals, ``--seed``): SIGKILL of a random sampler, of the trainer, or of the engine, or a database outage
(the server stopped for ``--outage_s`` seconds and restarted on the same port with the same data).

Checked at the end, from the database (the trainer's step ledger, ``Metric.sample_ids``, and the Records):
samples **lost** (slots without a trained sample) and **duplicated** (ledger entries beyond the distinct samples,
plus slots with more than one finished attempt) must both be 0. Throughput: trained samples per second of wall
time from the first process start to the trainer's last step, faulted / fault-free. Results go to
``bench/results/faults.json`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from rollout import free_port, log, scripted_model, upload, write_inputs  # noqa: E402

FAULT_KINDS = ("sampler", "trainer", "engine", "database")


@dataclass
class RunFigures:
    faults: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    seconds: float = 0.0
    slots: int = 0
    trajectories: int = 0  # finished attempts, including the ones redone after a kill
    trained: int = 0
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)  # what a lost or duplicated sample looks like

    @property
    def samples_per_s(self) -> float:
        return self.trained / self.seconds if self.seconds else 0.0


class Loop:
    """The processes of one run and the supervisor that restarts them."""

    def __init__(self, args: argparse.Namespace, model: Path, workdir: Path, name: str):
        from agentrl.store import with_database
        from agentrl.store.embedded import EmbeddedServer

        self.args, self.model, self.workdir = args, model, workdir
        self.server = EmbeddedServer(data_dir=workdir / f"db-{name}", port=free_port())
        self.server.start()
        self.uri = with_database(self.server.uri(), name)
        self.engine_port = free_port()
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.processes: dict[str, subprocess.Popen] = {}
        self.restarts = 0
        self.trainer_done = False
        tasks, self.mcp = write_inputs(workdir, args.generations)
        copies = [json.loads(line) for line in tasks.read_text().splitlines()]
        tasks.write_text("".join(json.dumps({**task, "id": f"{task['id']}-{copy}"}) + "\n"
                                 for copy in range(args.copies) for task in copies))
        upload(self.uri, tasks, max_attempts=args.max_attempts)
        self.slots = len(copies) * args.copies * args.generations
        self.steps = self.slots // args.batch
        self.name = name

    def command(self, role: str) -> list[str]:
        cli = [sys.executable, "-m", "agentrl.cli.main"]
        if role == "engine":
            return [*cli, "engine", "--model_name_or_path", str(self.model), "--port", str(self.engine_port),
                    "--db_connection_string", self.uri, "--heartbeat_interval_s", "1", "--num_threads", "1",
                    "--max_total_tokens", "8192", "--max_running_requests", "16"]
        if role.startswith("sampler"):
            return [*cli, "sample", "--db_connection_string", self.uri, "--model_name_or_path", str(self.model),
                    "--mcp_config", str(self.mcp), "--max_turns", "3", "--max_new_tokens", "40", "--temperature",
                    "0", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false", "--lease_s", "10",
                    "--max_concurrent_samples_per_process", "4", "--train_batch_size", str(self.args.batch),
                    "--max_staleness", "1000", "--exit_when_done", "true", "--sampler_id", role]
        resume = ["--resume_from_checkpoint", "latest"] if (self.workdir / f"out-{self.name}").exists() else []
        return [sys.executable, "-m", "agentrl.train", "--db_connection_string", self.uri, "--model_name_or_path",
                str(self.model), "--output_dir", str(self.workdir / f"out-{self.name}"), "--num_threads", "1",
                "--poll_interval_s", "0.5", "--learning_rate", "1e-4", "--train_batch_size", str(self.args.batch),
                "--max_steps", str(self.steps), "--save_steps", "1", "--max_staleness", "1000", *resume]

    def start(self, role: str) -> None:
        log_file = (self.workdir / f"{self.name}-{role}.log").open("a")
        self.processes[role] = subprocess.Popen(self.command(role), stdout=log_file, stderr=subprocess.STDOUT,
                                                env=self.env)

    def supervise(self) -> bool:
        """Restart what died before its time; ``True`` once the trainer finished and every sampler exited 0."""
        for role, process in list(self.processes.items()):
            code = process.poll()
            if code is None:
                continue
            if role == "trainer" and code == 0:
                self.trainer_done = True
                continue
            if role.startswith("sampler") and code == 0:
                continue
            if role == "engine" and self.trainer_done:
                continue
            self.restarts += 1
            log(f"  [{self.name}] {role} exited ({code}): restarting")
            self.start(role)
        samplers_done = all(p.poll() == 0 for r, p in self.processes.items() if r.startswith("sampler"))
        return self.trainer_done and samplers_done

    def kill(self, role: str) -> None:
        process = self.processes[role]
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(30)
        self.server.stop()


def check(loop: Loop) -> RunFigures:
    """Lost and duplicated samples from the ledger and the Records."""
    from agentrl.store import sync_client

    client = sync_client(loop.uri)
    try:
        db = client.get_default_database()
        ledger = [sid for m in db.Metric.find({"split": "train"}) for sid in m["sample_ids"]]
        records = list(db.Record.find({}, {"task_id": 1, "slot": 1, "status": 1}))
        samples = {d["_id"]: d for d in db.DBRecordData.find(
            {}, {"status": 1, "claimed_step": 1, "claimed_rank": 1, "record_id": 1, "skip_reason": 1})}
        trained = {sid for sid, d in samples.items() if d["status"] == "trained"}
        steps = sorted(m["step"] for m in db.Metric.find({"split": "train"}, {"step": 1}))
    finally:
        client.close()
    odd = (set(samples) ^ (set(ledger) & trained)) | {sid for sid, n in Counter(ledger).items() if n > 1}
    problems = [f"sample {sid}: {samples.get(sid)}, in the ledger {ledger.count(sid)} time(s)" for sid in sorted(odd)]
    if len(samples) != loop.slots:
        problems.append(f"{len(samples)} samples for {loop.slots} slots")
    if steps != list(range(1, loop.steps + 1)):
        problems.append(f"ledger steps {steps[:3]}...{steps[-3:]} ({len(steps)} of {loop.steps})")
    finished = Counter((r["task_id"], r["slot"]) for r in records
                       if r["status"] in ("scored", "ready", "trained", "abandoned"))
    distinct = set(ledger)
    return RunFigures(
        slots=loop.slots, trajectories=sum(finished.values()) + sum(r["status"] == "failed" for r in records),
        trained=len(distinct & trained), lost=loop.slots - len(distinct & trained),
        duplicated=(len(ledger) - len(distinct)) + sum(count - 1 for count in finished.values()), problems=problems)


def run(args: argparse.Namespace, model: Path, workdir: Path, name: str, faults: bool) -> RunFigures:
    loop = Loop(args, model, workdir, name)
    rng = random.Random(args.seed)
    injected: Counter[str] = Counter()
    started = time.monotonic()
    try:
        loop.start("engine")
        for index in range(args.samplers):
            loop.start(f"sampler{index}")
        loop.start("trainer")
        next_fault = started + rng.expovariate(1 / args.fault_every_s) if faults else float("inf")
        while not loop.supervise():
            now = time.monotonic()
            if now - started > args.timeout_s:
                raise SystemExit(f"[{name}] not finished after {args.timeout_s:.0f} s; logs in {workdir}")
            if now >= next_fault and not loop.trainer_done:
                kind = rng.choice(FAULT_KINDS)
                if kind == "sampler":
                    role = rng.choice([r for r in loop.processes if r.startswith("sampler")])
                    log(f"  [{name}] fault: SIGKILL {role}")
                    loop.kill(role)
                elif kind == "database":
                    log(f"  [{name}] fault: database down for {args.outage_s:.0f} s")
                    loop.server.stop()
                    time.sleep(args.outage_s)
                    loop.server.start()
                else:
                    log(f"  [{name}] fault: SIGKILL {kind}")
                    loop.kill(kind)
                injected[kind] += 1
                next_fault = time.monotonic() + rng.expovariate(1 / args.fault_every_s)
            time.sleep(0.5)
        seconds = time.monotonic() - started
        figures = check(loop)
    finally:
        loop.stop()
    figures.faults, figures.restarts, figures.seconds = dict(injected), loop.restarts, seconds
    return figures


def table(clean: RunFigures, faulted: RunFigures) -> str:
    rows = [
        ("faults injected", "0", ", ".join(f"{k} {v}" for k, v in sorted(faulted.faults.items())) or "0"),
        ("process restarts", str(clean.restarts), str(faulted.restarts)),
        ("slots (samples expected)", str(clean.slots), str(faulted.slots)),
        ("trajectories finished", str(clean.trajectories), str(faulted.trajectories)),
        ("samples trained", str(clean.trained), str(faulted.trained)),
        ("samples lost (must be 0)", str(clean.lost), str(faulted.lost)),
        ("samples duplicated (must be 0)", str(clean.duplicated), str(faulted.duplicated)),
        ("wall time (s)", f"{clean.seconds:.0f}", f"{faulted.seconds:.0f}"),
        ("trained samples / s", f"{clean.samples_per_s:.3f}", f"{faulted.samples_per_s:.3f}"),
        ("throughput ratio (faulted / clean)", "1.00",
         f"{faulted.samples_per_s / clean.samples_per_s:.2f}" if clean.samples_per_s else "n/a"),
    ]
    lines = ["| | without faults | with faults |", "|---|---:|---:|"]
    lines += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samplers", type=int, default=2)
    parser.add_argument("--copies", type=int, default=3, help="copies of each scripted question")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="--train_batch_size")
    parser.add_argument("--fault_every_s", type=float, default=20.0, help="mean time between faults")
    parser.add_argument("--outage_s", type=float, default=8.0, help="length of a database outage")
    parser.add_argument("--max_attempts", type=int, default=10,
                        help="attempts per slot (each SIGKILL of a sampler costs its slots one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout_s", type=float, default=1500.0, help="give up on a run after this long")
    parser.add_argument("--cache_dir", type=Path, default=Path.home() / ".cache" / "agentrl-bench")
    args = parser.parse_args()

    model = scripted_model(args.cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-faults-"))
    log("run without faults ...")
    clean = run(args, model, workdir, "clean", faults=False)
    log("run with faults ...")
    faulted = run(args, model, workdir, "faulted", faults=True)
    print(table(clean, faulted))
    for name, figures in (("without faults", clean), ("with faults", faulted)):
        for problem in figures.problems:
            print(f"{name}: {problem}")
    out = BENCH / "results" / "faults.json"
    out.write_text(json.dumps({
        "when": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
        "clean": asdict(clean), "faulted": asdict(faulted)}, indent=2))
    if clean.problems or faulted.problems:
        print(f"logs and databases kept in {workdir}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
