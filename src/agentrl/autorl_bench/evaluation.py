"""Grading a model on a scenario's held-out tasks: one ``agentrl eval`` run per evaluation, one at a time.

Each evaluation is an ``agentrl eval`` child process (greedy, one sample per task, the scenario's protocol) on the
scenario's test file, so it uses the same rollout, tools, scorers and environment code as training and scales the
same way: an ``agentrl engine`` started on the model (``engine_args``, e.g. ``--device cuda``), or live SGLang /
engine services (``inference_urls``) that are first told to load the model (``update_weights_from_disk``).
Evaluations are **serialised** (a FIFO lock): two never share a device. An evaluation that runs longer than
``timeout_s`` is stopped (its process group gets SIGTERM, then SIGKILL) and fails. The database's connection
string reaches ``agentrl eval`` through its environment (``$AGENTRL_DB``), never its command line. Result files
and logs go to ``state_dir``, which must lie outside any agent's workspace (they name the test file); so does an
:class:`EvaluationResult`'s ``detail`` (the log and its last lines), while its ``error`` is what an agent may read.
``agentrl eval`` stores every result in the run database keyed by model identity (path, weight files' sizes and
mtimes), tasks and settings, so evaluating an unchanged model again reuses the stored result (``reused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agentrl.autorl_bench.scenarios import Scenario
from agentrl.log import redact
from agentrl.store.connection import ENV_VAR

logger = logging.getLogger(__name__)

MODEL_MARKERS = ("config.json", "pytorch_model.bin", "model.safetensors", "adapter_config.json")
"""A directory holding any of these is a model (AutoRL-Bench's ``/validate`` rule)."""


class EvaluationResult(BaseModel):
    """What one evaluation produced: the score in percent, or the error that prevented it (``error`` may be shown
    to the agent; ``detail``, the log and its last lines, only to the operator)."""

    score: float | None = None
    metrics: dict[str, Any] = {}
    error: str | None = None
    detail: str | None = None
    reused: bool = False
    elapsed_seconds: float = 0.0


def model_problem(path: Path, shown: str | Path | None = None) -> str | None:
    """Why ``path`` cannot be evaluated as a model (``None`` when it can); the message calls it ``shown``."""
    shown = shown or path
    if not path.is_dir():
        return f"{shown} is not a directory"
    return files_problem([p.name for p in path.iterdir()], shown)


def files_problem(files: list[str], shown: str | Path) -> str | None:
    """Why a directory ``shown`` holding ``files`` is not a model (``None`` when it is)."""
    if not any(marker in files for marker in MODEL_MARKERS):
        return f"{shown} holds none of {', '.join(MODEL_MARKERS)}"
    if "adapter_config.json" in files and "config.json" not in files:
        return (f"{shown} is a LoRA adapter without its base weights: merge it first (`agentrl model merge "
                f"{shown} --out DIR`, or PEFT's merge_and_unload() then save_pretrained) and submit the merged model")
    return None


def model_digest(path: Path) -> str:
    """A digest of the model's identity: its path and the size and mtime of each file (as ``agentrl eval``)."""
    rows = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(path.resolve()), rows]).encode()).hexdigest()[:16]


