"""Configuration of a trainer run (``agentrl train`` / ``python -m agentrl.train``); flag names are the original
AgentRL's (docs/original.md).

Batch size: one optimiser step trains ``train_batch_size`` samples (merged trajectory branches) over all
data-parallel ranks together. ``--per_device_train_batch_size`` / ``--gradient_accumulation_steps`` give it as
their product × data-parallel size, the Hugging Face convention the original followed. With sampling (online), the
batch size, ``max_staleness`` and ``temperature`` are values the run records
(:class:`agentrl.store.models.RunValues`, docs/configuration.md): left unset they are the run's; offline the batch
size defaults to that product. Within a step every rank splits its
share into micro-batches by a token budget (``max_tokens`` forwarded tokens per pass), so gradient
accumulation follows from the data, not from a fixed count; normalisers are global over the whole step.

Flags of the original kept for its scripts: ``--optim_args`` (Hugging Face syntax) sets ``adam_beta1``,
``adam_beta2`` and ``adam_epsilon``; ``--preferred_sampling_params`` gives ``temperature`` (that of the behaviour
logprobs); ``--report_to`` accepts every Hugging Face integration, but only tensorboard and wandb are sinks here.
:meth:`TrainConfig.advisories` lists, one line each, what is accepted but not done, and loss recipes combined
with settings their authors recommend against. The loss options are one nested model, ``TrainConfig.loss``
(:class:`agentrl.training.loss_config.LossConfig`), whose fields are flags of their own (``--epsilon``).

This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.store.models import RUN_VALUE_HELP, RunValues
from agentrl.training.loss_config import LossConfig

SchedulerName = Literal["constant", "linear", "cosine"]
ReportTarget = Literal["none", "tensorboard", "wandb", "all", "azure_ml", "clearml", "codecarbon", "comet_ml",
                       "dagshub", "dvclive", "flyte", "kubeflow", "mlflow", "neptune", "swanlab", "trackio"]
"""Hugging Face's ``report_to`` values; only ``SUPPORTED_REPORT_TARGETS`` are sinks of this trainer."""
SUPPORTED_REPORT_TARGETS: frozenset[str] = frozenset({"none", "tensorboard", "wandb"})

OPTIM_ARGS: dict[str, str] = {"beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_epsilon"}
"""``--optim_args`` keys and the fields they set."""

def _set_unless_contradicted(data: dict[str, Any], field: str, value: float, source: str) -> None:
    """``data[field] = value``, or an error naming ``source`` and ``--field`` when that was given otherwise."""
    given = data.get(field)
    if given is not None and float(given) != value:
        raise ValueError(f"{source} contradicts --{field} {given}")
    data[field] = value


