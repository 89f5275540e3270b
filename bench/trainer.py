"""Trainer throughput at the embedded model's size (SmolLM2-135M) against a plain Hugging Face loop, same run; and
what shared prefixes and bf16 buy.

    .venv/bin/python bench/trainer.py [--model_name_or_path DIR | --model_config bench/configs/NAME.json]
                                      [--steps 4] [--samples_per_step 4] [--turns 4] [--turn_tokens 64]
                                      [--group_size 1] [--max_tokens 4096] [--loss_calculater GRPO]
                                      [--dtype auto] [--gradient_checkpointing] [--prefix_shapes default long]
                                      [--prefix_repeats 2] [--prefix_only] [--profile] [--json FILE] [--dry_run]

``--model_config`` builds a model of that architecture (a Hugging Face ``config.json``; ``bench/configs/`` has
Qwen3-0.6B, Qwen2.5-1.5B, Qwen3-4B and Qwen2.5-7B shapes) with seeded random weights, saved to a temporary
directory with the embedded model's tokenizer: throughput and MFU depend on the shapes, not on the weights.

Trainer vs plain loop. Both sides train on the same synthetic multi-turn samples (random tokens, ``--turns`` calls of
about ``--turn_tokens`` new prompt + output tokens each, merged into one sequence per trajectory as the samplers'
group stage does; ``--group_size`` trajectories share their first prompt; behaviour logprobs from the model itself)
at the same precision (``--dtype``, resolved as the trainer resolves it):

* ``trainer``: ``agentrl.train`` itself, in this process, on an embedded NX-27017 database holding the samples
  (``--enable_sampling false``: no weight publishing; claims, loss, clipping, AdamW, metrics, all included).
  Throughput: the step's tokens over its compute time (``step_s``) and over the wall time between two steps'
  metrics (everything the trainer does per step);
* ``baseline``: a bare loop over the same samples, one padded row per sample: ``model(input_ids).logits`` → token
  logprobs → mean negative logprob of the loss tokens → backward → clip → AdamW step.

The first step of each side is a warm-up and is not counted; figures are medians over the other steps. On CUDA the
script prints the MFU estimate ``6 × parameters × tokens/s / peak bf16 FLOP/s`` (attention FLOPs left out).

Shared prefixes and precision (``--prefix_shapes``; none: skipped). One GRPO group at a time, forward + backward of
the trainer's own forward (``agentrl.training.logprobs.layout_logprobs``, fp32 LM head at the loss positions), median
seconds per group over ``--prefix_repeats`` after a warm-up:

* ``default``: the default run's shape, a group of 4 trajectories of 2 turns: a 310-token prompt shared by the
  group, then about 52 tokens of their own (two outputs and a tool result);
* ``long``: an agent with a long prompt, a group of 8 trajectories of 8 turns: a 2,048-token shared prompt, then
  8 × (48 observation + 64 output) tokens of their own;
* ``prompt_1k`` and ``group_16`` (not measured unless named): the default shape with a 1,024-token prompt, and with
  16 trajectories in the group; with the others they place where sharing starts to pay on a GPU, whose model calls
  are bound by kernel launches at these sizes.

Both sides get the token budget ``max(--max_tokens, the group's tokens with its prompt once)``, so the group's
prompt is forwarded once (the long shape holds about 9,200 tokens in one micro-batch: over 20 GB of activations
for SmolLM2-135M on CPU). ``--gradient_checkpointing`` recomputes activations on both sides; on CPU a shape whose
per-sample micro-batches would need more than 80 % of the free memory (``activation_bytes``) is measured so anyway,
said in the output and in the JSON (``[long_]gradient_checkpointing``).
``shared_prefix_speedup`` is one forward per sample over the shared forward, at ``--dtype`` on both sides;
``bf16_speedup`` is fp32 over ``--dtype auto``, both with shared prefixes (1.0 where ``auto`` is fp32); the
keys of the other shapes start with their name (``long_``...). ``--prefix_only`` skips the trainer-vs-loop part;
``--profile`` adds, per shape, ``torch.profiler``'s operators of one shared forward + backward with the largest self
CPU time (and their device time on CUDA): where a launch-bound pass spends its time.

The LM head alone (``--head_tokens``, default 16,384; 0 skips it): forward + backward of the trainer's chunked head
(``agentrl.training.logprobs.head_logprobs``) on the model's final hidden states for random tokens, in fp32 and with
the product in bf16 and fp32 output (what bf16 mode runs on CUDA; on the CPU the product is emulated from fp32
copies, so its speed there says nothing): tokens/s, peak memory on CUDA, ``head_speedup`` (compute dtype over fp32)
and ``head_mean_abs_diff`` (nats between the two heads' logprobs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from agentrl.precision import resolve_dtype
from agentrl.store import DBRecordData, Metric, sync_client, with_database
from agentrl.store.embedded import EmbeddedServer
from agentrl.training.batching import MicroBatch, collate, pack_micro_batches
from agentrl.training.data import to_merged
from agentrl.training.logprobs import layout_logprobs, token_logprobs
from agentrl.trajectory.merge import CallTokens, MergedSample, merge_trajectory

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
PREFIX_SHAPES = {  # group size, shared prompt tokens, turns, new observation tokens per later turn, output tokens
    "default": {"group_size": 4, "prompt": 310, "turns": 2, "observation": 12, "output": 20},
    "long": {"group_size": 8, "prompt": 2048, "turns": 8, "observation": 48, "output": 64},
    "prompt_1k": {"group_size": 4, "prompt": 1024, "turns": 2, "observation": 12, "output": 20},
    "group_16": {"group_size": 16, "prompt": 310, "turns": 2, "observation": 12, "output": 20},
}
MEASURED_BY_DEFAULT = ["default", "long"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_samples(model: torch.nn.Module, count: int, turns: int, turn_tokens: int, seed: int, group_size: int = 1
                 ) -> list[DBRecordData]:
    """``count`` merged trajectories of ``turns`` calls with random tokens; each ``group_size`` consecutive ones share
    their first prompt (a group); behaviour logprobs from ``model``."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    samples, prompt = [], []
    for index in range(count):
        if index % group_size == 0:
            prompt = tokens(turn_tokens)
        calls, previous = [], None
        for turn in range(turns):
            output = tokens(turn_tokens // 2)
            calls.append(CallTokens(
                call_id=f"{index}/{turn}", output_ids=output, output_logprobs=[0.0] * len(output),
                input_ids=prompt if previous is None else None, previous_call_id=previous,
                prompt_delta_ids=tokens(turn_tokens // 2) if previous else (), weight_version=0,
                advantage=1.0 if index % 2 else -1.0))
            previous = calls[-1].call_id
        (merged,) = merge_trajectory(calls).samples
        with torch.no_grad():
            ids = torch.tensor([merged.input_ids], device=model.device)
            behaviour = token_logprobs(model(input_ids=ids).logits, ids)[0].tolist()
        samples.append(DBRecordData(
            id=f"bench{index}", record_id=f"bench{index}", task_id=f"bench{index // group_size}", seq=index + 1,
            input_ids=merged.input_ids, loss_mask=merged.loss_mask,
            logprobs=[lp if m else 0.0 for lp, m in zip(behaviour, merged.loss_mask)], versions=merged.versions,
            advantages=merged.advantages, reward=float(index % 2), turn_boundaries=merged.turn_boundaries,
            num_tokens=merged.num_tokens))
    return samples


def baseline(model_path: Path, steps: list[list[DBRecordData]], max_tokens: int, lr: float, bf16: bool,
             device: torch.device, gradient_checkpointing: bool = False) -> list[float]:
    """Tokens/s of each step of a plain Hugging Face forward+backward+AdamW loop on the same micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
    if gradient_checkpointing:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rates = []
    for samples in steps:
        batches = pack_micro_batches([to_merged(s) for s in samples], max_tokens, min_shared=None)
        tokens = sum(s.num_tokens for s in samples)
        synchronize(device)
        started = time.perf_counter()
        for batch in batches:
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logprobs = token_logprobs(model(input_ids=batch.input_ids, use_cache=False).logits,
                                          batch.input_ids)
            loss = -(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        rates.append(tokens / (time.perf_counter() - started))
    return rates


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer(uri: str, model_path: Path, output_dir: Path, args: argparse.Namespace, bf16: bool
            ) -> tuple[list[float], list[float]]:
    """Run ``agentrl.train`` on the queued samples; (compute tokens/s, wall tokens/s) of each step."""
    from agentrl.train import main

    flags = ["--db_connection_string", uri, "--model_name_or_path", str(model_path), "--output_dir",
             str(output_dir), "--train_batch_size", str(args.samples_per_step), "--max_steps", str(args.steps + 1),
             "--max_tokens", str(args.max_tokens), "--save_steps", "0", "--enable_sampling", "false",
             "--loss_calculater", args.loss_calculater, "--learning_rate", "1e-5",
             "--dtype", "bfloat16" if bf16 else "float32",
             "--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    if main(flags) != 0:
        raise SystemExit("the trainer failed")
    client = sync_client(uri)
    try:
        docs = sorted((Metric.from_mongo(d) for d in client.get_default_database().Metric.find()),
                      key=lambda m: m.step)
    finally:
        client.close()
    compute = [m.values["tokens"] / m.values["step_s"] for m in docs]
    wall = [b.values["tokens"] / (b.created_at - a.created_at).total_seconds() for a, b in itertools.pairwise(docs)]
    return compute, [compute[0], *wall]


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (plus one warm-up step)")
    parser.add_argument("--samples_per_step", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn_tokens", type=int, default=64)
    parser.add_argument("--group_size", type=int, default=1, help="trajectories sharing their first prompt")
    parser.add_argument("--max_tokens", type=int, default=4096, help="forwarded tokens per micro-batch")
    parser.add_argument("--loss_calculater", default="GRPO")
    parser.add_argument("--model_config", default=None, help="a config.json to build a random-weight model from")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="both loops recompute activations")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="compute precision of both loops, resolved as the trainer resolves it")
    parser.add_argument("--prefix_shapes", nargs="*", default=MEASURED_BY_DEFAULT, choices=list(PREFIX_SHAPES),
                        help="group shapes for the shared-prefix and bf16 figures (none: skip them)")
    parser.add_argument("--prefix_only", action="store_true", help="skip the trainer-vs-plain-loop measurement")
    parser.add_argument("--profile", action="store_true",
                        help="per prefix shape, the operators of one shared pass with the most self CPU time")
    parser.add_argument("--prefix_repeats", type=int, default=2, help="measured forward+backward passes per figure")
    parser.add_argument("--head_tokens", type=int, default=16384, help="tokens of the LM-head measurement (0: skip)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--dry_run", action="store_true", help="check the arguments and the model, measure nothing")
    args = parser.parse_args()
    if args.model_config and args.model_name_or_path:
        parser.error("give --model_name_or_path or --model_config, not both")
    if args.model_config and not Path(args.model_config).is_file():
        parser.error(f"--model_config {args.model_config}: no such file")

    from agentrl.inference.embedded_model import default_model_path
    from agentrl.inference.tiny_model import build_random_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = resolve_dtype(args.dtype, device) == torch.bfloat16
    if args.dry_run:
        from transformers import AutoConfig

        config = AutoConfig.for_model(**json.loads(Path(args.model_config).read_text())) if args.model_config \
            else AutoConfig.from_pretrained(args.model_name_or_path or default_model_path())
        print(f"dry run: would train a {config.model_type} model ({config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}) on {device}, {'bf16' if bf16 else 'fp32'}, {args.samples_per_step} samples of "
              f"{args.turns} turns per step; prefix shapes: {' '.join(args.prefix_shapes) or 'none'}")
        return 0
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-model-") as built:
        if args.model_config:
            model_path = build_random_model(args.model_config, Path(built) / Path(args.model_config).stem)
        else:
            model_path = Path(args.model_name_or_path or default_model_path())
        figures = {} if args.prefix_only else measure(args, model_path, device, bf16)
        if args.prefix_shapes:
            figures.update(measure_prefix(args, model_path, device))
        if args.head_tokens:
            figures.update(measure_head(model_path, device, args.head_tokens))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace, model_path: Path, device: torch.device, bf16: bool) -> dict:
    """Run both loops, print the table and return the figures."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    parameters = sum(p.numel() for p in model.parameters())
    samples = make_samples(model, (args.steps + 1) * args.samples_per_step, args.turns, args.turn_tokens, seed=0,
                           group_size=args.group_size)
    del model
    steps = [samples[i:i + args.samples_per_step] for i in range(0, len(samples), args.samples_per_step)]
    tokens_per_step = statistics.mean(sum(s.num_tokens for s in step) for step in steps)

    base_rates = baseline(model_path, steps, args.max_tokens, 1e-5, bf16, device, args.gradient_checkpointing)[1:]
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-trainer-") as tmp:
        server = EmbeddedServer(data_dir=Path(tmp) / "db", port=free_port())
        server.start()
        try:
            uri = with_database(server.uri(), "bench_trainer")
            client = sync_client(uri)
            client.get_default_database().DBRecordData.insert_many(
                [{**s.to_mongo(), "status": "queued"} for s in samples])
            client.close()
            compute, wall = trainer(uri, model_path, Path(tmp) / "out", args, bf16)
        finally:
            server.stop()
    compute, wall = compute[1:], wall[1:]

    base, ours, ours_wall = (statistics.median(x) for x in (base_rates, compute, wall))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\nmodel {model_path.name}: {parameters / 1e6:.1f}M parameters on {name}; {args.samples_per_step} samples "
          f"of {args.turns} turns per step, {tokens_per_step:.0f} tokens per step, {args.steps} measured steps "
          f"(medians), {'bf16' if bf16 else 'fp32'}\n")
    print("| loop | tokens/s | vs baseline |")
    print("|---|---:|---:|")
    print(f"| baseline: plain HF forward+backward+AdamW | {base:,.0f} | 1.00 |")
    print(f"| agentrl trainer, step compute | {ours:,.0f} | {ours / base:.2f} |")
    print(f"| agentrl trainer, wall between steps | {ours_wall:,.0f} | {ours_wall / base:.2f} |")
    figures = {"device": name, "model": model_path.name, "parameters": parameters, "precision": "bf16" if bf16
               else "fp32", "tokens_per_step": tokens_per_step, "baseline_tokens_per_s": base,
               "trainer_tokens_per_s": ours, "trainer_wall_tokens_per_s": ours_wall, "trainer_vs_baseline": ours / base}
    peak = peak_flops(device)
    if peak:
        for label, rate in (("baseline", base), ("trainer", ours)):
            figures[f"{label}_mfu"] = 6 * parameters * rate / peak
            print(f"MFU {label}: {figures[f'{label}_mfu']:.1%} (6·N·tokens/s over {peak / 1e12:.0f} TFLOP/s)")
        figures["peak_flops"] = peak
    elif device.type == "cuda":
        print("MFU: unknown peak FLOP/s for this GPU")
    return figures


def measure_head(model_path: Path, device: torch.device, tokens: int, repeats: int = 3) -> dict:
    """The LM head alone, fp32 against the compute dtype (bf16 product, fp32 output): print and return the figures."""
    from transformers import AutoModelForCausalLM

    from agentrl.training.logprobs import head_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (tokens // 1024, 1024), generator=generator).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        hidden = torch.cat([model.model(input_ids=row[None]).last_hidden_state[0] for row in ids]).bfloat16()
    head = model.get_output_embeddings()
    weight = head.weight.detach().clone().requires_grad_()
    targets = ids.reshape(-1)
    del model
    results: dict[str, dict[str, float]] = {}
    picked = {}
    for label, dtype in (("fp32", None), ("compute_dtype", torch.bfloat16)):
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up
            states = hidden.detach().clone().requires_grad_()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            synchronize(device)
            started = time.perf_counter()
            out = head_logprobs(states[None], weight, None, targets[None], 1.0, matmul_dtype=dtype)
            out.sum().backward()
            synchronize(device)
            seconds.append(time.perf_counter() - started)
            weight.grad = None
        picked[label] = out.detach()[0]
        results[label] = {"tokens_per_s": tokens / statistics.median(seconds[1:]),
                          "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                          else float("nan")}
    speedup = results["compute_dtype"]["tokens_per_s"] / results["fp32"]["tokens_per_s"]
    diff = float((picked["compute_dtype"] - picked["fp32"]).abs().mean())
    note = "" if device.type == "cuda" else " (CPU: the bf16 product is emulated in fp32, its speed means nothing)"
    print(f"\nLM head alone, {tokens:,} tokens, vocabulary {weight.shape[0]:,}, forward + backward{note}")
    print("| head | tokens/s | peak GiB |")
    print("|---|---:|---:|")
    for label, figures in results.items():
        print(f"| {label} | {figures['tokens_per_s']:,.0f} | {figures['peak_gib']:.2f} |")
    print(f"head_speedup {speedup:.2f}, head_mean_abs_diff {diff:.2e} nats")
    return {"head_tokens": tokens, "head": results, "head_speedup": speedup, "head_mean_abs_diff": diff,
            "head_product_emulated": device.type != "cuda"}


def prefix_group(shape: dict[str, int], seed: int) -> list[MergedSample]:
    """One group of ``shape`` (see ``PREFIX_SHAPES``): random tokens, the first prompt shared, loss on the outputs."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    prompt, samples = tokens(shape["prompt"]), []
    for index in range(shape["group_size"]):
        calls: list[CallTokens] = []
        for turn in range(shape["turns"]):
            output = tokens(shape["output"] + rng.randrange(-4, 5))
            calls.append(CallTokens(
                call_id=f"{index}/{turn}", output_ids=output, output_logprobs=[-1.0] * len(output),
                input_ids=prompt if turn == 0 else None, previous_call_id=calls[-1].call_id if turn else None,
                prompt_delta_ids=tokens(shape["observation"]) if turn else (), weight_version=0,
                advantage=1.0 if index % 2 else -1.0))
        samples.extend(merge_trajectory(calls).samples)
    return samples


def seconds_per_group(model: torch.nn.Module, batches: list[MicroBatch], bf16: bool, device: torch.device,
                      repeats: int) -> float:
    """Median time of the trainer's forward (shared prefixes per the batches' layouts) + backward over ``batches``."""
    times = []
    for _ in range(repeats + 1):  # the first pass is a warm-up
        synchronize(device)
        started = time.perf_counter()
        group_pass(model, batches, bf16, device)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def group_pass(model: torch.nn.Module, batches: list[MicroBatch], bf16: bool, device: torch.device) -> None:
    """One forward + backward over ``batches`` (gradients dropped afterwards)."""
    for batch in batches:
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logprobs = layout_logprobs(model, batch.layout)
        (-(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    model.zero_grad(set_to_none=True)


def activation_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Rough estimate of the fp32 activations a forward + backward over ``tokens`` tokens keeps: ~2 MB a token for
    SmolLM2-135M, whose long-shape micro-batches (~9,200 tokens) were killed for memory on a 24 GiB machine."""
    config = model.config
    return tokens * config.num_hidden_layers * (20 * config.hidden_size + 6 * config.intermediate_size) * 4


def measure_prefix(args: argparse.Namespace, model_path: Path, device: torch.device) -> dict:
    """Seconds per group: one forward per sample vs shared prefixes at ``--dtype``, and fp32 vs ``auto`` shared."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()
    bf16 = resolve_dtype(args.dtype, device) == torch.bfloat16
    auto_bf16 = resolve_dtype("auto", device) == torch.bfloat16
    figures: dict = {"precision_auto": "bf16" if auto_bf16 else "fp32"}
    print("\n| group shape | tokens: per sample / shared | per sample, s | shared, s | speedup | shared fp32, s | "
          "shared auto, s | auto vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.prefix_shapes:
        shape = PREFIX_SHAPES[name]
        samples = prefix_group(shape, seed=1)
        budget = max(args.max_tokens, collate(samples).layout.computed_tokens)  # the group's prompt forwarded once
        alone = pack_micro_batches(samples, budget, min_shared=None)
        shared = pack_micro_batches(samples, budget)
        needed = activation_bytes(model, max(b.layout.computed_tokens for b in alone))
        available = psutil.virtual_memory().available
        recompute = not args.gradient_checkpointing and device.type == "cpu" and needed > 0.8 * available
        if recompute:  # for this shape only, both sides
            print(f"({name}: about {needed / 2**30:.0f} GiB of activations per micro-batch, "
                  f"{available / 2**30:.0f} GiB available: both sides recompute activations)")
            model.activation_checkpointing_enable()
        dense_tokens = sum(b.layout.computed_tokens for b in alone)
        shared_tokens = sum(b.layout.computed_tokens for b in shared)
        seconds = {
            "dense": seconds_per_group(model, alone, bf16, device, args.prefix_repeats),
            "shared": seconds_per_group(model, shared, bf16, device, args.prefix_repeats),
            "shared_fp32": seconds_per_group(model, shared, False, device, args.prefix_repeats),
        }
        seconds["shared_auto"] = (seconds_per_group(model, shared, True, device, args.prefix_repeats) if auto_bf16
                                  else seconds["shared_fp32"])
        prefix = "" if name == "default" else f"{name}_"
        if args.profile:
            figures[f"{prefix}shared_profile"] = profile_pass(model, shared, bf16, device)
        if recompute:
            model.activation_checkpointing_disable()
        figures[f"{prefix}gradient_checkpointing"] = args.gradient_checkpointing or recompute
        figures.update({f"{prefix}shared_prefix_speedup": seconds["dense"] / seconds["shared"],
                        f"{prefix}bf16_speedup": seconds["shared_fp32"] / seconds["shared_auto"],
                        f"{prefix}group_seconds": seconds,
                        f"{prefix}group_tokens": {"per_sample": dense_tokens, "shared": shared_tokens,
                                                  "real": sum(s.num_tokens for s in samples)}})
        print(f"| {name}: {shape['group_size']} × ({shape['prompt']} shared + {shape['turns']} turns) | "
              f"{dense_tokens:,} / {shared_tokens:,} | {seconds['dense']:.2f} | {seconds['shared']:.2f} | "
              f"{seconds['dense'] / seconds['shared']:.2f} | {seconds['shared_fp32']:.2f} | "
              f"{seconds['shared_auto']:.2f} | {seconds['shared_fp32'] / seconds['shared_auto']:.2f} |")
    print(f"(per sample and shared at --dtype {args.dtype}; auto is {figures['precision_auto']} here)")
    for name in args.prefix_shapes if args.profile else ():
        prefix = "" if name == "default" else f"{name}_"
        print(f"\n{name}, one shared forward + backward: operators by self CPU time\n")
        print("| operator | calls | self CPU, ms | self device, ms |\n|---|---:|---:|---:|")
        for row in figures[f"{prefix}shared_profile"]:
            print(f"| {row['name']} | {row['calls']} | {row['self_cpu_ms']:.1f} | {row['self_device_ms']:.1f} |")
    return figures


def profile_pass(model: torch.nn.Module, batches: list[MicroBatch], bf16: bool, device: torch.device,
                 top: int = 15) -> list[dict]:
    """The ``top`` operators by self CPU time of one forward + backward over ``batches`` (after a warm-up pass)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    group_pass(model, batches, bf16, device)
    with profile(activities=activities) as prof:
        group_pass(model, batches, bf16, device)
        synchronize(device)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3} for e in rows]


if __name__ == "__main__":
    sys.exit(main())
