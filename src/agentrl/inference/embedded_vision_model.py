"""The embedded vision-language model: the embedded SmolLM2-135M-Instruct given eyes, as a Qwen2.5-VL.

No pretrained small VLM ships in a package here, so the picture demo (``./minirl_vision_example.sh``) builds one:
a ``Qwen2_5_VLForConditionalGeneration`` whose language model *is* SmolLM2-135M-Instruct — same widths, 30 layers,
its weights copied, Qwen2's q/k/v biases zero (then the two attention blocks compute the same function), one
rotary section per axis that sums to the head's (text alone gets equal positions on every axis, so multimodal
rotary positions reduce to SmolLM2's) — and a small **random** vision tower (two blocks of width 128, 1.2 M
parameters) whose output is scaled to the norm of the text embeddings. On text it answers as the embedded model
does (tested: equal logits); what it sees it has to learn: the picture demo's warm-up takes it from no answer to
about half the held-out pictures right (docs/images.md).

It is built once (about 10 s) into ``$AGENTRL_HOME/models/`` (as the embedded model is converted: atomically, under
a file lock); ``agentrl model default --vision`` prints its directory. The tokenizer is the embedded one with the
four Qwen-VL vision tokens added (their embeddings the mean of the others), the chat template the embedded one
that also renders image parts, the image processor transformers' PIL one with at most 112 x 112 pixels an image
(16 image tokens).
"""

from __future__ import annotations

from pathlib import Path

from agentrl.inference.embedded_model import cached_model_dir, default_model_path

VISION_MODEL_DIR_NAME = "SmolLM2-135M-Instruct-VL-1"
"""The cached directory's name: its number changes with what :func:`build_vision_model` makes, so that a cache of an
older build is never taken for the current one."""
VISION_TOWER = {"depth": 2, "hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1]}
"""The vision tower's shape: Qwen2.5-VL's patch, merge and window layout, two thin blocks."""
MAX_PIXELS = 112 * 112
SEED = 0


def default_vision_model_path() -> Path:
    """The cached directory of the embedded vision-language model, building it on first use."""
    return cached_model_dir(VISION_MODEL_DIR_NAME,
                            lambda _gguf, out_dir: build_vision_model(default_model_path(), out_dir))


def build_vision_model(text_model: str | Path, out_dir: str | Path, *, seed: int = SEED) -> Path:
    """Save the Qwen2.5-VL made of the Llama-architecture model ``text_model`` (SmolLM2) and a seeded random vision
    tower into ``out_dir``; return it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from agentrl.inference.tiny_model import VISION_CHAT_TEMPLATE, VISION_TOKENS, seeded

    out = Path(out_dir)
    text = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    source = text.config
    if source.model_type != "llama" or getattr(source, "attention_bias", False) or getattr(source, "mlp_bias", False):
        raise ValueError(f"{text_model}: expected a Llama model without biases, got {source.model_type}")
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    head_dim = source.hidden_size // source.num_attention_heads
    quarter = head_dim // 8
    section = [head_dim // 2 - 4 * quarter, 2 * quarter, 2 * quarter]  # temporal, height, width: [8, 12, 12] at 64
    text_config = {
        "vocab_size": len(tokenizer), "hidden_size": source.hidden_size,
        "intermediate_size": source.intermediate_size, "num_hidden_layers": source.num_hidden_layers,
        "num_attention_heads": source.num_attention_heads, "num_key_value_heads": source.num_key_value_heads,
        "max_position_embeddings": source.max_position_embeddings, "rms_norm_eps": source.rms_norm_eps,
        "hidden_act": source.hidden_act, "bos_token_id": source.bos_token_id, "eos_token_id": source.eos_token_id,
        "pad_token_id": source.pad_token_id,
        "rope_parameters": {"rope_type": "default", "rope_theta": source.rope_parameters["rope_theta"],
                            "mrope_section": section}}
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=VISION_TOWER | {"out_hidden_size":
                                                                                     source.hidden_size},
                              image_token_id=image, video_token_id=video, vision_start_token_id=start,
                              vision_end_token_id=end, tie_word_embeddings=True)
    model = seeded(seed, Qwen2_5_VLForConditionalGeneration, config)
    weights = text.state_dict()
    embeddings = weights.pop("model.embed_tokens.weight")
    weights.pop("lm_head.weight", None)  # tied
    state = {f"model.language_model.{name.removeprefix('model.')}": value for name, value in weights.items()}
    added = embeddings.mean(dim=0, keepdim=True).expand(len(tokenizer) - embeddings.shape[0], -1)
    state["model.language_model.embed_tokens.weight"] = torch.cat([embeddings, added])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("model.language_model.") and name.endswith("_proj.bias"):
                parameter.zero_()
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [name for name in missing if not name.startswith("model.visual.") and not name.endswith("_proj.bias")
            and name != "lm_head.weight"]
    if left or unexpected:
        raise ValueError(f"{text_model}: weights that do not map onto Qwen2.5-VL: {left or unexpected}")
    processor = Qwen2VLImageProcessorPil(patch_size=14, min_pixels=28 * 28, max_pixels=MAX_PIXELS)
    _match_text_scale(model, processor, seed)
    model.generation_config = text.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _match_text_scale(model, processor, seed: int) -> None:
    """Scale the vision merger's output layer so that image embeddings have the text embeddings' mean norm (a
    random tower's are far smaller or larger, which would drown the text or vanish in it)."""
    import numpy
    import torch
    from PIL import Image

    rng = numpy.random.default_rng(seed)
    side = int(MAX_PIXELS ** 0.5)
    pictures = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=numpy.uint8)) for _ in range(4)]
    inputs = processor(images=pictures, return_tensors="pt")
    with torch.no_grad():
        seen = torch.cat(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        text = model.model.language_model.embed_tokens.weight.norm(dim=-1).mean()
        last = model.model.visual.merger.mlp[2]
        scale = text / seen.norm(dim=-1).mean()
        last.weight.mul_(scale)
        last.bias.mul_(scale)
