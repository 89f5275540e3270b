"""Scoring: pluggable scorers behind ``MCPScorerFactory`` and the answer schemas.

``await MCPScorerFactory.score(name, model_answer, ground_truth, config)`` returns a ``ScoreResult`` (a score or
the error that prevented one; ``unavailable`` when the scorer's backend, e.g. the LLM judge, could not be reached:
an infrastructure failure, not a verdict). Built-in scorers: ``math``, ``exact``, ``agentcpm`` (LLM judge), ``env_reward``.
``extract_answer(text, schema)`` pulls the final answer out of a model output (schemas ``answer``, ``boxed``).
"""

from agentrl.scoring.agent_config import AgentConfig, JudgeConfig, LLMEndpoint, LLMPoolConfig, load_agent_config
from agentrl.scoring.answers import ANSWER_SCHEMAS, extract_answer
from agentrl.scoring.errors import ScorerUnavailable
from agentrl.scoring.factory import MCPScorerFactory, ScorerError, ScoreResult
from agentrl.scoring.math_equiv import math_equal

__all__ = [
    "ANSWER_SCHEMAS",
    "AgentConfig",
    "JudgeConfig",
    "LLMEndpoint",
    "LLMPoolConfig",
    "MCPScorerFactory",
    "ScoreResult",
    "ScorerError",
    "ScorerUnavailable",
    "extract_answer",
    "load_agent_config",
    "math_equal",
]
