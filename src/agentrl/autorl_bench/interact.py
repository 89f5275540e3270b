"""``POST /interact`` for interactive scenarios: environment sessions an agent plays to gather experience.

A session is one in-process instance of the scenario's environment (:mod:`agentrl.envs`), reset to a task of the
scenario's **training data** (the ``env.data_idx`` of its rows; every other index is refused, so held-out goals
cannot be played). A request without a
``session_id`` (or with an unknown one) starts a session on ``data_idx`` (default: a random training task) and
returns the first observation; a request with a ``session_id`` and an ``action`` steps it. Environment calls run in
worker threads (one at a time per session). Sessions idle longer than ``ttl_s`` are closed, and at most
``max_sessions`` are open (the oldest idle one is closed to make room).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.base import EnvError, Environment, StepResult
from agentrl.envs.registry import get_spec


class InteractError(ValueError):
    """A request ``/interact`` refuses with HTTP 400."""


@dataclass
class Session:
    env: Environment
    data_idx: int
    last_used: float = field(default_factory=time.monotonic)
    total_reward: float = 0.0
    steps: int = 0
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def training_indices(path: str, env_name: str) -> set[int]:
    """The ``env.data_idx`` of the rows of the task file ``path`` that name environment ``env_name``."""
    indices = set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            env = json.loads(line).get("env") if line.strip() else None
            if isinstance(env, dict) and env.get("name") == env_name and isinstance(env.get("data_idx"), int):
                indices.add(env["data_idx"])
    return indices


class InteractSessions:
    """Open environment sessions of one environment kind."""

    def __init__(self, env_name: str, train: set[int], *, ttl_s: float = 1800.0, max_sessions: int = 64):
        if not train:
            raise InteractError(f"the scenario's training data has no {env_name} task (rows with env.data_idx)")
        self.spec = get_spec(env_name)
        self.train = train
        self.ttl_s, self.max_sessions = ttl_s, max_sessions
        self.sessions: dict[str, Session] = {}

    async def interact(self, session_id: str | None, action: str | None, data_idx: int | None) -> dict[str, Any]:
        self._expire()
        if session_id and session_id in self.sessions:
            if not isinstance(action, str) or not action.strip():
                raise InteractError("'action' is required to step a session (a non-empty string)")
            return await asyncio.to_thread(self._step, session_id, action)
        return await asyncio.to_thread(self._start, session_id or uuid.uuid4().hex[:12], data_idx)

    def _start(self, session_id: str, data_idx: int | None) -> dict[str, Any]:
        if data_idx is None:
            data_idx = random.choice(sorted(self.train))
        if isinstance(data_idx, bool) or not isinstance(data_idx, int) or data_idx not in self.train:
            raise InteractError(f"'data_idx' must be the task index of a row of the training data ({len(self.train)} "
                                f"tasks, e.g. {min(self.train)}); got {data_idx!r}")
        if len(self.sessions) >= self.max_sessions:
            oldest = min(self.sessions, key=lambda s: self.sessions[s].last_used)
            self._close(oldest)
        env = self.spec.factory()
        try:
            observation = env.reset(data_idx)
        except EnvError as error:
            env.close()
            raise InteractError(str(error)) from None
        self.sessions[session_id] = Session(env=env, data_idx=data_idx)
        return {"session_id": session_id, "observation": observation, "reward": 0.0, "done": False,
                "info": {"data_idx": data_idx, "instruction": self.spec.instruction,
                         "action_format": self.spec.action_format}}

    def _step(self, session_id: str, action: str) -> dict[str, Any]:
        session = self.sessions[session_id]
        with session.lock:
            if session.done:
                raise InteractError(f"session {session_id} has finished; start a new one")
            try:
                result: StepResult = session.env.step(action)
            except EnvError as error:
                raise InteractError(str(error)) from None
            session.last_used = time.monotonic()
            session.steps += 1
            session.total_reward += result.reward
            session.done = result.done or session.steps >= self.spec.max_turns
        success = session.total_reward >= self.spec.success_reward
        return {"session_id": session_id, "observation": result.observation, "reward": result.reward,
                "done": session.done, "info": {**result.info, "data_idx": session.data_idx, "steps": session.steps,
                                               "total_reward": session.total_reward, "success": success}}

    def _close(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.env.close()

    def _expire(self) -> None:
        deadline = time.monotonic() - self.ttl_s
        for session_id in [s for s, session in self.sessions.items() if session.last_used < deadline]:
            self._close(session_id)

    def close_all(self) -> None:
        for session_id in list(self.sessions):
            self._close(session_id)
