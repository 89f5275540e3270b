"""Scoring: pluggable scorers behind ``MCPScorerFactory`` and the answer schemas.

``await MCPScorerFactory.score(name, model_answer, ground_truth, config)`` returns a ``ScoreResult`` (a score or
the error that prevented one; ``unavailable`` when the scorer's backend, e.g. the LLM judge, could not be reached:
an infrastructure failure, not a verdict). Built-in scorers: ``math``, ``exact``, ``agentcpm`` (LLM judge),
``env_reward``, ``gsm8k``, ``humaneval`` (tests run in the sandbox).
``extract_answer(text, schema)`` pulls the final answer out of a model output (schemas ``answer``, ``boxed``,
``gsm8k``, ``code``).

The names below are imported on first use, so that light modules such as :mod:`agentrl.scoring.answers` (whose
``ANSWER_SCHEMAS`` the command-line parsers list) load without the judge's and math checker's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.scoring.agent_config import (
        AgentConfig,
        JudgeConfig,
        LLMEndpoint,
        LLMPoolConfig,
        load_agent_config,
    )
    from agentrl.scoring.answers import ANSWER_SCHEMAS, extract_answer
    from agentrl.scoring.errors import ScorerUnavailable
    from agentrl.scoring.factory import MCPScorerFactory, ScorerError, ScoreResult
    from agentrl.scoring.math_equiv import math_equal

_SUBMODULE_OF = {
    "ANSWER_SCHEMAS": "answers",
    "AgentConfig": "agent_config",
    "JudgeConfig": "agent_config",
    "LLMEndpoint": "agent_config",
    "LLMPoolConfig": "agent_config",
    "MCPScorerFactory": "factory",
    "ScoreResult": "factory",
    "ScorerError": "factory",
    "ScorerUnavailable": "errors",
    "extract_answer": "answers",
    "load_agent_config": "agent_config",
    "math_equal": "math_equiv",
}

__all__ = list(_SUBMODULE_OF)


def __getattr__(name: str) -> Any:
    submodule = _SUBMODULE_OF.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
