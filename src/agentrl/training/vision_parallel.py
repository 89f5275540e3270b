"""FSDP2 for a vision-language policy (the Qwen-VL family): its vision tower sharded per block, and run in every
pass on every rank.

FSDP2 ranks must make the same collectives in the same order: each sharded module all-gathers its parameters in
forward and reduce-scatters its gradients in backward. A pass whose rows have no picture (text-only samples, or the
empty pass that gives a rank as many passes as the others: ``batching.align_passes``) would skip the vision tower,
while another rank's pass with pictures runs it; the ranks would then wait on each other's collectives or sum the
wrong tensors. So in such a pass the tower forwards a blank picture of one merged patch right where a picture's
features join the sequence (after the token embedding) and adds 0 × its outputs to the embeddings: the same modules
run in the same order on every rank, with the same data flow for backward, and the blank picture contributes exactly
0 to every logit and gradient (verl does the same for Qwen2-VL). One process (nothing to match) runs no blank pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves  # transformers registers its ModelOutputs


def vision_language_model(model: nn.Module) -> nn.Module | None:
    """The module holding a Qwen-VL policy's ``visual`` tower and ``language_model`` as children
    (``Qwen2_5_VLModel``/``Qwen3VLModel``, also under PEFT's wrapper); None for a text model."""
    for module in model.modules():
        children = dict(module.named_children())
        if "visual" in children and "language_model" in children:
            return module
    return None


def vision_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a Qwen-VL policy's vision tower (``visual.blocks``); None for a text model."""
    vlm = vision_language_model(model)
    blocks = getattr(vlm.visual, "blocks", None) if vlm is not None else None
    return blocks if isinstance(blocks, nn.ModuleList) else None


def blank_picture(config: Any, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of the smallest picture a Qwen-VL vision tower takes: one frame of
    ``merge × merge`` patches (one merged patch, one ``<|image_pad|>``), all zeros."""
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    width = int(getattr(vision, "in_channels", 3)) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    return (torch.zeros(merge * merge, width, device=device),
            torch.tensor([[1, merge, merge]], dtype=torch.long, device=device))


class BlankPicturePass:
    """Runs the vision tower on a blank picture in every forward pass of ``model`` given no ``pixel_values``
    (see the module docstring). Install once per sharded model; the hooks stay for its lifetime."""

    def __init__(self, model: nn.Module):
        vlm = vision_language_model(model)
        if vlm is None:
            raise ValueError(f"{type(model).__name__} has no vision tower (a 'visual' beside a 'language_model')")
        self.vlm = vlm
        self._blank_needed = False
        vlm.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        vlm.get_input_embeddings().register_forward_hook(self._after_embedding)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self._blank_needed = kwargs.get("pixel_values") is None and kwargs.get("pixel_values_videos") is None

    def _after_embedding(self, module: nn.Module, args: tuple, embeddings: torch.Tensor) -> torch.Tensor | None:
        if not self._blank_needed:
            return None
        self._blank_needed = False  # once per forward: the embedding may be called again (placeholder masks)
        pixel_values, grid = blank_picture(self.vlm.config, embeddings.device)
        features = self.vlm.get_image_features(pixel_values, grid)
        # every floating output (Qwen3-VL's deepstack features too) takes part in backward
        total = sum(t.float().sum() for t in tree_leaves(features) if torch.is_tensor(t) and t.is_floating_point())
        return embeddings + 0.0 * total.to(embeddings.dtype)
