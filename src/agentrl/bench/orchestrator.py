"""``agentrl bench run``: hand a scenario to an agent, let it post-train under a time limit, collect the best model
(seed 001's ``run_agent.py``).

1. **Agent**: ``agents/<id>/config.yaml`` (``name``, ``description``, ``start`` (default ``start.sh``),
   ``env_vars``), found under ``--agents_dir`` (default: ``./agents``, then the repository's ``agents/``).
2. **Workspace** ``<workspace_root>/<task>/<run_id>_<agent>/``: ``data/train.jsonl`` (a read-only copy of the
   training data: the only data there; the test file lives in the benchmark's cache and no path to it is written
   anywhere the agent reads), ``models/<name>`` (a symbolic link to the base model), ``output/`` (where the agent
   saves models), ``code/`` (its working directory), ``reports/``, ``instructions.md``, ``description.md``,
   ``scenario.json`` (the evaluation protocol, without the test file) and ``run_meta.json``.
3. **Grading server**: ``agentrl bench serve --task T --workspace W --port P`` as a child process, health-checked.
4. **Baseline**: the base model evaluated by the same server (``agentrl eval`` reuses the stored result for the same
   model, tasks and settings, so it is computed once per database), then ``POST /set_baseline``.
5. **Agent**: ``bash start.sh`` in ``code/`` with ``TASK, BASE_MODEL, WORKSPACE, MODEL_PATH, DATA_PATH, OUTPUT_DIR,
   GRADING_SERVER_URL`` and the config's ``env_vars``, in a process group of its own, output to ``agent.log``.
   On timeout, Ctrl-C or SIGTERM the whole group gets SIGTERM, then SIGKILL 10 s later.
6. **Collect**: evaluations still queued are finished (their results and logs are in the result directory's
   ``evaluations/``, never in the workspace), then ``results/<time>_<task>_<agent>/result.json``
   (``success, agent_id, task, base_model, timeout, start_time, end_time, duration_seconds, workspace, baseline,
   best, improvement, total_submissions``), ``scores.json`` copied, ``best_model`` linked, a row in
   ``results/results.csv``. The exit status is the agent's (0 only if ``start.sh`` exited 0).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.bench.grading import best_entry, read_json, write_json_atomic
from agentrl.bench.scenarios import Scenario, ScenarioSet
from agentrl.bench.server import READY_LINE

REPO_AGENTS = Path(__file__).resolve().parents[3] / "agents"
KILL_GRACE_S = 10.0


class BenchRunError(RuntimeError):
    """The run cannot start (unknown agent or task, bad agent config, grading server that does not come up)."""


class AgentConfig(BaseModel):
    """``agents/<id>/config.yaml``."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    start: str = "start.sh"
    env_vars: dict[str, str | int | float | bool] = Field(default_factory=dict)


class RunOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str
    task: str
    base_model: str | None = None
    timeout: float = Field(3600.0, gt=0)
    port: int = 5000
    host: str = "127.0.0.1"
    workspace_root: str = "workspace"
    results_dir: str = "results"
    agents_dir: str | None = None
    eval_limit: int | None = Field(None, ge=1)
    db_connection_string: str | None = None
    engine_args: str = ""
    scenario: list[str] = Field(default_factory=list)


def find_agent(agent_id: str, agents_dir: str | None) -> tuple[Path, AgentConfig]:
    """The agent's directory and configuration (``BenchRunError`` naming the agents found otherwise)."""
    roots = [Path(agents_dir)] if agents_dir else [Path("agents"), REPO_AGENTS]
    for root in roots:
        config_path = root / agent_id / "config.yaml"
        if config_path.is_file():
            try:
                config = AgentConfig.model_validate(yaml.safe_load(config_path.read_text()) or {})
            except (yaml.YAMLError, ValidationError) as error:
                raise BenchRunError(f"{config_path}: {error}") from None
            if not (root / agent_id / config.start).is_file():
                raise BenchRunError(f"{config_path}: field 'start': no such file {root / agent_id / config.start}")
            return (root / agent_id).resolve(), config
    known = sorted({p.parent.name for root in roots if root.is_dir() for p in root.glob("*/config.yaml")})
    raise BenchRunError(f"unknown agent {agent_id!r} (looked in {', '.join(map(str, roots))}); "
                        f"agents found: {', '.join(known) or 'none'}")


