"""LoRA adapters served next to the base model: loaded at run time, chosen per request (SGLang's multi-LoRA).

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, as ``agentrl train
--use_peft`` and PEFT's ``save_pretrained`` write it). Its ``lora_A``/``lora_B`` pairs stay separate from the base
weights: a forward hook on each adapted ``nn.Linear`` adds ``scale · (x Aᵀ) Bᵀ`` to the output rows of the tokens
whose request named that adapter, so one batch can mix requests of several adapters and of the base model.

Requests are given their adapter with :meth:`ServedAdapters.assign`; the rows of a forward pass are given by
:meth:`ServedAdapters.route` (each request's id and token count, in batch order). Adding or removing adapters must
happen between two forward passes (the batcher pauses its loop). What SGLang refuses, this refuses too: DoRA, adapters
that add tokens or train whole modules (``modules_to_save``), adapters of non-Linear layers. A vision-language
model's adapters adapt its language model only: its vision tower encodes a picture once for all requests (the
embedding cache is keyed by the picture alone), so an adapter of a tower layer is refused."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from agentrl.vision.processor import VISION_TOWER

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter directory cannot be served with this model (the message says why)."""


@dataclass(frozen=True)
class LoRAPair:
    """One adapted layer: ``A`` [r, in], ``B`` [out, r] and the scale ``alpha / r`` (``alpha / sqrt(r)``: rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    layers: dict[str, LoRAPair]  # module name in the served model -> its pair


def read_adapter(name: str, path: str | Path, model: nn.Module) -> Adapter:
    """Read a PEFT LoRA directory and check it against ``model``'s layers; :class:`AdapterError` if it cannot be
    served (missing files, DoRA, saved modules, unknown or non-Linear layers, wrong shapes)."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise AdapterError(f"{directory} is not a PEFT adapter directory (no {CONFIG_FILE})")
    if not (directory / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE}")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{directory}: peft_type {config.get('peft_type')!r} is not LORA")
    for field, why in (("use_dora", "DoRA adapters"), ("modules_to_save", "adapters that save whole modules"),
                       ("rank_pattern", "per-layer ranks"), ("alpha_pattern", "per-layer alphas")):
        if config.get(field):
            raise AdapterError(f"{directory}: {why} ({field}) cannot be served; publish merged weights instead")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    tensors = load_file(str(directory / WEIGHTS_FILE))
    modules = dict(model.named_modules())
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    layers: dict[str, LoRAPair] = {}
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise AdapterError(f"{directory}: tensor {key} is not a LoRA A/B weight of a Linear layer")
            continue
        module_name = key[:-len(".lora_A.weight")].removeprefix(_KEY_PREFIX)
        if VISION_TOWER.search(module_name):
            raise AdapterError(f"{directory}: adapted layer {module_name} is in the vision tower, which the engine "
                               f"runs once per picture for every adapter: adapt the language model only, or "
                               f"publish merged weights")
        module = modules.get(module_name)
        if not isinstance(module, nn.Linear):
            kind = "not in the model" if module is None else f"a {type(module).__name__}, not a Linear layer"
            raise AdapterError(f"{directory}: adapted layer {module_name} is {kind}")
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise AdapterError(f"{directory}: {key} has no {b_key}")
        a, b = tensors[key], tensors[b_key]
        if fan_in_fan_out:
            a, b = a.T, b.T
        expected = ((rank, module.in_features), (module.out_features, rank))
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise AdapterError(f"{directory}: {module_name} has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                               f"{expected[0]} and {expected[1]} (another base model?)")
        layers[module_name] = LoRAPair(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), scale)
    if not layers:
        raise AdapterError(f"{directory}: no LoRA weights in {WEIGHTS_FILE}")
    return Adapter(name=name, path=str(path), layers=layers)


class ServedAdapters:
    """The adapters of one served model and the per-forward routing of token rows to them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._adapter_of: dict[str, str] = {}  # request id -> adapter name (the base model's requests are absent)
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._rows: list[tuple[Adapter, slice | torch.Tensor]] = []  # routing of the current forward pass

    def add(self, adapter: Adapter) -> None:
        """Serve ``adapter`` (between two forward passes)."""
        if adapter.name in self.adapters:
            raise AdapterError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        self.adapters[adapter.name] = adapter
        modules = dict(self.model.named_modules())
        for name in adapter.layers.keys() - self._hooks.keys():
            self._hooks[name] = modules[name].register_forward_hook(self._hook(name))

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` (between two forward passes); layers no adapter uses lose their hook."""
        self.adapters.pop(name)
        self._rows = []  # the next forward pass routes again; none may point at a removed adapter
        used = set().union(*(a.layers.keys() for a in self.adapters.values()))
        for layer in self._hooks.keys() - used:
            self._hooks.pop(layer).remove()

    def assign(self, request_id: str, name: str) -> None:
        """Generate request ``request_id`` with adapter ``name`` (from any thread, before the request is added)."""
        self._adapter_of[request_id] = name

    def release(self, request_id: str) -> None:
        self._adapter_of.pop(request_id, None)

    def route(self, requests: Sequence[tuple[str, int]]) -> None:
        """Set the routing of the next forward pass: ``(request id, tokens)`` per request, in batch order."""
        self._rows = []
        if not self.adapters:
            return
        names = [self._adapter_of.get(request_id) for request_id, _ in requests]
        if names and all(name == names[0] for name in names):  # the common case: one adapter for the whole batch
            if names[0] is not None:
                self._rows = [(self.adapters[names[0]], slice(None))]
            return
        rows: dict[str, list[int]] = {}
        start = 0
        for name, (_, count) in zip(names, requests, strict=True):
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + count))
            start += count
        self._rows = [(self.adapters[name], torch.tensor(index)) for name, index in rows.items()]

    def _hook(self, layer: str):
        def add_lora(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]  # [1, tokens, in]: the batcher packs every request into one row
            for adapter, rows in self._rows:
                pair = adapter.layers.get(layer)
                if pair is None:
                    continue
                if isinstance(rows, slice):
                    output = output + pair.scale * ((x @ pair.a.T) @ pair.b.T)
                else:
                    delta = pair.scale * ((x[:, rows] @ pair.a.T) @ pair.b.T)
                    output = output.index_add(1, rows.to(output.device), delta)
            return output

        return add_lora