class Evaluator:
    """Runs ``agentrl eval`` for (scenario, model) pairs, one at a time; logs under ``state_dir/logs``."""

    def __init__(self, *, db_connection_string: str, state_dir: Path, eval_limit: int | None = None,
                 engine_args: str = "", inference_urls: list[str] | None = None,
                 env_servers: list[str] | None = None, concurrency: int = 16, timeout_s: float = 7200.0):
        self.db = db_connection_string
        self.timeout_s = timeout_s
        self.state_dir = state_dir
        self.eval_limit = eval_limit
        self.engine_args = engine_args
        self.inference_urls = inference_urls or []
        self.env_servers = env_servers or []
        self.concurrency = concurrency
        self._lock = asyncio.Lock()
        self._running: set[asyncio.subprocess.Process] = set()
        self._count = 0
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)

    def _mcp_config(self, tools: list[str]) -> Path:
        path = self.state_dir / f"mcp-{'-'.join(tools)}.json"
        servers = [{"name": tool, "command": sys.executable, "args": ["-m", "agentrl.cli.main", "tools", "serve", tool]}
                   for tool in tools]
        path.write_text(json.dumps({"servers": servers}, indent=2) + "\n")
        return path

    def command(self, scenario: Scenario, model: Path, label: str, output: Path) -> list[str]:
        """The ``agentrl eval`` command line of one evaluation (the database comes from the environment)."""
        protocol = scenario.eval
        command = [sys.executable, "-m", "agentrl.cli.main", "eval", "--tasks", scenario.test_data_path,
                   "--model_name_or_path", str(model),
                   "--scorer", protocol.scorer, "--answer_schema", protocol.answer_schema,
                   "--query_prompt", protocol.query_prompt, "--max_turns", str(protocol.max_turns),
                   "--max_new_tokens", str(protocol.max_new_tokens),
                   "--max_prompt_tokens", str(protocol.max_prompt_tokens), "--temperature", "0", "--seed", "0",
                   "--max_concurrent_samples_per_process", str(self.concurrency),
                   "--name", f"{scenario.id} {label}", "--output", str(output), "--json"]
        if self.eval_limit:
            command += ["--limit", str(self.eval_limit)]
        if self.inference_urls:
            command += ["--inference_urls", ",".join(self.inference_urls)]
        elif self.engine_args:
            command += ["--engine_args", self.engine_args]
        if protocol.mcp_config:
            command += ["--mcp_config", protocol.mcp_config]
        elif protocol.tools:
            command += ["--mcp_config", str(self._mcp_config(protocol.tools))]
        for entry in self.env_servers:
            command += ["--env_server", entry]
        return command

    async def evaluate(self, scenario: Scenario, model_path: str | Path, label: str,
                       on_start: Callable[[], None] | None = None) -> EvaluationResult:
        """Grade ``model_path`` on ``scenario`` once earlier evaluations are done (``on_start`` is called then);
        never raises for a model or evaluation failure: the result carries the error."""
        model = Path(model_path).resolve()
        async with self._lock:
            if on_start is not None:
                on_start()
            started = time.monotonic()
            result = await self._run(scenario, model, label)
            result.elapsed_seconds = round(time.monotonic() - started, 2)
            return result

    async def _run(self, scenario: Scenario, model: Path, label: str) -> EvaluationResult:
        problem = model_problem(model)
        if problem:
            return EvaluationResult(error=problem)
        self._count += 1
        stem = f"eval-{time.strftime('%Y%m%dT%H%M%S')}-{self._count}"
        output, log_path = self.state_dir / f"{stem}.json", self.state_dir / "logs" / f"{stem}.log"
        if self.inference_urls:
            error = await self._load_into_services(model)
            if error:
                return EvaluationResult(error=error)
        with open(log_path, "wb") as log:
            process = await asyncio.create_subprocess_exec(
                *self.command(scenario, model, label, output), stdout=log, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env={**os.environ, ENV_VAR: self.db})
            self._running.add(process)
            try:
                code = await asyncio.wait_for(process.wait(), self.timeout_s)
            except TimeoutError:
                await _stop(process)
                return EvaluationResult(error=f"the evaluation did not finish within {self.timeout_s:g} s",
                                        detail=f"log {log_path}")
            except asyncio.CancelledError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                raise
            finally:
                self._running.discard(process)
        if code != 0 or not output.is_file():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            return EvaluationResult(error=f"agentrl eval exited with status {code}",
                                    detail=redact(f"log {log_path}: " + " | ".join(tail)))
        data = json.loads(output.read_text())
        metrics = data.get("metrics", {})
        accuracy = metrics.get("accuracy")
        details = {"accuracy": accuracy, "correct": metrics.get("correct"),
                   "total": metrics.get("valid_samples"), "errors": metrics.get("errors"),
                   "num_tasks": metrics.get("tasks"), "mean_reward": metrics.get("mean_reward"),
                   "eval_key": data.get("key")}
        logger.info("%s on %s: accuracy %s (result %s, log %s)", model, scenario.id, accuracy, output, log_path)
        if accuracy is None:
            return EvaluationResult(metrics=details, reused=bool(data.get("reused")), detail=f"log {log_path}",
                                    error="no sample of the evaluation had a verdict (every one failed)")
        return EvaluationResult(score=round(100.0 * accuracy, 2), metrics=details, reused=bool(data.get("reused")))

    def stop_all(self) -> None:
        """SIGTERM to every running evaluation's process group (the server is stopping)."""
        for process in self._running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)

    async def _load_into_services(self, model: Path) -> str | None:
        from agentrl.inference.client import SGLangClient

        try:
            for url in self.inference_urls:
                async with SGLangClient(url) as client:
                    await client.update_weights_from_disk(str(model), weight_version=f"bench-{model_digest(model)}")
        except Exception as error:  # noqa: BLE001 - any refusal is the evaluation's error
            return f"the inference services could not load {model}: {error}"
        return None


async def _stop(process: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s``; returns once the process has ended."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), grace_s)
            return
