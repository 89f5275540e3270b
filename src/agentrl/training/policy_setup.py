"""What a trainer rank trains: the policy (full, LoRA or QLoRA), the reference model, AdamW and the learning-rate
schedule, built from the trainer's configuration."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from agentrl.training import lora
from agentrl.training.config import TrainConfig
from agentrl.training.errors import TrainerError
from agentrl.training.logprobs import shared_prefix_unsupported
from agentrl.training.parallel import ParallelState
from agentrl.training.prefix_tree import MIN_SHARED_TOKENS
from agentrl.training.vision_parallel import vision_language_model
from agentrl.training.weights import load_sharded
from agentrl.vision.processor import VISION_TOWER, VisionProcessor

logger = logging.getLogger(__name__)

SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def check_4bit(parallel: ParallelState) -> None:
    """``--load_in_4bit`` needs one CUDA process and bitsandbytes: :class:`TrainerError` otherwise."""
    if parallel.device.type != "cuda":
        raise TrainerError(f"--load_in_4bit needs a CUDA GPU (bitsandbytes 4-bit kernels); this trainer runs "
                           f"on {parallel.device}: drop --load_in_4bit (LoRA alone works on any device)")
    if parallel.distributed:
        raise TrainerError("--load_in_4bit works in one process only (FSDP2 cannot shard bitsandbytes "
                           "weights): launch a single process, or drop --load_in_4bit")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise TrainerError(f"--load_in_4bit needs bitsandbytes: pip install bitsandbytes ({error})") from None


def base_model_path(cfg: TrainConfig) -> str:
    """``--model_name_or_path``, else the embedded model's directory."""
    if cfg.model_name_or_path:
        return cfg.model_name_or_path
    from agentrl.inference.embedded_model import default_model_path

    return str(default_model_path())


def lora_settings(cfg: TrainConfig, resume: Path | None, base_path: str) -> Any:
    """The LoRA settings of this run (None: full fine-tuning). A resume must use the checkpoint's own."""
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


def build_policy(cfg: TrainConfig, parallel: ParallelState, path: str | Path, resume: Path | None,
                 lora_config: Any, bf16: bool) -> torch.nn.Module:
    """The policy from ``path`` (sharded over the ranks), with its LoRA adapter when ``lora_config`` is set."""
    def prepare(model: torch.nn.Module) -> None:
        model.config.use_cache = False
        if cfg.freeze_vision_tower:
            freeze_vision_tower(model)
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable()

    transform = None if lora_config is None else lora.adapter_transform(
        lora_config, resume, quantized=cfg.load_in_4bit, gradient_checkpointing=cfg.gradient_checkpointing)
    model = _load(cfg, parallel, path, bf16, prepare, transform, load_in_4bit=cfg.load_in_4bit)
    if lora_config is not None:
        logger.info("LoRA r=%d alpha=%g on %s: %s", lora_config.r, lora_config.lora_alpha,
                    " ".join(sorted(model.peft_config[lora.ADAPTER_NAME].target_modules)),
                    lora.trainable_summary(model))
        if cfg.lora_publish == "adapter" and (problem := lora.unservable_targets(model)):
            raise TrainerError(f"--lora_publish adapter: {problem}")
    return model


def vision_setup(cfg: TrainConfig, path: str | Path) -> VisionProcessor | None:
    """A vision-language policy's image processor (None for a text model); :class:`TrainerError` for a vision flag
    that does not fit the model. Over several ranks FSDP2 shards the tower and runs it in every pass
    (``agentrl.training.vision_parallel``)."""
    vision = VisionProcessor.of(path)
    if vision is None:
        for flag, given in (("freeze_vision_tower", cfg.freeze_vision_tower),
                            ("vision_learning_rate", cfg.vision_learning_rate is not None)):
            if given:
                raise TrainerError(f"--{flag}: {path} is a text model (it has no vision tower)")
    elif cfg.freeze_vision_tower and cfg.vision_learning_rate is not None:
        raise TrainerError("--vision_learning_rate: the vision tower is frozen (--freeze_vision_tower)")
    return vision


def freeze_vision_tower(model: torch.nn.Module) -> None:
    """``--freeze_vision_tower``: the tower's parameters take no gradient (before sharding, so FSDP2 neither
    computes nor reduces any)."""
    vlm = vision_language_model(model)
    if vlm is None:
        raise TrainerError(f"--freeze_vision_tower: cannot find the vision tower (model.visual) of "
                           f"{type(model).__name__}")
    vlm.visual.requires_grad_(False)
    logger.info("vision tower frozen: %d parameters not trained", sum(p.numel() for p in vlm.visual.parameters()))


def build_ref_model(cfg: TrainConfig, parallel: ParallelState, path: str | Path, bf16: bool) -> torch.nn.Module:
    """The frozen reference model of the KL term."""
    return _load(cfg, parallel, path, bf16, lambda model: model.requires_grad_(False).eval())


def _load(cfg: TrainConfig, parallel: ParallelState, path: str | Path, bf16: bool, prepare, transform=None,
          load_in_4bit: bool = False) -> torch.nn.Module:
    return load_sharded(path, parallel, bf16=bf16, reshard_after_forward=cfg.reshard_after_forward,
                        rank0_loading=cfg.cpu_ram_efficient_loading, attn_implementation=cfg.attention_implementation,
                        trust_remote_code=cfg.trust_remote_code, prepare=prepare, transform=transform,
                        load_in_4bit=load_in_4bit)


def shared_prefix_min(cfg: TrainConfig, model: torch.nn.Module, ref_model: torch.nn.Module | None) -> int | None:
    """The shortest token prefix forwarded once for the samples sharing it (None: every sample alone)."""
    if not cfg.share_prefix:
        return None
    reason = next(filter(None, (shared_prefix_unsupported(m) for m in (model, ref_model) if m)), None)
    if reason is not None:
        logger.warning("shared prefixes are forwarded once per sample: %s", reason)
        return None
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        logger.info("dropout is on: a shared prefix gets one dropout mask per micro-batch instead of one per "
                    "sample (the same expected gradient; --lora_dropout 0 makes it exact)")
    return MIN_SHARED_TOKENS


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only; a vision tower's parameters at ``--vision_learning_rate`` if set
    (the schedule scales every group alike; the first group's rate is the one logged)."""
    tower = {id(p) for name, p in model.named_parameters() if VISION_TOWER.search(name)} \
        if cfg.vision_learning_rate is not None else set()
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = []
    for rate, params in ((cfg.learning_rate, [p for p in trained if id(p) not in tower]),
                         (cfg.vision_learning_rate, [p for p in trained if id(p) in tower])):
        groups += [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr": rate},
                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": rate}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    """The learning-rate schedule (``--lr_scheduler_type``, ``--num_warmup_steps``)."""
    from transformers import get_scheduler

    return get_scheduler(SCHEDULERS[cfg.lr_scheduler_type], optimizer, num_warmup_steps=cfg.num_warmup_steps,
                         num_training_steps=cfg.max_steps if cfg.max_steps > 0 else None)
