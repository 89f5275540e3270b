"""The images of a micro-batch, for a vision-language policy: rebuilt from the stored pictures with the model's own
image processor, in the order of the forward pass's rows.

Each merged sample names its images (``MergedSample.images``: one per ``<|image_pad|>`` run of its ids, in order).
:meth:`StepImages.batch` turns the images of a micro-batch's rows into the model's ``pixel_values`` and
``image_grid_thw`` (concatenated in row order, as transformers' Qwen-VL forward takes them, its own
``get_rope_index`` giving each row its multimodal positions); ``mm_token_type_ids`` is 1 on the rows' image tokens.
The pixels are the ones ``agentrl engine`` computed from the same bytes (:class:`~agentrl.vision.processor
.VisionProcessor` on both sides), so the trainer's logprobs are of what the engine saw.

Samples with images are forwarded one per row (no shared-prefix packing: its explicit positions are 1-D, a Qwen-VL
model's are 3-D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentrl.vision.images import LoadedImage
from agentrl.vision.processor import VisionProcessor


@dataclass(frozen=True)
class VisionBatch:
    """The pixel inputs of a forward pass's rows (all rows' images, in row order)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_token_id: int

    def to(self, device: torch.device | str) -> VisionBatch:
        return VisionBatch(self.pixel_values.to(device), self.image_grid_thw.to(device), self.image_token_id)

    def model_kwargs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """What the model's forward takes besides ``input_ids`` (the rows the pass forwards)."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw,
                "mm_token_type_ids": (input_ids == self.image_token_id).int()}


@dataclass
class StepImages:
    """A step's pictures (by sha256) and the policy's image processor."""

    processor: VisionProcessor
    pictures: dict[str, LoadedImage]

    def batch(self, rows: list[list[str]]) -> VisionBatch | None:
        """The pixel inputs of rows whose images are ``rows`` (None when no row has one)."""
        ids = [sha256 for row in rows for sha256 in row]
        if not ids:
            return None
        inputs = self.processor.inputs([self.pictures[sha256] for sha256 in ids])
        return VisionBatch(inputs.pixel_values, inputs.image_grid_thw, self.processor.image_token_id)
