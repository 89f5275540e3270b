"""Benchmark ``agentrl engine``: generated tokens/s at 1, 4 and 16 concurrent requests vs sequential generate.

Usage: ``.venv/bin/python bench/engine.py [--model_name_or_path DIR | --model_config FILE] [--device cpu|cuda]
[--concurrency 1 4 16] [--repeats 3] [--compare_eager] [--output FILE] [--dry_run]``

``--model_config`` builds a model of that architecture (a Hugging Face ``config.json``, e.g.
``bench/configs/qwen3-0.6b.json``) with seeded random weights and the embedded tokenizer: speed depends on the
shapes, not on the weights.

In one run, with the same model, device, dtype and thread count:

* baseline: sequential ``model.generate`` calls (batch size 1, sampling at temperature 1, exactly
  ``--max_new_tokens`` tokens each) in this process;
* engine: a real ``agentrl engine`` subprocess, fed through its HTTP API (``SGLangClient``) with rounds of
  N concurrent ``/generate`` requests of the same length (``ignore_eos``), for N in ``--concurrency``;
* with ``--compare_eager`` on CUDA, the same rounds from a second engine with ``--disable_cuda_graph``: decode
  steps eager instead of replayed as CUDA graphs (``captured_speedup``: captured over eager tokens/s);
* weight load: ``/update_weights_from_disk`` of the model directory, timed end to end;
* logprob mismatch: the engine's logprobs vs this process's fp32 forward pass (``logprob_mismatch``);
* CPU time: tokens per CPU-second of the baseline (this process) and of the engine process (all its threads), a
  ratio that holds better than tokens/s on a machine other jobs share;
* the machine's limit: the rate of a bf16 (and an fp32) matmul of the model's shape, ``[256, hidden] x [hidden,
  4 hidden]``, with the same thread count, before and after the engine rounds (the higher is kept). The engine's
  arithmetic rate is ``2 x parameters x tokens/s``; ``fraction_of_limit`` is that over the bf16 rate.

Every figure is the median over ``--repeats`` rounds. The table is printed and written as JSON under
``bench/results/`` (not versioned).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.inference import SGLangClient
from agentrl.inference.consistency import logprob_mismatch
from agentrl.inference.embedded_model import default_model_path
from agentrl.inference.engine import resolve_device, resolve_dtype
from agentrl.inference.process import EngineProcess
from agentrl.inference.tiny_model import build_random_model

QUESTIONS = [
    "What is 17 times 23?", "Name three prime numbers above 50.", "Explain what a hash table is.",
    "Write a haiku about the sea.", "How many days are in a leap year?", "What is the capital of Peru?",
    "Give me a synonym for 'rapid'.", "Why is the sky blue?", "Convert 100 Fahrenheit to Celsius.",
    "What does HTTP stand for?", "List the planets of the solar system.", "What is 2 to the power of 10?",
    "Summarise the plot of Hamlet in one sentence.", "What is a neural network?", "Spell 'necessary' backwards.",
    "What is the square root of 144?",
]


def prompts(tokenizer, count: int) -> list[list[int]]:
    rendered = []
    for i in range(count):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rendered.append(tokenizer.encode(text, add_special_tokens=False))
    return rendered


def matmul_rate(hidden: int, dtype: torch.dtype, device: torch.device, seconds: float = 1.0) -> float:
    """GFLOP/s of ``[256, hidden] x [hidden, 4 hidden]`` matmuls in ``dtype`` (about ``seconds`` of them)."""
    a = torch.randn(256, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, 4 * hidden, dtype=dtype, device=device)
    flops, count = 2 * 256 * hidden * 4 * hidden, 0
    torch.matmul(a, b)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(8):
            torch.matmul(a, b)
        synchronize()
        count += 8
    return flops * count / (time.perf_counter() - started) / 1e9


def machine_limit(hidden: int, device: torch.device) -> dict[str, float]:
    return {str(dtype).removeprefix("torch."): matmul_rate(hidden, dtype, device)
            for dtype in (torch.bfloat16, torch.float32)}


def baseline(model, tokenizer, device: torch.device, max_new_tokens: int,
             repeats: int) -> tuple[list[float], list[float]]:
    """Tokens/s and tokens per CPU-second of sequential ``model.generate`` calls, one per round."""
    rates, cpu_rates = [], []
    for ids in prompts(tokenizer, repeats + 1):
        input_ids = torch.tensor([ids], device=device)
        started, cpu_started = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        rates.append((out.shape[1] - input_ids.shape[1]) / elapsed)
        cpu_rates.append((out.shape[1] - input_ids.shape[1]) / cpu)
    return rates[1:], cpu_rates[1:]  # the first call warms up


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, all threads) process ``pid`` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def engine_rounds(client: SGLangClient, tokenizer, concurrency: int, max_new_tokens: int, repeats: int,
                        engine_pid: int) -> tuple[list[float], list[float], list]:
    """Tokens/s and tokens per engine CPU-second of rounds of ``concurrency`` simultaneous requests; also returns
    the last round's results."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    rates, cpu_rates, results = [], [], []
    for round_index in range(repeats):
        batch = prompts(tokenizer, concurrency)
        started, cpu_started = time.perf_counter(), cpu_seconds(engine_pid)
        results = await asyncio.gather(*[
            client.generate(ids, {**params, "sampling_seed": round_index * 1000 + i}) for i, ids in enumerate(batch)])
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(engine_pid) - cpu_started
        rates.append(sum(r.completion_tokens for r in results) / elapsed)
        cpu_rates.append(sum(r.completion_tokens for r in results) / cpu)
    return rates, cpu_rates, list(zip(batch, results, strict=True))


