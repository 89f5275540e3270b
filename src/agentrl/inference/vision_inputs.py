"""Images in ``agentrl engine``: a request's vision prompt, and the inputs of a batching step that holds one.

At admission (:meth:`VisionEncoder.prompt`, on a worker thread) a request's images are turned into its
:class:`VisionPrompt`: the prompt's ``<|image_pad|>`` runs expanded to the images' token counts
(:meth:`~agentrl.vision.processor.VisionProcessor.expand`), each image's patch grid and embeddings from the image
processor and the vision tower (kept per image sha256 and weights in an LRU of :data:`EMBEDDING_CACHE_BYTES`: a
trajectory's later turns send the same pictures again, and cost neither pixels nor tower), the prompt's
multimodal rotary positions from the model's own ``get_rope_index`` and the offset ``delta`` of the positions
after it. The ids the batcher sees have each image's tokens replaced by that
image's *pad id*, ``vocab_size + sha256 mod 2**30`` (SGLang's ``pad_value``): the prefix cache's block hashes then
tell two images apart, and a later turn with the same picture reuses its cached blocks. The ids the engine
validates, reports and returns are the real ones.

In a step whose requests include one with a vision prompt (:meth:`VisionEncoder.step_logits`) the language model
runs on embeddings instead of ids: token embeddings, with the rows of image tokens replaced by the image's, and
positions ``[3, tokens]`` taken from the prompt's rotary table (``prompt position + delta`` after the prompt, for
the generated tokens); Qwen3-VL's deepstack features are added in its first layers at the same rows, as
transformers' forward does. Every other step is the text path unchanged.

A weight swap waits for an encoding in progress (:attr:`VisionEncoder.lock`) and empties the embedding cache
(:meth:`VisionEncoder.forget`); a prompt encoded before the swap keeps its embeddings, as its KV cache does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from agentrl.vision.images import LoadedImage
from agentrl.vision.processor import VisionProcessor

EMBEDDING_CACHE_BYTES = 256 * 1024 * 1024
"""The vision-tower outputs the engine keeps for images it may see again (least recently used dropped first)."""
PAD_ID_RANGE = 2 ** 30
"""Pad ids are ``vocab_size + (int(sha256) mod PAD_ID_RANGE)``: beyond the vocabulary, inside the batcher's int32."""


Features = tuple[tuple[int, int, int], torch.Tensor, tuple[torch.Tensor, ...]]
"""An image's patch grid, embeddings [tokens, hidden] and deepstack features (Qwen3-VL; else empty)."""


def _nbytes(features: Features) -> int:
    _, embeds, layers = features
    return sum(t.numel() * t.element_size() for t in (embeds, *layers))


@dataclass(frozen=True)
class VisionPrompt:
    """One request's prompt with images, ready for the batcher."""

    ids: list[int]  # the real ids, image tokens expanded
    cache_ids: list[int]  # the ids the batcher and its prefix cache see: image tokens as their image's pad id
    image_rows: torch.Tensor  # [prompt] row of ``embeds`` for each image token, -1 for text
    embeds: torch.Tensor  # [image tokens, hidden] in prompt order
    deepstack: tuple[torch.Tensor, ...]  # Qwen3-VL: per deepstack layer, [image tokens, hidden]; else empty
    mrope: torch.Tensor  # [3, prompt] rotary positions (temporal, height, width)
    delta: int  # a generated token at sequence position p has rotary position p + delta on all three axes

    @property
    def length(self) -> int:
        return len(self.ids)