INSTRUCTIONS = """# Instructions

You are post-training a language model for the scenario described in `description.md`; the benchmark grades the
models you submit on held-out data you cannot see. The best submission counts.

Environment variables:
- `TASK` scenario id, `BASE_MODEL` the base model's name, `MODEL_PATH` its directory (read-only: do not write
  into it), `DATA_PATH` the training data directory (read-only), `OUTPUT_DIR` where to save models,
  `WORKSPACE` this directory, `GRADING_SERVER_URL` the grading server.

Layout: `data/` (training data), `models/` (base model), `output/` (your models), `code/` (your working
directory), `scenario.json` (the evaluation protocol: prompt, answer format, turns, tools), `run_meta.json`
(start time and time budget: the single source of truth for your deadline).

Loop: read `description.md` and `scenario.json`, train, save a Hugging Face model directory (config.json and
weights; merge LoRA adapters first) under `$OUTPUT_DIR`, submit it, repeat while time remains:

    curl -s -X POST $GRADING_SERVER_URL/submit -H 'Content-Type: application/json' -d '{"model_path": "output/v1"}'
    curl -s -X POST $GRADING_SERVER_URL/submit -H 'Content-Type: application/json' \\
         -d '{"model_path": "output/v2", "async": true}'      # returns a job id at once: GET /jobs/ID
    curl -s $GRADING_SERVER_URL/best                        # best submission so far
    curl -s $GRADING_SERVER_URL/time                        # seconds remaining
    curl -s -X POST $GRADING_SERVER_URL/validate -d '{"model_path": "output/v1"}'

Model paths must lie inside the workspace (relative paths are resolved against it). Submissions are evaluated one
at a time; a blocking submit returns when its evaluation is done.
"""


def prepare_workspace(scenario: Scenario, agent_id: str, options: RunOptions, run_id: str) -> Path:
    """Create the run's workspace (see the module docstring) and return it."""
    suffix = f"_p{options.port}" if options.port != 5000 else ""
    workspace = (Path(options.workspace_root) / scenario.id / f"{run_id}{suffix}_{agent_id}").resolve()
    for sub in ("data", "models", "output", "code", "reports"):
        (workspace / sub).mkdir(parents=True, exist_ok=True)
    train = workspace / "data" / "train.jsonl"
    shutil.copyfile(scenario.train_data_path, train)
    train.chmod(0o444)
    (workspace / "data").chmod(0o555)
    base = Path(scenario.base_model()).resolve()
    (workspace / "models" / base.name).symlink_to(base, target_is_directory=True)
    (workspace / "instructions.md").write_text(INSTRUCTIONS)
    (workspace / "description.md").write_text(f"# {scenario.name}\n\n{scenario.description}\n\nMetric: "
                                              f"{scenario.metric} (percent); base model: {base.name}.\n")
    info = scenario.public_info(None)
    info.update(base_model_path=str(workspace / "models" / base.name), train_data=str(train),
                train_data_path=str(train))
    write_json_atomic(workspace / "scenario.json", info)
    return workspace


