"""The image side of a Qwen-VL model directory: which tokens stand for an image, how many, and its pixel inputs.

A Qwen-VL prompt marks each image ``<|vision_start|><|image_pad|>...<|image_pad|><|vision_end|>``: one
``<|image_pad|>`` per merged patch, ``t·h·w / merge²`` of them, where ``(t, h, w)`` is the image's patch grid after
the model's image processor resized it (to a multiple of ``patch · merge`` pixels each way, between its minimum and
maximum pixel counts). :meth:`VisionProcessor.expand` turns a prompt with one ``<|image_pad|>`` per image (what a
chat template renders) into that, and checks an already expanded one; samplers, ``agentrl engine`` and the trainer
all expand with it, so the ids the model saw are the ids stored and trained. The pixels come from the model's own
image processor (``AutoImageProcessor``: transformers' PIL processor where torchvision is absent, as here), so the
trainer rebuilds exactly the engine's pixel values from the stored image bytes.

``Qwen2_5_VLProcessor`` itself is not used: it insists on a video processor, which needs torchvision.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.vision.images import ImageError, LoadedImage

if TYPE_CHECKING:
    import torch

VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
"""Model types whose images ``agentrl`` serves and trains (the Qwen-VL family: one ``<|image_pad|>`` per merged
patch, multimodal rotary positions)."""


VISION_TOWER = re.compile(r"(^|\.)visual\.")
"""Names of a Qwen-VL model's vision tower parameters and modules (``model.visual.*``, also under PEFT's wrapper)."""


class VisionInputError(ValueError):
    """Images that do not fit the prompt or the model (counts, placeholders, a text-only model)."""


@dataclass(frozen=True)
class ImageInputs:
    """The model inputs of a prompt's images, in prompt order: ``pixel_values`` [patches, C·T·P·P] and
    ``image_grid_thw`` [images, 3] as the image processor makes them."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def grids(self) -> list[tuple[int, int, int]]:
        return [tuple(int(v) for v in row) for row in self.image_grid_thw.tolist()]


def model_type(path: str | Path) -> str | None:
    """``config.json``'s ``model_type`` of a model directory (None without one)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_vision_model(path: str | Path) -> bool:
    return model_type(path) in VISION_MODEL_TYPES


def model_class(kind: str | None) -> Any:
    """The transformers auto class of a model type: ``AutoModelForImageTextToText`` for :data:`VISION_MODEL_TYPES`
    (the model with its vision tower), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if kind in VISION_MODEL_TYPES else AutoModelForCausalLM


class VisionProcessor:
    """A Qwen-VL model directory's image tokens and image processor."""

    def __init__(self, path: str | Path):
        from transformers import AutoImageProcessor

        config = json.loads((Path(path) / "config.json").read_text())
        self.model_type: str = config["model_type"]
        if self.model_type not in VISION_MODEL_TYPES:
            raise VisionInputError(f"{path}: model type {self.model_type} takes no images (vision-language model "
                                   f"types: {', '.join(sorted(VISION_MODEL_TYPES))})")
        self.image_token_id: int = int(config["image_token_id"])
        self.vision_start_id: int = int(config["vision_start_token_id"])
        self.vision_end_id: int = int(config["vision_end_token_id"])
        self.placeholder_ids: frozenset[int] = frozenset(
            int(config[key]) for key in ("image_token_id", "video_token_id") if config.get(key) is not None)
        """The ids that stand for a picture's (or a video's) tokens: a prompt's only where a picture is given, so a
        generated one can be neither served again (its count fits no image) nor trained."""
        self.merge_size: int = int(config["vision_config"]["spatial_merge_size"])
        self.image_processor: Any = AutoImageProcessor.from_pretrained(str(path))

    @classmethod
    def of(cls, path: str | Path) -> VisionProcessor | None:
        """The processor of a vision-language model directory; None for a text model."""
        return cls(path) if is_vision_model(path) else None

    @property
    def placeholder(self) -> list[int]:
        """One image's ids before expansion (what the chat templates render)."""
        return [self.vision_start_id, self.image_token_id, self.vision_end_id]

    def inputs(self, images: list[LoadedImage]) -> ImageInputs:
        """Pixel values and patch grids of ``images`` (blocking: resizing and normalising)."""
        out = self.image_processor(images=[image.rgb for image in images], return_tensors="pt")
        return ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])

    def grid_tokens(self, grid: tuple[int, int, int]) -> int:
        """``<|image_pad|>`` tokens of an image of patch grid ``grid``."""
        t, h, w = grid
        return t * h * w // (self.merge_size ** 2)

    def image_tokens(self, image: LoadedImage) -> int:
        """``<|image_pad|>`` tokens of ``image``, from its size alone (the processor's own count, which vLLM uses
        too: no pixels are processed; equal to :meth:`grid_tokens` of its grid, tested)."""
        return self.image_processor.get_number_of_image_patches(image.height, image.width) // self.merge_size ** 2

    def expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """``ids`` with the ``i``-th run of ``<|image_pad|>`` made ``counts[i]`` long (the ``i``-th image's
        tokens): a run of one is expanded, a run of exactly that length kept; any other length, or a number of runs
        other than of images, is a :class:`VisionInputError`."""
        out: list[int] = []
        runs = 0
        i = 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                out.append(ids[i])
                i += 1
                continue
            end = i
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            if runs >= len(counts):
                raise VisionInputError(f"the prompt has more image placeholders than the {len(counts)} image(s) "
                                       f"given")
            wanted = counts[runs]
            if end - i not in (1, wanted):
                raise VisionInputError(f"image {runs}: its placeholder has {end - i} <|image_pad|> tokens; the "
                                       f"image takes {wanted} (or give one to expand)")
            out.extend([self.image_token_id] * wanted)
            runs += 1
            i = end
        if runs != len(counts):
            raise VisionInputError(f"{len(counts)} image(s) given but the prompt has {runs} image placeholder(s) "
                                   f"(<|vision_start|><|image_pad|><|vision_end|> per image)")
        return out


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The sha256 of every ``{"type": "image", "image": SHA256}`` part of chat ``messages``, in order (how
    AgentRL's conversations hold pictures; the chat templates render such a part as an image placeholder)."""
    return [part["image"] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]


def refuse_images(model_name: str, count: int) -> None:
    """The error for images sent to a text-only model."""
    if count:
        raise VisionInputError(f"{model_name} is a text-only model: it takes no images ({count} given); serve a "
                               f"vision-language model (model types {', '.join(sorted(VISION_MODEL_TYPES))})")


__all__ = ["ImageError", "ImageInputs", "VISION_MODEL_TYPES", "VisionInputError", "VisionProcessor",
           "is_vision_model", "message_images", "model_class", "model_type", "refuse_images"]
