"""Decode steps from static buffers (agentrl.inference.decode_graphs) and the paged decode kernel
(agentrl.inference.decode_kernel), on the CPU.

The buffers' step runs eagerly here (on CUDA the same step is captured and replayed: tests/test_gpu.py); the Triton
kernel runs through Triton's interpreter against the gather-and-SDPA reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling
from agentrl.inference.consistency import logprob_mismatch
from agentrl.inference.decode_graphs import DecodeGraphs, buckets

torch.set_num_threads(1)
GREEDY = RequestSampling(top_k=1)


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 5000 + 10 for i in range(length)]


async def generate(batcher: ContinuousBatcher, prompts: list[list[int]], max_new_tokens: int,
                   sampling: RequestSampling = GREEDY) -> list:
    return await asyncio.gather(*[batcher.generate(p, max_new_tokens=max_new_tokens, stop_token_ids=[],
                                                   sampling=sampling) for p in prompts])


def test_buckets() -> None:
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(1) == [1] and buckets(3) == [1, 2, 3] and buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.fixture
def served_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of requests of every step the static buffers ran."""
    steps: list[int] = []
    forward = DecodeGraphs.forward

    def spy(self, batch, decoding, cache):
        steps.append(len(decoding))
        return forward(self, batch, decoding, cache)

    monkeypatch.setattr(DecodeGraphs, "forward", spy)
    return steps


async def test_static_decode_steps_give_the_eager_paths_tokens(tiny_model_dir: Path,
                                                               served_steps: list[int]) -> None:
    # Requests of different lengths crossing page boundaries, a prompt sharing cached pages, batches of 1 and 5
    # padded to buckets (1 and 8): greedy tokens as the eager path's, logprobs as a full forward's.
    prompts = [prompt(5, 1), prompt(40, 3), prompt(17, 2), prompt(31, 7), [*prompt(40, 3)[:32], *prompt(3, 9)]]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    outputs = {}
    for static in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
        batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=4096, page_size=16, max_running_requests=6,
                                                          decode_graphs=static))
        assert (batcher.graphs is not None) is static
        batcher.start()
        try:
            alone = await generate(batcher, prompts[:1], max_new_tokens=20)
            together = await generate(batcher, prompts, max_new_tokens=20)
        finally:
            batcher.stop()
        outputs[static] = [*alone, *together]
    assert served_steps and {1, 5} <= set(served_steps)  # 5: padded to 8
    for eager, static, ids in zip(outputs[False], outputs[True], [prompts[0], *prompts], strict=True):
        assert static.generated_tokens == eager.generated_tokens
        mismatch = logprob_mismatch(reference, ids, static.generated_tokens, static.logprobs)
        assert mismatch["num_tokens"] == 20 and mismatch["max_abs_diff"] <= 1e-4, mismatch


async def test_sampling_parameters_apply_to_static_steps(tiny_model_dir: Path, served_steps: list[int]) -> None:
    # The graph computes logits only: each request's temperature, top-k/p and seed still apply (same seed, same
    # tokens as the eager path; different seeds, other tokens).
    sampled = RequestSampling(temperature=1.3, top_p=0.9, top_k=50, seed=7)
    outputs = {}
    for static in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
        batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048, page_size=16, decode_graphs=static))
        batcher.start()
        try:
            outputs[static] = await generate(batcher, [prompt(9, 1), prompt(9, 1)], 16, sampled)
            other = await generate(batcher, [prompt(9, 1)], 16, RequestSampling(temperature=1.3, seed=8))
        finally:
            batcher.stop()
    assert served_steps
    assert [o.generated_tokens for o in outputs[True]] == [o.generated_tokens for o in outputs[False]]
    assert outputs[True][0].generated_tokens == outputs[True][1].generated_tokens != other[0].generated_tokens


async def test_weights_are_copied_in_place_while_graphs_read_them(tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A captured graph reads the parameters by address: a swap must copy the new values into the same storage
    # (forced here on the CPU, where the step is not captured), and decoding then follows the new weights.
    monkeypatch.setattr(DecodeGraphs, "in_place_weights", property(lambda self: True))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048, page_size=16, decode_graphs=True))
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.05)
    addresses = {name: p.data_ptr() for name, p in model.named_parameters()}
    batcher.start()
    try:
        before = (await generate(batcher, [prompt(12, 4)], 12))[0]
        await asyncio.to_thread(batcher.load_state_dict, other.state_dict(), "v2")
        after = (await generate(batcher, [prompt(12, 4)], 12))[0]
    finally:
        batcher.stop()
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == addresses
    assert after.versions == [("v2", 12)]
    assert logprob_mismatch(other, prompt(12, 4), after.generated_tokens, after.logprobs)["max_abs_diff"] <= 1e-4
    assert before.logprobs != after.logprobs


KERNEL_CHECK = """
import json, sys
import torch
from agentrl.inference import decode_kernel

assert decode_kernel.triton_available(torch.device("cpu"))
results = []
for heads, kv_heads, dim, dtype in [(4, 4, 16, torch.float32), (8, 2, 20, torch.float32),
                                    (16, 8, 64, torch.bfloat16)]:
    generator = torch.Generator().manual_seed(heads + dim)
    page, pages = 16, 128
    k_cache = torch.randn(pages * page, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(pages * page, kv_heads, dim, generator=generator).to(dtype)
    seq_lens = torch.tensor([1, 16, 17, 300, 5], dtype=torch.int32)
    block_table = torch.randperm(pages, generator=generator)[:5 * 20].view(5, 20).to(torch.int32)
    query = torch.randn(heads, 5, dim, generator=generator).to(dtype).transpose(0, 1)
    out = decode_kernel.paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, page, dim ** -0.5)
    expected = decode_kernel.paged_decode_reference(query.float(), k_cache.float(), v_cache.float(), block_table,
                                                    seq_lens, page, dim ** -0.5)
    one_key = v_cache[block_table[0, 0].long() * page].float().repeat_interleave(heads // kv_heads, 0)
    results.append({"dtype": str(dtype), "shape": list(out.shape), "out_dtype": str(out.dtype),
                    "max_diff": (out.float() - expected).abs().max().item(),
                    "one_key_exact": torch.equal(out[0].float(), one_key)})
json.dump(results, sys.stdout)
"""


def test_the_triton_kernel_matches_sdpa_over_the_gathered_keys() -> None:
    # Through Triton's interpreter on the CPU (set before Triton is imported: a process of its own). Key counts of
    # 1, a page exactly, a page and one, and more than KV_SPLITS * BLOCK_KEYS (every split busy, several iterations
    # each); pages in random order; a strided query; one head per key/value head, groups of 4 and 2, a head size
    # that is not a power of 2; fp32 and bf16.
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    for result, dtype in zip(results, ["torch.float32", "torch.float32", "torch.bfloat16"], strict=True):
        assert result["out_dtype"] == dtype and result["shape"][0] == 5, result
        assert result["max_diff"] <= (1e-5 if dtype == "torch.float32" else 2e-2), result
        assert result["one_key_exact"], result  # one key: exactly its value