async def run_engine(engine: EngineProcess, model_dir: str, tokenizer, model, concurrencies: list[int],
                     max_new_tokens: int, repeats: int) -> dict:
    report: dict = {"concurrency": {}, "concurrency_cpu": {}}
    async with SGLangClient(engine.url, timeout_s=3600) as client:
        await client.generate(prompts(tokenizer, 1)[0], {"max_new_tokens": 8})  # warm up
        for concurrency in concurrencies:
            rates, cpu_rates, last = await engine_rounds(client, tokenizer, concurrency, max_new_tokens, repeats,
                                                         engine.process.pid)
            report["concurrency"][concurrency], report["concurrency_cpu"][concurrency] = rates, cpu_rates
            if concurrency == max(concurrencies):
                mismatches = [logprob_mismatch(model, ids, r.output_ids, r.output_token_logprobs) for ids, r in last]
                report["logprob_max_abs_diff"] = max(m["max_abs_diff"] for m in mismatches)
                report["logprob_mean_abs_diff"] = statistics.fmean(m["mean_abs_diff"] for m in mismatches)
        loads = []
        for version in range(1, repeats + 1):
            started = time.perf_counter()
            await client.update_weights_from_disk(model_dir, weight_version=version)
            loads.append(time.perf_counter() - started)
        report["weight_load_s"] = loads
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--model_config", default=None, help="a config.json to build a random-weight model from")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--num_threads", type=int, default=os.cpu_count(), help="torch CPU threads, both sides")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare_eager", action="store_true",
                        help="on CUDA, also measure an engine whose decode steps run eagerly (--disable_cuda_graph)")
    parser.add_argument("--output", default=None, help="JSON file (default: bench/results/engine-<time>.json)")
    parser.add_argument("--dry_run", action="store_true", help="check the arguments and the model, measure nothing")
    args = parser.parse_args()
    if args.model_config and args.model_name_or_path:
        parser.error("give --model_name_or_path or --model_config, not both")
    if args.model_config and not Path(args.model_config).is_file():
        parser.error(f"--model_config {args.model_config}: no such file")

    torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.dry_run:
        print(f"dry run: would serve {args.model_config or args.model_name_or_path or 'the embedded model'} on "
              f"{device} ({dtype}) at {args.concurrency} concurrent requests")
        return 0
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-engine-") as built:
        if args.model_config:
            model_dir = str(build_random_model(args.model_config, Path(built) / Path(args.model_config).stem))
        else:
            model_dir = args.model_name_or_path or str(default_model_path())
        return measure(args, model_dir, device, dtype)


