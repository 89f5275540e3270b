"""LoRA on the trainer's model (PEFT): put adapters in, and take them out as an adapter or as merged weights.

* :func:`inject_lora` puts PEFT LoRA layers into the Hugging Face model in place
  (``peft.inject_adapter_in_model``): the model keeps its class and module tree, so sharding (FSDP2 shards base
  and adapters alike), logprobs and export see the same modules. Only the adapters (and the ``modules_to_save``
  copies) stay trainable, so only they get gradients and AdamW state. It is applied before sharding, to the model
  that holds the weights and to the meta-device replicas alike, so their parameter names match.
* :func:`adapter_files` turns the model's full state dict into a PEFT adapter directory's content
  (``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names), which
  ``PeftModel.from_pretrained``, SGLang's ``/load_lora_adapter`` and :func:`load_adapter_weights` read.
* :func:`merge_state_dict` turns the same state dict into the base architecture's, with ``W + scale · B A`` for
  every adapted layer and the ``modules_to_save`` copies in place of the originals: what a LoRA run publishes to
  servers that cannot load adapters, and its ``final`` model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.training.dirs import replace_dir

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SAVED_PREFIX = "base_model.model."
"""PEFT saves adapter keys under the ``PeftModel`` wrapper's prefix; our models are not wrapped."""


class LoraError(ValueError):
    """The LoRA settings do not fit the model, or an adapter directory cannot be used."""


def lora_config(*, r: int, alpha: float, dropout: float, target_modules: list[str] | None,
                modules_to_save: list[str] | None, base_model: str | None = None):
    """PEFT's ``LoraConfig`` for the trainer's flags (``all-linear`` as the only target means every linear layer
    but the output head; no targets: PEFT's default for the architecture, e.g. q_proj and v_proj for Llama)."""
    from peft import LoraConfig

    targets: list[str] | str | None = target_modules
    if target_modules == ["all-linear"]:
        targets = "all-linear"
    elif target_modules and "all-linear" in target_modules:
        raise LoraError("--lora_target_modules: 'all-linear' stands alone (it means every linear layer but the "
                        f"output head); got {' '.join(target_modules)}")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      modules_to_save=modules_to_save or None, task_type="CAUSAL_LM", bias="none",
                      base_model_name_or_path=base_model)


def inject_lora(model: nn.Module, config: Any) -> nn.Module:
    """Put LoRA layers described by ``config`` into ``model`` (in place; returned for convenience) and freeze
    everything else. Raises ``LoraError`` when the targets match nothing or would break tied embeddings."""
    from peft import inject_adapter_in_model

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    saved = set(config.modules_to_save or [])
    if tied and saved & {"lm_head", "embed_tokens"}:
        raise LoraError(f"--lora_modules_to_save {' '.join(sorted(saved))}: this model ties its output head to its "
                        "input embeddings, so training a copy of one would untie them; leave them out (or train "
                        "the whole model without --use_peft)")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as error:
        raise LoraError(f"--lora_target_modules: {error}") from error
    return model


def is_adapted(model: nn.Module) -> bool:
    return getattr(model, "peft_config", None) is not None


def unservable_targets(model: nn.Module) -> str | None:
    """Why an inference server could not serve this model's adapter (``--lora_publish adapter``), or None: it serves
    LoRA pairs of Linear layers only (not an embedding or a GPT-2 Conv1D), and of a vision-language model's language
    model only (an engine encodes a picture once for every adapter)."""
    from peft.tuners.lora import LoraLayer

    from agentrl.vision.processor import VISION_TOWER

    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    if odd := [name for name, module in adapted if not isinstance(module.get_base_layer(), nn.Linear)]:
        return (f"inference servers serve adapters of Linear layers only, and {', '.join(odd[:3])} is not one: leave "
                f"it out of --lora_target_modules or publish merged weights")
    if tower := [name for name, _ in adapted if VISION_TOWER.search(name)]:
        return (f"an engine serves adapters of the language model only (it encodes a picture once for every "
                f"adapter), and this one adapts the vision tower's {', '.join(tower[:3])}: name the language "
                f"model's layers in --lora_target_modules (e.g. q_proj v_proj) or publish merged weights")
    return None


