"""Helpers for the training-core tests: a tiny random Llama built in code and synthetic multi-turn trajectories."""

from __future__ import annotations

import random
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.training.batching import MicroBatch, pack_micro_batches
from agentrl.training.logprobs import model_token_logprobs
from agentrl.training.losses import LossConfig, LossInput, LossMetrics, global_normaliser, loss_fn
from agentrl.trajectory.merge import CallTokens, MergedSample, merge_trajectory

VOCAB = 97


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> LlamaForCausalLM:
    """A seeded, randomly initialised 2-layer Llama (hidden 32, GQA) in eval mode (no dropout)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.4,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    return (in_float64(model) if dtype == torch.float64 else model).eval()


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 throughout: its parameters, and its RMSNorms, which Hugging Face computes in float32
    whatever the model's dtype (so gradients would be rounded to float32 per token, and two exact-equal paths
    that sum them in another order would differ by ~1e-7 relative)."""
    model.to(torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def forward(hidden: torch.Tensor, norm: torch.nn.Module = module) -> torch.Tensor:
                variance = hidden.pow(2).mean(-1, keepdim=True)
                return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))
            module.forward = forward
    return model


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def delta_trajectory(
    rng: random.Random,
    turns: int,
    *,
    prompt_len: int = 12,
    delta_len: int = 4,
    out_len: int = 5,
    prefix: str = "c",
    first_version: int = 0,
) -> list[CallTokens]:
    """``turns`` calls stored the way samplers store them: full prompt first, then previous call + delta.

    Logprobs are placeholders (negative numbers); versions increase by one per turn; advantage 1.0 each.
    """
    calls: list[CallTokens] = []
    for k in range(turns):
        out = random_ids(rng, out_len + k % 3)
        logprobs = [-0.1 * (i + 1) for i in range(len(out))]
        common = {"output_ids": out, "output_logprobs": logprobs, "weight_version": first_version + k, "advantage": 1.0}
        if k == 0:
            calls.append(CallTokens(call_id=f"{prefix}{k}", input_ids=random_ids(rng, prompt_len), **common))
        else:
            calls.append(
                CallTokens(
                    call_id=f"{prefix}{k}",
                    previous_call_id=calls[-1].call_id,
                    prompt_delta_ids=random_ids(rng, delta_len + k % 2),
                    **common,
                )
            )
    return calls


@torch.no_grad()
def per_call_output_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logprobs of ``output`` after ``prompt`` from one forward pass over that call alone (no padding)."""
    ids = torch.tensor([prompt + output])
    return model_token_logprobs(model, ids)[0, len(prompt) :]


def step_samples(model: torch.nn.Module, seed: int = 0, count: int = 6) -> list[MergedSample]:
    """Merged samples of ``count`` trajectories with mixed-sign advantages, several weight versions and behaviour
    logprobs = the model's own logprobs + noise (so ratios spread around 1 and clipping/masking happen)."""
    rng = random.Random(seed)
    samples: list[MergedSample] = []
    for index in range(count):
        calls = delta_trajectory(rng, 1 + index % 4, prompt_len=6 + index, prefix=f"s{index}-", first_version=index % 3)
        calls = [replace(c, advantage=rng.choice([-1.5, -0.5, 0.25, 1.0])) for c in calls]
        samples.extend(merge_trajectory(calls).samples)
    generator = torch.Generator().manual_seed(seed)
    for sample in samples:
        with torch.no_grad():
            own = model_token_logprobs(model, torch.tensor([sample.input_ids]))[0].double()
        noise = 0.3 * torch.randn(len(own), generator=generator, dtype=torch.float64)
        sample.logprobs = [
            float(lp + z) if m else 0.0 for lp, z, m in zip(own.tolist(), noise.tolist(), sample.loss_mask)
        ]
    return samples


def accumulate_gradient(
    model: torch.nn.Module,
    config: LossConfig,
    batches: list[MicroBatch],
    normaliser: float,
    current_version: int = 3,
) -> tuple[torch.Tensor, LossMetrics]:
    """Forward/backward every micro-batch with the given normaliser; return the flat accumulated gradient."""
    model.zero_grad(set_to_none=True)
    metrics = LossMetrics()
    for mb in batches:
        new = model_token_logprobs(model, mb.input_ids, mb.attention_mask)
        loss, m = loss_fn(config, LossInput.from_batch(mb, new, current_version), normaliser)
        loss.backward()
        metrics = metrics + m
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return grad, metrics


def rank_worker(rank: int, world: int, port: int, config_json: str, out_path: str) -> None:
    """One data-parallel rank: train on samples ``rank::world`` with the global normaliser, all-reduce (SUM) the
    gradients and metrics, and (rank 0) save them to ``out_path``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from agentrl.training.parallel import ParallelState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = LossConfig.model_validate_json(config_json)
        model = tiny_llama(seed=3, dtype=torch.float64)
        samples = step_samples(model)
        mine = samples[rank::world]
        batches = pack_micro_batches(mine, max_tokens=48)
        parallel = ParallelState(rank=rank, world_size=world, dp_rank=rank, dp_size=world,
                                 mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp")))
        normaliser = global_normaliser(config, batches, parallel)
        grad, metrics = accumulate_gradient(model, config, batches, normaliser)
        dist.all_reduce(grad)
        metrics = metrics.all_reduce(parallel)
        if rank == 0:
            torch.save({"grad": grad, "normaliser": normaliser, "metrics": metrics.as_dict(),
                        "num_batches": len(batches)}, out_path)
    finally:
        dist.destroy_process_group()