def measure(args: argparse.Namespace, model_dir: str, device: torch.device, dtype: torch.dtype) -> int:
    """Run the baseline and the engine rounds, print the table and write the JSON."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

    hidden, parameters = model.config.hidden_size, model.num_parameters()
    limit_before = machine_limit(hidden, device)
    baseline_rates, baseline_cpu_rates = baseline(model, tokenizer, device, args.max_new_tokens, args.repeats)
    del model
    engine_args = ["--num_threads", str(args.num_threads), "--dtype", args.dtype, "--no_register",
                   "--max_running_requests", str(max(args.concurrency)), "--weight_version", "0"]
    if args.device:
        engine_args += ["--device", args.device]
    with EngineProcess(model_dir, *engine_args) as engine:
        report = asyncio.run(run_engine(engine, model_dir, tokenizer, reference, args.concurrency,
                                        args.max_new_tokens, args.repeats))
        captured = device.type == "cuda" and "CUDA graphs" in engine.output
    eager: dict = {}
    if args.compare_eager and captured:
        with EngineProcess(model_dir, *engine_args, "--disable_cuda_graph") as engine:
            eager = asyncio.run(run_engine(engine, model_dir, tokenizer, reference, args.concurrency,
                                           args.max_new_tokens, args.repeats))

    limit = {dtype: max(rate, limit_before[dtype]) for dtype, rate in machine_limit(hidden, device).items()}
    median = statistics.median
    base, base_cpu = median(baseline_rates), median(baseline_cpu_rates)
    rows = [("sequential model.generate", 1, base, base_cpu)]
    rows += [("agentrl engine, eager decode", concurrency, median(rates), median(eager["concurrency_cpu"][concurrency]))
             for concurrency, rates in eager.get("concurrency", {}).items()]
    mode = "agentrl engine, CUDA graphs" if captured else "agentrl engine"
    rows += [(mode, concurrency, median(rates), median(report["concurrency_cpu"][concurrency]))
             for concurrency, rates in report["concurrency"].items()]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"\nmodel {model_dir}\ndevice {device} ({device_name}), dtype {dtype}, {args.num_threads} threads, "
          f"{args.max_new_tokens} new tokens per request, median of {args.repeats} rounds\n")
    print("| mode | concurrent requests | generated tokens/s | vs baseline | GFLOP/s | of the bf16 limit "
          "| tokens per CPU-second | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, concurrency, rate, cpu_rate in rows:
        gflops = 2 * parameters * rate / 1e9
        print(f"| {mode} | {concurrency} | {rate:.1f} | {rate / base:.2f}x | {gflops:.1f} | "
              f"{gflops / limit['bfloat16']:.1%} | {cpu_rate:.1f} | {cpu_rate / base_cpu:.2f}x |")
    print(f"\nmachine limit ([256, {hidden}] x [{hidden}, {4 * hidden}] matmul): bf16 {limit['bfloat16']:.0f}, "
          f"fp32 {limit['float32']:.0f} GFLOP/s; {parameters / 1e6:.1f}M parameters")
    print(f"\nweight load (/update_weights_from_disk, idle engine): {median(report['weight_load_s']):.2f} s median")
    print(f"logprob mismatch engine vs fp32 forward ({max(args.concurrency)} sampled sequences): "
          f"max {report['logprob_max_abs_diff']:.2e}, mean {report['logprob_mean_abs_diff']:.2e}")

    output = Path(args.output) if args.output else (
        Path(__file__).parent / "results" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    by_concurrency = lambda values: {str(k): v for k, v in values.items()}  # noqa: E731
    engine_rows = [row for row in rows[1:] if row[0] == mode]
    output.write_text(json.dumps({
        "model": args.model_config or model_dir, "device": str(device), "device_name": device_name, "dtype": str(dtype),
        "num_threads": args.num_threads, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "baseline_tokens_per_s": baseline_rates, "engine_tokens_per_s": by_concurrency(report["concurrency"]),
        "weight_load_s": report["weight_load_s"], "logprob_max_abs_diff": report["logprob_max_abs_diff"],
        "logprob_mean_abs_diff": report["logprob_mean_abs_diff"], "parameters": parameters, "matmul_gflops": limit,
        "speedup_vs_baseline": {str(c): rate / base for _, c, rate, _ in engine_rows},
        "fraction_of_limit": {str(c): 2 * parameters * rate / 1e9 / limit["bfloat16"] for _, c, rate, _ in engine_rows},
        "baseline_tokens_per_cpu_s": baseline_cpu_rates,
        "engine_tokens_per_cpu_s": by_concurrency(report["concurrency_cpu"]),
        "speedup_per_cpu_s": {str(c): cpu_rate / base_cpu for _, c, _, cpu_rate in engine_rows},
        "cuda_graphs": captured,
        "engine_eager_tokens_per_s": by_concurrency(eager.get("concurrency", {})),
        "captured_speedup": {str(c): median(rates) / median(eager["concurrency"][c])
                             for c, rates in report["concurrency"].items() if c in eager.get("concurrency", {})}},
        indent=2))
    print(f"\nwritten to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
