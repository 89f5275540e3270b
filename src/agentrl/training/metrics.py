"""Per-step trainer metrics: statistics of the step's samples, reduction over ranks, and where they are written.

Every step rank 0 writes one ``Metric`` document (``store.runs.log_metrics``) and, every ``logging_steps``, a
progress line on the console; ``--report_to tensorboard`` / ``wandb`` also send the values there. Names:

* loss and token counts: ``loss``, ``loss_tokens``, ``sequences``, ``masked_fraction`` (out-of-band tokens),
  ``clip_fraction``, ``truncated_fraction``, ``ratio_mean``, ``ratio_max``, ``behaviour_kl``, ``ref_kl``;
* data: ``samples``, ``tokens`` (real), ``padded_tokens`` (tokens the model forwarded: padding included, a shared
  prefix once), ``reward_mean``/``_std``, ``advantage_mean``/``_std``/
  ``_min``/``_max`` and ``advantage_positive_fraction`` (over loss tokens), ``staleness_mean``/``_max`` (policy
  version minus the version that sampled each loss token), ``sampled_at_step`` (mean trainer step whose weights
  sampled the step's samples), ``merge_ratio`` (tokens forwarded / tokens one pass per turn would forward),
  ``skipped_stale``;
* engine vs trainer: ``logprob_mismatch_mean``/``_max``: |behaviour logprob − trainer logprob| on loss tokens,
  before the update (``_fresh``: only tokens sampled by the current version, i.e. pure numerical mismatch);
* optimisation and speed: ``grad_norm``, ``learning_rate``, ``policy_version``, ``epoch``, ``step_s``,
  ``wait_s``, ``publish_s`` (of which ``publish_export_s`` gathering and writing the weights,
  ``publish_load_s`` the services' loads and swaps, and ``publish_probe_s`` the
  policy probe; from the export to the Run's new version), ``publish_wait_s`` (how long the trainer waited for
  it: with ``overlap_publish`` the next step's compute hides the rest), ``publish_failures``, ``tokens_per_s``
  (real tokens / compute time of the step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.store import DBRecordData, Store
from agentrl.training.aio import LoopThread
from agentrl.training.data import sample_staleness, tokens_if_unmerged
from agentrl.training.parallel import ParallelState

logger = logging.getLogger(__name__)


@dataclass
class Reducer:
    """Named sums, maxima and minima of one rank, reduced over the data-parallel ranks in three all-reduces."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    minima: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    def min(self, name: str, value: float) -> None:
        self.minima[name] = min(self.minima.get(name, math.inf), float(value))

    def reduce(self, parallel: ParallelState, names: Iterable[tuple[str, str]]) -> dict[str, float]:
        """Reduced values of ``names`` (pairs of kind ``sum``/``max``/``min`` and name); every rank must pass the
        same names. Missing maxima/minima stay infinite (no value on any rank)."""
        names = list(names)
        out: dict[str, float] = {}
        for kind, table, default in (("sum", self.sums, 0.0), ("max", self.maxima, -math.inf),
                                     ("min", self.minima, math.inf)):
            keys = [name for k, name in names if k == kind]
            if keys:
                values = parallel.all_reduce([table.get(k, default) for k in keys], op=kind, group="dp")
                out.update(zip(keys, values))
        return out


SAMPLE_STATS: tuple[tuple[str, str], ...] = (
    ("sum", "samples"), ("sum", "tokens"), ("sum", "tokens_if_unmerged"), ("sum", "rewards"),
    ("sum", "reward_sum"), ("sum", "reward_sq"), ("sum", "adv_tokens"), ("sum", "adv_sum"), ("sum", "adv_sq"),
    ("sum", "adv_positive"), ("max", "adv_max"), ("min", "adv_min"), ("sum", "stale_tokens"),
    ("sum", "stale_sum"), ("max", "stale_max"), ("sum", "sampled_at_count"), ("sum", "sampled_at_sum"),
)


def add_sample_stats(reducer: Reducer, samples: Iterable[DBRecordData], current_version: int,
                     version_steps: dict[int, int]) -> None:
    """Accumulate the data statistics of this rank's samples (see the module docstring for the names)."""
    for sample in samples:
        reducer.add("samples", 1)
        reducer.add("tokens", sample.num_tokens)
        reducer.add("tokens_if_unmerged", tokens_if_unmerged(sample))
        if sample.reward is not None:
            reducer.add("rewards", 1)
            reducer.add("reward_sum", sample.reward)
            reducer.add("reward_sq", sample.reward ** 2)
        loss_advantages = [a for a, m in zip(sample.advantages, sample.loss_mask) if m]
        if loss_advantages:
            reducer.add("adv_tokens", len(loss_advantages))
            reducer.add("adv_sum", math.fsum(loss_advantages))
            reducer.add("adv_sq", math.fsum(a * a for a in loss_advantages))
            reducer.add("adv_positive", sum(1 for a in loss_advantages if a > 0))
            reducer.max("adv_max", max(loss_advantages))
            reducer.min("adv_min", min(loss_advantages))
        lags = [current_version - v for v, m in zip(sample.versions, sample.loss_mask) if m and v >= 0]
        if lags:
            reducer.add("stale_tokens", len(lags))
            reducer.add("stale_sum", sum(lags))
            reducer.max("stale_max", max(lags))
            oldest = current_version - sample_staleness(sample, current_version)
            if oldest in version_steps:
                reducer.add("sampled_at_count", 1)
                reducer.add("sampled_at_sum", version_steps[oldest])


