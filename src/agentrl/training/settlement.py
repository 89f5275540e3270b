"""After a step's update: its weights published as the next policy version, its Records released once the
inference services serve that version, its metrics logged with the step's ledger, its samples trained.

Every ``sync_every`` steps the weights are exported as the next version and the services load them on the io loop
(``agentrl.training.publish``) while the next step computes (``overlap_publish``); once they serve it, the step's
Records become ``trained``; then its metrics are written (``agentrl.training.metrics``) and, every ``save_steps``,
the trainer's checkpoint is saved (a checkpoint step settles at once: it saves the model as the step left it). An
overlapped publish changes no order within a step (export, loads, probe, bump, Records, metrics, checkpoint); it
only lets the next step claim and compute before the last three, a window a crash treats like one during that
step's own compute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.failpoints import failpoint
from agentrl.store import DBRecordData, RecordStatus, ServiceStatus, Store
from agentrl.training.aio import LoopThread
from agentrl.training.checkpoint import TrainerState
from agentrl.training.config import TrainConfig
from agentrl.training.data import StepData, move_record
from agentrl.training.metrics import MetricsSink
from agentrl.training.parallel import ParallelState
from agentrl.training.policy_probe import probe_metrics, probe_token_ids
from agentrl.training.publish import PendingPublish, ProbeSettings, PublishError, PublishResult, WeightPublisher

logger = logging.getLogger(__name__)

VERSION_HISTORY = 1000  # version -> step entries kept in the trainer state
PROBE_REPUBLISHES = 1  # publishes again when every service failed the policy probe, before the run stops


def build_publisher(cfg: TrainConfig, parallel: ParallelState, store: Store, io: LoopThread, output_dir: Path,
                    model: torch.nn.Module, tokenizer: Any, bf16: bool) -> WeightPublisher:
    """The weight publisher of this rank, with its transport and policy probe."""
    return WeightPublisher(store, io, parallel, output_dir, dtype=torch.bfloat16 if bf16 else torch.float32,
                           tokenizer=tokenizer, keep=cfg.keep_published_weights, retries=cfg.publish_retries,
                           adapter=cfg.use_peft and cfg.lora_publish == "adapter",
                           probe=_probe_settings(cfg, parallel, model, tokenizer),
                           transport=weight_transport(cfg, parallel), bucket_mb=cfg.weight_bucket_mb,
                           timeout_s=cfg.weight_update_timeout_s, address=cfg.weight_sync_address)


def weight_transport(cfg: TrainConfig, parallel: ParallelState) -> str:
    """``--weight_transport`` resolved: ``auto`` is a weight-update group from a CUDA trainer and shared memory from
    a CPU one (on one CPU host loopback TCP is slower than the page cache, shared memory faster: docs/training.md);
    files only for what only files carry (adapters, merges into a 4-bit base's weights)."""
    files_only = ("LoRA adapters are published as files" if cfg.use_peft and cfg.lora_publish == "adapter" else
                  "a 4-bit base's adapters are merged from the base's files" if cfg.load_in_4bit else None)
    transport = cfg.weight_transport
    if transport == "auto":
        transport = "disk" if files_only else "distributed" if parallel.device.type == "cuda" else "tensor"
    elif files_only and transport != "disk":
        logger.warning("--weight_transport %s: %s, so weights go through disk", transport, files_only)
        transport = "disk"
    if cfg.enable_sampling and parallel.is_main:
        logger.info("weights reach the inference services %s", {
            "distributed": "in memory (SGLang's weight-update group; through disk for a service that cannot join "
                           "one)",
            "tensor": "in memory, shared with the services on this host (/update_weights_from_tensor; through disk "
                      "for the others)",
            "disk": "through disk (weights/<version>, /update_weights_from_disk)"}[transport])
    return transport


def _probe_settings(cfg: TrainConfig, parallel: ParallelState, model: torch.nn.Module,
                    tokenizer: Any) -> ProbeSettings | None:
    """What the policy probe after each publish checks (None: ``--policy_probe_max_diff 0``)."""
    if not cfg.policy_probe_max_diff:
        return None
    positions = getattr(model.config, "max_position_embeddings", None)
    ids = parallel.broadcast_from_main(probe_token_ids(tokenizer, positions) if parallel.is_main else None)
    return ProbeSettings(token_ids=ids, max_mean_abs_diff=cfg.policy_probe_max_diff)


@dataclass
class _Unsettled:
    """A trained step not yet logged: its publish (None: not a publishing step) and, on tensor-parallel leaders,
    the io loop's work that releases its Records once the version is served."""

    data: StepData
    values: dict[str, float]
    pending: PendingPublish | None
    released: Future | None


class Settlement:
    """Publishes and settles a rank's steps (see the module doc). ``version`` is the policy version the model
    is (its weights written; the services may still be loading them); ``checkpoint`` saves the trainer's."""

    def __init__(self, cfg: TrainConfig, parallel: ParallelState, store: Store, io: LoopThread,
                 model: torch.nn.Module, publisher: WeightPublisher, state: TrainerState, sink: MetricsSink | None,
                 version: int, checkpoint: Callable[[], None]):
        self.cfg, self.parallel, self.store, self.io = cfg, parallel, store, io
        self.model, self.publisher, self.state, self.sink = model, publisher, state, sink
        self.version = version
        self.checkpoint = checkpoint
        self.unsettled: _Unsettled | None = None  # the last step, while its publish may still be loading
        state.version_steps.setdefault(version, state.step)

    def checkpoint_due(self, step: int) -> bool:
        return bool(self.cfg.save_steps) and step % self.cfg.save_steps == 0

    def publish(self) -> PublishResult:
        """Publish the model as the next version and wait until it is served."""
        result = self.publisher.publish(self.model, self.version + 1)
        self._adopt_version(result.version)
        return result

    def unpublished_step(self) -> bool:
        """Whether the last step's update is in no published version (``sync_every`` left it out)."""
        return self.state.version_steps.get(self.version) != self.state.step

    def service_behind(self) -> bool:
        """Main rank, while waiting for samples: a service STARTING (joining the run) that serves an older version
        than the trainer's. It waits for the trainer to send the weights when the Run's version was published in
        memory; until then it serves no sampler, and if no service serves, no sample comes: publish now."""
        services = self.io.run(self.store.services.serving())
        behind = [s.base_url for s in services
                  if s.status == ServiceStatus.STARTING and s.weight_version < self.version]
        if behind:
            logger.info("inference service(s) %s joined the run and wait for its weights: publishing now",
                        ", ".join(behind))
        return bool(behind)

    def after_step(self, data: StepData, values: dict[str, float], trainer_logprobs: dict[Any, list[float]],
                   computed_by: int | None) -> None:
        """Publish (export now, the services load on the io loop), release the step's Records once the version is
        served, then log and checkpoint; with ``overlap_publish`` the last two wait for the next step's end (or
        its wait for samples) unless this step saves a checkpoint (which needs the model as this step left it).
        ``computed_by``: the policy that computed ``trainer_logprobs`` (None: unpublished weights)."""
        self.settle()
        cfg, parallel, step = self.cfg, self.parallel, data.step
        values.update(policy_version=float(self.version), epoch=float(self.state.epoch), wait_s=data.wait_s,
                      skipped_stale=parallel.all_reduce([float(data.skipped_stale)], group="dp")[0])
        pending = None
        if cfg.enable_sampling and step % cfg.sync_every == 0:
            pending = self.publisher.export(self.model, self.version + 1)
            self._adopt_version(pending.result.version)
        released = None
        if parallel.is_tp_leader:
            released = self.io.submit(self._release(data, computed_by, trainer_logprobs, pending))
        self.unsettled = _Unsettled(data, values, pending, released)
        if pending is None or not cfg.overlap_publish or self.checkpoint_due(step):
            self.settle()

    def settle(self) -> None:
        """Finish the last step: wait for its publish and Records, log it, save its checkpoint if one is due."""
        unsettled, self.unsettled = self.unsettled, None
        if unsettled is None:
            return
        parallel, step, values = self.parallel, unsettled.data.step, unsettled.values
        waited = time.monotonic()
        if unsettled.released is not None:
            unsettled.released.result()
        if unsettled.pending is not None:
            result = self.publisher.finish(unsettled.pending)
            values.update(publish_s=result.seconds, publish_export_s=result.export_s, publish_load_s=result.load_s,
                          publish_probe_s=result.probe_s, publish_wait_s=time.monotonic() - waited,
                          publish_failures=float(len(result.failures)), policy_version=float(result.version))
            if self.publisher.probe is not None:
                values.update(probe_metrics(result.probes))
                self._after_probe(result)
        # the step ledger: tensor-parallel peers hold the same samples, their leaders speak for them
        ledger = parallel.gather_to_main([s.id for s in unsettled.data.samples] if parallel.is_tp_leader else [])
        if self.sink is not None:
            self.sink.log(step, values, [sample_id for ids in ledger for sample_id in ids])
        if self.cfg.save_steps == 0:  # no checkpoint to wait for: trained once the ledger lists them
            parallel.barrier()
            if parallel.is_tp_leader:
                self.io.run(self.store.samples.mark_trained(parallel.dp_rank, step,
                                                            [s.id for s in unsettled.data.samples]))
        failpoint("trainer.step.after_log")
        if self.checkpoint_due(step):
            self.checkpoint()

    def _adopt_version(self, version: int) -> None:
        """The model is ``version`` from now on (its weights are written; the services may still be loading)."""
        self.version = version
        self.state.version_steps[version] = self.state.step
        for old in [v for v in self.state.version_steps if v < version - VERSION_HISTORY]:
            del self.state.version_steps[old]

    def _after_probe(self, result: PublishResult) -> None:
        """When every service failed the policy probe, none serves samplers, so no sample comes: publish the
        trainer's weights again (``PROBE_REPUBLISHES`` times), then stop the run with :class:`PublishError`."""
        for attempt in range(PROBE_REPUBLISHES + 1):
            failed = self.parallel.broadcast_from_main(
                bool(result.probes) and not any(p.ok for p in result.probes.values())
                if self.parallel.is_main else None)
            if not failed:
                return
            errors = "; ".join(f"{url}: {p.error}" for url, p in result.probes.items())
            if attempt == PROBE_REPUBLISHES:
                raise PublishError(f"every inference service failed the policy probe after weights version "
                                   f"{result.version}, published {attempt + 1} times ({errors}): they do not serve "
                                   "the trainer's policy (another model or precision? see --policy_probe_max_diff), "
                                   "so no sampler can use them: stopping the run")
            logger.warning("every inference service failed the policy probe after weights version %d (%s): "
                           "publishing the trainer's weights again", result.version, errors)
            result = self.publish()

    async def _release(self, data: StepData, trained_version: int | None, trainer_logprobs: dict[Any, list[float]],
                       pending: PendingPublish | None) -> None:
        """A tensor-parallel leader's share of a step, on the io loop: once the step's version is served (rank 0
        announces it; the others wait to see it on the Run), its Records leave ``ready`` — the samplers' admission
        control counts them until then, so what it admits next is sampled by the new policy — and the trainer's
        logprobs are stored."""
        if pending is not None:
            if self.parallel.is_main:
                await self.publisher.announce(pending)
            else:
                await served_by_main(self.store, pending.result.version, self.cfg.ddp_timeout,
                                     self.cfg.poll_interval_s)
        await _records_trained(self.store, data.samples)
        await self.store.samples.record_trainer_logprobs(self.parallel.dp_rank, data.step, trained_version,
                                                         trainer_logprobs)


async def served_by_main(store: Store, version: int, timeout_s: float, poll_interval_s: float) -> None:
    """Another rank's wait for rank 0's announcement of ``version`` (seen on the Run), at most ``timeout_s``
    (``--ddp_timeout``; rank 0's publish failed, or rank 0 is gone: :class:`PublishError`)."""
    deadline = time.monotonic() + timeout_s
    while await store.runs.policy_version() < version:
        if time.monotonic() > deadline:
            raise PublishError(f"rank 0 did not publish weights version {version} within --ddp_timeout "
                               f"{timeout_s} s (its publish failed, or it is gone: see its log)")
        await asyncio.sleep(min(poll_interval_s, 0.5))


async def _records_trained(store: Store, samples: list[DBRecordData]) -> None:
    for record_id in dict.fromkeys(s.record_id for s in samples):
        await move_record(store, record_id, RecordStatus.TRAINED)
