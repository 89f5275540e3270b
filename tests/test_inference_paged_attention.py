"""The engine's attention over the paged KV cache (agentrl.inference.paged_attention), on an in-process batcher.

Every call to SDPA is recorded (and run) by a spy on ``torch.nn.functional.scaled_dot_product_attention``, which
the attention code looks up at call time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.inference import paged_attention
from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling
from agentrl.inference.consistency import logprob_mismatch
from agentrl.inference.paged_attention import supports
from emulated_kernels import count_kernel, long_query_sdpa

torch.set_num_threads(1)
GREEDY = RequestSampling(top_k=1)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Shapes and masking of every SDPA call from now on."""
    calls: list[dict] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        calls.append({"query": tuple(query.shape), "key": tuple(key.shape), "is_causal": is_causal,
                      "mask": None if attn_mask is None else tuple(attn_mask.shape)})
        return real(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


async def generate(batcher: ContinuousBatcher, prompts: list[list[int]], max_new_tokens: int) -> list:
    return await asyncio.gather(*[batcher.generate(p, max_new_tokens=max_new_tokens, stop_token_ids=[],
                                                   sampling=GREEDY) for p in prompts])


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 5000 + 10 for i in range(length)]


async def test_decode_attends_to_each_request_alone(tiny_model_dir: Path, sdpa_calls: list[dict]) -> None:
    # transformers' sdpa path gathered the keys of all running requests for every query (and repeated the key/value
    # heads): 8 requests of 34 tokens gave keys [1, 4, 272, 16]; each request needs only its own 34.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048))
    batcher.start()
    try:
        outputs = await generate(batcher, [prompt(10, i) for i in range(8)], max_new_tokens=24)
    finally:
        batcher.stop()
    assert all(len(o.generated_tokens) == 24 for o in outputs)
    decode = [c for c in sdpa_calls if c["query"][0] > 1]  # one row per decoding request
    assert decode and max(c["query"][0] for c in decode) == 8
    assert max(c["key"][2] for c in sdpa_calls) <= 10 + 24
    assert {c["key"][1] for c in sdpa_calls} == {model.config.num_key_value_heads}  # no repeated heads


@pytest.mark.parametrize("bucket", [1, 16])
async def test_mixed_steps_match_a_full_forward_pass(tiny_model_dir: Path, sdpa_calls: list[dict], bucket: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # bucket 1: the CPU's settings; 16: CUDA's (decode keys padded, prefills unpadded and plainly causal) on the CPU
    # 16-token steps: the long prompt is prefilled in chunks (the later ones over cached keys) while the short ones
    # decode in the same steps; then a prompt sharing its first 48 tokens starts from the prefix cache. With a
    # bucket (CUDA's setting, here on the CPU) the decode group's keys are padded to its multiples, masked.
    monkeypatch.setattr(paged_attention, "DECODE_KEY_BUCKET", {"cpu": bucket})
    padded = bucket == 1
    monkeypatch.setattr(paged_attention, "PREFILL_QUERY_BLOCK", {"cpu": 32} if padded else {})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048, max_batch_tokens=16,
                                                      max_running_requests=8, page_size=16))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    long = prompt(60, 3)
    prompts = [prompt(5, 1), long, prompt(7, 2)]
    batcher.start()
    try:
        first = await generate(batcher, prompts, max_new_tokens=12)
        shared = [*long[:48], *prompt(9, 4)]
        second = await generate(batcher, [shared, prompt(6, 5)], max_new_tokens=12)
    finally:
        batcher.stop()
    engine_calls = list(sdpa_calls)  # not the reference's below
    for ids, output in zip([*prompts, shared, prompt(6, 5)], [*first, *second], strict=True):
        mismatch = logprob_mismatch(reference, ids, output.generated_tokens, output.logprobs)
        assert mismatch["num_tokens"] == 12 and mismatch["max_abs_diff"] <= 1e-4, mismatch
    prefill = [c for c in engine_calls if c["query"][0] == 1 and c["query"][1] == model.config.num_attention_heads]
    cached = [c for c in prefill if c["mask"]]
    assert len({c["key"][2] for c in cached}) >= 3 and 57 in {c["key"][2] for c in cached}
    if padded:  # explicit masks and whole blocks of queries: the same kernels cached or not
        assert cached == prefill and all(c["query"][2] == 32 for c in prefill)
        assert not any(c["is_causal"] for c in engine_calls)
    else:  # prompts with nothing cached keep the causal flag (CUDA's flash kernel)
        assert any(c["is_causal"] for c in engine_calls) and any(c["query"][2] % 32 for c in prefill)
    decode = [c for c in engine_calls if c["query"][0] > 1]  # requests decoding together
    assert decode and all(c["key"][2] % bucket == 0 for c in decode)
    assert bucket > 1 or any(c["key"][2] % 16 for c in decode)  # unpadded, the lengths are not all multiples


