"""The trainer: stream DBRecordData steps from the store, optimise the policy loss, publish, checkpoint, log.

The loop (:meth:`Trainer._loop`), every rank in lockstep: claim this rank's share of ``train_batch_size`` samples
(``agentrl.training.data``), waiting if needed; one optimiser step on them (``agentrl.training.optimizer_step``:
micro-batches, forward, loss, backward, AdamW); then the step is settled (``agentrl.training.settlement``): every
``sync_every`` steps its weights are published as the next version, its Records released once the services serve
it, its metrics logged, and every ``save_steps`` a checkpoint saved (``agentrl.training.checkpoint``). Set-up builds
the policy, reference model and optimizer (``agentrl.training.policy_setup``) and restores the state.

Exactly-once training across crashes: a sample stays ``claimed(rank, step)`` until a checkpoint that contains its
update is complete, and only then becomes ``trained`` (with ``save_steps 0`` right after its step). A trainer
resumed from checkpoint ``s`` marks the claims of steps ``<= s`` trained and gets back the same claims for steps
``> s`` (or, with another data-parallel layout, returns them to the queue), so no sample is skipped or trained
twice (``agentrl.training.claims``). SIGTERM/SIGINT finish the running step (or abandon one still waiting for
data), save a checkpoint and exit 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.failpoints import failpoint
from agentrl.log import redact
from agentrl.precision import native_bf16, resolve_dtype
from agentrl.store import DatabaseUnreachable, RunStatus, Store, database_name, resolve_connection_string
from agentrl.store.outage import outage_tolerance_s
from agentrl.store.runs import RunValuesConflict
from agentrl.training import lora
from agentrl.training.aio import LoopThread
from agentrl.training.checkpoint import (
    CheckpointError,
    TrainerState,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from agentrl.training.claims import adopt_claims, earlier_steps, release_stale_claims
from agentrl.training.config import TrainConfig
from agentrl.training.data import SampleStream, StepData, StepEnd
from agentrl.training.errors import TrainerError
from agentrl.training.launcher import LaunchConfigError, apply_launch_config
from agentrl.training.losses import loss_spec
from agentrl.training.metrics import MetricsSink, ReportError
from agentrl.training.optimizer_step import OptimizerStep
from agentrl.training.parallel import ParallelError, init_parallel, shutdown_parallel
from agentrl.training.policy_setup import (
    base_model_path,
    build_optimizer,
    build_policy,
    build_ref_model,
    build_scheduler,
    check_4bit,
    lora_settings,
    shared_prefix_min,
    vision_setup,
)
from agentrl.training.publish import PublishError
from agentrl.training.settlement import Settlement, build_publisher
from agentrl.training.signals import stop_on_signals
from agentrl.training.weights import WeightsError, export_pretrained, load_tokenizer

logger = logging.getLogger(__name__)

SETUP_ERRORS: tuple[type[Exception], ...] = (TrainerError, ReportError, WeightsError, CheckpointError, ParallelError,
                                             PublishError, LaunchConfigError, lora.LoraError, DatabaseUnreachable)
"""Errors whose message says everything (no traceback needed)."""


class Trainer:
    """A trainer rank. ``Trainer(config).run()`` trains until ``max_steps``, the data ends (offline) or SIGTERM."""

    def __init__(self, config: TrainConfig):
        self.cfg = config
        self.stop = threading.Event()
        self.parallel = self.io = self.store = self.sink = self.publisher = None
        self.first_step = 0  # steps before this trainer's own that --max_steps leaves out (after a finished trainer)
        self.interrupted = False  # main rank: the run's last trainer did not finish

    # --------------------------------------------------------------------------------------------------- loop

    def run(self) -> int:
        """Train; returns the process exit code (0 also after a SIGTERM that stopped the run cleanly)."""
        with stop_on_signals(self.stop):
            try:
                self._setup()
                self._finish(self._loop())
            except RunValuesConflict:  # refused before anything was written: the run is not this trainer's to fail
                raise
            except BaseException:
                if self.parallel is not None and self.parallel.is_main and self.store is not None:
                    with contextlib.suppress(Exception):
                        self.io.run(self.store.runs.set_status(RunStatus.FAILED))
                raise
            finally:
                self._close()
        return 0

    def _loop(self) -> bool:
        """Train steps until a stop condition; True when the run is complete (max_steps or data used up)."""
        cfg, state, settlement = self.cfg, self.state, self.settlement
        deadline = time.monotonic() + cfg.max_train_time_s if cfg.max_train_time_s else None
        while True:
            if 0 < cfg.max_steps <= state.step - self.first_step:
                self.stream.give_back(state.step + 1)  # a resumed run's claims for later steps
                return True
            if deadline is not None and self.parallel.broadcast_from_main(
                    time.monotonic() >= deadline if self.parallel.is_main else None):
                logger.info("training time limit of %.0f s reached after step %d", cfg.max_train_time_s, state.step)
                self.stream.give_back(state.step + 1)
                return True
            got = self.stream.next_step(state.step + 1, settlement.version, deadline, before_waiting=settlement.settle,
                                        publish_due=settlement.service_behind if cfg.enable_sampling else None)
            if got is StepEnd.PUBLISH:
                settlement.settle()
                settlement.publish()
            elif got is StepEnd.DEADLINE:
                logger.info("training time limit of %.0f s reached while waiting for the samples of step %d: "
                            "finishing after step %d", cfg.max_train_time_s, state.step + 1, state.step)
                return True
            elif got is StepEnd.STOPPED:
                logger.info("stop requested: leaving after step %d", state.step)
                return False
            elif got is StepEnd.EXHAUSTED:
                if not cfg.enable_sampling and state.epoch + 1 < cfg.num_train_epochs:
                    self._next_epoch()
                    continue
                if state.step == 0 and state.epoch == 0:
                    logger.warning("no queued samples in split %r: nothing to train", cfg.split)
                return True
            else:
                self._step(got)

    def _step(self, data: StepData) -> None:
        """One optimiser step on ``data``, then its settlement (publish, Records, metrics, checkpoint)."""
        settlement = self.settlement
        # the weights are policy version ``settlement.version`` only if no update came after its publish
        computed_by = None if settlement.unpublished_step() else settlement.version
        values, trainer_logprobs = self.optimize(data, settlement.version, self.state.version_steps, computed_by)
        self.state.step = data.step
        settlement.after_step(data, values, trainer_logprobs, computed_by)

    # ------------------------------------------------------------------------------------------------- set-up

    def _setup(self) -> None:
        self._setup_process()
        self._open_run()
        resume = self._setup_models()
        self._restore(resume)
        self._setup_publishing(resume)

    def _setup_process(self) -> None:
        """The launch configuration, threads, process group, precision and seed."""
        from transformers.utils import logging as hf_logging

        self.cfg = cfg = apply_launch_config(self.cfg)
        hf_logging.disable_progress_bar()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.parallel = parallel = init_parallel(cfg.tp_size or 1, cfg.ddp_backend, cfg.ddp_timeout)
        if not parallel.is_main:
            logging.getLogger("agentrl").setLevel(logging.WARNING)
        if cfg.load_in_4bit:
            check_4bit(parallel)  # before the run's database is touched
        try:
            self.bf16 = resolve_dtype(cfg.precision, parallel.device) == torch.bfloat16
        except ValueError as error:  # an accelerate config's mixed_precision against an explicit --dtype
            raise TrainerError(str(error)) from None
        if self.bf16 and not native_bf16(parallel.device):
            logger.warning("bf16 on %s, which has no bf16 matrix instructions: bf16 compute is emulated and slow "
                           "there (meant for precision checks; --dtype auto picks fp32 here)", parallel.device)
        torch.manual_seed(cfg.seed)

    def _agree_run_values(self) -> None:
        """Online, the batch size, staleness bound and temperature: those given to this trainer, recorded on the
        run unless recorded before, else the run's, else the defaults (``RunValues``); the main rank asks, every
        rank takes its answer. A given value that differs from the run's raises ``RunValuesConflict``. Sets the
        per-step batch size."""
        cfg, parallel = self.cfg, self.parallel
        answer: tuple[dict[str, Any] | None, str | None] = (None, None)
        if parallel.is_main and cfg.enable_sampling:
            try:
                run = self.io.run(self.store.runs.agree(self.run_name, cfg.run_values(parallel.dp_size),
                                                        cfg.run_value_sources(parallel.dp_size)))
                answer = (run.values, None)
            except RunValuesConflict as error:
                answer = (None, str(error))
        values, conflict = parallel.broadcast_from_main(answer)
        if conflict is not None:
            raise RunValuesConflict(conflict)
        if values is not None:
            self.cfg = cfg = cfg.with_run_values(values)
            if cfg.temperature <= 0:
                raise RunValuesConflict(f"run {self.run_name!r} records temperature {cfg.temperature:g} (greedy "
                                        "samplers): the trainer divides its logits by the temperature, which must "
                                        "be > 0")
        try:
            self.batch_size = cfg.resolved_train_batch_size(parallel.dp_size)
        except ValueError as error:
            raise TrainerError(str(error)) from None

    def _open_run(self) -> None:
        """Connect to the run's database; agree on the run's values (``_agree_run_values``); the main rank records
        the run (config snapshot, running) and its metrics sink."""
        cfg, parallel = self.cfg, self.parallel
        uri = parallel.broadcast_from_main(
            resolve_connection_string(cfg.db_connection_string, database=cfg.run_name) if parallel.is_main else None)
        self.run_name = database_name(uri)
        self.output_dir = Path(cfg.output_dir or Path("output") / self.run_name)
        self.io = LoopThread()
        self.store = self.io.run(_open_store(uri))
        self._agree_run_values()
        cfg = self.cfg
        logger.info("run %s (%s); %d ranks (dp %d × tp %d) on %s (%s, %s); %d samples per step; output in %s",
                    self.run_name, redact(uri), parallel.world_size, parallel.dp_size, parallel.tp_size,
                    parallel.device, parallel.backend or "one process", "bf16" if self.bf16 else "fp32",
                    self.batch_size, self.output_dir)
        if parallel.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            snapshot = cfg.flag_values(exclude=frozenset({"db_connection_string"}))
            run = self.io.run(self.store.runs.get_or_create(self.run_name, snapshot))
            self.interrupted = run.status in (RunStatus.RUNNING, RunStatus.FAILED)  # an earlier trainer did not finish
            self.io.run(self.store.runs.set_status(RunStatus.RUNNING))
            self.sink = MetricsSink(self.store, self.io, report_to=cfg.report_to,
                                    logging_dir=Path(cfg.logging_dir or self.output_dir / "runs"),
                                    logging_steps=cfg.logging_steps, max_steps=cfg.max_steps,
                                    run_name=self.run_name, config=snapshot)
        parallel.barrier()

    def _setup_models(self) -> Path | None:
        """The policy (from the checkpoint to resume, if any, else the base model; LoRA or full), the tokenizer,
        the reference model, AdamW and the schedule; returns the checkpoint to resume from."""
        cfg, parallel = self.cfg, self.parallel
        resume = parallel.broadcast_from_main(
            resolve_resume(cfg.resume_from_checkpoint, self.output_dir) if parallel.is_main else None)
        base_path = parallel.broadcast_from_main(base_model_path(cfg) if parallel.is_main else None)
        lora_config = lora_settings(cfg, resume, base_path)
        self.vision = vision_setup(cfg, base_path)
        self.model = build_policy(cfg, parallel, base_path if lora_config is not None else resume or base_path,
                                  resume, lora_config, self.bf16)
        self.tokenizer = load_tokenizer(resume or base_path, cfg.trust_remote_code) if parallel.is_main else None
        ref_model = build_ref_model(cfg, parallel, cfg.ref_model_name_or_path or base_path,
                                    self.bf16) if cfg.loss.kl_coef else None
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.optimize = OptimizerStep(cfg, parallel, self.model, ref_model, self.optimizer, self.scheduler,
                                      bf16=self.bf16, min_shared=shared_prefix_min(cfg, self.model, ref_model))
        return resume

    def _restore(self, resume: Path | None) -> None:
        """The trainer state: from checkpoint ``resume`` (its claims adopted, later metrics forgotten), else fresh
        (stale claims released, steps numbered after those an earlier trainer logged)."""
        parallel, store, io = self.parallel, self.store, self.io
        self.state = TrainerState(dp_size=parallel.dp_size, train_batch_size=self.batch_size)
        if resume is not None:
            saved = load_checkpoint(resume, self.model, self.optimizer, self.scheduler, parallel)
            logger.info("resumed from %s at step %d (epoch %d)", resume, saved.step, saved.epoch)
            if parallel.is_main and (lost := io.run(store.runs.forget_metrics_after(saved.step))):
                logger.info("the updates of %d later steps were not in the checkpoint: their Metric documents are "
                            "removed from the ledger and their samples are trained again", lost)
            adopt_claims(store, io, parallel, saved, self.batch_size)
            self.state.step, self.state.epoch = saved.step, saved.epoch
            self.state.version_steps = saved.version_steps
        else:
            release_stale_claims(store, io, parallel)
            last, first = earlier_steps(store, io, parallel, self.interrupted) if self.cfg.enable_sampling else (0, 0)
            if last:
                self.state.step, self.first_step = last, first
                if self.sink is not None:
                    self.sink.max_steps = self.cfg.max_steps + first if self.cfg.max_steps > 0 else -1
        self.last_checkpoint = self.state.step

    def _setup_publishing(self, resume: Path | None) -> None:
        """The run's policy version, the weight publisher and settlement (aligning the services on a resume or a
        later version) and the sample stream."""
        cfg, parallel = self.cfg, self.parallel
        version = int(parallel.broadcast_from_main(
            self.io.run(self.store.runs.policy_version()) if parallel.is_main else None))
        self.publisher = build_publisher(cfg, parallel, self.store, self.io, self.output_dir, self.model,
                                         self.tokenizer, self.bf16)
        self.settlement = Settlement(cfg, parallel, self.store, self.io, self.model, self.publisher, self.state,
                                     self.sink, version, checkpoint=self._checkpoint)
        if cfg.enable_sampling and (resume is not None or version > 0):
            # the services may serve weights this trainer does not have (a later step, another run): align them
            self.settlement.publish()
        policy_gradient = loss_spec(cfg.loss).policy_gradient
        self.stream = SampleStream(self.store, self.io, parallel, split=cfg.split, batch_size=self.batch_size,
                                   staleness_bound=cfg.staleness_bound, offline=not cfg.enable_sampling,
                                   poll_interval_s=cfg.poll_interval_s, stop=self.stop,
                                   temperature=cfg.temperature if policy_gradient else None, vision=self.vision)

    # --------------------------------------------------------------------------------------------------- ends

    def _next_epoch(self) -> None:
        """Offline training: the data is used up; make this epoch durable and queue the data again."""
        self.settlement.settle()
        if self.cfg.save_steps and self.last_checkpoint != self.state.step:
            self._checkpoint()
        if self.parallel.is_main:
            queued = self.io.run(self.store.samples.start_epoch(self.cfg.split, self.state.epoch + 1))
            logger.info("epoch %d done after step %d: %d samples queued for epoch %d", self.state.epoch,
                        self.state.step, queued, self.state.epoch + 1)
        self.parallel.barrier()
        self.state.epoch += 1

    def _finish(self, finished: bool) -> None:
        """Settle the last step and checkpoint it; a finished run also publishes its last step if ``sync_every``
        left it unpublished (the services serve the trained policy), writes ``final`` and records it on the Run as
        the files of the last version (an engine joining later loads them)."""
        settlement, cfg = self.settlement, self.cfg
        settlement.settle()
        if finished and cfg.enable_sampling and settlement.unpublished_step():
            logger.info("publishing the last step (%d), which --sync_every %d left unpublished", self.state.step,
                        cfg.sync_every)
            settlement.publish()
        if cfg.save_steps and self.last_checkpoint != self.state.step:
            self._checkpoint()
        if finished:
            final = self.output_dir / "final"
            export_pretrained(self.model, self.parallel, final, dtype=torch.float32, tokenizer=self.tokenizer)
            if self.parallel.is_main:
                if cfg.enable_sampling and not self.publisher.adapter:
                    self.io.run(self.store.runs.record_weights(str(final.resolve()), settlement.version))
                self.io.run(self.store.runs.set_status(RunStatus.FINISHED))
                logger.info("training finished after %d steps; final model in %s", self.state.step, final)

    def _checkpoint(self) -> None:
        """Save the model, optimizer, schedule and state; then the samples of its steps are trained."""
        path = save_checkpoint(self.output_dir, self.model, self.optimizer, self.scheduler, self.state,
                               self.parallel, tokenizer=self.tokenizer, save_total_limit=self.cfg.save_total_limit,
                               model_only=self.cfg.save_only_model)
        failpoint("trainer.checkpoint.before_mark_trained")
        if self.parallel.is_tp_leader:
            self.io.run(self.store.samples.mark_trained_through(self.parallel.dp_rank, self.state.step))
        self.parallel.barrier()
        self.last_checkpoint = self.state.step
        logger.info("checkpoint saved: %s", path)

    def _close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.sink is not None:
            self.sink.close()
        if self.io is not None:
            if self.store is not None:
                self.io.run(self.store.close())
            self.io.close()
        if self.parallel is not None:
            shutdown_parallel(self.parallel)


async def _open_store(uri: str) -> Store:
    """The run's store, waiting for the database as long as for an outage while running."""
    store = Store(uri, connect_timeout_s=outage_tolerance_s())
    try:
        await store.connect()
    except BaseException:
        await store.close()
        raise
    return store
