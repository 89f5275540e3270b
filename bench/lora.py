"""LoRA against full fine-tuning on the embedded model (SmolLM2-135M) on CPU, in one run: trainer tokens/s, peak
memory, publish time, and held-out accuracy after the same RL wall time.

    .venv/bin/python bench/lora.py [--ranks 1 8 32] [--steps 4] [--train_time_s 240] [--skip_learning]

1. **Trainer** (one variant after the other, each in a fresh database of a database server this script starts):
   ``python -m agentrl.train`` on the same synthetic multi-turn GRPO samples (``bench/trainer.py``'s), with a live
   ``agentrl engine --enable_lora`` serving the embedded model and registered in that database, so the trainer
   publishes after every step as in a real run: full weights (``/update_weights_from_disk``) or the adapter alone
   (``--lora_publish adapter``, ``/load_lora_adapter``). Variants: full fine-tuning; LoRA of each rank on every
   linear layer (alpha 32, no dropout: the examples' settings) publishing adapters; LoRA of the middle rank
   publishing merged weights. Figures (the first step is a warm-up and not counted; medians over the rest):
   tokens/s of the step's compute (``step_s``),
   publish seconds per version (export + every service loads it + version bump), the trainer process's peak
   resident memory (``VmHWM``), trainable parameters and the size of a published version on disk.
2. **Learning**: ``minirl_example.sh`` per variant (``LORA_R``; LoRA runs publish adapters, ``LORA_PUBLISH=adapter``)
   with the same warm-up (``--warmup`` calculator demonstrations) and the same RL time (``--train_time_s``):
   held-out accuracy of the warm-up and of the final model on ``--num_eval_tasks`` tasks (greedy).

The baseline of every ratio is full fine-tuning, measured in the same run. Results go to ``--out`` (JSON) and the
tables are printed. Run it on a quiet machine: the trainer and the engine share the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINABLE = re.compile(r"([\d,]+) of ([\d,]+) parameters trainable")


def bench_module(name: str):
    """Another benchmark script of this directory, imported by path (``bench`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=4, help="measured trainer steps (plus one warm-up step)")
    parser.add_argument("--samples_per_step", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn_tokens", type=int, default=64)
    parser.add_argument("--train_time_s", type=float, default=240.0, help="RL time of each learning run")
    parser.add_argument("--num_eval_tasks", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=24, help="warm-up demonstrations of each learning run")
    parser.add_argument("--skip_learning", action="store_true", help="only the trainer figures")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora.json")
    return parser.parse_args()


def variants(ranks: list[int]) -> list[dict]:
    middle = sorted(ranks)[len(ranks) // 2]
    return ([{"name": "full", "rank": 0, "publish": "merged"}]
            + [{"name": f"lora r{r}", "rank": r, "publish": "adapter"} for r in ranks]
            + [{"name": f"lora r{middle}, merged", "rank": middle, "publish": "merged"}])


def lora_flags(rank: int, publish: str) -> list[str]:
    if not rank:
        return ["--learning_rate", "1e-5"]
    return ["--use_peft", "--lora_r", str(rank), "--lora_alpha", "32", "--lora_target_modules",
            "all-linear", "--lora_dropout", "0", "--lora_publish", publish, "--learning_rate", "1e-4"]


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def trainer_run(variant: dict, server_uri: str, model_path: Path, samples: list, args: argparse.Namespace,
                tmp: Path) -> dict:
    """One trainer variant against a live engine; its figures."""
    from agentrl.inference.process import EngineProcess
    from agentrl.store import Metric, sync_client, with_database

    database = "lora_" + re.sub(r"\W+", "_", variant["name"])
    uri = with_database(server_uri, database)
    client = sync_client(uri)
    client.get_default_database().DBRecordData.insert_many([{**s.to_mongo(), "status": "queued"} for s in samples])
    engine = EngineProcess(model_path, "--enable_lora", "--db_connection_string", uri, "--heartbeat_interval_s", "1",
                           "--num_threads", "1", env={"OMP_NUM_THREADS": "1"})
    out = tmp / database
    try:
        deadline = time.monotonic() + 60
        while not client.get_default_database().InferenceService.count_documents({"status": "UP"}):
            if time.monotonic() > deadline:
                raise SystemExit("the engine did not register")
            time.sleep(0.2)
        command = [sys.executable, "-m", "agentrl.train", "--db_connection_string", uri, "--model_name_or_path",
                   str(model_path), "--output_dir", str(out), "--train_batch_size", str(args.samples_per_step),
                   "--max_steps", str(args.steps + 1), "--save_steps", "0", "--loss_calculater", "GRPO",
                   "--max_staleness", "1000", "--keep_published_weights", "1", "--num_threads", "1",
                   *lora_flags(variant["rank"], variant["publish"])]
        started = time.monotonic()
        log = tmp / f"{database}.log"
        with log.open("w") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})
            peak = 0.0
            while process.poll() is None:
                peak = max(peak, peak_rss_mb(process.pid) or 0.0)
                time.sleep(0.2)
        output = log.read_text()
        if process.returncode != 0:
            raise SystemExit(f"{variant['name']}: the trainer failed:\n{output[-3000:]}")
        wall = time.monotonic() - started
        metrics = sorted((Metric.from_mongo(d) for d in client.get_default_database().Metric.find(
            {"split": "train"})), key=lambda m: m.step)[1:]
        published = max((p for p in (out / "weights").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    finally:
        engine.stop()
        client.close()
    match = TRAINABLE.search(output)
    trainable = int(match.group(1).replace(",", "")) if match else None
    total = int(match.group(2).replace(",", "")) if match else None
    return {
        **variant,
        "tokens_per_s": statistics.median(m.values["tokens"] / m.values["step_s"] for m in metrics),
        "step_s": statistics.median(m.values["step_s"] for m in metrics),
        "publish_s": statistics.median(m.values["publish_s"] for m in metrics),
        "publish_failures": sum(m.values.get("publish_failures", 0.0) for m in metrics),
        "peak_rss_mb": peak, "wall_s": wall, "trainable": trainable, "parameters": total,
        "published_mb": sum(f.stat().st_size for f in published.rglob("*") if f.is_file()) / 2**20,
    }


def learning_run(variant: dict, server_uri: str, args: argparse.Namespace, tmp: Path) -> dict:
    """``minirl_example.sh`` for one variant; held-out accuracy of the warm-up and the final model."""
    learning = bench_module("learning")
    run_name = "lora-learning-" + re.sub(r"\W+", "-", variant["name"])
    example = argparse.Namespace(
        train_time_s=args.train_time_s, train_steps=500, num_eval_tasks=args.num_eval_tasks, warmup=args.warmup,
        num_tasks=200, num_generations=4, train_batch_size=8, max_new_tokens=48, max_turns=2, temperature=0.7,
        learning_rate=1e-5 if not variant["rank"] else 1e-4, max_staleness=1,  # LoRA: 10×, as the examples
        time_limit_s=args.train_time_s + 900)
    os.environ["LORA_R"] = str(variant["rank"])
    os.environ["LORA_PUBLISH"] = variant["publish"]
    os.environ.pop("WARMUP_LEARNING_RATE", None)
    run_dir = tmp / run_name
    code, elapsed = learning.run_example(example, server_uri, run_dir, run_name)
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return {**variant, "exit_code": code, "error": f"no summary; logs were in {run_dir / 'logs'}"}
    summary = json.loads(summary_file.read_text())
    evals = summary["eval"]
    return {**variant, "exit_code": code, "wall_s": elapsed, "steps": summary["steps"],
            "samples_trained": summary["samples_trained"],
            **{label: evals[key]["accuracy"] if evals.get(key) else None
               for label, key in (("base", "before"), ("warmup", "warmup"), ("final", "after"))}}


def main() -> int:
    args = parse_args()
    from transformers import AutoModelForCausalLM

    from agentrl.inference.embedded_model import default_model_path
    from agentrl.store.embedded import embedded_server

    model_path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    count = (args.steps + 1) * args.samples_per_step
    samples = bench_module("trainer").make_samples(model, count, args.turns, args.turn_tokens, seed=0)
    del model
    tokens_per_step = statistics.mean(s.num_tokens for s in samples) * args.samples_per_step
    result: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "tokens_per_step": tokens_per_step, "trainer": [], "learning": []}
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-lora-") as tmp:
        server = embedded_server(Path(tmp) / "db", port=0)
        server.start()
        try:
            for variant in variants(args.ranks):
                print(f"trainer: {variant['name']} ...", flush=True)
                result["trainer"].append(trainer_run(variant, server.uri(), model_path, samples, args, Path(tmp)))
                print(f"  {json.dumps(result['trainer'][-1])}", flush=True)
            if not args.skip_learning:
                for variant in [v for v in variants(args.ranks) if v["publish"] == "adapter" or not v["rank"]]:
                    print(f"learning: {variant['name']}, {args.train_time_s:.0f} s of RL ...", flush=True)
                    result["learning"].append(learning_run(variant, server.uri(), args, Path(tmp)))
                    print(f"  {json.dumps(result['learning'][-1])}", flush=True)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_tables(result, args)
    return 0


def print_tables(result: dict, args: argparse.Namespace) -> None:
    rows = result["trainer"]
    full = rows[0]
    print(f"\nTrainer, embedded SmolLM2-135M on CPU (1 thread each for trainer and engine), GRPO, "
          f"{args.samples_per_step} samples of {args.turns} turns per step ({result['tokens_per_step']:.0f} tokens), "
          f"{args.steps} measured steps, medians; a publish after every step to a live agentrl engine\n")
    print("| variant | publishes | trainable | tokens/s | vs full | peak RSS MB | vs full | publish s | vs full "
          "| published MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        share = f"{100 * row['trainable'] / row['parameters']:.2f}%" if row["trainable"] and row["rank"] else "100%"
        print(f"| {row['name']} | {row['publish']} | {share} | {row['tokens_per_s']:,.0f} | "
              f"{row['tokens_per_s'] / full['tokens_per_s']:.2f} | {row['peak_rss_mb']:,.0f} | "
              f"{row['peak_rss_mb'] / full['peak_rss_mb']:.2f} | {row['publish_s']:.2f} | "
              f"{row['publish_s'] / full['publish_s']:.2f} | {row['published_mb']:.1f} |")
    if result["learning"]:
        print(f"\nLearning: minirl_example.sh, warm-up on {args.warmup} demonstrations, then {args.train_time_s:.0f} s "
              f"of MINIRL; held-out accuracy on {args.num_eval_tasks} tasks (greedy)\n")
        print("| variant | RL steps | base | after warm-up | after RL |")
        print("|---|---:|---:|---:|---:|")
        for row in result["learning"]:
            cells = [f"{row[k]:.3f}" if isinstance(row.get(k), float) else "-" for k in ("base", "warmup", "final")]
            print(f"| {row['name']} | {row.get('steps', '-')} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.exit(main())