def _std(total: float, squares: float, count: float) -> float:
    if count <= 0:
        return 0.0
    mean = total / count
    return math.sqrt(max(squares / count - mean * mean, 0.0))


def data_metrics(raw: dict[str, float]) -> dict[str, float]:
    """Loggable data statistics from the reduced sums of ``SAMPLE_STATS``."""
    out = {"samples": raw["samples"], "tokens": raw["tokens"],
           "merge_ratio": raw["tokens"] / raw["tokens_if_unmerged"] if raw["tokens_if_unmerged"] else 1.0}
    if raw["rewards"]:
        out["reward_mean"] = raw["reward_sum"] / raw["rewards"]
        out["reward_std"] = _std(raw["reward_sum"], raw["reward_sq"], raw["rewards"])
    if raw["adv_tokens"]:
        out.update(advantage_mean=raw["adv_sum"] / raw["adv_tokens"],
                   advantage_std=_std(raw["adv_sum"], raw["adv_sq"], raw["adv_tokens"]),
                   advantage_min=raw["adv_min"], advantage_max=raw["adv_max"],
                   advantage_positive_fraction=raw["adv_positive"] / raw["adv_tokens"])
    if raw["stale_tokens"]:
        out.update(staleness_mean=raw["stale_sum"] / raw["stale_tokens"], staleness_max=raw["stale_max"])
    if raw["sampled_at_count"]:
        out["sampled_at_step"] = raw["sampled_at_sum"] / raw["sampled_at_count"]
    return out


def progress_line(step: int, max_steps: int, values: dict[str, float]) -> str:
    """One console line with the step's main numbers."""
    total = f"/{max_steps}" if max_steps > 0 else ""
    parts = [f"step {step}{total}", f"loss {values.get('loss', 0.0):.4g}"]
    if "reward_mean" in values:
        parts.append(f"reward {values['reward_mean']:.3f}±{values['reward_std']:.3f}")
    if "advantage_mean" in values:
        parts.append(f"adv {values['advantage_mean']:+.3f}±{values['advantage_std']:.3f}")
    parts.append(f"clip {values.get('clip_fraction', 0.0):.3f}")
    parts.append(f"masked {values.get('masked_fraction', 0.0):.3f}")
    if "staleness_mean" in values:
        parts.append(f"stale {values['staleness_mean']:.2f} (max {values['staleness_max']:.0f})")
    if "logprob_mismatch_mean" in values:
        parts.append(f"lp-mismatch {values['logprob_mismatch_mean']:.2e}")
    parts += [f"merge {values.get('merge_ratio', 1.0):.2f}", f"gnorm {values.get('grad_norm', 0.0):.3g}",
              f"lr {values.get('learning_rate', 0.0):.2e}", f"{values.get('tokens_per_s', 0.0):.0f} tok/s",
              f"v{values.get('policy_version', 0):.0f}"]
    if values.get("skipped_stale"):
        parts.append(f"skipped {values['skipped_stale']:.0f} stale")
    return " | ".join(parts)


class ReportError(RuntimeError):
    """A ``--report_to`` target is not available."""


class MetricsSink:
    """Writes each step's metrics (rank 0 only): the ``Metric`` collection, the console, tensorboard, wandb."""

    def __init__(self, store: Store, io: LoopThread, *, report_to: Iterable[str], logging_dir: Path,
                 logging_steps: int, max_steps: int, run_name: str, config: dict[str, Any]):
        self.store, self.io = store, io
        self.logging_steps, self.max_steps = logging_steps, max_steps
        targets = set(report_to) - {"none"}
        self._tensorboard = self._wandb = None
        if "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ReportError("--report_to tensorboard needs the tensorboard package "
                                  "(pip install tensorboard)") from error
            self._tensorboard = SummaryWriter(log_dir=str(logging_dir))
        if "wandb" in targets:
            try:
                import wandb
            except ImportError as error:
                raise ReportError("--report_to wandb needs the wandb package (pip install wandb)") from error
            self._wandb = wandb.init(name=run_name, config=config)

    def log(self, step: int, values: dict[str, float], sample_ids: list[str]) -> None:
        """Write the step's ``Metric`` (values and the ledger of trained sample ids), print and export it."""
        self.io.run(self.store.runs.log_metrics(step, values, sample_ids=sample_ids))
        if step % self.logging_steps == 0 or step == self.max_steps:
            logger.info("%s", progress_line(step, self.max_steps, values))
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(f"train/{name}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
