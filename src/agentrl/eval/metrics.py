"""Evaluation metrics over the samples of each task: accuracy, mean reward, avg@k, pass@k (unbiased), per type.

A task was sampled ``n_total = k × repeats`` times. Each sample is either **valid** (it has a verdict: a score
from the scorer, including 0 for trajectories that ended without an answer — turns limit, length limit,
repetition) or an **error** (no verdict: the inference service failed (``failed_error``, a generation error), an
environment could not be started (``env_start_error``) or failed mid-episode (``env_error``), the scorer or judge
failed (``score_error``), the slot was given up after repeated crashes (``slot_failed``), or it has no Record
(``missing``)). Errors are excluded from every rate and counted separately, so an infrastructure failure never
reads as a wrong answer. A valid sample is **correct** when its score is at least ``CORRECT_THRESHOLD`` (0.5, the
group stage's threshold; binary scorers give 0 or 1) — or, for an environment episode, when the environment says it
succeeded (reward 1, 0.5 for BabyAI, 100 for SciWorld: the success rate of AgentGym's evaluations); ``mean_env_reward``
is then the mean episode reward on the environment's own scale.

For a task with ``n`` valid samples of which ``c`` are correct:

- ``pass@k = 1 - C(n - c, k) / C(n, k)`` — the unbiased estimator of the probability that at least one of ``k``
  samples is correct (Chen et al. 2021), using all ``n`` samples (``n = k × repeats`` when nothing failed). When
  errors leave ``n < k``, the task's pass@k falls back to pass@n (1 if any sample is correct, else 0); such
  tasks are counted in ``tasks_short_of_k``.
- ``avg@k`` — the task's mean correctness ``c / n``.

Over tasks: ``pass@k`` and ``avg@k`` are means over the tasks with at least one valid sample (tasks weigh
equally; tasks with only errors are counted in ``tasks_all_errors``); ``accuracy`` is correct / valid over all
samples, ``mean_reward`` the mean score of all valid samples (they equal avg@k and the mean per-task reward when
every task has the same number of valid samples). With ``repeats > 1`` each repeat (slots ``r·k … r·k + k - 1``)
is also summarised on its own, giving the spread (sample standard deviation) of accuracy and pass@k.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agentrl.store.models import SUCCESS_SCORE

CORRECT_THRESHOLD = SUCCESS_SCORE
UNTYPED = "untyped"

FAILED_ERROR = "failed_error"
ENV_START_ERROR = "env_start_error"
ENV_ERROR = "env_error"
SCORE_ERROR = "score_error"
SLOT_FAILED = "slot_failed"
MISSING = "missing"


@dataclass(frozen=True)
class Sample:
    """One sample slot of a task: its score, or why it has none (``error``)."""

    slot: int
    score: float | None = None
    error: str | None = None
    outcome: str | None = None
    num_turns: int = 0
    success: bool | None = None
    """An environment episode's own verdict (reward reached the environment's success reward); overrides the
    score threshold."""
    env_reward: float | None = None
    """An environment episode's reward on the environment's own scale (SciWorld: 0-100)."""

    @property
    def valid(self) -> bool:
        return self.error is None and self.score is not None

    def correct(self, threshold: float = CORRECT_THRESHOLD) -> bool:
        if not self.valid:
            return False
        return self.success if self.success is not None else self.score >= threshold


@dataclass
class TaskSamples:
    """All sample slots of one task."""

    task_id: str
    task_type: str = UNTYPED
    samples: list[Sample] = field(default_factory=list)

    def counts(self, threshold: float = CORRECT_THRESHOLD) -> tuple[int, int, float]:
        """``(valid, correct, reward_sum)``."""
        valid = [s for s in self.samples if s.valid]
        return len(valid), sum(s.correct(threshold) for s in valid), float(sum(s.score for s in valid))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one correctly rounded division


def task_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one task; with fewer than ``k`` valid samples (errors), pass@n."""
    return pass_at_k(n, c, min(k, n))


def pass_ks(k: int) -> list[int]:
    """The pass@ values reported for ``k`` samples per task: 1, powers of two below ``k``, and ``k``."""
    ks = {1, k}
    power = 2
    while power < k:
        ks.add(power)
        power *= 2
    return sorted(ks)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) >= 2 else None