class VisionEncoder:
    """The served model's vision side: prompts, the embedding cache and the requests' prompts by request id."""

    def __init__(self, model: torch.nn.Module, processor: VisionProcessor):
        self.model = model
        self.processor = processor
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.deepstack = processor.model_type == "qwen3_vl"
        self.lock = threading.Lock()  # an encoding and a weight swap never overlap
        self.prompts: dict[str, VisionPrompt] = {}  # requests being generated, by batcher request id
        self._cache: OrderedDict[str, Features] = OrderedDict()
        self._cache_bytes = 0

    # ---------------------------------------------------------------------------------------------- admission

    def prompt(self, ids: list[int], images: list[LoadedImage]) -> VisionPrompt:
        """The vision prompt of ``ids`` with ``images`` (blocking: the pixels and the vision tower of the images
        not cached; a later turn re-sending its pictures costs neither)."""
        ids = self.processor.expand(ids, [self.processor.image_tokens(image) for image in images])
        with self.lock, torch.no_grad():
            features = self._features(images)
            device = self.model.device
            ids_tensor = torch.tensor([ids], device=device)
            token_types = (ids_tensor == self.processor.image_token_id).int()
            grids = torch.tensor([grid for grid, _, _ in features], device=device)
            positions, delta = self.model.model.get_rope_index(ids_tensor, token_types, image_grid_thw=grids)
        embeds = torch.cat([embed for _, embed, _ in features])
        deepstack = tuple(torch.cat([layers[k] for _, _, layers in features]) for k in range(len(features[0][2])))
        is_image = torch.tensor(ids) == self.processor.image_token_id
        image_rows = torch.full((len(ids),), -1, dtype=torch.long)
        image_rows[is_image] = torch.arange(int(is_image.sum()))
        cache_ids, image = list(ids), 0
        for i, token in enumerate(ids):
            if token == self.processor.image_token_id:
                if i == 0 or ids[i - 1] != self.processor.image_token_id:  # a new run: the next image
                    pad = self.vocab_size + int(images[image].sha256, 16) % PAD_ID_RANGE
                    image += 1
                cache_ids[i] = pad
        return VisionPrompt(ids=ids, cache_ids=cache_ids, image_rows=image_rows.to(device), embeds=embeds,
                            deepstack=deepstack, mrope=positions[:, 0].to(device), delta=int(delta.reshape(-1)[0]))

    def _features(self, images: list[LoadedImage]) -> list[Features]:
        """Each image's patch grid and embeddings (and deepstack features): from the cache, else the image
        processor and the vision tower (one call for all the images not cached). Its token count is checked against
        the grid (the sampler counted it from the size)."""
        out: list[Features | None] = []
        missing: list[int] = []
        for i, image in enumerate(images):
            cached = self._cache.get(image.sha256)
            if cached is not None:
                self._cache.move_to_end(image.sha256)
            else:
                missing.append(i)
            out.append(cached)
        if missing:
            inputs = self.processor.inputs([images[i] for i in missing])
            device = self.model.device
            encoded = self.model.model.get_image_features(inputs.pixel_values.to(device),
                                                          inputs.image_grid_thw.to(device), return_dict=True)
            layers = getattr(encoded, "deepstack_features", None) or []
            for j, (i, grid) in enumerate(zip(missing, inputs.grids(), strict=True)):
                features = (grid, encoded.pooler_output[j], tuple(layer[j] for layer in layers))
                out[i] = features
                self._remember(images[i].sha256, features)
        return out  # type: ignore[return-value]

    def _remember(self, sha256: str, features: Features) -> None:
        size = _nbytes(features)
        if sha256 in self._cache or size > EMBEDDING_CACHE_BYTES:
            return
        self._cache[sha256] = features
        self._cache_bytes += size
        while self._cache_bytes > EMBEDDING_CACHE_BYTES:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= _nbytes(dropped)

    def forget(self) -> None:
        """Drop the cached embeddings (new weights)."""
        self._cache.clear()
        self._cache_bytes = 0

    # -------------------------------------------------------------------------------------------------- steps

    def step_logits(self, model: torch.nn.Module, batch: dict, requests: list[tuple[str, int]]) -> torch.Tensor | None:
        """The step's logits ``[1, tokens, vocab]`` when one of its ``(request id, query tokens)`` has a vision
        prompt, or a pad id is among its tokens (a request cancelled while its prompt is computed: its prompt is
        gone, its rows get token 0's embedding, its output is dropped); None otherwise (the text path serves it)."""
        spans, offset = [], 0
        for request_id, tokens in requests:
            prompt = self.prompts.get(request_id)
            if prompt is not None:
                spans.append((offset, tokens, prompt))
            offset += tokens
        ids, positions = batch["input_ids"][0], batch["position_ids"][0].long()
        if not spans and not bool((ids >= self.vocab_size).any()):
            return None
        embeds = model.get_input_embeddings()(torch.where(ids < self.vocab_size, ids, 0).long())
        rotary = positions.expand(3, -1).clone()
        visual = torch.zeros_like(positions, dtype=torch.bool)
        deepstack_rows: list[tuple[VisionPrompt, torch.Tensor]] = []
        for start, tokens, prompt in spans:
            span = slice(start, start + tokens)
            at = positions[span]
            inside = at < prompt.length
            clamped = at.clamp(max=prompt.length - 1)
            rotary[:, span] = torch.where(inside, prompt.mrope[:, clamped], at + prompt.delta)
            rows = torch.where(inside, prompt.image_rows[clamped], -1)
            image = rows >= 0
            if bool(image.any()):
                embeds[span][image] = prompt.embeds[rows[image]].to(embeds.dtype)
                visual[span] = image
                deepstack_rows.append((prompt, rows[image]))
        return self._logits(model, embeds, rotary, visual, deepstack_rows,
                            {k: v for k, v in batch.items() if k not in ("input_ids", "position_ids")})

    def prompt_logits(self, model: torch.nn.Module, prompt: VisionPrompt, keep: int) -> torch.Tensor:
        """Logits ``[keep, vocab]`` of the prompt's last ``keep`` positions, the whole prompt in one forward pass
        without the KV cache (prompt logprobs)."""
        ids = torch.tensor(prompt.ids, device=model.device)
        embeds = model.get_input_embeddings()(ids)
        image = prompt.image_rows >= 0
        embeds[image] = prompt.embeds.to(embeds.dtype)
        rows = [(prompt, prompt.image_rows[image])] if bool(image.any()) else []
        return self._logits(model, embeds, prompt.mrope, image, rows, {"use_cache": False, "logits_to_keep": keep})[0]

    def _logits(self, model: torch.nn.Module, embeds: torch.Tensor, rotary: torch.Tensor, visual: torch.Tensor,
                deepstack_rows: list[tuple[VisionPrompt, torch.Tensor]], kwargs: dict) -> torch.Tensor:
        """The language model and its head on ``embeds`` [tokens, hidden] at positions ``rotary`` [3, tokens]; the
        head on the rows ``logits_to_keep`` names, as transformers' forward (all rows without it)."""
        keep = kwargs.pop("logits_to_keep", 0)
        extra = {}
        if self.deepstack and deepstack_rows:
            layers = len(deepstack_rows[0][0].deepstack)
            extra = {"visual_pos_masks": visual[None], "deepstack_visual_embeds": [
                torch.cat([prompt.deepstack[k][rows] for prompt, rows in deepstack_rows]).to(embeds.dtype)
                for k in range(layers)]}
        hidden = model.model.language_model(inputs_embeds=embeds[None], position_ids=rotary[:, None], **kwargs,
                                            **extra).last_hidden_state
        return model.lm_head(hidden[:, slice(-keep, None) if isinstance(keep, int) else keep])
