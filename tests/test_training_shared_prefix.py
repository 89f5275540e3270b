"""Shared prefixes forwarded once: exactly the per-sample forward, in one process, under FSDP2 and tensor parallelism.

Oracle: every sample forwarded alone, unpadded (``model_token_logprobs`` of its tokens), its logprobs put in the
micro-batch's dense ``[B, T]`` layout, then the same loss. In float64 the shared forward's logprobs (each
continuation's first token included) and every parameter's gradient (embeddings and LoRA adapters included) must
agree within 1e-10 (gradients: relative L2 error per parameter). The data: groups whose samples share a prompt,
multi-turn samples, branches of one trajectory that share earlier turns, and samples whose outputs start alike, so
a shared span holds loss tokens of several samples with different advantages.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from agentrl.training.batching import MicroBatch, align_passes, collate, pack_micro_batches, plan_micro_batches
from agentrl.training.logprobs import layout_logprobs, model_token_logprobs, shared_prefix_unsupported
from agentrl.training.losses import LossConfig, LossInput, global_normaliser, loss_fn
from agentrl.training.prefix_tree import build_forest
from agentrl.trajectory.merge import CallTokens, MergedSample, merge_trajectory
from training_core_fixtures import VOCAB, in_float64, tiny_llama

pytestmark = pytest.mark.slow

MIN_SHARED = 8
DTYPE = torch.float64
BOUND = 1e-10
"""In float64 (``in_float64``) the shared forward equals the per-sample one to rounding (measured ~1e-14 relative);
in fp32 the summation order alone moves gradients by ~1e-5 relative, which passed or failed a 1e-5 bound with the
CPU's kernels and the reduction order."""
LOSSES = {
    "grpo": LossConfig(loss_calculater="GRPO", importance_weight_cap_ratio=2.0),
    "minirl": LossConfig(loss_calculater="MINIRL", strict_in_bound=True, token_level_loss=False,
                         skip_length_normalization=True),
    "gspo": LossConfig(loss_calculater="GSPO", token_level_loss=False),
    "cross-entropy": LossConfig(loss_calculater="CrossEntropy"),
}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def group(rng: random.Random, prompt: list[int], size: int, *, turns: int = 2, name: str = "g",
          opening: list[int] = ()) -> list[MergedSample]:
    """``size`` trajectories of ``turns`` calls after the same ``prompt``; the first output of all but the last
    trajectory starts with ``opening``."""
    samples = []
    for index in range(size):
        calls: list[CallTokens] = []
        for turn in range(turns):
            output = (list(opening) if turn == 0 and index < size - 1 else []) + ids(rng, rng.randrange(1, 7))
            common = {"call_id": f"{name}{index}-{turn}", "output_ids": output,
                          "output_logprobs": [-1.0] * len(output), "weight_version": turn,
                          "advantage": rng.choice([-1.5, -0.5, 0.5, 1.0])}
            if turn == 0:
                calls.append(CallTokens(input_ids=prompt, **common))
            else:
                calls.append(CallTokens(previous_call_id=calls[-1].call_id, prompt_delta_ids=ids(rng, 3), **common))
        samples.extend(merge_trajectory(calls).samples)
    return samples


def branchy(rng: random.Random, prompt: list[int], name: str = "b") -> list[MergedSample]:
    """One trajectory whose third call restarts from the first call's context: two branches sharing turn 1, which
    is trained in the first branch only."""
    first = CallTokens(call_id=f"{name}0", input_ids=prompt, output_ids=ids(rng, 12), output_logprobs=[-1.0] * 12,
                       advantage=1.0, weight_version=0)
    second = CallTokens(call_id=f"{name}1", previous_call_id=first.call_id, prompt_delta_ids=ids(rng, 4),
                        output_ids=ids(rng, 5), output_logprobs=[-1.0] * 5, advantage=1.0, weight_version=0)
    restart = list(prompt) + list(first.output_ids) + ids(rng, 6)
    third = CallTokens(call_id=f"{name}2", input_ids=restart, output_ids=ids(rng, 4), output_logprobs=[-1.0] * 4,
                       advantage=-0.5, weight_version=1)
    samples = merge_trajectory([first, second, third]).samples
    assert len(samples) == 2
    return samples