def summarize(tasks: Iterable[TaskSamples], k: int, repeats: int = 1, *, threshold: float = CORRECT_THRESHOLD,
              with_repeats: bool = True) -> dict[str, Any]:
    """Metrics of ``tasks`` (see the module docstring); rates are ``None`` when nothing has a verdict."""
    tasks = list(tasks)
    samples = [s for t in tasks for s in t.samples]
    valid = [s for s in samples if s.valid]
    errors = Counter(s.error or MISSING for s in samples if not s.valid)
    per_task = [t.counts(threshold) for t in tasks]
    scored = [(n, c) for n, c, _ in per_task if n > 0]
    correct = sum(c for _, c, _ in per_task)
    summary: dict[str, Any] = {
        "k": k,
        "repeats": repeats,
        "tasks": len(tasks),
        "tasks_scored": len(scored),
        "tasks_all_errors": len(tasks) - len(scored),
        "tasks_short_of_k": sum(1 for n, _ in scored if n < k),
        "samples": len(samples),
        "valid_samples": len(valid),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "correct": correct,
        "accuracy": correct / len(valid) if valid else None,
        "mean_reward": _mean([float(s.score) for s in valid]),
        "mean_env_reward": _mean([s.env_reward for s in valid if s.env_reward is not None]),
        f"avg@{k}": _mean([c / n for n, c in scored]),
    }
    for j in pass_ks(k):
        summary[f"pass@{j}"] = _mean([task_pass_at_k(n, c, j) for n, c in scored])
    summary["outcomes"] = dict(sorted(Counter(s.outcome or "unknown" for s in valid).items()))
    summary["mean_turns"] = _mean([float(s.num_turns) for s in valid])
    if repeats > 1 and with_repeats:
        by_repeat = []
        for r in range(repeats):
            part = [TaskSamples(t.task_id, t.task_type, [s for s in t.samples if s.slot // k == r]) for t in tasks]
            one = summarize(part, k, 1, threshold=threshold, with_repeats=False)
            by_repeat.append({key: one[key] for key in ("accuracy", "mean_reward", f"pass@{k}", "valid_samples",
                                                        "errors")})
        summary["by_repeat"] = by_repeat
        for key in ("accuracy", f"pass@{k}"):
            summary[f"{key}_std"] = _std([row[key] for row in by_repeat if row[key] is not None])
    return summary


def summarize_by_type(tasks: Iterable[TaskSamples], k: int, repeats: int = 1, *,
                      threshold: float = CORRECT_THRESHOLD) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per task type (sorted by type name)."""
    groups: dict[str, list[TaskSamples]] = {}
    for task in tasks:
        groups.setdefault(task.task_type or UNTYPED, []).append(task)
    return {name: summarize(group, k, repeats, threshold=threshold, with_repeats=False)
            for name, group in sorted(groups.items())}


def per_task_rows(tasks: Iterable[TaskSamples], *, threshold: float = CORRECT_THRESHOLD) -> list[dict[str, Any]]:
    """One compact row per task: id, type, valid samples, correct, errors, mean reward."""
    rows = []
    for task in tasks:
        n, c, reward = task.counts(threshold)
        rows.append({"id": task.task_id, "type": task.task_type, "valid": n, "correct": c,
                     "errors": len(task.samples) - n, "mean_reward": reward / n if n else None})
    return rows


def paired_difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after − before`` accuracy over the tasks both evaluations scored (their ``per_task`` rows with ``id``,
    ``correct`` and ``valid``), with a 95 % interval (normal approximation over the per-task differences):
    ``{"difference", "ci95", "tasks", "better", "worse"}``; ``difference`` is None with fewer than 2 tasks."""
    first = {row["id"]: row for row in before.get("per_task") or [] if row["valid"]}
    second = {row["id"]: row for row in after.get("per_task") or [] if row["valid"]}
    common = sorted(set(first) & set(second))
    diffs = [second[t]["correct"] / second[t]["valid"] - first[t]["correct"] / first[t]["valid"] for t in common]
    if len(diffs) < 2:
        return {"difference": None, "ci95": None, "tasks": len(diffs), "better": 0, "worse": 0}
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = 1.96 * sd / math.sqrt(len(diffs))
    return {"difference": mean, "ci95": [mean - half, mean + half], "tasks": len(diffs),
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs)}