class GradingServer:
    """``agentrl bench serve`` for one run, as a child process in its own process group."""

    def __init__(self, options: RunOptions, workspace: Path, state_dir: Path):
        command = [sys.executable, "-m", "agentrl.cli.main", "bench", "serve", "--task", options.task,
                   "--workspace", str(workspace), "--host", options.host, "--port", str(options.port),
                   "--state_dir", str(state_dir)]
        if options.eval_limit:
            command += ["--eval_limit", str(options.eval_limit)]
        if options.db_connection_string:
            command += ["--db_connection_string", options.db_connection_string]
        if options.engine_args:
            command += ["--engine_args", options.engine_args]
        for path in options.scenario:
            command += ["--scenario", path]
        self.log = open(workspace / "grading_server.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in stop
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
                                        text=True, start_new_session=True)
        self.url = self._wait_ready(timeout_s=120.0)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> str:
        prefix = READY_LINE.split("{")[0]
        deadline = time.monotonic() + timeout_s
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.write(line)
            self.log.flush()
            if line.startswith(prefix):
                url = line.strip().removeprefix(prefix)
                while time.monotonic() < deadline:
                    try:
                        if httpx.get(url + "/health", timeout=5).status_code == 200:
                            return url
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.2)
                break
            if time.monotonic() > deadline:
                break
        self.stop()
        raise BenchRunError(f"the grading server did not start (log {self.log.name})")

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.write(line)
            self.log.flush()

    def pending(self) -> int | None:
        """Submissions queued or being graded; None when the server is gone or does not answer."""
        if self.process.poll() is not None:
            return None
        try:
            return int(_get(self.url + "/health", timeout=10).json().get("pending_evaluations", 0))
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def run_agent_process(agent_dir: Path, config: AgentConfig, env: dict[str, str], cwd: Path, log_path: Path,
                      timeout_s: float, progress: Callable[[float], None] | None = None,
                      progress_every_s: float = 60.0) -> tuple[int | None, str]:
    """Run the agent's start script under ``timeout_s``; returns ``(exit status or None, how it ended)``.
    The whole process group is stopped on timeout, SIGINT or SIGTERM (SIGTERM, then SIGKILL). ``progress(elapsed)``
    is called every ``progress_every_s`` while the agent runs."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(["bash", str(agent_dir / config.start)], cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    stop = threading.Event()
    reason = ["finished"]

    def on_signal(signum: int, _frame: Any) -> None:
        reason[0] = f"stopped by {signal.Signals(signum).name}"
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start = time.monotonic()
        deadline, next_progress = start + timeout_s, start + progress_every_s
        while process.poll() is None:
            if progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                progress(time.monotonic() - start)
            if stop.is_set() or time.monotonic() >= deadline:
                if not stop.is_set():
                    reason[0] = f"timed out after {timeout_s:g} s"
                kill_group(process)
                break
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return process.returncode, reason[0]


def kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL to whatever is left after :data:`KILL_GRACE_S`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived the leader, or a leader ignoring TERM
    except ProcessLookupError:
        pass
    process.wait()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _progress_line(url: str, elapsed: float, timeout: float, baseline: float) -> str:
    """One status line while the agent runs: time, submissions, evaluations waiting, best score."""
    try:
        pending = _get(url + "/health", timeout=5).json().get("pending_evaluations", 0)
        submissions = len(_get(url + "/history", timeout=5).json())
        best = _get(url + "/best", timeout=5)
    except httpx.HTTPError as error:
        return f"agent running {_minutes(elapsed)} / {_minutes(timeout)} | grading server not answering: {error}"
    best_text = f"best {best.json()['best']['score']:.2f}" if best.status_code == 200 else "no score yet"
    return (f"agent running {_minutes(elapsed)} / {_minutes(timeout)} | {submissions} graded, {pending} "
            f"being graded or queued | {best_text} (baseline {baseline:.2f})")


_TOTAL = re.compile(r"evaluation \w+: (\d+) tasks × (\d+) samples")
_DONE = re.compile(r"sampler \S+: (\d+) trajectories \(([\d.]+)/s\)")


def _evaluation_progress(log_dir: Path) -> str | None:
    """``graded/total trajectories, rate, time left`` of the newest evaluation, read from the progress lines of its
    ``agentrl eval`` log (None before it has any)."""
    logs = sorted(log_dir.glob("*.log"), key=lambda path: path.stat().st_mtime) if log_dir.is_dir() else []
    if not logs:
        return None
    text = logs[-1].read_text(encoding="utf-8", errors="replace")
    total, done = _TOTAL.search(text), _DONE.findall(text)
    if total is None or not done:
        return None
    count, rate = int(done[-1][0]), float(done[-1][1])
    planned = int(total.group(1)) * int(total.group(2))
    left = f", about {_minutes((planned - count) / rate)} left" if rate > 0 and count < planned else ""
    return f"{count}/{planned} trajectories graded ({rate:.2f}/s{left})"


def _while_reporting(call: Callable[[], Any], status: Callable[[], str | None], say: Any,
                     every_s: float = 60.0) -> Any:
    """``call()`` in a thread, saying ``status()`` every ``every_s`` seconds until it returns (or raises)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    while True:
        worker.join(every_s)
        if not worker.is_alive():
            break
        line = status()
        if line:
            say(f"baseline: {line}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _get(url: str, timeout: float = 30.0) -> httpx.Response:
    return httpx.get(url, timeout=timeout)


def run(options: RunOptions, say: Any = print) -> int:
    """The whole run (see the module docstring); returns the agent's exit status (1 if it was stopped)."""
    agent_dir, agent = find_agent(options.agent, options.agents_dir)
    scenario = ScenarioSet(options.scenario).get(options.task)
    if options.base_model:
        scenario = scenario.model_copy(update={"base_model_path": str(Path(options.base_model).resolve())})
    run_id = datetime.now().strftime("%Y%m%dT%H%M%S")
    workspace = prepare_workspace(scenario, options.agent, options, run_id)
    result_dir = Path(options.results_dir).resolve() / f"{run_id}_{scenario.id}_{options.agent}"
    result_dir.mkdir(parents=True, exist_ok=True)
    say(f"workspace: {workspace}")
    started = time.time()
    server = GradingServer(options, workspace, result_dir / "evaluations")
    say(f"grading server: {server.url} (log {workspace / 'grading_server.log'})")
    try:
        say(f"baseline: evaluating {scenario.base_model()} on {scenario.id} ...")
        response = _while_reporting(
            lambda: httpx.post(server.url + "/evaluate", json={"scenario_id": scenario.id,
                                                               "model_path": scenario.base_model()}, timeout=None),
            lambda: _evaluation_progress(result_dir / "evaluations" / "logs"), say)
        if response.status_code != 200:
            raise BenchRunError(f"the baseline evaluation failed: {response.text}")
        baseline = response.json()["score"]
        httpx.post(server.url + "/set_baseline", json={"score": baseline}, timeout=30)
        say(f"baseline: {baseline:.2f} ({scenario.metric}, reused: {response.json()['details'].get('reused')})")
        write_json_atomic(workspace / "run_meta.json", {"start_time": time.time(), "timeout_s": options.timeout,
                                                          "last_submit_time": None, "end_time": None})
        env = {**os.environ, **{k: str(v) for k, v in agent.env_vars.items()},
               "TASK": scenario.id, "BASE_MODEL": Path(scenario.base_model()).name, "WORKSPACE": str(workspace),
               "MODEL_PATH": str(workspace / "models" / Path(scenario.base_model()).resolve().name),
               "DATA_PATH": str(workspace / "data"), "OUTPUT_DIR": str(workspace / "output"),
               "GRADING_SERVER_URL": server.url}
        say(f"agent {options.agent}: running {agent.start} for at most {options.timeout:g} s "
            f"(log {workspace / 'agent.log'})")
        status, how = run_agent_process(agent_dir, agent, env, workspace / "code", workspace / "agent.log",
                                        options.timeout, progress=lambda elapsed: say(
                                            _progress_line(server.url, elapsed, options.timeout, baseline)))
        say(f"agent {options.agent}: {how}, exit status {status}")
        meta = json.loads((workspace / "run_meta.json").read_text())
        meta["end_time"] = time.time()
        write_json_atomic(workspace / "run_meta.json", meta)
        said = None
        while pending := server.pending():
            if pending != said:
                say(f"grading the {pending} submission(s) still queued or running ...")
                said = pending
            time.sleep(5)
        if pending is None:
            say(f"the grading server stopped answering (log {workspace / 'grading_server.log'}): submissions "
                "still queued were not graded")
    finally:
        server.stop()
    history = read_json(workspace / "scores.json", [])  # the grading server's record, whatever became of it
    best = best_entry(history)
    ended = time.time()
    success = status == 0
    result = {"success": success, "agent_id": options.agent, "task": scenario.id,
              "base_model": scenario.base_model(), "timeout": options.timeout, "how_it_ended": how,
              "start_time": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
              "end_time": datetime.fromtimestamp(ended).isoformat(timespec="seconds"),
              "duration_seconds": round(ended - started, 1), "workspace": str(workspace), "baseline": baseline,
              "best": best, "improvement": None if best is None else round(best["score"] - baseline, 4),
              "total_submissions": len(history), "metric": scenario.metric}
    write_json_atomic(result_dir / "result.json", result)
    if (workspace / "scores.json").is_file():
        shutil.copyfile(workspace / "scores.json", result_dir / "scores.json")
    if best is not None and Path(best["model_path"]).is_dir():
        (result_dir / "best_model").symlink_to(best["model_path"], target_is_directory=True)
    _append_csv(Path(options.results_dir).resolve() / "results.csv", result, run_id)
    best_text = "no submission" if best is None else f"{best['score']:.2f} (submission {best['submission_id']})"
    improvement = "-" if result["improvement"] is None else f"{result['improvement']:+.2f}"
    say(f"result: baseline {baseline:.2f}, best {best_text}, improvement {improvement}; {len(history)} "
        f"submission(s); {result_dir / 'result.json'}")
    return 0 if success else (status if status and status > 0 else 1)


CSV_FIELDS = ["run_id", "timestamp", "task", "agent", "base_model", "baseline", "best_score", "improvement",
              "submissions", "duration_s", "success", "workspace"]


def _append_csv(path: Path, result: dict[str, Any], run_id: str) -> None:
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow({"run_id": run_id, "timestamp": result["end_time"], "task": result["task"],
                         "agent": result["agent_id"], "base_model": result["base_model"],
                         "baseline": result["baseline"],
                         "best_score": None if result["best"] is None else result["best"]["score"],
                         "improvement": result["improvement"], "submissions": result["total_submissions"],
                         "duration_s": result["duration_seconds"], "success": result["success"],
                         "workspace": result["workspace"]})
