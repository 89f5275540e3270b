"""Evaluation: roll a model out on a task file or split with the rollout machinery, score, and report accuracy,
mean reward, avg@k and unbiased pass@k (overall and per task type); results live in the ``Eval`` collection."""

from agentrl.eval.metrics import pass_at_k, summarize, summarize_by_type

__all__ = ["pass_at_k", "summarize", "summarize_by_type"]
