"""``agentrl bench run``: hand a scenario to an agent, let it post-train under a time limit, collect the best model
(AutoRL-Bench's ``run_agent.py``; docs/original.md).

1. **Agent**: found and configured by :mod:`agentrl.autorl_bench.agent`. Unless ``--uncontained``, containment
   (:mod:`agentrl.autorl_bench.containment`) is tried first and the run refuses to start where it cannot work.
2. **Workspace** ``<workspace_root>/<task>/<run_id>_<agent>/`` (new for every run): ``data/train.jsonl`` (a
   read-only copy of the training data: the only data there), ``models/<name>`` (the base model: mounted read-only
   when contained, or copied where the agent's uid could not read it; else a symbolic link), ``output/`` (where the
   agent saves models), ``code/`` (its working directory), ``reports/``, ``home/``, ``instructions.md``,
   ``description.md``, ``scenario.json`` (the evaluation protocol, without the test file) and ``run_meta.json``.
3. **Grading server**: ``agentrl bench serve --task T --workspace W`` as a child process, health-checked, with its
   state (grading record, model copies, evaluation results and logs) in the result directory's ``evaluations/``,
   the database's connection string and the operator's token in its environment (never on a command line the
   agent could read), ``--max_evaluations``, and, for a contained agent on an isolated network, a Unix socket.
4. **Baseline**: the base model evaluated by the same server with the operator's token (unrecorded; ``agentrl
   eval`` reuses the stored result for the same model, tasks and settings), then ``POST /set_baseline``.
5. **Agent**: its start script in ``code/`` under ``--timeout`` with ``TASK, BASE_MODEL, WORKSPACE, MODEL_PATH,
   DATA_PATH, OUTPUT_DIR, GRADING_SERVER_URL``, output to ``agent.log``; stopped on timeout, Ctrl-C or SIGTERM
   (which, at any step, also stops the grading server and its evaluations).
6. **Collect**: gradings still queued are finished (a grading ends within the evaluation timeout, so this wait
   ends; should none end for longer than that, the run stops waiting), the server is stopped, and the results are
   read from **its record** (never from the workspace): ``results/<time>_<task>_<agent>/result.json`` (``success,
   agent_id, task, base_model, timeout, how_it_ended, start_time, end_time, duration_seconds, workspace, baseline,
   best, best_model, improvement, total_submissions, failed_submissions, max_evaluations, contained,
   agent_network, metric``), ``scores.json`` (every grading), ``best_model`` (a link to the server's copy of the
   best submission) and a row in ``results/results.csv``. The exit status is the agent's (0 only if its start
   script exited 0).
"""

from __future__ import annotations

import csv
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from agentrl.autorl_bench import containment
from agentrl.autorl_bench.agent import (
    REPO_AGENTS,
    AgentError,
    BenchAgentConfig,
    agent_environment,
    find_agent,
    start_agent,
    supervise,
)
from agentrl.autorl_bench.containment import AgentSandbox, ContainmentUnavailable, Network
from agentrl.autorl_bench.data import public_answer_paths
from agentrl.autorl_bench.grading import GradingState, GradingStateError, write_json_atomic
from agentrl.autorl_bench.scenarios import Scenario, ScenarioSet, bench_home
from agentrl.autorl_bench.server import READY_LINE
from agentrl.store.connection import ENV_VAR as DB_ENV_VAR

TOKEN_ENV = "AGENTRL_BENCH_ADMIN_TOKEN"
STALL_MARGIN_S = 120.0
CHECKOUT = REPO_AGENTS.parent if (REPO_AGENTS.parent / "pyproject.toml").is_file() else None
"""The AgentRL checkout the built-in agents live in (their start scripts use its scripts and virtual environment)."""


