"""An AutoRL-Bench agent: its directory and configuration, its environment, and its process.

``agents/<id>/config.yaml``: ``name``, ``description``, ``start`` (default ``start.sh``), ``env_vars``; found under
``--agents_dir`` (default: ``./agents``, then the repository's ``agents/``).

The agent starts with an explicit environment, never the orchestrator's (which may hold the evaluation database's
connection string): ``PATH``, ``HOME``, ``LANG``, the variables of :data:`PASSED_THROUGH` and those named with
``--agent_env`` where they are set, the config's ``env_vars``, then the contract's variables. Contained
(:mod:`agentrl.autorl_bench.containment`), ``HOME`` is the workspace's ``home/`` and ``PATH`` the interpreter's
directory and the system's; uncontained, both are yours. Its stdin is ``/dev/null``, stdout and stderr its log; no
other file descriptor is inherited.

Stopping (timeout, Ctrl-C, SIGTERM): SIGTERM to the agent's process group, SIGKILL :data:`KILL_GRACE_S` later.
Contained, the launcher inside the namespaces does it when the orchestrator closes its control pipe, and the
namespace's end kills whatever the agent left behind, ``setsid`` and double-forked processes included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.autorl_bench.containment import AgentSandbox, args_through_fd

REPO_AGENTS = Path(__file__).resolve().parents[3] / "agents"
KILL_GRACE_S = 10.0
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("LANG", "LC_ALL", "TZ", "TERM", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                  "ROCR_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
"""Variables of the orchestrator's environment an agent gets where they are set (locale, devices, threads)."""


class AgentError(RuntimeError):
    """The agent cannot be run (unknown agent, bad config, a variable to pass that is not set)."""


class BenchAgentConfig(BaseModel):
    """``agents/<id>/config.yaml``."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    start: str = "start.sh"
    env_vars: dict[str, str | int | float | bool] = Field(default_factory=dict)


def find_agent(agent_id: str, agents_dir: str | None) -> tuple[Path, BenchAgentConfig]:
    """The agent's directory and configuration (``AgentError`` naming the agents found otherwise)."""
    roots = [Path(agents_dir)] if agents_dir else [Path("agents"), REPO_AGENTS]
    for root in roots:
        config_path = root / agent_id / "config.yaml"
        if config_path.is_file():
            try:
                config = BenchAgentConfig.model_validate(yaml.safe_load(config_path.read_text()) or {})
            except (yaml.YAMLError, ValidationError) as error:
                raise AgentError(f"{config_path}: {error}") from None
            if not (root / agent_id / config.start).is_file():
                raise AgentError(f"{config_path}: field 'start': no such file {root / agent_id / config.start}")
            return (root / agent_id).resolve(), config
    known = sorted({p.parent.name for root in roots if root.is_dir() for p in root.glob("*/config.yaml")})
    raise AgentError(f"unknown agent {agent_id!r} (looked in {', '.join(map(str, roots))}); "
                     f"agents found: {', '.join(known) or 'none'}")


def agent_environment(contract: dict[str, str], config: BenchAgentConfig, passed: list[str],
                      home: Path | None) -> dict[str, str]:
    """The agent's whole environment (``home``: contained, its ``$HOME``; None: uncontained, yours)."""
    missing = [name for name in passed if name not in os.environ]
    if missing:
        raise AgentError(f"--agent_env {', '.join(missing)}: not set in this environment")
    if home is None:
        env = {"PATH": os.environ.get("PATH", SYSTEM_PATH), "HOME": os.environ.get("HOME", "/")}
    else:
        env = {"PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}", "HOME": str(home)}
    env["LANG"] = "C.UTF-8"
    env.update({name: os.environ[name] for name in (*PASSED_THROUGH, *passed) if name in os.environ})
    env.update({key: str(value) for key, value in config.env_vars.items()})
    env.update(contract)
    return env


@dataclass
class RunningAgent:
    """The agent's process: ``bash start.sh`` in a session of its own, or bubblewrap running the launcher."""

    process: subprocess.Popen
    control: int | None = None  # contained: the launcher's control pipe (closing it stops the agent)

    def stop(self) -> None:
        """SIGTERM to the agent's process group, SIGKILL after :data:`KILL_GRACE_S`; returns once it ended."""
        if self.control is None:
            kill_group(self.process)
            return
        self.close()
        try:
            self.process.wait(timeout=KILL_GRACE_S + 10)
        except subprocess.TimeoutExpired:  # the launcher did not end it: bubblewrap's end ends the namespace
            kill_group(self.process, grace_s=0)

    def close(self) -> None:
        if self.control is not None:
            os.close(self.control)
            self.control = None


def start_agent(command: list[str], env: dict[str, str], cwd: Path, log_path: Path,
                sandbox: AgentSandbox | None) -> RunningAgent:
    """Start ``command`` (the agent's start script), contained in ``sandbox`` unless it is None."""
    with open(log_path, "ab") as log:
        if sandbox is None:
            return RunningAgent(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True))
        read, write = os.pipe()
        argv, args_fd = args_through_fd(sandbox.argv(command, read, KILL_GRACE_S))
        try:
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(read, args_fd))
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
            os.close(args_fd)
    return RunningAgent(process, write)


def supervise(agent: RunningAgent, timeout_s: float, progress: Callable[[float], None] | None = None,
              progress_every_s: float = 60.0) -> tuple[int | None, str]:
    """Wait for the agent under ``timeout_s``; returns ``(exit status or None, how it ended)``. It is stopped on
    timeout, SIGINT or SIGTERM. ``progress(elapsed)`` is called every ``progress_every_s`` while it runs."""
    stop = threading.Event()
    reason = ["finished"]

    def on_signal(signum: int, _frame: Any) -> None:
        reason[0] = f"stopped by {signal.Signals(signum).name}"
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start = time.monotonic()
        deadline, next_progress = start + timeout_s, start + progress_every_s
        while agent.process.poll() is None:
            if progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every_s
                progress(time.monotonic() - start)
            if stop.is_set() or time.monotonic() >= deadline:
                if not stop.is_set():
                    reason[0] = f"timed out after {timeout_s:g} s"
                agent.stop()
                break
            time.sleep(0.2)
    finally:
        agent.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return agent.process.returncode, reason[0]


def kill_group(process: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM to the process group, SIGKILL to whatever is left after ``grace_s``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader, or a leader ignoring TERM
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
