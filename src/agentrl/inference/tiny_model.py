"""Models built in code with the embedded model's tokenizer: a tiny random Llama for tests, and random-weight
models of any architecture for benchmarks.

They share the embedded model's tokenizer and chat template (so token ids, special tokens and rendering are those
of SmolLM2-135M-Instruct). The tiny model has two thin layers, so it builds in about a second and runs fast on CPU.
"""

from __future__ import annotations

from pathlib import Path

from agentrl.inference.embedded_model import default_tokenizer_path


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, num_layers: int = 2, hidden_size: int = 64) -> Path:
    """Save a seeded random ``LlamaForCausalLM`` and the embedded tokenizer into ``out_dir``; return it."""
    import torch
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
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
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
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(default_tokenizer_path()).save_pretrained(out_dir)
    return Path(out_dir)