class BenchRunError(RuntimeError):
    """The run cannot start (unknown agent or task, bad agent config, no containment, grading server down)."""


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
    eval_timeout: float = Field(7200.0, gt=0)
    max_evaluations: int | None = Field(None, ge=1)
    db_connection_string: str | None = None
    engine_args: str = ""
    scenario: list[str] = Field(default_factory=list)
    uncontained: bool = False
    agent_network: Network = "isolated"
    agent_env: list[str] = Field(default_factory=list)


INSTRUCTIONS = """# Instructions

You are post-training a language model for the scenario described in `description.md`; the benchmark grades the
models you submit on held-out data you cannot see. The best submission counts.

Environment variables:
- `TASK` scenario id, `BASE_MODEL` the base model's name, `MODEL_PATH` its directory (read-only), `DATA_PATH` the
  training data directory (read-only), `OUTPUT_DIR` where to save models, `WORKSPACE` this directory,
  `GRADING_SERVER_URL` the grading server.

Layout: `data/` (training data), `models/` (base model), `output/` (your models), `code/` (your working
directory), `reports/`, `home/`, `scenario.json` (the evaluation protocol: prompt, answer format, turns, tools),
`run_meta.json` (start time and time budget: the single source of truth for your deadline). Write only in
`output/`, `code/`, `reports/` and `home/`.

Loop: read `description.md` and `scenario.json`, train, save a Hugging Face model directory (config.json and
weights as regular files, no symbolic links; merge LoRA adapters first) under `$OUTPUT_DIR`, submit it, repeat
while time remains:

    curl -s -X POST $GRADING_SERVER_URL/submit -H 'Content-Type: application/json' -d '{"model_path": "output/v1"}'
    curl -s -X POST $GRADING_SERVER_URL/submit -H 'Content-Type: application/json' \\
         -d '{"model_path": "output/v2", "async": true}'      # returns a job id at once: GET /jobs/ID
    curl -s $GRADING_SERVER_URL/best                        # best submission so far
    curl -s $GRADING_SERVER_URL/history                     # every grading
    curl -s $GRADING_SERVER_URL/time                        # seconds remaining
    curl -s $GRADING_SERVER_URL/health                      # evaluations queued, and left if they are limited
    curl -s -X POST $GRADING_SERVER_URL/validate -H 'Content-Type: application/json' -d '{"model_path": "output/v1"}'

Model paths must lie inside the workspace (relative paths are resolved against it). A submitted model is copied
at once (change it afterwards as you like) and graded; gradings run one at a time, and a blocking submit returns
when its grading is done. Every grading counts, failed ones too.
"""


def prepare_workspace(scenario: Scenario, agent_id: str, options: RunOptions, run_name: str) -> Path:
    """Create the run's workspace (see the module docstring) and return it; it must not exist yet."""
    workspace = (Path(options.workspace_root) / scenario.id / f"{run_name}_{agent_id}").resolve()
    workspace.parent.mkdir(parents=True, exist_ok=True)
    try:
        workspace.mkdir()
    except FileExistsError:
        raise BenchRunError(f"the workspace {workspace} exists already: start the run again") from None
    for sub in ("data", "models", "output", "code", "reports", "home"):
        (workspace / sub).mkdir()
    train = workspace / "data" / "train.jsonl"
    shutil.copyfile(scenario.train_data_path, train)
    train.chmod(0o444)
    (workspace / "data").chmod(0o555)
    base = Path(scenario.base_model()).resolve()
    if options.uncontained:
        (workspace / "models" / base.name).symlink_to(base, target_is_directory=True)
    (workspace / "instructions.md").write_text(INSTRUCTIONS)
    (workspace / "description.md").write_text(f"# {scenario.name}\n\n{scenario.description}\n\nMetric: "
                                              f"{scenario.metric} (percent); base model: {base.name}.\n")
    info = scenario.public_info(None)
    info.update(base_model=str(workspace / "models" / base.name), base_model_path=str(workspace / "models" / base.name),
                train_data=str(train), train_data_path=str(train))
    write_json_atomic(workspace / "scenario.json", info)
    return workspace