def step_data(seed: int = 0) -> list[MergedSample]:
    rng = random.Random(seed)
    prompt_a, prompt_b = ids(rng, 40), ids(rng, 33)
    samples = group(rng, prompt_a, 4, name="a")
    samples += group(rng, prompt_b, 3, turns=3, name="b", opening=ids(rng, 10))  # shared loss tokens
    samples += branchy(rng, ids(rng, 20))
    samples += group(rng, ids(rng, 25), 1, name="c")  # a group of one
    return samples


def with_behaviour(model: torch.nn.Module, samples: list[MergedSample], seed: int = 0) -> list[MergedSample]:
    """The samples with behaviour logprobs = the model's own + noise (ratios spread around 1)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for sample in samples:
        with torch.no_grad():
            own = model_token_logprobs(model, torch.tensor([sample.input_ids]))[0]
        noisy = own + 0.3 * torch.randn(len(own), generator=generator, dtype=own.dtype)
        out.append(replace(sample, logprobs=[float(x) if m else 0.0 for x, m in zip(noisy, sample.loss_mask)]))
    return out


def oracle_logprobs(model: torch.nn.Module, batch: MicroBatch, samples: list[MergedSample]) -> torch.Tensor:
    rows = []
    for index in batch.sample_indices:
        alone = model_token_logprobs(model, torch.tensor([samples[index].input_ids]))[0]
        rows.append(torch.nn.functional.pad(alone, (0, batch.input_ids.shape[1] - len(alone))))
    return torch.stack(rows)


def step_gradients(model: torch.nn.Module, config: LossConfig, batches: list[MicroBatch],
                   samples: list[MergedSample], *, shared: bool, normaliser: float | None = None,
                   scale: float = 1.0) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Every micro-batch's loss backward (shared forward or oracle); the gradients and each batch's logprobs."""
    model.zero_grad(set_to_none=True)
    normaliser = normaliser or global_normaliser(config, batches)
    logprobs = []
    for batch in batches:
        new = layout_logprobs(model, batch.layout) if shared else oracle_logprobs(model, batch, samples)
        loss, _ = loss_fn(config, LossInput.from_batch(batch, new, current_version=2), normaliser)
        (loss * scale).backward()
        logprobs.append(new.detach())
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, logprobs


def assert_close_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float = BOUND) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert grad.norm() > 0, name
        error = float((got[name] - grad).norm() / grad.norm())
        assert error < bound, (name, error)


def assert_close_logprobs(got: torch.Tensor, want: torch.Tensor, batch: MicroBatch, bound: float = BOUND) -> None:
    mask = batch.loss_mask
    assert mask.any()
    assert (got - want)[mask].abs().max().item() < bound
    computed = got != 0  # positions off the loss tokens are computed where another row needs them, else 0
    assert (got - want)[computed].abs().max().item() < bound


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=2, dtype=DTYPE).train()  # dropout-free: training mode changes nothing else


@pytest.fixture(scope="module")
def samples(model: torch.nn.Module) -> list[MergedSample]:
    return with_behaviour(model, step_data())


# ------------------------------------------------------------------------------------------------ the forest


def test_forest_shares_prompts_and_trunks_and_leaves_short_spans_to_the_samples() -> None:
    rng = random.Random(1)
    prompt, trunk = ids(rng, 20), ids(rng, 15)
    seqs = [prompt + trunk + [1, 2], prompt + trunk + [3], prompt + [4, 5], prompt + [4, 6], ids(rng, 12),
            prompt + trunk, prompt + [4, 5]]
    forest = build_forest(seqs, min_shared=8)
    spans = [(node.start, node.end, node.depth) for node in forest.nodes]
    root, trunk_node = spans.index((0, 20, 0)), spans.index((20, 35, 1))
    assert [forest.nodes[n].parent for n in forest.paths[0]] == [-1, root, trunk_node]
    assert forest.paths[5] == [root, trunk_node], "a sample may end where a shared span ends"
    # [4, 5] / [4, 6] share one token: too short for a node, each keeps its own continuation
    assert [spans[n] for n in forest.paths[2]] == [(0, 20, 0), (20, 22, 1)]
    assert forest.paths[6][-1] != forest.paths[2][-1], "identical samples get their own (short) continuations"
    assert [spans[n] for n in forest.paths[4]] == [(0, 12, 0)]
    for i, seq in enumerate(seqs):
        assert forest.nodes[forest.paths[i][-1]].end == len(seq)
    assert all(len(path) == 1 for path in build_forest(seqs, min_shared=10**9).paths), "no sharing"


