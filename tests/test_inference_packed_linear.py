"""oneDNN-packed Linear layers of a bf16 model on CPU (agentrl.inference.packed_linear)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from agentrl.inference import packed_linear
from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling
from agentrl.inference.packed_linear import ROW_BLOCK, PackedLinear, RowLayout, pack_linears, packing_supported
from emulated_kernels import count_kernel, position_kernel, single_row_kernel

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
        batcher.load_state_dict(other.state_dict(), "1")
        output = await batcher.generate(PROMPT, max_new_tokens=8, stop_token_ids=[],
                                        sampling=RequestSampling(top_k=1))
    finally:
        batcher.stop()
    with torch.no_grad():
        logits = other(input_ids=torch.tensor([PROMPT + output.generated_tokens])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(output.generated_tokens)[:, None])
    assert torch.allclose(torch.tensor(output.logprobs), expected[:, 0], atol=2e-3)  # the other weights are ~0.05 away


def test_bf16_matmuls_round_the_layers_inputs_and_weights_but_keep_the_head_and_activations_fp32(
        tiny_model_dir: Path) -> None:
    """``bf16_matmuls`` (the engine's ``auto`` on a CPU with bf16 units): each layer but the LM head computes
    ``bf16(x) @ bf16(W)ᵀ`` and returns fp32, so the model's logits are those of an fp32 model whose layers (not its
    head) multiply in bf16 (a bf16 model's are further away)."""
    bf16_model(tiny_model_dir)  # skips where oneDNN has no bf16
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    mixed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pack_linears(mixed, bf16_matmuls=True)
    head = mixed.get_output_embeddings()
    assert head.matmul_dtype == torch.float32
    layers = [m for m in mixed.modules() if isinstance(m, PackedLinear) and m is not head]
    assert {m.matmul_dtype for m in layers} == {torch.bfloat16}
    assert mixed.state_dict()["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32

    def rounded_matmul(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight.bfloat16(), None if module.bias is None else module.bias.bfloat16()
        return nn.functional.linear(inputs[0].bfloat16(), weight, bias).float()

    hooks = [m.register_forward_hook(rounded_matmul) for m in plain.modules()
             if isinstance(m, nn.Linear) and m is not plain.get_output_embeddings()]
    ids = torch.tensor([PROMPT * 3])
    with torch.no_grad():
        logits = mixed(input_ids=ids).logits
        expected = plain(input_ids=ids).logits
        for hook in hooks:
            hook.remove()
        fp32 = plain(input_ids=ids).logits
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 1e-3 < (logits - fp32).abs().max()


@pytest.mark.parametrize("bf16_matmuls", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (4096, 512)])
def test_a_row_gets_the_same_bits_alone_or_among_others(in_features: int, out_features: int,
                                                        bf16_matmuls: bool) -> None:
    # oneDNN's one-row kernel splits the sum over the inputs from about 1,536 of them: such layers take a single
    # row as two. (The embedded model's 1536 -> 576 projection is one; before, a prompt whose last token came
    # alone after cached pages was answered otherwise.)
    if bf16_matmuls and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 matrix instructions")
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(in_features, out_features))
    pack_linears(layer, bf16_matmuls=bf16_matmuls)
    rows = torch.randn(12, in_features)
    with torch.no_grad():
        together = layer(rows)
        for count in (1, 2, 3, 5):
            alone = torch.cat([layer(rows[i:i + count]) for i in range(0, 12 - count + 1, count)])
            assert torch.equal(alone, together[:alone.shape[0]]), count
        assert torch.equal(layer(rows[None, :1]), together[None, :1])  # [batch, tokens, features] as the model calls


@pytest.mark.parametrize("bf16_matmuls", [False, True])
@pytest.mark.parametrize(("kernel", "expected"), [
    (lambda real: count_kernel(16, real), RowLayout(block_rows=ROW_BLOCK)),  # AMX-like: by the row count
    (single_row_kernel, RowLayout(pad_single_row=True)),
    (position_kernel, RowLayout(block_rows=ROW_BLOCK, exact=False)),
])
def test_the_probe_finds_a_layout_under_which_kernels_that_depend_on_the_rows_agree(
        kernel, expected: RowLayout, bf16_matmuls: bool, emulate_matmul) -> None:
    # Kernels emulated (tests/emulated_kernels.py): this machine's do not depend on the row count, a Xeon's with AMX
    # do. Before, only a single row was probed, so a count-dependent kernel went unnoticed and a prompt's last token
    # computed alone (after cached pages) got other bits than among the prompt's other tokens.
    if bf16_matmuls and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 matrix instructions")
    emulate_matmul(kernel)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 384))
    pack_linears(layer, bf16_matmuls=bf16_matmuls)
    assert layer[0].row_layout == expected
    rows = torch.randn(70, 256)
    with torch.no_grad():
        together = layer(rows)
        same = [torch.equal(layer(rows[start:start + count]), together[start:start + count])
                for count in (1, 2, 5, 16, 33, 40) for start in (0, 1, 17, 30)]
    assert all(same) is expected.exact


def test_every_row_count_agrees_on_this_cpu_as_probed(tiny_model_dir: Path) -> None:
    """On the real kernels of this machine: whatever layout the probe chose, every count agrees at every offset."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pack_linears(model, bf16_matmuls=torch.ops.mkldnn._is_mkldnn_bf16_supported())
    layers = {(m.in_features, m.out_features, m.matmul_dtype): m for m in model.modules()
              if isinstance(m, PackedLinear)}
    assert all(m.row_layout.exact for m in layers.values())
    for layer in layers.values():
        rows = torch.randn(80, layer.in_features)
        with torch.no_grad():
            together = layer(rows)
            for count in (1, 2, 3, 7, 16, 31, 33, 64):
                for start in (0, 3, 16):
                    assert torch.equal(layer(rows[start:start + count]), together[start:start + count]), (
                        layer.in_features, layer.out_features, count, start, layer.row_layout)


def test_blocks_multiply_every_call_with_the_same_number_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = packed_linear.packed_matmul
    monkeypatch.setattr(packed_linear, "packed_matmul",
                        lambda rows, packed, bias: calls.append(rows.shape[0]) or real(rows, packed, bias))
    layer = nn.Sequential(nn.Linear(64, 48))
    pack_linears(layer)
    layer[0].row_layout = RowLayout(block_rows=ROW_BLOCK)
    rows = torch.randn(1, 70, 64)
    with torch.no_grad():
        calls.clear()
        out = layer(rows)
        assert calls == [ROW_BLOCK] * 3 and out.shape == (1, 70, 48)
        calls.clear()
        assert torch.equal(layer(rows[:, 40:41]), out[:, 40:41]) and calls == [ROW_BLOCK]