def masked_paths(options: RunOptions, scenarios: ScenarioSet, result_dir: Path) -> tuple[Path, ...]:
    """What a contained agent must not see even where it lies under a directory it sees: the benchmark's cache (its
    secret and built-in data), results, other runs' workspaces, the embedded database's files, every scenario
    file's test data and the installed files that hold public held-out problems with their answers."""
    from agentrl.store.embedded import default_data_dir

    paths = [bench_home(), Path(options.results_dir), result_dir, Path(options.workspace_root), default_data_dir(),
             *(Path(s.test_data_path) for s in scenarios.from_files()), *public_answer_paths()]
    return tuple(dict.fromkeys(path.resolve() for path in paths))


class GradingServer:
    """``agentrl bench serve`` for one run, as a child process in its own process group."""

    def __init__(self, options: RunOptions, workspace: Path, state_dir: Path, log_path: Path, token: str,
                 unix_socket: Path | None):
        command = [sys.executable, "-m", "agentrl.cli.main", "bench", "serve", "--task", options.task,
                   "--workspace", str(workspace), "--host", options.host, "--port", str(options.port),
                   "--state_dir", str(state_dir), "--admin_token_env", TOKEN_ENV,
                   "--eval_timeout", str(options.eval_timeout)]
        for flag, value in (("--eval_limit", options.eval_limit), ("--max_evaluations", options.max_evaluations),
                            ("--engine_args", options.engine_args or None), ("--unix_socket", unix_socket)):
            if value is not None:
                command += [flag, str(value)]
        for path in options.scenario:
            command += ["--scenario", path]
        env = {**os.environ, TOKEN_ENV: token}
        if options.db_connection_string:
            env[DB_ENV_VAR] = options.db_connection_string
        self.headers = {"Authorization": f"Bearer {token}"}
        self.state_dir = state_dir
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL,
                                        text=True, start_new_session=True, env=env)
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

    def progress(self) -> tuple[int, int] | None:
        """(gradings queued or running, gradings recorded); None when the server is gone or does not answer."""
        if self.process.poll() is not None:
            return None
        try:
            pending = int(_get(self.url + "/health", timeout=10).json().get("pending_evaluations", 0))
            return pending, len(_get(self.url + "/history", timeout=10).json())
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


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


def _finish_gradings(server: GradingServer, say: Any, stall_s: float) -> None:
    """Wait until the server has no grading queued or running; stop waiting if it stops answering or no grading
    ends for ``stall_s`` (each ends within the evaluation timeout, so that means something is wrong)."""
    said, last, changed = None, None, time.monotonic()
    while (progress := server.progress()) is not None and progress[0]:
        if progress != last:
            last, changed = progress, time.monotonic()
        elif time.monotonic() - changed > stall_s:
            say(f"no grading ended for {stall_s:g} s: stopping the grading server with {progress[0]} ungraded")
            return
        if progress[0] != said:
            say(f"grading the {progress[0]} submission(s) still queued or running ...")
            said = progress[0]
        time.sleep(5)
    if progress is None:
        say(f"the grading server stopped answering (log {server.log.name}): submissions still queued were not "
            "graded")


def _sandbox(options: RunOptions, scenarios: ScenarioSet, scenario: Scenario, agent_dir: Path, workspace: Path,
             result_dir: Path, socket: Path, port: int) -> AgentSandbox:
    """Where the contained agent runs: its uid, what it sees and hides, its network."""
    return AgentSandbox(workspace=workspace, agent_dir=agent_dir, base_model=Path(scenario.base_model()).resolve(),
                        uid=containment.agent_uid(), checkout=CHECKOUT,
                        masked=masked_paths(options, scenarios, result_dir), network=options.agent_network,
                        grading_socket=socket if options.agent_network == "isolated" else None, port=port)