@pytest.mark.parametrize("kernels", ["this CPU's", "by row count (emulated)"])
@pytest.mark.parametrize("bf16_matmuls", [False, True])
async def test_a_prompt_from_the_prefix_cache_gets_the_bits_it_gets_computed_whole(
        tiny_model_dir: Path, bf16_matmuls: bool, kernels: str, monkeypatch: pytest.MonkeyPatch,
        emulate_matmul) -> None:
    # Before: a prompt whose last 1-3 tokens followed cached pages took other kernels (its last token even joined
    # the decode group), and the embedded model's second identical greedy request differed from its 7th token.
    # Then on a Xeon with AMX, whose kernels depend on the row count (here emulated, tests/emulated_kernels.py:
    # matmuls of fewer than 16 rows and SDPA calls of 64 query rows or more one float step off), the same
    # request differed again: the packed layers took a prompt's rows in one call, SDPA its queries in one call.
    if bf16_matmuls and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 matrix instructions")
    if kernels != "this CPU's":
        emulate_matmul(lambda real: count_kernel(16, real))
        long_query_sdpa(64, monkeypatch)
    cached: list[bool] = []  # per prefill, whether its first keys came from the prefix cache
    from_batch = paged_attention.StepLayout.from_batch.__func__

    def spy(cls, batch: dict, *args) -> paged_attention.StepLayout:
        layout = from_batch(cls, batch, *args)
        cached.extend(p.slots is not None for p in layout.prefills)
        return layout

    monkeypatch.setattr(paged_attention.StepLayout, "from_batch", classmethod(spy))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048, page_size=16,
                                                      bf16_matmuls=bf16_matmuls))
    batcher.start()
    try:
        for length in (17, 18, 19, 20, 35, 47, 200):  # 1, 2, 3, 4, 3, 15 and 8 tokens after whole cached pages
            ids = prompt(length, length)
            runs = []
            for fresh in (True, False, True):
                if fresh:
                    batcher.reset_prefix_cache()
                cached.clear()
                runs.append((await generate(batcher, [ids], max_new_tokens=12))[0])
                assert cached[0] is not fresh, (length, fresh, cached)
            assert all(run.generated_tokens == runs[0].generated_tokens for run in runs), length
            assert all(run.logprobs == runs[0].logprobs for run in runs), (length, [r.logprobs for r in runs])
    finally:
        batcher.stop()


@pytest.mark.parametrize(("model_type", "overrides", "served"), [
    ("llama", {}, True),
    ("qwen3", {}, True),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "num_hidden_layers": 2},
     False),
    ("gemma2", {"layer_types": ["full_attention"] * 2, "num_hidden_layers": 2}, False),  # soft-capped scores
    ("gpt_oss", {}, False),  # sliding layers (and attention sinks)
])
def test_models_it_cannot_serve_keep_transformers_attention(model_type: str, overrides: dict, served: bool) -> None:
    assert supports(AutoConfig.for_model(model_type, **overrides)) is served
