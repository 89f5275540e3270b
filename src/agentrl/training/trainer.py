"""The trainer: stream DBRecordData steps from the store, optimise the policy loss, publish, checkpoint, log.

One optimiser step (every rank in lockstep):

1. claim this rank's share of ``train_batch_size`` samples (``agentrl.training.data``), waiting if needed;
2. split it into micro-batches by the token budget, samples that share a token prefix together (the prefix is
   forwarded once, ``agentrl.training.prefix_tree``); ranks agree on the number of passes and of model calls per
   pass (a rank with fewer runs empty ones, which FSDP2 needs); the loss normaliser is counted over the whole step
   and all ranks first;
3. forward, per-token logprobs, loss (``agentrl.training.losses``), backward for every micro-batch, then
   gradient clipping, AdamW and the LR schedule;
4. every ``sync_every`` steps the weights are written as the next version and the inference services load it
   (``agentrl.training.publish``), on the io loop while the next step computes (``overlap_publish``); once they
   serve it, the step's Records become ``trained``; then its metrics are written (``agentrl.training.metrics``)
   and every ``save_steps`` a checkpoint is saved (``agentrl.training.checkpoint``; a checkpoint step waits for
   its publish, since it saves the model as the step left it).

Exactly-once training across crashes: a sample stays ``claimed(rank, step)`` until a checkpoint that contains its
update is complete, and only then becomes ``trained`` (with ``save_steps 0`` right after its step). A trainer
resumed from checkpoint ``s`` marks the claims of steps ``<= s`` trained and gets back the same claims for steps
``> s`` (or, with another data-parallel layout, returns them to the queue), so no sample is skipped or trained
twice. An overlapped publish changes no order within a step (export, loads, probe, bump, Records, metrics,
checkpoint); it only lets the next step claim and compute before the last three, a window a crash treats like one
during that step's own compute. SIGTERM/SIGINT finish the running step (or abandon one still waiting for data),
save a checkpoint and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.failpoints import failpoint
from agentrl.log import redact
from agentrl.precision import native_bf16, resolve_dtype
from agentrl.store import (
    DatabaseUnreachable,
    DBRecordData,
    RecordStatus,
    RunStatus,
    ServiceStatus,
    Store,
    database_name,
    resolve_connection_string,
)
from agentrl.store.outage import outage_tolerance_s
from agentrl.store.runs import RunValuesConflict
from agentrl.training import lora
from agentrl.training.aio import LoopThread
from agentrl.training.batching import MicroBatch, align_passes, pack_micro_batches
from agentrl.training.checkpoint import (
    CheckpointError,
    TrainerState,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from agentrl.training.config import TrainConfig
from agentrl.training.data import SampleStream, StepData, StepEnd, move_record, to_merged
from agentrl.training.launcher import LaunchConfigError, apply_launch_config
from agentrl.training.logprobs import layout_logprobs, shared_prefix_unsupported
from agentrl.training.losses import LossInput, LossMetrics, global_normaliser, loss_fn, loss_spec
from agentrl.training.metrics import (
    SAMPLE_STATS,
    MetricsSink,
    Reducer,
    ReportError,
    add_sample_stats,
    data_metrics,
)
from agentrl.training.parallel import (
    ParallelError,
    ParallelState,
    clip_grad_norm,
    init_parallel,
    shutdown_parallel,
)
from agentrl.training.policy_probe import probe_metrics, probe_token_ids
from agentrl.training.prefix_tree import MIN_SHARED_TOKENS
from agentrl.training.publish import PendingPublish, ProbeSettings, PublishError, PublishResult, WeightPublisher
from agentrl.training.weights import WeightsError, export_pretrained, load_sharded, load_tokenizer

logger = logging.getLogger(__name__)

SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
VERSION_HISTORY = 1000  # version -> step entries kept in the trainer state
PROBE_REPUBLISHES = 1  # publishes again when every service failed the policy probe, before the run stops


class TrainerError(RuntimeError):
    """The trainer cannot run with this configuration or environment."""


SETUP_ERRORS: tuple[type[Exception], ...] = (TrainerError, ReportError, WeightsError, CheckpointError, ParallelError,
                                             PublishError, LaunchConfigError, lora.LoraError, DatabaseUnreachable)
"""Errors whose message says everything (no traceback needed)."""


@dataclass
class _Unsettled:
    """A trained step not yet logged: its publish (None: not a publishing step) and, on tensor-parallel leaders,
    the io loop's work that releases its Records once the version is served."""

    data: StepData
    values: dict[str, float]
    pending: PendingPublish | None
    released: Future | None


