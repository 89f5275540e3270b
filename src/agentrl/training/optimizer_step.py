"""One optimiser step over a step's samples: micro-batches, forward, loss, backward, clipping, AdamW, schedule.

The samples are merged (one row per trajectory) and packed into micro-batches by the token budget, samples that share
a token prefix together (the prefix is forwarded once, ``agentrl.training.prefix_tree``); ranks agree on the number
of passes and of model calls per pass (a rank with fewer runs empty ones, which FSDP2 needs); the loss normaliser
is counted over the whole step and all ranks first (``agentrl.training.losses``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from agentrl.training.batching import MicroBatch, align_passes, pack_micro_batches
from agentrl.training.config import TrainConfig
from agentrl.training.data import StepData, to_merged
from agentrl.training.logprobs import layout_logprobs
from agentrl.training.losses import LossInput, LossMetrics, global_normaliser, loss_fn, loss_spec
from agentrl.training.metrics import SAMPLE_STATS, Reducer, add_sample_stats, data_metrics
from agentrl.training.parallel import ParallelState, clip_grad_norm

logger = logging.getLogger(__name__)


class OptimizerStep:
    """Trains ``model`` (and reads ``ref_model``, for the KL term) one step at a time."""

    def __init__(self, cfg: TrainConfig, parallel: ParallelState, model: torch.nn.Module,
                 ref_model: torch.nn.Module | None, optimizer: torch.optim.Optimizer, scheduler: Any, *, bf16: bool,
                 min_shared: int | None):
        self.cfg, self.parallel = cfg, parallel
        self.model, self.ref_model = model, ref_model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.bf16, self.min_shared = bf16, min_shared
        self.policy_gradient = loss_spec(cfg.loss).policy_gradient  # behaviour logprobs to compare with

    def __call__(self, data: StepData, version: int, version_steps: dict[int, int], computed_by: int | None
                 ) -> tuple[dict[str, float], dict[Any, list[float]]]:
        """Train on ``data`` with the policy of ``version`` (``computed_by``: the version the weights are, None when
        an update came after its publish); returns the step's metrics and the logprobs the policy gave each sample's
        tokens (by sample id; 0 off the loss tokens; none with cross-entropy), which the store keeps for audits."""
        cfg, parallel, device = self.cfg, self.parallel, self.parallel.device
        started = time.monotonic()
        merged = [to_merged(sample) for sample in data.samples]
        if cfg.loss.trajectory_weight == "once":
            merged = [sample.weighed_once() for sample in merged]
        pad_id = self.model.config.get_text_config().pad_token_id or 0
        micro = pack_micro_batches(merged, cfg.max_tokens, pad_token_id=pad_id, min_shared=self.min_shared,
                                   pad_to_multiple_of=cfg.pad_to_multiple_of, images=data.images) if merged else []
        real = align_passes(micro, parallel, pad_id)  # FSDP2: the same passes and model calls on every rank
        normaliser = global_normaliser(cfg.loss, micro, parallel)
        loss_metrics, mismatch = LossMetrics(), Reducer()
        trainer_logprobs: dict[Any, list[float]] = {}
        padded = 0
        self.model.train()
        if normaliser > 0:
            for index, batch in enumerate(micro):
                if parallel.distributed:
                    self.model.set_requires_gradient_sync(index == len(micro) - 1)
                metrics, scored = self._micro_step(batch.to(device), normaliser, version, computed_by, mismatch)
                if scored is not None and index < real:  # the empty passes that pad this rank hold no sample
                    for row, sample in enumerate(batch.sample_indices):
                        trainer_logprobs[data.samples[sample].id] = scored[row, : merged[sample].num_tokens].tolist()
                loss_metrics = loss_metrics + metrics
                padded += batch.layout.computed_tokens
            grad_norm = clip_grad_norm(list(self.model.parameters()), cfg.max_grad_norm, parallel)
            learning_rate = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
        else:
            logger.warning("step %d has no loss token on any rank: no update", data.step)
            grad_norm, learning_rate = 0.0, self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        compute_s = time.monotonic() - started

        reducer = Reducer()  # tensor-parallel peers hold the same samples: reduce over data-parallel ranks only
        add_sample_stats(reducer, data.samples, version, version_steps)
        values = data_metrics(reducer.reduce(parallel, SAMPLE_STATS))
        values.update(loss_metrics.all_reduce(parallel).as_dict())
        values.update(self._mismatch_metrics(mismatch))
        padded_total = parallel.all_reduce([float(padded)], group="dp")[0]
        values.update(grad_norm=grad_norm, learning_rate=learning_rate, padded_tokens=padded_total,
                      step_s=compute_s, tokens_per_s=values["tokens"] / compute_s if compute_s > 0 else 0.0)
        return values, trainer_logprobs

    def _micro_step(self, batch: MicroBatch, normaliser: float, version: int, computed_by: int | None,
                    mismatch: Reducer) -> tuple[LossMetrics, torch.Tensor | None]:
        """Forward, loss and backward of one micro-batch; returns its loss metrics and the policy's logprobs of its
        loss tokens (``[B, T]`` on the CPU, 0 elsewhere; ``None`` with cross-entropy)."""
        cfg = self.cfg
        with self._autocast():
            # Shared prefixes are forwarded once; the LM head runs only where trained tokens are predicted.
            compute_dtype = torch.bfloat16 if self.bf16 else None
            new_logprobs = layout_logprobs(self.model, batch.layout, temperature=cfg.temperature,
                                           compute_dtype=compute_dtype, vision=batch.vision)
            ref_logprobs = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logprobs = layout_logprobs(self.ref_model, batch.layout, temperature=cfg.temperature,
                                                   compute_dtype=compute_dtype, vision=batch.vision)
        loss_input = LossInput.from_batch(batch, new_logprobs, version, ref_logprobs)
        loss_sum, metrics = loss_fn(cfg.loss, loss_input, normaliser)
        (loss_sum * self.parallel.dp_size).backward()
        if not self.policy_gradient:
            return metrics, None
        with torch.no_grad():
            mask = batch.loss_mask
            gap = (new_logprobs.detach() - batch.old_logprobs).abs()
            fresh = mask & (batch.versions == computed_by) if computed_by is not None else mask & False
            for suffix, selected in (("", mask), ("_fresh", fresh)):
                values = gap[selected]
                if values.numel():
                    mismatch.add(f"count{suffix}", values.numel())
                    mismatch.add(f"sum{suffix}", float(values.sum()))
                    mismatch.max(f"max{suffix}", float(values.max()))
        return metrics, new_logprobs.detach().float().masked_fill(~mask, 0.0).cpu()

    def _mismatch_metrics(self, mismatch: Reducer) -> dict[str, float]:
        """``logprob_mismatch_mean``/``_max`` (and ``_fresh``: tokens the current weights sampled) over all ranks."""
        if not self.policy_gradient:
            return {}
        names = [(kind, f"{stat}{suffix}") for suffix in ("", "_fresh")
                 for kind, stat in (("sum", "count"), ("sum", "sum"), ("max", "max"))]
        raw = mismatch.reduce(self.parallel, names)
        out = {}
        for suffix in ("", "_fresh"):
            if raw[f"count{suffix}"]:
                out[f"logprob_mismatch_mean{suffix}"] = raw[f"sum{suffix}"] / raw[f"count{suffix}"]
                out[f"logprob_mismatch_max{suffix}"] = raw[f"max{suffix}"]
        return out

    def _autocast(self):
        if self.bf16 and not self.parallel.distributed:  # FSDP2's mixed-precision policy handles the sharded case
            return torch.autocast(device_type=self.parallel.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
