"""Models built in code with the embedded model's tokenizer: a tiny random Llama for tests, and random-weight
models of any architecture for benchmarks.

They share the embedded model's tokenizer and chat template (so token ids, special tokens and rendering are those
of SmolLM2-135M-Instruct). The tiny model has two thin layers, so it builds in about a second and runs fast on CPU.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.inference.embedded_model import default_tokenizer_path


def seeded(seed: int, build, *args, **kwargs):
    """``build(*args, **kwargs)`` with torch's generator seeded by ``seed``, the caller's state restored after."""
    import torch

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return build(*args, **kwargs)
    finally:
        torch.random.set_rng_state(generator_state)


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64) -> Path:
    """Save a seeded random ``LlamaForCausalLM`` and the embedded tokenizer into ``out_dir``; return it."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = seeded(seed, LlamaForCausalLM, config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_random_model(config_file: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Save a model of ``config_file``'s architecture (a Hugging Face ``config.json``) with seeded random weights and
    the embedded tokenizer into ``out_dir``; return it. Benchmarks use it: speed depends on shapes, not weights."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(**json.loads(Path(config_file).read_text()))
    model = seeded(seed, AutoModelForCausalLM.from_config, config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(default_tokenizer_path()).save_pretrained(out_dir)
    return Path(out_dir)


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The Qwen-VL family's vision tokens, added to the embedded tokenizer by :func:`build_tiny_vision_model`."""

VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""The embedded model's chat template, with a message's content also a list of ``text`` and ``image`` parts (an
image rendered as the Qwen-VL placeholder, as Qwen's own templates do)."""


QWEN2_5_VL_3B_SHAPE = {
    "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 2,
             "num_hidden_layers": 4, "initializer_range": 0.02},
    "vision": {"hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "depth": 4, "out_hidden_size": 2048,
               "window_size": 112, "fullatt_block_indexes": [3], "initializer_range": 0.02},
    "rope_section": [16, 24, 24],
}
"""Qwen2.5-VL-3B-Instruct's widths (its ``config.json``), with 4 of its 36 text layers and 4 of its 32 vision
blocks: the GPU check's model (the shapes its kernels see, in the minutes the check has)."""


def build_tiny_vision_model(out_dir: str | Path, *, family: str = "qwen2_5_vl", seed: int = 0,
                            hidden_size: int = 64, max_pixels: int = 112 * 112,
                            shape: dict | None = None) -> Path:
    """Save a seeded random Qwen-VL model (``family``: ``qwen2_5_vl`` or ``qwen3_vl``) with two thin text layers
    and a two-block vision tower, the embedded tokenizer with the four vision tokens and a chat template that
    renders images, and the family's image processor (at most ``max_pixels`` pixels an image: 16 tokens at the
    default) into ``out_dir``; return it. ``shape`` (Qwen2.5-VL only, e.g. :data:`QWEN2_5_VL_3B_SHAPE`) overrides
    the text and vision widths. No pretrained small VLM ships in a package here: the tests use these."""
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    head_dim = hidden_size // 4
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "initializer_range": 0.2,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    section = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]  # temporal, height, width
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": hidden_size, "initializer_range": 0.2}  # 0.2: outputs that depend on the image
    tokens = {"image_token_id": image, "video_token_id": video, "vision_start_token_id": start,
              "vision_end_token_id": end, "tie_word_embeddings": True}
    if shape is not None:
        if family != "qwen2_5_vl":
            raise ValueError("shape is for qwen2_5_vl models")
        text, vision, section = text | shape["text"], vision | shape["vision"], shape["rope_section"]
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        config = Config(text_config=text | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                "mrope_section": section}},
                        vision_config={"fullatt_block_indexes": [1], "window_size": 56} | vision, **tokens)
        patch = 14
    elif family == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model

        config = Config(text_config=text | {"head_dim": head_dim, "rope_parameters": {
                            "rope_type": "default", "rope_theta": 5e6, "mrope_section": section,
                            "mrope_interleaved": True}},
                        vision_config=vision | {"deepstack_visual_indexes": [0], "num_position_embeddings": 64},
                        **tokens)
        patch = 16
    else:
        raise ValueError(f"family must be qwen2_5_vl or qwen3_vl, not {family!r}")
    model = seeded(seed, Model, config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    factor = patch * 2
    Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=factor * factor, max_pixels=max_pixels,
                             **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == "qwen3_vl" else {})
                             ).save_pretrained(out)
    return out
