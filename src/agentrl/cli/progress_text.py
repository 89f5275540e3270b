"""The words the live status line (``agentrl watch``), the run summary (``agentrl report``) and ``agentrl status``
use for a run's progress, which :mod:`agentrl.store.progress` reads from the database."""

from __future__ import annotations

from agentrl.store.models import ZERO_VARIANCE_DECISION
from agentrl.store.progress import Progress


def failure_line(failures: dict[str, int]) -> str:
    """Records not trained per failure class, as the status line, the summary and ``agentrl status`` show them."""
    return ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in failures.items())


def reason_label(reason: str) -> str:
    """A drop reason as the status line and the summary show it."""
    return "zero variance" if reason == ZERO_VARIANCE_DECISION else reason


def diagnose(progress: Progress) -> list[str]:
    """Why a run trained nothing (or little), in words a user can act on; empty when it trained."""
    if progress.step > 0:
        return []
    if progress.trajectories == 0:
        return ["no trajectory finished: check the sampler and engine logs (is an inference service up, and do "
                "the tools start?)"]
    lines = []
    if progress.groups_done == 0:
        lines.append(f"{progress.trajectories} trajectories finished but no group was complete: each task needs "
                     "all its samples scored before its group is judged")
    dropped = progress.groups_dropped.get(ZERO_VARIANCE_DECISION, 0)
    if dropped:
        lines.append(f"{dropped} of {progress.groups_done} groups were dropped for zero reward variance (mean "
                     f"reward {progress.reward_mean or 0:.3f}): every sample of a task scored the same, which "
                     "gives no learning signal")
    for reason, count in progress.groups_dropped.items():
        if reason != ZERO_VARIANCE_DECISION:
            lines.append(f"{count} groups dropped: {reason}")
    if progress.samples_skipped:
        lines.append(f"{progress.samples_skipped} samples were skipped as too stale (raise --max_staleness)")
    if progress.groups_kept and not progress.step:
        lines.append(f"{progress.groups_kept} groups were kept but no step completed: the trainer stopped before "
                     "a full batch was queued (see its log)")
    return lines