def _baseline(server: GradingServer, scenario: Scenario, log_dir: Path, say: Any) -> float:
    """The base model's score, evaluated with the operator's token (unrecorded) and set as the run's baseline."""
    say(f"baseline: evaluating {scenario.base_model()} on {scenario.id} ...")
    response = _while_reporting(
        lambda: httpx.post(server.url + "/evaluate", json={"scenario_id": scenario.id,
                                                           "model_path": scenario.base_model()},
                           headers=server.headers, timeout=None),
        lambda: _evaluation_progress(log_dir), say)
    if response.status_code != 200:
        raise BenchRunError(f"the baseline evaluation failed: {response.text}")
    baseline = response.json()["score"]
    reply = httpx.post(server.url + "/set_baseline", json={"score": baseline}, headers=server.headers, timeout=30)
    if reply.status_code != 200:
        raise BenchRunError(f"the grading server refused the baseline: {reply.text}")
    say(f"baseline: {baseline:.2f} ({scenario.metric}, reused: {response.json()['details'].get('reused')})")
    return baseline


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def run(options: RunOptions, say: Any = print) -> int:
    """The whole run (see the module docstring); returns the agent's exit status (1 if it was stopped). SIGTERM
    stops it as Ctrl-C does: the grading server and its evaluations are stopped too."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(options, say)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(options: RunOptions, say: Any) -> int:
    try:
        agent_dir, agent = find_agent(options.agent, options.agents_dir)
        scenarios = ScenarioSet(options.scenario)
        scenario = scenarios.get(options.task)
        if options.base_model:
            scenario = scenario.model_copy(update={"base_model_path": str(Path(options.base_model).resolve())})
        agent_environment({}, agent, options.agent_env, None)  # every --agent_env variable is set
        if not options.uncontained:
            containment.check(options.agent_network)
    except (AgentError, ContainmentUnavailable) as error:
        raise BenchRunError(str(error)) from None
    run_id = datetime.now().strftime("%Y%m%dT%H%M%S")
    run_name = run_id + (f"_p{options.port}" if options.port != 5000 else "")
    workspace = prepare_workspace(scenario, options.agent, options, run_name)
    result_dir = Path(options.results_dir).resolve() / f"{run_name}_{scenario.id}_{options.agent}"
    result_dir.parent.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir()  # new, as the workspace
    state_dir = result_dir / "evaluations"
    say(f"workspace: {workspace}")
    started = time.time()
    socket_dir = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))  # 0700: the socket is reachable from no one else
    contained_socket = not options.uncontained and options.agent_network == "isolated"
    try:
        server = GradingServer(options, workspace, state_dir, result_dir / "grading_server.log",
                               secrets.token_urlsafe(32), socket_dir / "grading.sock" if contained_socket else None)
        say(f"grading server: {server.url} (log {server.log.name})")
        try:
            sandbox = None if options.uncontained else _sandbox(options, scenarios, scenario, agent_dir, workspace,
                                                               result_dir, socket_dir / "grading.sock",
                                                               urlsplit(server.url).port or options.port)
            status, how, baseline = _run_agent(options, agent_dir, agent, scenario, workspace, server, sandbox, say)
            _finish_gradings(server, say, options.eval_timeout + STALL_MARGIN_S)
        finally:
            server.stop()
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    try:
        state = GradingState.load(state_dir / "grading.json")  # the grading server's own record
    except GradingStateError as error:
        raise BenchRunError(str(error)) from None
    return _report(options, scenario, state, baseline, status, how, started, workspace, result_dir, run_id, say)


def _run_agent(options: RunOptions, agent_dir: Path, agent: BenchAgentConfig, scenario: Scenario, workspace: Path,
               server: GradingServer, sandbox: AgentSandbox | None, say: Any) -> tuple[int | None, str, float]:
    """Baseline, then the agent from start to end: ``(exit status, how it ended, baseline)``."""
    state_dir = server.state_dir
    baseline = _baseline(server, scenario, state_dir / "logs", say)
    if sandbox is not None:
        sandbox.prepare()
        if sandbox.uid is not None and sandbox.grading_socket is not None:
            os.chown(sandbox.grading_socket, sandbox.uid, sandbox.uid)
    meta = {"start_time": time.time(), "timeout_s": options.timeout, "end_time": None}
    write_json_atomic(state_dir / "run_meta.json", meta)
    write_json_atomic(workspace / "run_meta.json", meta)
    base = Path(scenario.base_model()).resolve()
    url = f"http://127.0.0.1:{sandbox.port}" if sandbox and sandbox.network == "isolated" else server.url
    contract = {"TASK": scenario.id, "BASE_MODEL": base.name, "WORKSPACE": str(workspace),
                "MODEL_PATH": str(workspace / "models" / base.name), "DATA_PATH": str(workspace / "data"),
                "OUTPUT_DIR": str(workspace / "output"), "GRADING_SERVER_URL": url}
    env = agent_environment(contract, agent, options.agent_env, workspace / "home" if sandbox else None)
    where = "uncontained" if sandbox is None else f"contained, {sandbox.network} network"
    say(f"agent {options.agent}: running {agent.start} ({where}) for at most {options.timeout:g} s "
        f"(log {workspace / 'agent.log'})")
    running = start_agent(["bash", str(agent_dir / agent.start)], env, workspace / "code", workspace / "agent.log",
                          sandbox)
    status, how = supervise(running, options.timeout, progress=lambda elapsed: say(
        _progress_line(server.url, elapsed, options.timeout, baseline)))
    say(f"agent {options.agent}: {how}, exit status {status}")
    write_json_atomic(state_dir / "run_meta.json", {**meta, "end_time": time.time()})
    return status, how, baseline


def _report(options: RunOptions, scenario: Scenario, state: GradingState, baseline: float, status: int | None,
            how: str, started: float, workspace: Path, result_dir: Path, run_id: str, say: Any) -> int:
    """Write result.json, scores.json, the best_model link and the CSV row from the server's record."""
    best = state.best()
    baseline = state.baseline_score if state.baseline_score is not None else baseline
    ended = time.time()
    success = status == 0
    result = {"success": success, "agent_id": options.agent, "task": scenario.id,
              "base_model": scenario.base_model(), "timeout": options.timeout, "how_it_ended": how,
              "start_time": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
              "end_time": datetime.fromtimestamp(ended).isoformat(timespec="seconds"),
              "duration_seconds": round(ended - started, 1), "workspace": str(workspace), "baseline": baseline,
              "best": None if best is None else best.public(), "best_model": None if best is None else best.snapshot,
              "improvement": None if best is None else round(best.score - baseline, 4),
              "total_submissions": len(state.submissions),
              "failed_submissions": sum(1 for s in state.submissions if s.error),
              "max_evaluations": options.max_evaluations, "contained": not options.uncontained,
              "agent_network": None if options.uncontained else options.agent_network, "metric": scenario.metric}
    write_json_atomic(result_dir / "result.json", result)
    write_json_atomic(result_dir / "scores.json", [s.public() for s in state.submissions])
    if best is not None and best.snapshot and Path(best.snapshot).is_dir():
        (result_dir / "best_model").symlink_to(best.snapshot, target_is_directory=True)
    _append_csv(Path(options.results_dir).resolve() / "results.csv", result, run_id)
    best_text = "no submission" if best is None else f"{best.score:.2f} (submission {best.submission_id})"
    improvement = "-" if result["improvement"] is None else f"{result['improvement']:+.2f}"
    say(f"result: baseline {baseline:.2f}, best {best_text}, improvement {improvement}; {len(state.submissions)} "
        f"grading(s), {result['failed_submissions']} failed; {result_dir / 'result.json'}")
    return 0 if success else (status if how == "finished" and status and status > 0 else 1)


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