# ------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("loss", list(LOSSES))
def test_shared_forward_equals_per_sample_forward(model, samples, loss: str) -> None:
    config = LOSSES[loss]
    batches = pack_micro_batches(samples, max_tokens=10_000, min_shared=MIN_SHARED)
    forest = build_forest([s.input_ids for s in samples], MIN_SHARED)
    assert max(node.depth for node in forest.nodes) == 2, "prompts, trunks and continuations"
    assert len(batches) == 1 and batches[0].layout.mask is not None
    dense_tokens = sum(s.num_tokens for s in samples)
    assert sum(node.width for node in forest.nodes) < dense_tokens * 0.6, "each shared span once"
    assert batches[0].layout.computed_tokens < dense_tokens, "the trees' rows padded to the longest"
    got, got_lp = step_gradients(model, config, batches, samples, shared=True)
    want, want_lp = step_gradients(model, config, batches, samples, shared=False)
    assert_close_logprobs(got_lp[0], want_lp[0], batches[0])
    assert "model.embed_tokens.weight" in want
    assert_close_gradients(got, want)


def test_shared_loss_tokens_count_once_per_sample_with_their_own_advantage(model, samples) -> None:
    """Group b's outputs start with the same 10 tokens: that span is forwarded once, yet each sample's loss holds
    it with its own advantage, so the gradient is that of the per-sample forward, not of one copy."""
    batch = collate(samples, min_shared=MIN_SHARED)
    shared_loss_span = [n for n in build_forest([s.input_ids for s in samples], MIN_SHARED).nodes
                        if n.depth == 1 and n.end - n.start == 10]
    assert shared_loss_span, "the data must share an output span"
    config = LossConfig(loss_calculater="MINIRL", importance_weight_cap_ratio=None)
    got, _ = step_gradients(model, config, [batch], samples, shared=True)
    want, _ = step_gradients(model, config, [batch], samples, shared=False)
    assert_close_gradients(got, want)


def test_one_sample_equals_the_dense_forward(model, samples) -> None:
    batch = collate(samples, [0], min_shared=MIN_SHARED)
    dense = collate(samples, [0], min_shared=None)
    assert batch.layout.mask is None and dense.layout.mask is None and batch.layout.input_ids.shape[0] == 1
    out = layout_logprobs(model, batch.layout)
    want = model_token_logprobs(model, batch.input_ids, scored=batch.loss_mask)
    assert torch.equal(out, want)


def test_a_one_token_continuation_and_a_perturbed_neighbour(model) -> None:
    rng = random.Random(4)
    prompt = ids(rng, 30)
    seqs = [prompt + [7], prompt + ids(rng, 6), prompt + ids(rng, 9)]
    samples = [MergedSample(input_ids=s, loss_mask=[0] * 30 + [1] * (len(s) - 30), logprobs=[0.0] * len(s),
                            versions=[0] * len(s), advantages=[1.0] * len(s)) for s in seqs]
    batch = collate(samples, min_shared=MIN_SHARED)
    with torch.no_grad():
        out = layout_logprobs(model, batch.layout)
        assert_close_logprobs(out, oracle_logprobs(model, batch, samples), batch)
        assert out[0, 30] != 0, "a one-token continuation is scored from the prompt's last position"
        changed = samples[:2] + [replace(samples[2], input_ids=prompt + ids(rng, 9))]
        again = layout_logprobs(model, collate(changed, min_shared=MIN_SHARED).layout)
    # the neighbour's tokens move the others within their packed row (rounding differs by ~1e-6); a leak would not
    assert torch.allclose(again[:2], out[:2], rtol=0, atol=BOUND), "another continuation changed a sample's logprobs"