def trainable_summary(model: nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{trainable:,} of {total:,} parameters trainable ({100 * trainable / max(total, 1):.2f}%)"


def _scales(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """Adapted module name -> (scaling, fan_in_fan_out) of the adapter, for Linear and Embedding LoRA layers."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.scaling:
            found[name] = (float(module.scaling[ADAPTER_NAME]), bool(getattr(module, "fan_in_fan_out", False)))
    return found


def merge_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base architecture's state dict from the full state dict ``state`` of the adapted ``model``: every
    adapted weight is ``W + scale · B A`` (computed in fp32), every ``modules_to_save`` copy replaces its
    original, and weights tied to a merged one (an output head tied to the input embeddings) follow it."""
    merged: dict[str, torch.Tensor] = {}
    marker = f".modules_to_save.{ADAPTER_NAME}."
    for key, tensor in state.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        if marker in key:
            merged[key.replace(marker, ".")] = tensor
        elif ".modules_to_save." not in key:
            merged[key.replace(".base_layer.", ".")] = tensor
    for name, (scale, fan_in_fan_out) in _scales(model).items():
        if f"{name}.lora_A.{ADAPTER_NAME}.weight" in state:
            a, b = state[f"{name}.lora_A.{ADAPTER_NAME}.weight"], state[f"{name}.lora_B.{ADAPTER_NAME}.weight"]
            delta = b.float() @ a.float()
            delta = delta.T if fan_in_fan_out else delta
        else:  # an Embedding: A is (r, vocab), B is (dim, r)
            a, b = state[f"{name}.lora_embedding_A.{ADAPTER_NAME}"], state[f"{name}.lora_embedding_B.{ADAPTER_NAME}"]
            delta = (b.float() @ a.float()).T
        key = f"{name}.weight"
        merged[key] = (merged[key].float() + scale * delta).to(merged[key].dtype)
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if tied in merged and source in merged:  # e.g. an output head tied to adapted input embeddings
            merged[tied] = merged[source]
    return merged


def adapter_files(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, adapter_weights)`` of a PEFT adapter directory, from the full state dict ``state`` of the
    adapted ``model``."""
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER_NAME)
    config = model.peft_config[ADAPTER_NAME].to_dict()
    for key, value in list(config.items()):
        if isinstance(value, set):
            config[key] = sorted(value)
    config["target_modules"] = _short_names(model, config["target_modules"])
    return config, {SAVED_PREFIX + key: tensor.contiguous() for key, tensor in weights.items()}


def _short_names(model: nn.Module, targets: Any) -> Any:
    """Module names as most adapter configs carry them (``q_proj``, not ``model.layers.0.self_attn.q_proj``; SGLang
    reads them that way), when the short names select exactly the same modules."""
    if not isinstance(targets, list) or not targets:
        return targets
    from peft.tuners.lora import LoraLayer

    short = {name.rsplit(".", 1)[-1] for name in targets}
    selected = {name for name, module in model.named_modules()
                if name.rsplit(".", 1)[-1] in short and isinstance(module, LoraLayer)}
    everything = {name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in short}
    return sorted(short) if selected == everything == set(targets) else targets


def write_adapter(directory: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(path: str | Path):
    """The ``LoraConfig`` saved in an adapter directory."""
    from peft import LoraConfig

    file = Path(path) / ADAPTER_CONFIG
    try:
        return LoraConfig.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as error:
        raise LoraError(f"{file}: not a readable LoRA adapter config ({error})") from error


def load_adapter_weights(model: nn.Module, path: str | Path) -> None:
    """Load the adapter weights saved in ``path`` into the adapted ``model`` (unsharded); every adapter parameter
    must be in the file."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(path) / ADAPTER_WEIGHTS
    try:
        saved = load_file(str(file))
    except (OSError, ValueError) as error:
        raise LoraError(f"{file}: cannot read the adapter weights ({error})") from error
    weights = {key.removeprefix(SAVED_PREFIX): tensor for key, tensor in saved.items()}
    result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    missing = [key for key in result.missing_keys if ".lora_" in key or ".modules_to_save." in key]
    if missing or result.unexpected_keys:
        raise LoraError(f"{file}: does not fit the model's adapters ({len(missing)} missing, e.g. "
                        f"{missing[:2]}; {len(result.unexpected_keys)} unexpected, e.g. {result.unexpected_keys[:2]})")


def adapter_transform(config: Any, resume_from: Path | None, *, quantized: bool = False,
                      gradient_checkpointing: bool = False) -> Callable[[nn.Module, bool], nn.Module]:
    """What ``weights.load_sharded`` applies to the loaded model before sharding: PEFT's k-bit preparation for a
    ``quantized`` (4-bit) base, the adapters, and, on the copy that holds real weights, a checkpoint's adapter
    weights to resume. With ``gradient_checkpointing`` the frozen embeddings' output carries gradients to the
    adapters."""

    def transform(model: nn.Module, holds_weights: bool) -> nn.Module:
        if quantized:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, gradient_checkpointing)
        inject_lora(model, config)
        if holds_weights and resume_from is not None:
            load_adapter_weights(model, resume_from)
        if gradient_checkpointing:
            model.enable_input_require_grads()
        return model

    return transform


def merge_adapter_dir(adapter: str | Path, out: Path, base_model: str | Path | None = None) -> Path:
    """Write ``adapter`` (a PEFT adapter directory, e.g. a LoRA checkpoint) merged into its base model as a plain
    Hugging Face directory ``out`` (with the adapter's tokenizer if it has one, else the base's), by PEFT's own
    ``merge_and_unload``; the base is ``base_model``, else the one named in the adapter's config. Returns the base
    used."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from agentrl.vision.processor import model_class, model_type

    adapter = Path(adapter)
    if not is_adapter_dir(adapter):
        raise LoraError(f"{adapter}: not a LoRA adapter directory (no {ADAPTER_CONFIG})")
    base = Path(base_model or read_adapter_config(adapter).base_model_name_or_path or "")
    if not base_model and not (base / "config.json").is_file():
        raise LoraError(f"{adapter / ADAPTER_CONFIG}: its base model {str(base) or '(none)'} is not a local model "
                        "directory: name it with --base_model")
    try:
        model = model_class(model_type(base)).from_pretrained(str(base), dtype=torch.float32)
    except OSError as error:
        raise LoraError(f"cannot load the base model {base}: {error}") from error
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = out.with_name(f".{out.name}.tmp")
    merged.save_pretrained(tmp, safe_serialization=True)
    source = adapter if (adapter / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(tmp)
    replace_dir(tmp, out)
    return base
