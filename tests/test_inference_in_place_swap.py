"""Weights swapped between two decoding steps while a request runs (``ContinuousBatcher.swap``): every token keeps
the version that sampled it, the tokens after the swap are exactly the new weights' on the KV cache the old ones
wrote, and no later request reuses a prefix block the old weights computed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling

torch.set_num_threads(1)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
GREEDY = RequestSampling(top_k=1)
ATOL = 1e-4  # fp32, paged attention vs HF's eager cache


def fp32_model(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def picked(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


async def test_a_request_across_a_swap_samples_each_token_from_the_weights_it_is_labelled_with(
        tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    old, new = fp32_model(tiny_model_dir), fp32_model(tiny_model_b_dir)
    batcher = ContinuousBatcher(fp32_model(tiny_model_dir), BatchingConfig(max_total_tokens=1024), version="3")
    prepared = batcher.prepare(new.state_dict())
    batcher.start()
    try:
        running = asyncio.create_task(batcher.generate(PROMPT, max_new_tokens=300, stop_token_ids=[],
                                                       sampling=GREEDY))
        while batcher.versions.sampled() < 8:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(batcher.swap, prepared, "4")
        output = await running
    finally:
        batcher.stop()

    (v_old, n_old), (v_new, n_new) = output.versions
    assert (v_old, v_new) == ("3", "4") and n_old >= 8 and n_new > 0 and n_old + n_new == 300
    tokens = output.generated_tokens
    # Token k is drawn from the logits of the forward pass over token k-1: the first n_old passes ran the old
    # weights; the later ones the new weights, attending to the keys and values the old weights had cached.
    with torch.no_grad():
        before = old(input_ids=torch.tensor([PROMPT + tokens[:n_old - 1]]), use_cache=True)
        after = new(input_ids=torch.tensor([tokens[n_old - 1:-1]]), past_key_values=before.past_key_values)
    logits = torch.cat([before.logits[0, len(PROMPT) - 1:], after.logits[0]])
    assert logits.argmax(-1).tolist() == tokens
    assert torch.allclose(torch.tensor(output.logprobs), picked(logits, tokens), atol=ATOL)
    with torch.no_grad():  # what the label rules out: the old weights did not sample the later tokens
        all_old = old(input_ids=torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:]
    assert not torch.allclose(torch.tensor(output.logprobs[n_old:]), picked(all_old, tokens)[n_old:], atol=ATOL)


async def test_a_request_after_a_swap_reuses_no_prefix_block_of_the_old_weights(
        tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    new = fp32_model(tiny_model_b_dir)
    batcher = ContinuousBatcher(fp32_model(tiny_model_dir), BatchingConfig(max_total_tokens=2048, page_size=4))
    prompt = PROMPT * 3  # 27 tokens: six complete pages, held by the running request across the swap
    batcher.start()
    try:
        running = asyncio.create_task(batcher.generate(prompt, max_new_tokens=400, stop_token_ids=[],
                                                       sampling=GREEDY))
        while batcher.versions.sampled() < 4:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(batcher.swap, batcher.prepare(new.state_dict()), "1")
        output = await batcher.generate(prompt, max_new_tokens=4, stop_token_ids=[], sampling=GREEDY)
        assert not running.done()
        await running
    finally:
        batcher.stop()
    assert output.versions == [("1", 4)]
    with torch.no_grad():
        logits = new(input_ids=torch.tensor([prompt + output.generated_tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert torch.allclose(torch.tensor(output.logprobs), picked(logits, output.generated_tokens), atol=ATOL)