def test_a_micro_batch_without_any_prediction_still_has_a_graph(model) -> None:
    one_token = MergedSample(input_ids=[5], loss_mask=[0], logprobs=[0.0], versions=[-1], advantages=[0.0])
    batch = collate([one_token], min_shared=MIN_SHARED)
    assert batch.layout.computed_tokens == 0
    out = layout_logprobs(model, batch.layout)
    assert out.shape == (1, 1) and out.eq(0).all() and out.requires_grad


def test_loss_on_the_first_continuation_only(model, samples) -> None:
    only_first = [s if i == 0 else replace(s, loss_mask=[0] * s.num_tokens) for i, s in enumerate(samples[:4])]
    batch = collate(only_first, min_shared=MIN_SHARED)
    assert batch.layout.mask is not None and batch.layout.input_ids.shape[0] == 1, "one tree: a prompt and its branches"
    config = LOSSES["grpo"]
    got, _ = step_gradients(model, config, [batch], only_first, shared=True)
    want, _ = step_gradients(model, config, [batch], only_first, shared=False)
    assert_close_gradients(got, want)


def test_two_groups_in_one_micro_batch_and_gradient_checkpointing(samples) -> None:
    model = tiny_llama(seed=2, dtype=DTYPE).train()
    model.activation_checkpointing_enable()
    batch = collate(samples, list(range(7)), min_shared=MIN_SHARED)  # groups a and b
    assert batch.layout.input_ids.shape[0] == 2, "two trees, one packed row each"
    config = LOSSES["gspo"]
    got, _ = step_gradients(model, config, [batch], samples, shared=True)
    want, _ = step_gradients(model, config, [batch], samples, shared=False)
    assert_close_gradients(got, want)


def test_lora_adapters_get_the_per_sample_gradients(samples) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(seed=2, dtype=DTYPE), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at 0: give the adapters a value so A gets a gradient too
            torch.nn.init.normal_(param, std=0.1)
    model.train()
    batches = pack_micro_batches(samples, max_tokens=10_000, min_shared=MIN_SHARED)
    got, _ = step_gradients(model, LOSSES["grpo"], batches, samples, shared=True)
    want, _ = step_gradients(model, LOSSES["grpo"], batches, samples, shared=False)
    assert {name for name in want if "lora_A" in name} and all("lora_" in name for name in want)
    assert_close_gradients(got, want)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "mistral"])