class Trainer:
    """A trainer rank. ``Trainer(config).run()`` trains until ``max_steps``, the data ends (offline) or SIGTERM."""

    def __init__(self, config: TrainConfig):
        self.cfg = config
        self.loss_cfg = config.loss
        self.policy_gradient = loss_spec(config.loss).policy_gradient  # behaviour logprobs to compare with
        self.stop = threading.Event()
        self.parallel: ParallelState | None = None
        self.io: LoopThread | None = None
        self.store: Store | None = None
        self.sink: MetricsSink | None = None
        self.unsettled: _Unsettled | None = None  # the last step, while its publish may still be loading
        self.computed_by: int | None = None  # the policy version of the weights the running step computes with
        self.first_step = 0  # steps before this trainer's own that --max_steps leaves out (after a finished trainer)
        self.interrupted = False  # main rank: the run's last trainer did not finish

    # ------------------------------------------------------------------------------------------------- set-up

    def _setup(self) -> None:
        self._setup_process()
        self._open_run()
        resume = self._setup_models()
        self._setup_optimizer()
        self._restore(resume)
        self._setup_publishing(resume)

    def _setup_process(self) -> None:
        """The launch configuration, threads, process group, precision, seed and per-step batch size."""
        from transformers.utils import logging as hf_logging

        self.cfg = cfg = apply_launch_config(self.cfg)
        hf_logging.disable_progress_bar()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.parallel = parallel = init_parallel(cfg.tp_size or 1, cfg.ddp_backend, cfg.ddp_timeout)
        if not parallel.is_main:
            logging.getLogger("agentrl").setLevel(logging.WARNING)
        if cfg.load_in_4bit:
            self._check_4bit()  # before the run's database is touched
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
        """The policy (from the checkpoint to resume, if any, else the base model; LoRA or full), the tokenizer and
        the reference model; returns the checkpoint to resume from."""
        cfg, parallel = self.cfg, self.parallel
        resume = parallel.broadcast_from_main(
            resolve_resume(cfg.resume_from_checkpoint, self.output_dir) if parallel.is_main else None)
        base_path = parallel.broadcast_from_main(self._base_model_path() if parallel.is_main else None)
        self.lora = self._lora_config(resume, base_path)
        self.model = self._build_model(base_path if self.lora is not None else resume or base_path, resume)
        if self.lora is not None:
            logger.info("LoRA r=%d alpha=%g on %s: %s", self.lora.r, self.lora.lora_alpha,
                        " ".join(sorted(self.model.peft_config[lora.ADAPTER_NAME].target_modules)),
                        lora.trainable_summary(self.model))
            if cfg.lora_publish == "adapter" and (odd := lora.non_linear_targets(self.model)):
                raise TrainerError(f"--lora_publish adapter: inference servers serve adapters of Linear layers "
                                   f"only, and {', '.join(odd[:3])} is not one: leave it out of "
                                   "--lora_target_modules or publish merged weights")
        self.tokenizer = load_tokenizer(resume or base_path, cfg.trust_remote_code) if parallel.is_main else None
        self.ref_model = self._build_ref_model(cfg.ref_model_name_or_path or base_path) if cfg.loss.kl_coef else None
        self.min_shared = self._min_shared()
        return resume

    def _setup_optimizer(self) -> None:
        """AdamW and the learning-rate schedule."""
        cfg = self.cfg
        self.optimizer = self._build_optimizer()
        from transformers import get_scheduler

        self.scheduler = get_scheduler(SCHEDULERS[cfg.lr_scheduler_type], self.optimizer,
                                       num_warmup_steps=cfg.num_warmup_steps,
                                       num_training_steps=cfg.max_steps if cfg.max_steps > 0 else None)

    def _restore(self, resume: Path | None) -> None:
        """The trainer state: from checkpoint ``resume`` (its claims adopted, later metrics forgotten), else fresh
        (stale claims released)."""
        parallel = self.parallel
        self.state = TrainerState(dp_size=parallel.dp_size, train_batch_size=self.batch_size)
        if resume is not None:
            saved = load_checkpoint(resume, self.model, self.optimizer, self.scheduler, parallel)
            logger.info("resumed from %s at step %d (epoch %d)", resume, saved.step, saved.epoch)
            if parallel.is_main:
                lost = self.io.run(self.store.runs.forget_metrics_after(saved.step))
                if lost:
                    logger.info("the updates of %d later steps were not in the checkpoint: their Metric documents "
                                "are removed from the ledger and their samples are trained again", lost)
            self._adopt_claims(saved)
            self.state.step, self.state.epoch = saved.step, saved.epoch
            self.state.version_steps = saved.version_steps
        else:
            self._release_stale_claims()
            self._continue_step_count()
        self.last_checkpoint = self.state.step

    def _setup_publishing(self, resume: Path | None) -> None:
        """The run's policy version, the weight publisher (aligning the services on a resume or a later version)
        and the sample stream."""
        cfg, parallel = self.cfg, self.parallel
        self.version = int(parallel.broadcast_from_main(
            self.io.run(self.store.runs.policy_version()) if parallel.is_main else None))
        self.state.version_steps.setdefault(self.version, self.state.step)
        self.publisher = WeightPublisher(self.store, self.io, parallel, self.output_dir,
                                         dtype=torch.bfloat16 if self.bf16 else torch.float32,
                                         tokenizer=self.tokenizer, keep=cfg.keep_published_weights,
                                         retries=cfg.publish_retries,
                                         adapter=cfg.use_peft and cfg.lora_publish == "adapter",
                                         probe=self._probe_settings(), transport=self._weight_transport(),
                                         bucket_mb=cfg.weight_bucket_mb, timeout_s=cfg.weight_update_timeout_s,
                                         address=cfg.weight_sync_address)
        if cfg.enable_sampling and (resume is not None or self.version > 0):
            # the services may serve weights this trainer does not have (a later step, another run): align them
            self._publish()
        self.stream = SampleStream(self.store, self.io, parallel, split=cfg.split, batch_size=self.batch_size,
                                   staleness_bound=cfg.staleness_bound, offline=not cfg.enable_sampling,
                                   poll_interval_s=cfg.poll_interval_s, stop=self.stop,
                                   temperature=cfg.temperature if self.policy_gradient else None)

    def _weight_transport(self) -> str:
        """``--weight_transport`` resolved: ``auto`` is a weight-update group from a CUDA trainer and shared memory
        from a CPU one (on one CPU host loopback TCP is slower than the page cache, shared memory faster:
        docs/training.md); files only for what only files carry (adapters, merges into a 4-bit base's weights)."""
        cfg = self.cfg
        files_only = ("LoRA adapters are published as files" if cfg.use_peft and cfg.lora_publish == "adapter" else
                      "a 4-bit base's adapters are merged from the base's files" if cfg.load_in_4bit else None)
        transport = cfg.weight_transport
        if transport == "auto":
            transport = "disk" if files_only else "distributed" if self.parallel.device.type == "cuda" else "tensor"
        elif files_only and transport != "disk":
            logger.warning("--weight_transport %s: %s, so weights go through disk", transport, files_only)
            transport = "disk"
        if cfg.enable_sampling and self.parallel.is_main:
            logger.info("weights reach the inference services %s", {
                "distributed": "in memory (SGLang's weight-update group; through disk for a service that cannot "
                               "join one)",
                "tensor": "in memory, shared with the services on this host (/update_weights_from_tensor; through "
                          "disk for the others)",
                "disk": "through disk (weights/<version>, /update_weights_from_disk)"}[transport])
        return transport

    def _probe_settings(self) -> ProbeSettings | None:
        """What the policy probe after each publish checks (None: ``--policy_probe_max_diff 0``)."""
        if not self.cfg.policy_probe_max_diff:
            return None
        positions = getattr(self.model.config, "max_position_embeddings", None)
        ids = self.parallel.broadcast_from_main(
            probe_token_ids(self.tokenizer, positions) if self.parallel.is_main else None)
        return ProbeSettings(token_ids=ids, max_mean_abs_diff=self.cfg.policy_probe_max_diff)

    def _base_model_path(self) -> str:
        if self.cfg.model_name_or_path:
            return self.cfg.model_name_or_path
        from agentrl.inference.embedded_model import default_model_path

        return str(default_model_path())

    def _lora_config(self, resume: Path | None, base_path: str):
        """The LoRA settings of this run (None: full fine-tuning). A resume must use the checkpoint's own."""
        cfg = self.cfg
        adapter_checkpoint = resume is not None and lora.is_adapter_dir(resume)
        if not cfg.use_peft:
            if adapter_checkpoint:
                raise TrainerError(f"{resume} holds a LoRA adapter: resume it with --use_peft (and its LoRA flags)")
            return None
        config = lora.lora_config(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                                  target_modules=cfg.lora_target_modules,
                                  modules_to_save=cfg.lora_modules_to_save, base_model=base_path)
        if resume is None:
            return config
        if not adapter_checkpoint:
            raise TrainerError(f"{resume} holds a full model, not a LoRA adapter: resume it without --use_peft")
        saved = lora.read_adapter_config(resume)
        for name in ("r", "lora_alpha", "lora_dropout", "modules_to_save"):
            if getattr(saved, name) != getattr(config, name):
                raise TrainerError(f"{resume}: its adapter has {name} {getattr(saved, name)!r}, the flags ask for "
                                   f"{getattr(config, name)!r}: resume with the checkpoint's LoRA settings")
        return saved

    def _min_shared(self) -> int | None:
        """The shortest token prefix forwarded once for the samples sharing it (None: every sample alone)."""
        if not self.cfg.share_prefix:
            return None
        reason = next(filter(None, (shared_prefix_unsupported(m) for m in (self.model, self.ref_model) if m)), None)
        if reason is not None:
            logger.warning("shared prefixes are forwarded once per sample: %s", reason)
            return None
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()):
            logger.info("dropout is on: a shared prefix gets one dropout mask per micro-batch instead of one per "
                        "sample (the same expected gradient; --lora_dropout 0 makes it exact)")
        return MIN_SHARED_TOKENS

    def _check_4bit(self) -> None:
        if self.parallel.device.type != "cuda":
            raise TrainerError(f"--load_in_4bit needs a CUDA GPU (bitsandbytes 4-bit kernels); this trainer runs "
                               f"on {self.parallel.device}: drop --load_in_4bit (LoRA alone works on any device)")
        if self.parallel.distributed:
            raise TrainerError("--load_in_4bit works in one process only (FSDP2 cannot shard bitsandbytes "
                               "weights): launch a single process, or drop --load_in_4bit")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as error:
            raise TrainerError(f"--load_in_4bit needs bitsandbytes: pip install bitsandbytes ({error})") from None

    def _build_model(self, path: str | Path, resume: Path | None) -> torch.nn.Module:
        cfg = self.cfg

        def prepare(model: torch.nn.Module) -> None:
            model.config.use_cache = False
            if cfg.gradient_checkpointing:
                model.activation_checkpointing_enable()

        transform = None if self.lora is None else lora.adapter_transform(
            self.lora, resume, quantized=cfg.load_in_4bit, gradient_checkpointing=cfg.gradient_checkpointing)
        return self._load(path, prepare, transform, load_in_4bit=cfg.load_in_4bit)

    def _build_ref_model(self, path: str | Path) -> torch.nn.Module:
        return self._load(path, lambda model: model.requires_grad_(False).eval())

    def _load(self, path: str | Path, prepare, transform=None, load_in_4bit: bool = False) -> torch.nn.Module:
        cfg = self.cfg
        return load_sharded(path, self.parallel, bf16=self.bf16, reshard_after_forward=cfg.reshard_after_forward,
                            rank0_loading=cfg.cpu_ram_efficient_loading,
                            attn_implementation=cfg.attention_implementation,
                            trust_remote_code=cfg.trust_remote_code, prepare=prepare, transform=transform,
                            load_in_4bit=load_in_4bit)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.cfg.learning_rate,
                                 betas=(self.cfg.adam_beta1, self.cfg.adam_beta2), eps=self.cfg.adam_epsilon)

    def _adopt_claims(self, saved: TrainerState) -> None:
        """After loading checkpoint ``saved``: its steps' claims are trained; later claims are replayed as they
        are, or returned to the queue when the data-parallel layout or the batch size changed."""
        parallel = self.parallel
        if parallel.is_main and (saved.dp_size, saved.train_batch_size) != (parallel.dp_size, self.batch_size):
            returned = self.io.run(self.store.samples.requeue(from_step=saved.step + 1))
            logger.info("layout changed (dp %d → %d, batch %d → %d): %d claims of later steps went back to "
                        "the queue", saved.dp_size, parallel.dp_size, saved.train_batch_size, self.batch_size,
                        returned)
        parallel.barrier()
        if parallel.is_tp_leader:
            self.io.run(self.store.samples.mark_trained_through(parallel.dp_rank, saved.step))
        if parallel.is_main:  # ranks of the checkpoint's layout that no longer exist: their updates are in it too
            for rank in range(parallel.dp_size, saved.dp_size):
                self.io.run(self.store.samples.mark_trained_through(rank, saved.step))
        parallel.barrier()

    def _continue_step_count(self) -> None:
        """A fresh start online in a run whose earlier trainer logged steps (without a checkpoint to resume, e.g.
        ``--save_steps 0``): number the steps after them, so that the ledger keeps every step it logged.
        ``--max_steps`` counts them too when that trainer did not finish (this one takes its place), else only this
        trainer's own steps."""
        if not self.cfg.enable_sampling:
            return
        last = self.parallel.broadcast_from_main(self.io.run(self.store.runs.last_step())
                                                 if self.parallel.is_main else None)
        interrupted = self.parallel.broadcast_from_main(self.interrupted if self.parallel.is_main else None)
        if last:
            logger.info("an earlier trainer of this run logged %d steps (no checkpoint resumed: this one starts from "
                        "the base weights): numbering the steps from %d on%s", last, last + 1,
                        "; it did not finish, so --max_steps counts them too" if interrupted else "")
            self.state.step = last
            self.first_step = 0 if interrupted else last
            if self.sink is not None:
                self.sink.max_steps = self.cfg.max_steps + self.first_step if self.cfg.max_steps > 0 else -1

    def _release_stale_claims(self) -> None:
        """A fresh start: claims an earlier trainer of this run left behind go back to the queue, except those its
        ledger lists (``--save_steps 0``: it died between logging a step and marking its samples trained)."""
        if self.parallel.is_main:
            for step in self.io.run(self.store.samples.claimed_steps()):
                logged = self.io.run(self.store.runs.ledger(step))
                if logged and (settled := self.io.run(self.store.samples.mark_logged_trained(step, logged))):
                    logger.info("step %d of an earlier trainer is in the ledger: its %d samples still claimed are "
                                "trained", step, settled)
            returned = self.io.run(self.store.samples.requeue(from_step=0))
            if returned:
                logger.info("%d samples claimed by an earlier trainer of this run went back to the queue",
                            returned)
        self.parallel.barrier()

    # --------------------------------------------------------------------------------------------------- loop

    def run(self) -> int:
        """Train; returns the process exit code (0 also after a SIGTERM that stopped the run cleanly)."""
        with self._signals():
            try:
                self._setup()
                finished = self._loop()
                self._finish(finished)
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
        cfg = self.cfg
        started = time.monotonic()
        deadline = started + cfg.max_train_time_s if cfg.max_train_time_s else None
        while True:
            if 0 < cfg.max_steps <= self.state.step - self.first_step:
                self.stream.give_back(self.state.step + 1)  # a resumed run's claims for later steps
                return True
            if deadline is not None and self.parallel.broadcast_from_main(
                    time.monotonic() >= deadline if self.parallel.is_main else None):
                logger.info("training time limit of %.0f s reached after step %d", cfg.max_train_time_s,
                            self.state.step)
                self.stream.give_back(self.state.step + 1)
                return True
            got = self.stream.next_step(self.state.step + 1, self.version, deadline, before_waiting=self._settle,
                                        publish_due=self._service_behind if cfg.enable_sampling else None)
            if got is StepEnd.PUBLISH:
                self._settle()
                self._publish()
                continue
            if got is StepEnd.DEADLINE:
                logger.info("training time limit of %.0f s reached while waiting for the samples of step %d: "
                            "finishing after step %d", cfg.max_train_time_s, self.state.step + 1, self.state.step)
                return True
            if got is StepEnd.STOPPED:
                logger.info("stop requested: leaving after step %d", self.state.step)
                return False
            if got is StepEnd.EXHAUSTED:
                if not cfg.enable_sampling and self.state.epoch + 1 < cfg.num_train_epochs:
                    self._next_epoch()
                    continue
                if self.state.step == 0 and self.state.epoch == 0:
                    logger.warning("no queued samples in split %r: nothing to train", cfg.split)
                return True
            values, trainer_logprobs = self._train_step(got)
            self.state.step = got.step
            self._after_step(got, values, trainer_logprobs)

    def _after_step(self, data: StepData, values: dict[str, float], trainer_logprobs: dict[Any, list[float]]
                    ) -> None:
        """Publish (export now, the services load on the io loop), release the step's Records once the version is
        served, then log and checkpoint; with ``overlap_publish`` the last two wait for the next step's end (or
        its wait for samples) unless this step saves a checkpoint (which needs the model as this step left it)."""
        self._settle()
        cfg, parallel, step = self.cfg, self.parallel, data.step
        trained_version = self.computed_by  # the policy that computed trainer_logprobs (None: unpublished weights)
        values.update(policy_version=float(self.version), epoch=float(self.state.epoch),
                      wait_s=data.wait_s,
                      skipped_stale=parallel.all_reduce([float(data.skipped_stale)], group="dp")[0])
        pending = None
        if cfg.enable_sampling and step % cfg.sync_every == 0:
            pending = self.publisher.export(self.model, self.version + 1)
            self._adopt_version(pending.result.version)
        released = None
        if parallel.is_tp_leader:
            released = self.io.submit(self._release(data, trained_version, trainer_logprobs, pending))
        self.unsettled = _Unsettled(data, values, pending, released)
        if pending is None or not cfg.overlap_publish or self._checkpoint_due(step):
            self._settle()

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
                await self._served_by_main(pending.result.version)
        await self._records_trained(data.samples)
        await self.store.samples.record_trainer_logprobs(self.parallel.dp_rank, data.step, trained_version,
                                                         trainer_logprobs)

    async def _served_by_main(self, version: int) -> None:
        """Another rank's wait for rank 0's announcement of ``version`` (seen on the Run), at most ``--ddp_timeout``
        (rank 0's publish failed, or rank 0 is gone: :class:`PublishError`)."""
        deadline = time.monotonic() + self.cfg.ddp_timeout
        while await self.store.runs.policy_version() < version:
            if time.monotonic() > deadline:
                raise PublishError(f"rank 0 did not publish weights version {version} within --ddp_timeout "
                                   f"{self.cfg.ddp_timeout} s (its publish failed, or it is gone: see its log)")
            await asyncio.sleep(min(self.cfg.poll_interval_s, 0.5))

    def _settle(self) -> None:
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
        if self._checkpoint_due(step):
            self._checkpoint()

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
            result = self._publish()

    def _checkpoint_due(self, step: int) -> bool:
        return bool(self.cfg.save_steps) and step % self.cfg.save_steps == 0

    async def _records_trained(self, samples: list[DBRecordData]) -> None:
        for record_id in dict.fromkeys(s.record_id for s in samples):
            await move_record(self.store, record_id, RecordStatus.TRAINED)

    def _next_epoch(self) -> None:
        """Offline training: the data is used up; make this epoch durable and queue the data again."""
        self._settle()
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
        self._settle()
        cfg = self.cfg
        if finished and cfg.enable_sampling and self.state.version_steps.get(self.version) != self.state.step:
            logger.info("publishing the last step (%d), which --sync_every %d left unpublished", self.state.step,
                        cfg.sync_every)
            self._publish()
        if cfg.save_steps and self.last_checkpoint != self.state.step:
            self._checkpoint()
        if finished:
            final = self.output_dir / "final"
            export_pretrained(self.model, self.parallel, final, dtype=torch.float32, tokenizer=self.tokenizer)
            if self.parallel.is_main:
                if cfg.enable_sampling and not self.publisher.adapter:
                    self.io.run(self.store.runs.record_weights(str(final.resolve()), self.version))
                self.io.run(self.store.runs.set_status(RunStatus.FINISHED))
                logger.info("training finished after %d steps; final model in %s", self.state.step,
                            self.output_dir / "final")

    def _close(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        if self.sink is not None:
            self.sink.close()
        if self.io is not None:
            if self.store is not None:
                self.io.run(self.store.close())
            self.io.close()
        if self.parallel is not None:
            shutdown_parallel(self.parallel)

    @contextlib.contextmanager
    def _signals(self):
        """SIGTERM/SIGINT ask the loop to stop at the next step boundary (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, _frame: Any) -> None:
            if not self.stop.is_set():
                logger.info("%s received: stopping after the current step", signal.Signals(signum).name)
            self.stop.set()

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ------------------------------------------------------------------------------------------- one step

    def _train_step(self, data: StepData) -> tuple[dict[str, float], dict[Any, list[float]]]:
        """One optimiser step: its metrics, and the logprobs the policy gave each sample's tokens (by sample id; 0 off
        the loss tokens; none with cross-entropy), which the store keeps for audits."""
        cfg, parallel, device = self.cfg, self.parallel, self.parallel.device
        started = time.monotonic()
        # the weights are policy version ``self.version`` only if no update came after its publish (sync_every > 1)
        self.computed_by = self.version if self.state.version_steps.get(self.version) == self.state.step else None
        merged = [to_merged(sample) for sample in data.samples]
        pad_id = self.model.config.pad_token_id or 0
        micro = pack_micro_batches(merged, cfg.max_tokens, pad_token_id=pad_id, min_shared=self.min_shared,
                                   pad_to_multiple_of=cfg.pad_to_multiple_of) if merged else []
        real = align_passes(micro, parallel, pad_id)  # FSDP2: the same passes and model calls on every rank
        normaliser = global_normaliser(self.loss_cfg, micro, parallel)
        loss_metrics, mismatch = LossMetrics(), Reducer()
        trainer_logprobs: dict[Any, list[float]] = {}
        padded = 0
        self.model.train()
        if normaliser > 0:
            for index, batch in enumerate(micro):
                if parallel.distributed:
                    self.model.set_requires_gradient_sync(index == len(micro) - 1)
                metrics, scored = self._micro_step(batch.to(device), normaliser, mismatch)
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
        add_sample_stats(reducer, data.samples, self.version, self.state.version_steps)
        raw = reducer.reduce(parallel, SAMPLE_STATS)
        values = data_metrics(raw)
        values.update(loss_metrics.all_reduce(parallel).as_dict())
        values.update(self._mismatch_metrics(mismatch))
        padded_total = parallel.all_reduce([float(padded)], group="dp")[0]
        values.update(grad_norm=grad_norm, learning_rate=learning_rate, padded_tokens=padded_total,
                      step_s=compute_s, tokens_per_s=values["tokens"] / compute_s if compute_s > 0 else 0.0)
        return values, trainer_logprobs

    def _micro_step(self, batch: MicroBatch, normaliser: float, mismatch: Reducer
                    ) -> tuple[LossMetrics, torch.Tensor | None]:
        """Forward, loss and backward of one micro-batch; returns its loss metrics and the policy's logprobs of its
        loss tokens (``[B, T]`` on the CPU, 0 elsewhere; ``None`` with cross-entropy)."""
        cfg = self.cfg
        with self._autocast():
            # Shared prefixes are forwarded once; the LM head runs only where trained tokens are predicted.
            compute_dtype = torch.bfloat16 if self.bf16 else None
            new_logprobs = layout_logprobs(self.model, batch.layout, temperature=cfg.temperature,
                                           compute_dtype=compute_dtype)
            ref_logprobs = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logprobs = layout_logprobs(self.ref_model, batch.layout, temperature=cfg.temperature,
                                                   compute_dtype=compute_dtype)
        loss_input = LossInput.from_batch(batch, new_logprobs, self.version, ref_logprobs)
        loss_sum, metrics = loss_fn(self.loss_cfg, loss_input, normaliser)
        (loss_sum * self.parallel.dp_size).backward()
        if self.policy_gradient:
            with torch.no_grad():
                mask = batch.loss_mask
                gap = (new_logprobs.detach() - batch.old_logprobs).abs()
                fresh = mask & (batch.versions == self.computed_by) if self.computed_by is not None else mask & False
                for suffix, selected in (("", mask), ("_fresh", fresh)):
                    values = gap[selected]
                    if values.numel():
                        mismatch.add(f"count{suffix}", values.numel())
                        mismatch.add(f"sum{suffix}", float(values.sum()))
                        mismatch.max(f"max{suffix}", float(values.max()))
            return metrics, new_logprobs.detach().float().masked_fill(~mask, 0.0).cpu()
        return metrics, None

    def _mismatch_metrics(self, mismatch: Reducer) -> dict[str, float]:
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

    # ------------------------------------------------------------------------------------- publish, save

    def _publish(self):
        """Publish the model as the next version and wait until it is served."""
        result = self.publisher.publish(self.model, self.version + 1)
        self._adopt_version(result.version)
        return result

    def _service_behind(self) -> bool:
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

    def _adopt_version(self, version: int) -> None:
        """The model is ``version`` from now on (its weights are written; the services may still be loading)."""
        self.version = version
        self.state.version_steps[version] = self.state.step
        for old in [v for v in self.state.version_steps if v < version - VERSION_HISTORY]:
            del self.state.version_steps[old]

    def _checkpoint(self) -> None:
        path = save_checkpoint(self.output_dir, self.model, self.optimizer, self.scheduler, self.state,
                               self.parallel, tokenizer=self.tokenizer, save_total_limit=self.cfg.save_total_limit,
                               model_only=self.cfg.save_only_model)
        failpoint("trainer.checkpoint.before_mark_trained")
        if self.parallel.is_tp_leader:
            self.io.run(self.store.samples.mark_trained_through(self.parallel.dp_rank, self.state.step))
        self.parallel.barrier()
        self.last_checkpoint = self.state.step
        logger.info("checkpoint saved: %s", path)


async def _open_store(uri: str) -> Store:
    """The run's store, waiting for the database as long as for an outage while running."""
    store = Store(uri, connect_timeout_s=outage_tolerance_s())
    try:
        await store.connect()
    except BaseException:
        await store.close()
        raise
    return store
