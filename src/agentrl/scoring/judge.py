"""The ``agentcpm`` scorer: an LLM judge decides whether the model's answer matches the reference answer.

The judge is the ``scorer_agent`` of the agent config (``config["scorer_agent"]``): its models are tried in
order with retries (``agentrl.scoring.llm``). A reply must contain the verdict ``Correct`` or ``Incorrect``;
anything else counts as a failed attempt. When no model gives a verdict the scorer raises, so the failure is
recorded as a judge error and never becomes a silent reward of 0. When every attempt failed because the judge
could not be reached (connection errors, timeouts, HTTP 5xx/429 on every model) it raises
:class:`~agentrl.scoring.errors.ScorerUnavailable` instead: a sampler retries it for the judge's
``unavailable_retry_s`` and then gives the slot back unscored (retried later), rather than failing it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentrl.scoring.agent_config import JudgeConfig
from agentrl.scoring.errors import ScorerUnavailable
from agentrl.scoring.llm import LLMUnavailableError, chat_with_failover

DEFAULT_JUDGE_PROMPT = """You grade answers to questions. Compare the candidate answer with the reference answer.

Question: {question}
Reference answer: {labeled_answer}
Candidate answer: {pred_answer}

The candidate is correct when it states the same final result as the reference: ignore wording, formatting,
units written differently and equivalent numeric forms, but not a different or incomplete result. Reply with
exactly one word: Correct or Incorrect."""

_PLACEHOLDER = re.compile(r"\{(question|labeled_answer|pred_answer)\}")
_VERDICT = re.compile(r"\b(incorrect|not\s+correct|correct)\b", re.IGNORECASE)


def parse_verdict(reply: str) -> bool:
    """``True`` for Correct, ``False`` for Incorrect; ``ValueError`` when the reply holds no verdict."""
    verdicts = {match.lower().split()[0] for match in _VERDICT.findall(reply)}
    if not verdicts:
        raise ValueError(f"no Correct/Incorrect verdict in the judge's reply: {reply[:200]!r}")
    return "incorrect" not in verdicts and "not" not in verdicts


def judge_config(config: Mapping[str, Any] | None) -> JudgeConfig:
    """The judge settings under ``config["scorer_agent"]`` (a ``JudgeConfig`` or its dict)."""
    settings = (config or {}).get("scorer_agent")
    if settings is None:
        raise ValueError(
            "the agentcpm scorer needs judge settings: give --agent_config_path with a scorer_agent section"
        )
    return settings if isinstance(settings, JudgeConfig) else JudgeConfig.model_validate(settings)


async def agentcpm_score(
    model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None
) -> float | tuple[float, dict[str, str]]:
    """1.0 if the judge says the answer is correct, 0.0 if not, with the judge's model and reply as details.

    An empty answer is 0.0 without asking. ``ground_truth`` is the reference answer or a mapping with ``answer``
    (and ``query``, the question shown to the judge; else ``config["query"]``).
    """
    judge = judge_config(config)
    if isinstance(ground_truth, Mapping):
        question, reference = ground_truth.get("query") or "", ground_truth.get("answer")
    else:
        question, reference = "", ground_truth
    question = question or (config or {}).get("query") or ""
    if reference is None or not str(reference).strip():
        raise ValueError("the agentcpm scorer needs a reference answer")
    if not model_answer or not model_answer.strip():
        return 0.0
    values = {"question": str(question), "labeled_answer": str(reference), "pred_answer": model_answer}
    prompt = _PLACEHOLDER.sub(lambda m: values[m.group(1)], judge.judge_prompt_template or DEFAULT_JUDGE_PROMPT)
    try:
        (verdict, reply), model = await chat_with_failover(
            judge, [{"role": "user", "content": prompt}], lambda text: (parse_verdict(text), text), temperature=0
        )
    except LLMUnavailableError as error:
        if error.unreachable:
            raise ScorerUnavailable(f"the judge cannot be reached: {error}", judge.unavailable_retry_s) from error
        raise
    return (1.0 if verdict else 0.0), {"judge_model": model, "judge_reply": reply}