def test_other_architectures(architecture: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(architecture, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.4,
                                  sliding_window=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = in_float64(AutoModelForCausalLM.from_config(config)).train()
    assert shared_prefix_unsupported(model) is None
    samples = with_behaviour(model, step_data())
    batch = collate(samples, min_shared=MIN_SHARED)
    got, got_lp = step_gradients(model, LOSSES["grpo"], [batch], samples, shared=True)
    want, want_lp = step_gradients(model, LOSSES["grpo"], [batch], samples, shared=False)
    assert_close_logprobs(got_lp[0], want_lp[0], batch)
    assert_close_gradients(got, want)


def test_eager_attention_and_the_unsupported_cases() -> None:
    model = tiny_llama(seed=2, dtype=DTYPE, attn="eager").train()
    samples = with_behaviour(model, step_data(seed=5))
    batch = collate(samples, min_shared=MIN_SHARED)
    got, _ = step_gradients(model, LOSSES["grpo"], [batch], samples, shared=True)
    want, _ = step_gradients(model, LOSSES["grpo"], [batch], samples, shared=False)
    # Hugging Face's eager attention takes its softmax in float32 whatever the dtype: measured 5e-7 relative here
    # (a wrong mask gives ~1e-1)
    assert_close_gradients(got, want, bound=1e-5)
    assert shared_prefix_unsupported(model) is None
    flash = tiny_llama()
    flash.config._attn_implementation = "flash_attention_2"  # no flash kernel on CPU: only the check is tested
    assert "flash_attention_2" in shared_prefix_unsupported(flash)
    sliding = tiny_llama()
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding_attention" in shared_prefix_unsupported(sliding)


def test_under_bf16_autocast_the_shared_forward_is_as_close_to_fp32_as_the_dense_one() -> None:
    model = tiny_llama(seed=2).train()  # fp32: bf16 autocast casts fp32 matmuls (a float64 model it leaves alone)
    samples = with_behaviour(model, step_data())
    shared, dense = collate(samples, min_shared=MIN_SHARED), collate(samples, min_shared=None)
    with torch.no_grad():
        reference = layout_logprobs(model, dense.layout)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors = {name: (layout_logprobs(model, batch.layout) - reference)[batch.loss_mask].abs().mean().item()
                      for name, batch in (("shared", shared), ("dense", dense))}
    assert errors["dense"] > 1e-4, "bf16 must differ from fp32, or the comparison proves nothing"
    assert errors["shared"] < 2 * errors["dense"], errors


# ------------------------------------------------------------------------------------------- micro-batches


def test_micro_batches_keep_groups_together_under_the_budget(samples) -> None:
    seqs = [s.input_ids for s in samples]
    alone = plan_micro_batches(seqs, 10_000, min_shared=None)
    assert len(alone) == 1
    budget = 150
    plan = plan_micro_batches(seqs, budget, min_shared=MIN_SHARED)
    assert sorted(i for b in plan for i in b) == list(range(len(samples)))
    for members in plan:
        batch = collate(samples, members, min_shared=MIN_SHARED)
        assert batch.layout.computed_tokens <= budget or len(members) == 1
    group_a = set(range(4))  # 4 samples, prompt 40 tokens: 39 + 4 continuations fit in the budget together
    assert any(group_a <= set(members) for members in plan)
    assert plan == plan_micro_batches(seqs, budget, min_shared=MIN_SHARED)
    # a group over the budget is cut into runs that each forward its prompt once
    cut = plan_micro_batches(seqs[:4], 60, min_shared=MIN_SHARED)
    assert len(cut) > 1 and all(collate(samples, m, min_shared=MIN_SHARED).layout.computed_tokens <= 60
                                for m in cut)


# ----------------------------------------------------------------------------------- FSDP2 and tensor parallel


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, tp_size: int, out: str) -> None:
    import torch.distributed as dist

    from agentrl.training.parallel import init_parallel, shard_model

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    state = init_parallel(tp_size=tp_size)
    try:
        model = tiny_llama(seed=2, dtype=DTYPE).train()
        samples = with_behaviour(model, step_data())
        if tp_size == 1:  # FSDP2 with activation checkpointing, as the trainer sets it up (before sharding)
            model.activation_checkpointing_enable()
        shard_model(model, state, bf16=False)
        # FSDP2: rank 0 gets the branchy trajectory (a deeper forest, more micro-batches), rank 1 flat groups
        if tp_size == 1:
            mine, budget = (samples[:4] + samples[7:9], 120) if rank == 0 else (samples[4:7] + samples[9:], 10_000)
        else:  # tensor-parallel peers hold the same samples
            mine, budget = samples, 10_000
        batches = pack_micro_batches(mine, max_tokens=budget, min_shared=MIN_SHARED)
        depths = [1 + max(node.depth for node in build_forest([mine[i].input_ids for i in b.sample_indices],
                                                               MIN_SHARED).nodes) for b in batches]
        align_passes(batches, state)
        config = LOSSES["gspo"]
        normaliser = global_normaliser(config, batches, state)
        for index, batch in enumerate(batches):
            model.set_requires_gradient_sync(index == len(batches) - 1)
            new = layout_logprobs(model, batch.layout)
            loss, _ = loss_fn(config, LossInput.from_batch(batch, new, current_version=2), normaliser)
            (loss * state.dp_size).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"grads": grads, "depths": depths}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp_size", [1, 2], ids=["fsdp2", "tensor-parallel"])
def test_two_gloo_ranks_give_the_per_sample_gradient(tp_size: int, tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(_free_port(), tp_size, str(out)), nprocs=2, join=True)
    result = torch.load(out)
    model = tiny_llama(seed=2, dtype=DTYPE).train()
    samples = with_behaviour(model, step_data())
    batches = pack_micro_batches(samples, max_tokens=10_000, min_shared=MIN_SHARED)
    want, _ = step_gradients(model, LOSSES["gspo"], batches, samples, shared=False)
    assert_close_gradients(result["grads"], want)
    if tp_size == 1:
        assert max(result["depths"]) > 1, "rank 0 must forward a deep prefix forest where rank 1's are flat"
