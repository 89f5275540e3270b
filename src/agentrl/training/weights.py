"""Hugging Face weights in and out of the trainer: load pretrained (never a silent random init), export full.

Export gathers the full state dict to rank 0 (a collective: every rank calls it) and writes a plain Hugging Face
directory (config, safetensors, generation config, tokenizer) that transformers and SGLang load. The directory is
written under a temporary name and renamed when complete, so a reader never sees half a model.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.training import lora
from agentrl.training.dirs import replace_dir
from agentrl.training.parallel import ParallelState, materialize_from_main, shard_model
from agentrl.vision.processor import model_class, model_type

logger = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


PREPROCESSOR_FILE = "preprocessor_config.json"


class WeightsError(RuntimeError):
    """Pretrained weights are missing or do not fit the model."""


def load_pretrained(path: str | Path, *, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                    load_in_4bit: bool = False) -> nn.Module:
    """``AutoModelForCausalLM`` from ``path`` in fp32 with every weight loaded from it (``load_in_4bit``: the linear
    layers in bitsandbytes NF4 with double quantisation and bf16 compute, QLoRA's recipe; CUDA only).

    Raises ``WeightsError`` when a local directory holds no weight files, or when any parameter would be left at
    its random initialisation (missing or mismatched keys). A vision-language model (the Qwen-VL family) loads
    with its vision tower (``AutoModelForImageTextToText``).
    """
    local = Path(path)
    if local.exists():
        if not local.is_dir():
            raise WeightsError(f"model path {local} is not a directory")
        if not any(next(local.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            raise WeightsError(f"no weights in {local} (no *.safetensors or *.bin files): the trainer starts from "
                               "pretrained weights, never from a random initialisation")
    quantization = {}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        quantization = {"device_map": {"": torch.cuda.current_device()}, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)}
    try:
        model, info = model_class(model_type(path)).from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code, output_loading_info=True, **quantization)
    except OSError as error:
        raise WeightsError(f"cannot load the model {path}: {error}") from error
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        names = ", ".join(str(k) for k in (missing + mismatched)[:5])
        raise WeightsError(f"{path}: {len(missing)} missing and {len(mismatched)} mismatched weights (e.g. "
                           f"{names}): they would be randomly initialised")
    return model


def load_sharded(path: str | Path, parallel: ParallelState, *, bf16: bool, reshard_after_forward: bool = True,
                 rank0_loading: bool = True, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                 prepare: Callable[[nn.Module], None] | None = None,
                 transform: Callable[[nn.Module, bool], nn.Module] | None = None,
                 load_in_4bit: bool = False) -> nn.Module:
    """The pretrained model at ``path``, sharded over ``parallel`` (``shard_model``) and on its device.

    With several ranks and ``rank0_loading`` only rank 0 reads the weights into host memory: the others build the
    model on the meta device, shard it, and receive their shards by broadcast (``materialize_from_main``), so host
    memory holds one full copy per machine instead of one per rank. A load error on rank 0 is raised on every
    rank. ``prepare`` runs on the unsharded model (e.g. to enable gradient checkpointing), then ``transform``
    (e.g. LoRA adapters, ``agentrl.training.lora``) on every copy before sharding: ``transform(model, True)`` on
    the copy that holds the weights, ``transform(model, False)`` on a meta-device replica.
    """
    if not (parallel.distributed and rank0_loading):
        model = load_pretrained(path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                                load_in_4bit=load_in_4bit)
        if prepare is not None:
            prepare(model)
        if transform is not None:
            model = transform(model, True)
        if load_in_4bit:
            return model  # bitsandbytes placed it on the GPU; one process only
        shard_model(model, parallel, bf16=bf16, reshard_after_forward=reshard_after_forward)
        return model if parallel.distributed else model.to(parallel.device)
    source, failure = None, None
    if parallel.is_main:
        try:
            source = load_pretrained(path, attn_implementation=attn_implementation,
                                     trust_remote_code=trust_remote_code)
            if transform is not None:
                source = transform(source, True)
        except (WeightsError, ValueError) as error:
            failure = str(error)
    failure = parallel.broadcast_from_main(failure)
    if failure is not None:
        raise WeightsError(failure if parallel.is_main else f"rank 0 could not load the model: {failure}")
    config = parallel.broadcast_from_main(source.config if parallel.is_main else None)
    with torch.device("meta"):
        model = model_class(config.model_type).from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if source is not None:
        model.generation_config = source.generation_config
    if prepare is not None:
        prepare(model)
    if transform is not None:
        model = transform(model, False)
    shard_model(model, parallel, bf16=bf16, reshard_after_forward=reshard_after_forward)
    materialize_from_main(model, parallel, source)
    del source
    logger.info("rank 0 read the weights of %s; %d ranks received their shards by broadcast", path,
                parallel.world_size)
    return model


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer saved with the model, if any (published weights carry it so they are a complete model)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        logger.warning("no tokenizer in %s (%s): exported weights will not include one", path, error)
        return None


def full_state_dict(model: nn.Module, parallel: ParallelState, *,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (empty on the other ranks), gathered one tensor at a time;
    ``dtype``: floating tensors converted on their device before the copy to the CPU (on a GPU, a bf16 export
    moves half the bytes of an fp32 one and converts nothing on the CPU). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))  # names as saved
    state = {}
    for name, tensor in sharded.items():  # the same order on every rank
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if parallel.is_main:
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            state[name] = full.detach().to("cpu")
    return state


def export_pretrained(model: nn.Module, parallel: ParallelState, out_dir: Path, *, dtype: torch.dtype,
                      tokenizer: Any | None = None) -> None:
    """Write ``model`` as a Hugging Face directory ``out_dir`` (rank 0 writes; every rank must call it).

    The weights are saved through a meta-device copy of the model class, so the saved config names the real
    architecture even when ``model`` is wrapped by FSDP2. A model with LoRA adapters is saved merged
    (``lora.merge_state_dict``): a plain model of the base architecture. The adapters of a 4-bit base are merged
    into the base model's own full-precision weights instead (:func:`export_merged_from_base`).
    """
    adapted = lora.is_adapted(model)
    state = full_state_dict(model, parallel, dtype=None if adapted else dtype)  # adapters merge in full precision
    if parallel.is_main and adapted and getattr(model, "hf_quantizer", None) is not None:
        export_merged_from_base(model, state, out_dir, tokenizer=tokenizer)
    elif parallel.is_main:
        if adapted:
            state = {name: tensor.to(dtype) for name, tensor in lora.merge_state_dict(model, state).items()}
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with torch.device("meta"):
            shell = model_class(model.config.model_type).from_config(model.config, dtype=dtype)
        for tied, source in getattr(shell, "all_tied_weights_keys", {}).items():
            if source in state:  # gathered copies of tied weights no longer share storage: save the source once
                state.pop(tied, None)
        if getattr(model, "generation_config", None) is not None:
            shell.generation_config = model.generation_config
        shell.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        source = Path(getattr(model, "name_or_path", "") or ".") / PREPROCESSOR_FILE
        if source.is_file():  # a vision-language model's image processor: the export is a complete model
            shutil.copyfile(source, tmp / PREPROCESSOR_FILE)
        replace_dir(tmp, out_dir)
    parallel.barrier()


def export_merged_from_base(model: nn.Module, state: dict[str, torch.Tensor], out_dir: Path, *,
                            tokenizer: Any | None = None) -> None:
    """Write the adapters of ``model`` (full state dict ``state``) merged into the full-precision weights of the base
    model it was loaded from (``model.name_or_path``), with PEFT's ``merge_and_unload``: the weights of a 4-bit
    model are rounded, so merging into them would publish the rounding too."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.adapter-", dir=out_dir.parent) as adapter:
        config, weights = lora.adapter_files(model, state)
        lora.write_adapter(Path(adapter), config, {name: tensor.float() for name, tensor in weights.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(adapter)
        lora.merge_adapter_dir(adapter, out_dir, base_model=model.name_or_path)


def trainable_state_dict(model: nn.Module, parallel: ParallelState) -> dict[str, torch.Tensor]:
    """The trainable parameters (a LoRA model's adapters and saved modules) on rank 0's CPU, empty on the other
    ranks, gathered one at a time: the frozen base is never gathered. Every rank must call it."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, param in model.named_parameters():  # the same order on every rank
        if not param.requires_grad:
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if parallel.is_main:
            for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
                name = name.replace(wrapper, "")
            state[name] = full.detach().to("cpu", copy=True)
    return state


def export_adapter(model: nn.Module, parallel: ParallelState, out_dir: Path, *, tokenizer: Any | None = None) -> None:
    """Write the LoRA adapter of ``model`` as a PEFT adapter directory ``out_dir`` (fp32; rank 0 writes, every rank
    must call it), complete before it appears under its name. Only the adapters are gathered."""
    state = trainable_state_dict(model, parallel)
    if parallel.is_main:
        config, weights = lora.adapter_files(model, state)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        lora.write_adapter(tmp, config, {name: tensor.float() for name, tensor in weights.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out_dir)
    parallel.barrier()
