"""oneDNN-packed Linear layers of a bf16 model on CPU (agentrl.inference.packed_linear)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling
from agentrl.inference.packed_linear import PackedLinear, pack_linears, packing_supported

torch.set_num_threads(1)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]


def bf16_model(directory: Path) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    if not packing_supported(model):
        pytest.skip("this CPU's oneDNN has no bf16 support: layers stay plain")
    return model


def test_packed_layers_compute_exactly_what_plain_ones_do(tiny_model_dir: Path) -> None:
    plain, packed = bf16_model(tiny_model_dir), bf16_model(tiny_model_dir)
    linears = sum(isinstance(m, nn.Linear) for m in plain.modules())
    assert pack_linears(packed) == linears
    assert all(isinstance(m, PackedLinear) for m in packed.modules() if isinstance(m, nn.Linear))
    assert packed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([PROMPT * 3])
    with torch.no_grad():
        assert torch.equal(packed(input_ids=ids).logits, plain(input_ids=ids).logits)


async def test_loaded_weights_reach_the_packed_layers(tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    batcher = ContinuousBatcher(bf16_model(tiny_model_dir), BatchingConfig(max_total_tokens=1024))
    other = bf16_model(tiny_model_b_dir)
    batcher.start()
    try:
        batcher.load_state_dict(other.state_dict())
        output = await batcher.generate(PROMPT, max_new_tokens=8, stop_token_ids=[],
                                        sampling=RequestSampling(top_k=1))
    finally:
        batcher.stop()
    with torch.no_grad():
        logits = other(input_ids=torch.tensor([PROMPT + output.generated_tokens])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(output.generated_tokens)[:, None])
    assert torch.allclose(torch.tensor(output.logprobs), expected[:, 0], atol=2e-3)  # the other weights are ~0.05 away
