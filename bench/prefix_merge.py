"""Benchmark: forward+backward wall time of prefix-merged trajectories vs one pass per turn.

A randomly initialised Llama (default hidden 256, 4 layers) trains on synthetic multi-turn trajectories with
realistic turn lengths (a 300-token system+user prompt, 40-token tool deltas, 60-token outputs). For each turn
count it times one merged pass (``merge_trajectory``) against one pass per turn (each turn's prompt + output as
its own sequence, as without merging), both through the real GRPO loss with the same global normaliser, and
checks that the two paths give the same per-token logprobs. Prints a table of medians with the token ratio
``tokens_if_unmerged / tokens_forwarded``, the speedup and ``speedup / token ratio`` (target >= 0.9).

    .venv/bin/python bench/prefix_merge.py [--turns 2 4 8 16] [--repeats 5] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.training.batching import collate
from agentrl.training.logprobs import model_token_logprobs
from agentrl.training.losses import LossConfig, LossInput, loss_fn
from agentrl.trajectory.merge import CallTokens, MergedSample, full_prompts, merge_trajectory


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).train()


def trajectory(turns: int, args: argparse.Namespace, rng: random.Random) -> list[CallTokens]:
    """``turns`` calls stored as the sampler stores them (full first prompt, then previous call + delta)."""
    calls: list[CallTokens] = []
    for k in range(turns):
        out = [rng.randrange(1, args.vocab) for _ in range(args.output)]
        common = {"output_ids": out, "output_logprobs": [-1.0] * len(out), "weight_version": 0, "advantage": 1.0}
        if k == 0:
            prompt = [rng.randrange(1, args.vocab) for _ in range(args.prompt)]
            calls.append(CallTokens(call_id="0", input_ids=prompt, **common))
        else:
            delta = [rng.randrange(1, args.vocab) for _ in range(args.delta)]
            calls.append(CallTokens(call_id=str(k), previous_call_id=str(k - 1), prompt_delta_ids=delta, **common))
    return calls


def per_turn_samples(calls: list[CallTokens]) -> list[MergedSample]:
    """One sample per call (its full prompt + output): what training without merging forwards."""
    return [
        merge_trajectory([CallTokens(c.call_id, c.output_ids, c.output_logprobs, input_ids=p, weight_version=0,
                                     advantage=c.advantage)]).samples[0]
        for c, p in zip(calls, full_prompts(calls))
    ]


def train_pass(model: LlamaForCausalLM, samples: list[MergedSample], normaliser: float, device: str) -> list:
    """Forward + loss + backward of each sample as its own pass; returns the logprobs of every pass."""
    config = LossConfig(loss_calculater="GRPO")
    outputs = []
    for sample in samples:
        mb = collate([sample]).to(device)
        new = model_token_logprobs(model, mb.input_ids)
        loss, _ = loss_fn(config, LossInput.from_batch(mb, new), normaliser)
        loss.backward()
        outputs.append(new.detach()[0])
    return outputs


def timed(model: LlamaForCausalLM, samples: list[MergedSample], normaliser: float, device: str) -> tuple[float, list]:
    model.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = train_pass(model, samples, normaliser, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def measure(model: LlamaForCausalLM, turns: int, args: argparse.Namespace) -> dict[str, float]:
    calls = trajectory(turns, args, random.Random(turns))
    result = merge_trajectory(calls)
    merged = result.samples
    unmerged = per_turn_samples(calls)
    normaliser = float(sum(sum(s.loss_mask) for s in merged))
    timed(model, merged, normaliser, args.device)  # warm-up
    timed(model, unmerged, normaliser, args.device)
    t_merged, t_turns = [], []
    for _ in range(args.repeats):
        seconds, merged_lp = timed(model, merged, normaliser, args.device)
        t_merged.append(seconds)
        seconds, turn_lp = timed(model, unmerged, normaliser, args.device)
        t_turns.append(seconds)
    max_diff = 0.0
    for turn, alone in zip(merged[0].turns, turn_lp):
        start = turn.output_start
        diff = (merged_lp[0][start : turn.output_end] - alone[start : turn.output_end]).abs().max().item()
        max_diff = max(max_diff, diff)
    ratio = result.tokens_if_unmerged / result.tokens_forwarded
    speedup = statistics.median(t_turns) / statistics.median(t_merged)
    return {
        "turns": turns,
        "tokens_forwarded": result.tokens_forwarded,
        "tokens_if_unmerged": result.tokens_if_unmerged,
        "token_ratio": ratio,
        "merged_s": statistics.median(t_merged),
        "per_turn_s": statistics.median(t_turns),
        "speedup": speedup,
        "speedup_over_ratio": speedup / ratio,
        "max_abs_logprob_diff": max_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=300, help="tokens of the first prompt (system + user)")
    parser.add_argument("--delta", type=int, default=40, help="tokens of each tool-result delta")
    parser.add_argument("--output", type=int, default=60, help="tokens of each model output")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({params:.1f}M params), "
          f"{args.dtype} on {args.device}, {torch.get_num_threads()} threads; turns: prompt {args.prompt}, "
          f"delta {args.delta}, output {args.output} tokens; median of {args.repeats}")
    rows = [measure(model, turns, args) for turns in args.turns]
    header = ("turns", "tok merged", "tok per-turn", "token ratio", "merged ms", "per-turn ms", "speedup",
              "speedup/ratio", "max |dlogp|")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['turns']} | {r['tokens_forwarded']} | {r['tokens_if_unmerged']} | {r['token_ratio']:.2f} | "
              f"{1000 * r['merged_s']:.0f} | {1000 * r['per_turn_s']:.0f} | {r['speedup']:.2f} | "
              f"{r['speedup_over_ratio']:.2f} | {r['max_abs_logprob_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