def _apply_optim_args(data: dict[str, Any], text: str) -> None:
    """Set the fields of ``key=value,key=value`` (Hugging Face's ``optim_args``; keys from OPTIM_ARGS)."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"--optim_args: expected key=value pairs separated by commas, got {item!r}")
        if key not in OPTIM_ARGS:
            raise ValueError(f"--optim_args: unknown key {key!r} (expected {', '.join(OPTIM_ARGS)})")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--optim_args {key}={raw}: not a number") from None
        _set_unless_contradicted(data, OPTIM_ARGS[key], value, f"--optim_args {key}={raw}")


class TrainConfig(BaseModel):
    """Every option of a trainer run; each field is the flag ``--<name>``."""

    model_config = ConfigDict(extra="forbid")

    # --------------------------------------------------------------------------------------------- model, data
    model_name_or_path: str | None = Field(
        None, description="Hugging Face model directory to train (default: the embedded SmolLM2-135M-Instruct); "
        "its weights are always loaded")
    db_connection_string: str | None = Field(
        None, description="MongoDB connection string whose path is the run's database (default: $AGENTRL_DB, "
        "else the embedded database)")
    run_name: str | None = Field(None, description="database (run) name when the connection string has no path")
    output_dir: str | None = Field(
        None, description="checkpoints, published weights and the final model (default: output/<run name>)")
    split: str = Field("train", description="split of the DBRecordData queue to train on")
    attention_implementation: str = Field("sdpa", description="sdpa, eager or flash_attention_2")
    trust_remote_code: bool = Field(False, description="allow model code from the model directory")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    freeze_vision_tower: bool = Field(False, description="a vision-language policy: train its language model only, "
                                      "the vision tower (model.visual) frozen (EasyR1's and verl's name)")
    vision_learning_rate: float | None = Field(
        None, gt=0, description="a vision-language policy: the learning rate of its vision tower (model.visual), "
        "e.g. higher for a newly initialised one, as LLaVA's mm_projector_lr (default: --learning_rate)")
    cpu_ram_efficient_loading: bool = Field(
        True, description="several ranks: only rank 0 reads the weights into host memory, the others build the "
        "model on the meta device and receive their shards by broadcast (false: every rank reads them)")

    # ------------------------------------------------------------------------------------------------ LoRA (TRL)
    use_peft: bool = Field(False, description="train LoRA adapters (PEFT) instead of every weight; checkpoints hold "
                           "the adapter, published and final weights are merged into full weights")
    lora_r: int = Field(16, ge=1, description="LoRA rank")
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA scaling numerator (the update is alpha / r · B A)")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    lora_target_modules: list[str] | None = Field(
        None, description="module names to adapt, or all-linear (every linear layer but the output head); "
        "default: PEFT's choice for the architecture (q_proj v_proj for Llama)")
    lora_modules_to_save: list[str] | None = Field(
        None, description="modules trained in full alongside the adapters (e.g. a new classification head)")
    load_in_4bit: bool = Field(False, description="QLoRA: the base model in 4-bit NF4 (bitsandbytes, CUDA, one "
                               "process; needs --use_peft)")
    lora_publish: Literal["merged", "adapter"] = Field(
        "merged", description="what a LoRA run publishes to the inference services: merged full weights "
        "(/update_weights_from_disk, any server) or the adapter alone (/load_lora_adapter: SGLang started with "
        "--enable-lora, or agentrl engine --enable_lora); samplers then name it in every request")

    # ------------------------------------------------------------------------------------------------- batches
    train_batch_size: int | None = Field(
        None, ge=1, description="samples per optimiser step over all ranks (default: the run's, else "
        f"{RunValues.model_fields['train_batch_size'].default}; offline, or given --per_device_train_batch_size or "
        "--gradient_accumulation_steps: their product × data-parallel size); with --enable_sampling "
        f"{RUN_VALUE_HELP}")
    per_device_train_batch_size: int = Field(8, ge=1, description="see train_batch_size")
    gradient_accumulation_steps: int = Field(1, ge=1, description="see train_batch_size")
    max_tokens: int = Field(8192, ge=1, description="tokens the model forwards per micro-batch, padding included "
                            "and a shared prefix once; a longer sample gets a micro-batch of its own")
    pad_to_multiple_of: int = Field(1, ge=1, description="pad micro-batch length to a multiple of this")
    share_prefix: bool = Field(True, description="forward a token prefix that samples of a micro-batch share (a "
                               "group's prompt, a trajectory's common turns) once, not once per sample")
    temperature: float = Field(RunValues.model_fields["temperature"].default, gt=0.0,
                               description=f"sampling temperature of the behaviour logprobs; {RUN_VALUE_HELP}")
    preferred_sampling_params: dict[str, Any] | None = Field(
        None, description="the original's engine sampling defaults as JSON: the trainer takes its temperature as "
        "--temperature (the other parameters belong to the samplers or the engine)")

    # -------------------------------------------------------------------------------------------------- losses
    loss: LossConfig = Field(default_factory=LossConfig, description="the loss options: each field is a flag")
    ref_model_name_or_path: str | None = Field(
        None, description="reference model for kl_coef (default: model_name_or_path)")

    # ------------------------------------------------------------------------------------------------ optimiser
    learning_rate: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    optim_args: str | None = Field(
        None, description="Hugging Face syntax, comma-separated key=value: beta1, beta2 and eps set adam_beta1, "
        "adam_beta2 and adam_epsilon (e.g. beta1=0.9,beta2=0.98)")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the global gradient norm (none: no clip)")
    lr_scheduler_type: SchedulerName = Field("constant", description="constant, linear or cosine (these two need "
                                             "max_steps), all after a linear warmup")
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="warmup as a fraction of max_steps")
    seed: int = 42

    # -------------------------------------------------------------------------------------------- run control
    max_steps: int = Field(-1, description="stop after this many optimiser steps (-1: no limit)")
    max_train_time_s: float = Field(0.0, ge=0.0, description="stop after the step during which this many seconds "
                                    "of training have passed, and finish as at max_steps (0: no limit)")
    num_train_epochs: int = Field(1, ge=1, description="passes over the queued data when enable_sampling is false")
    save_steps: int = Field(500, ge=0, description="checkpoint every this many steps (0: no checkpoints)")
    save_total_limit: int | None = Field(None, ge=1, description="keep only this many checkpoints")
    save_only_model: bool = Field(
        False, description="checkpoints without optimizer and scheduler state (much smaller); a resume from one "
        "starts the optimizer afresh, continues the learning-rate schedule and still trains every sample once")
    resume_from_checkpoint: str | None = Field(None, description="checkpoint directory, or 'latest' in output_dir")
    logging_steps: int = Field(1, ge=1, description="console progress line every this many steps")
    report_to: list[ReportTarget] = Field(
        default_factory=list, description="also log to tensorboard and/or wandb (Hugging Face's other "
        "integrations are accepted with a warning and ignored)")
    logging_dir: str | None = Field(None, description="tensorboard directory (default: output_dir/runs)")
    poll_interval_s: float = Field(2.0, gt=0.0, description="longest pause between two polls of an empty queue")

    # --------------------------------------------------------------------------------------- sampling, weights
    enable_sampling: bool = Field(
        True, description="samplers run alongside: publish weights to the inference services (false: offline "
        "training, e.g. SFT, from the queued DBRecordData only, stopping when they are used up)")
    sync_sampling: bool = Field(
        False, description="train only on samples produced by the current policy version (synchronous baseline)")
    max_staleness: int | None = Field(
        RunValues.model_fields["max_staleness"].default, ge=0,
        description="skip (count and log) samples more than this many policy versions old (none: no bound; "
        f"--sync_sampling: 0); {RUN_VALUE_HELP}")
    sync_every: int = Field(1, ge=1, description="publish the weights every this many steps")
    overlap_publish: bool = Field(
        True, description="train the next step while the inference services load the published weights (the "
        "step's samples leave the samplers' admission count once they serve them); false: wait for the services "
        "after every publish")
    keep_published_weights: int = Field(2, ge=1, description="published weight directories to keep on disk")
    weight_transport: Literal["auto", "distributed", "tensor", "disk"] = Field(
        "auto", description="how published weights reach the inference services: distributed (in memory over SGLang's "
        "weight-update group: flattened buckets broadcast from rank 0, gloo on CPU, NCCL on CUDA, nothing written per "
        "step; a service that cannot join one gets files), tensor (services on this host map each bucket in place: "
        "shared memory on CPU, CUDA IPC on GPU, /update_weights_from_tensor; others get files), disk "
        "(weights/<version> and /update_weights_from_disk), "
        "auto (distributed from a CUDA trainer, tensor from a CPU one: on one CPU host shared memory is faster than "
        "the page cache, which is faster than loopback TCP). A transfer that fails falls back to disk for that "
        "publish. LoRA adapters (--lora_publish adapter) and 4-bit bases always go through disk")
    weight_bucket_mb: float = Field(256.0, gt=0.0, description="distributed, tensor: the most MiB of weights "
                                    "gathered and sent at once (one dtype a bucket; a larger tensor goes alone)")
    weight_update_timeout_s: float = Field(
        120.0, gt=0.0, description="distributed, tensor: the longest a group's rendezvous, a bucket's broadcast or a "
        "service's answer to it may take before that service gets the version through disk")
    weight_sync_address: str | None = Field(
        None, description="distributed: the address the services reach this trainer's rank 0 by (default: the "
        "local address of the route to each service; 127.0.0.1 for a local one)")
    publish_retries: int = Field(3, ge=0, description="extra attempts per inference service when publishing")
    policy_probe_max_diff: float = Field(
        0.1, ge=0.0, description="after each publish every service scores a fixed sequence; one whose mean "
        "|logprob - trainer's| exceeds this is reported and kept off the samplers (measured: 1e-5 for fp32 serving, "
        "0.04 for bf16; 0.1 fits both, 0.001 suits fp32 serving only; 0 turns the check off)")

    # ------------------------------------------------------------------------------------ precision, parallelism
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute precision; bfloat16 keeps fp32 master weights and an fp32 LM head; auto: "
        "bfloat16 on CUDA and on CPUs with bf16 matrix instructions (AMX, AVX512-BF16), float32 elsewhere")
    bf16: bool | None = Field(None, description="TRL's name for the precision: true is --dtype bfloat16, false "
                              "--dtype float32 (default: --dtype decides)")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered parameters after each layer's "
                                        "forward pass (false: keep them for backward, faster, more memory)")
    tp_size: int | None = Field(None, ge=1, description="tensor-parallel degree (default: accelerate's "
                                "parallelism_config_tp_size, else 1); data-parallel size = world size / tp_size")
    ddp_backend: Literal["gloo", "nccl"] | None = Field(None, description="default: nccl on CUDA, gloo on CPU")
    ddp_timeout: int = Field(1800, ge=1, description="seconds a collective may wait")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads per process")

    @model_validator(mode="before")
    @classmethod
    def _original_flags(cls, data: Any) -> Any:
        """Apply ``optim_args`` and the temperature of ``preferred_sampling_params`` to the fields they set."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("optim_args"), str):
            _apply_optim_args(data, data["optim_args"])
        params = data.get("preferred_sampling_params")
        if isinstance(params, dict) and "temperature" in params:
            temperature = params["temperature"]
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature <= 0:
                raise ValueError(f"--preferred_sampling_params temperature must be a number > 0 (the trainer "
                                 f"divides the logits by it), got {temperature!r}")
            _set_unless_contradicted(data, "temperature", float(temperature),
                                     f"--preferred_sampling_params temperature {temperature}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.sync_sampling and "max_staleness" in self.model_fields_set and self.max_staleness != 0:
            raise ValueError(f"--sync_sampling trains only on current-version samples: it contradicts "
                             f"--max_staleness {self.max_staleness}")
        if self.sync_sampling and not self.enable_sampling:
            raise ValueError("--sync_sampling needs --enable_sampling true (it waits for fresh samples)")
        if self.lr_scheduler_type != "constant" and self.max_steps <= 0:
            raise ValueError(f"--lr_scheduler_type {self.lr_scheduler_type} decays over --max_steps: set it")
        if self.warmup_ratio and self.max_steps <= 0:
            raise ValueError("--warmup_ratio is a fraction of --max_steps: set it (or use --warmup_steps)")
        lora_flags = sorted(name for name in self.model_fields_set  # the defaults may be given (a snapshot is)
                            if (name.startswith("lora_") or name == "load_in_4bit")
                            and getattr(self, name) != type(self).model_fields[name].default)
        if lora_flags and not self.use_peft:
            raise ValueError(f"LoRA flags without --use_peft: --{' --'.join(lora_flags)} (add --use_peft to train "
                             "LoRA adapters)")
        if self.lora_publish == "adapter" and self.lora_modules_to_save:
            raise ValueError("--lora_publish adapter cannot serve --lora_modules_to_save (inference servers load "
                             "only LoRA pairs): publish merged weights instead")
        if self.loss.kl_coef == 0 and self.ref_model_name_or_path is not None:
            raise ValueError("--ref_model_name_or_path is only used with --kl_coef > 0")
        _ = self.precision
        return self

    def advisories(self) -> list[str]:
        """One line per setting that is accepted but not (entirely) done, or that combines a loss with settings
        its authors recommend against; ``agentrl train`` logs them at start-up."""
        notes: list[str] = []
        explicit = self.model_fields_set
        unsupported = [target for target in self.report_to if target not in SUPPORTED_REPORT_TARGETS]
        if unsupported:
            notes.append(f"--report_to {' '.join(unsupported)}: not supported here (supported: tensorboard, wandb); "
                         "metrics still go to the database (Metric), the console and the supported sinks")
        other = sorted(set(self.preferred_sampling_params or {}) - {"temperature"})
        if other:
            value = shlex.quote(json.dumps(self.preferred_sampling_params))
            notes.append(f"--preferred_sampling_params: the trainer uses only its temperature ({self.temperature}); "
                         f"the others ({', '.join(other)}) are sampling settings: pass them to the samplers, "
                         f"`agentrl sample --preferred_sampling_params {value}` (or as the engine's defaults, "
                         f"`agentrl engine --preferred_sampling_params {value}`)")
        if "num_train_epochs" in explicit and self.num_train_epochs > 1 and self.enable_sampling:
            notes.append(f"--num_train_epochs {self.num_train_epochs}: passes over the queued samples apply to "
                         "offline training (--enable_sampling false); with sampling every uploaded task gets its "
                         "samples once and training ends when they are trained or at --max_steps")
        return notes + self.loss.advisories()

    def flag_values(self, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Every flag and its value (JSON types; the fields of nested models such as ``loss`` are flags of their
        own), less ``exclude``: the run's configuration snapshot."""
        values: dict[str, Any] = {}
        for name, value in self.model_dump(mode="json").items():
            values.update(value if isinstance(getattr(self, name), BaseModel) else {name: value})
        return {name: value for name, value in values.items() if name not in exclude}

    @property
    def precision(self) -> Literal["auto", "float32", "bfloat16"]:
        """The requested compute precision: ``--bf16`` when given (it must agree with an explicit ``--dtype``),
        else ``--dtype``; ``auto`` is resolved on the trainer's device (``agentrl.precision``)."""
        if self.bf16 is None:
            return self.dtype
        named = "bfloat16" if self.bf16 else "float32"
        if self.dtype not in ("auto", named):
            raise ValueError(f"--bf16 {str(self.bf16).lower()} contradicts --dtype {self.dtype}: give one of them")
        return named

    @property
    def staleness_bound(self) -> int | None:
        """Most policy versions a trained sample may lag behind (0 under ``sync_sampling``; None: no bound)."""
        return 0 if self.sync_sampling else self.max_staleness

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps or int(self.warmup_ratio * max(self.max_steps, 0))

    def run_values(self, dp_size: int) -> dict[str, Any]:
        """The values of :class:`RunValues` these flags give (the others come from the run): the batch size given
        or computed from the per-device size, the staleness bound given (0 under ``sync_sampling``), the
        temperature given (also by ``preferred_sampling_params``)."""
        given: dict[str, Any] = {}
        if self.train_batch_size is not None:
            given["train_batch_size"] = self.train_batch_size
        elif {"per_device_train_batch_size", "gradient_accumulation_steps"} & self.model_fields_set:
            given["train_batch_size"] = self.per_device_train_batch_size * self.gradient_accumulation_steps * dp_size
        if "max_staleness" in self.model_fields_set or self.sync_sampling:
            given["max_staleness"] = self.staleness_bound
        if "temperature" in self.model_fields_set:
            given["temperature"] = self.temperature
        return given

    def run_value_sources(self, dp_size: int) -> dict[str, str]:
        """How this trainer was given each of :meth:`run_values` (for the run's record and its errors)."""
        given = self.run_values(dp_size)
        sources = {key: f"the trainer's --{key} {value:g}" if isinstance(value, float) else
                   f"the trainer's --{key} {value}" for key, value in given.items()}
        if "train_batch_size" in given and self.train_batch_size is None:
            sources["train_batch_size"] = (
                f"the trainer's --per_device_train_batch_size {self.per_device_train_batch_size} × "
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps} × {dp_size} data-parallel "
                f"rank(s) = {given['train_batch_size']}")
        if self.sync_sampling:
            sources["max_staleness"] = "the trainer's --sync_sampling (max_staleness 0)"
        if "temperature" in given and (self.preferred_sampling_params or {}).get("temperature") is not None:
            sources["temperature"] = f"the trainer's --preferred_sampling_params temperature {given['temperature']:g}"
        return sources

    def with_run_values(self, values: dict[str, Any]) -> TrainConfig:
        """This configuration with the values the run records (``Run.values``: only those some process was given)
        in place of the ones this trainer was not given (the batch size then replaces the per-device one's
        product); its own given values equal the run's (``Runs.agree``)."""
        given = self.run_values(dp_size=1)
        update = {key: value for key, value in values.items() if key not in given}
        if "train_batch_size" not in given:  # online, the default is the run's value or RunValues', not the product
            update.setdefault("train_batch_size", RunValues.model_fields["train_batch_size"].default)
        return self.model_copy(update=update)

    def resolved_train_batch_size(self, dp_size: int) -> int:
        """Samples per step over all ranks (see the module docstring)."""
        size = self.train_batch_size or self.per_device_train_batch_size * self.gradient_accumulation_steps * dp_size
        if size < dp_size:
            raise ValueError(f"train_batch_size {size} is smaller than the data-parallel size {dp_size}: every "
                             "rank needs at least one sample per step")
        return size
