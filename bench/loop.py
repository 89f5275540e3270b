"""The whole RL loop for a few steps: step time next to weight publish time, on a model built in code.

    .venv/bin/python bench/loop.py [--model_config bench/configs/NAME.json] [--device cpu|cuda] [--steps 4]
                                   [--train_batch_size 8] [--num_generations 4] [--json FILE] [--dry_run]

Real processes, as a user runs them: an embedded NX-27017 database (on the CPU), ``agentrl engine`` registered to
the run, one ``agentrl sample`` process with the built-in calculator over MCP on the arith tasks, and the trainer
(``agentrl.train``), which publishes its weights to the engine after every step. The model has random weights
(``--model_config``; default: the tiny two-layer Llama of the tests), so it babbles and every reward is 0: the
sampler keeps those groups (``--zero_variance_threshold 0 --drop_zero_advantage false``) so that every step
trains and publishes. What is measured is the loop's machinery, not learning: per step, the trainer's compute
time, its wait for samples, and the publish time (export, the engine's load, the version bump), as the trainer's
``Metric`` documents record them; medians leave out the first step (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "assets" / "tasks" / "arith_tools.jsonl"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agentrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli.main", *args]


def build_model(args: argparse.Namespace, out: Path) -> Path:
    from agentrl.inference.tiny_model import build_random_model, build_tiny_model

    return build_random_model(args.model_config, out) if args.model_config else build_tiny_model(out)


def run_loop(args: argparse.Namespace, work: Path) -> dict:
    """Start the database, engine, sampler and trainer; return the per-step figures from the Metric documents."""
    from agentrl.inference.process import EngineProcess
    from agentrl.store import sync_client, with_database
    from agentrl.store.embedded import EmbeddedServer

    model = build_model(args, work / "model")
    server = EmbeddedServer(data_dir=work / "db", port=free_port())
    server.start()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    engine = sampler = None
    try:
        uri = with_database(server.uri(), "bench_loop")
        subprocess.run(agentrl("tasks", "upload", str(TASKS), "--db_connection_string", uri, "--scorer", "math",
                               "--answer_schema", "boxed", "--num_generations", str(args.num_generations)),
                       check=True, env=env, capture_output=True, text=True, timeout=120)
        engine = EngineProcess(model, "--device", args.device, "--db_connection_string", uri,
                               "--heartbeat_interval_s", "1", "--max_running_requests", "64", env=env)
        mcp = work / "mcp.json"
        mcp.write_text(json.dumps({"servers": [{"name": "calculator", "command": sys.executable,
                                                "args": ["-m", "agentrl.cli.main", "tools", "serve", "calculator"]}]}))
        sampler_log = (work / "sampler.log").open("w")
        sampler = subprocess.Popen(
            agentrl("sample", "--db_connection_string", uri, "--model_name_or_path", str(model), "--mcp_config",
                    str(mcp), "--max_turns", "2", "--max_new_tokens", str(args.max_new_tokens), "--temperature",
                    "1.0", "--train_batch_size", str(args.train_batch_size), "--max_staleness", "1",
                    "--max_concurrent_samples_per_process", "32", "--zero_variance_threshold", "0",
                    "--drop_zero_advantage", "false", "--exit_when_done", "false"),
            stdout=sampler_log, stderr=subprocess.STDOUT, env=env)
        started = time.monotonic()
        trainer = subprocess.Popen(
            [sys.executable, "-m", "agentrl.train", "--db_connection_string", uri, "--model_name_or_path",
             str(model), "--output_dir", str(work / "out"), "--train_batch_size", str(args.train_batch_size),
             "--max_steps", str(args.steps), "--save_steps", "0", "--loss_calculater", "GRPO",
             "--learning_rate", "1e-6", "--keep_published_weights", "1"],
            env=env, stdout=(work / "trainer.log").open("w"), stderr=subprocess.STDOUT)
        wait_for_trainer(trainer, sampler, args.timeout_s, work)
        wall = time.monotonic() - started
        loads = [line for line in engine.output.splitlines()
                 if "loaded weights from" in line or "Succeeded to update model weights" in line]
        print("the engine's weight updates (receiving or reading, waiting for running requests, swapping):", *loads,
              sep="\n  ")
        client = sync_client(uri)
        try:
            db = client.get_default_database()
            metrics = sorted(db.Metric.find(), key=lambda d: d["step"])
            records = db.Record.count_documents({})
            served = db.InferenceService.find_one({}, {"weight_version": 1}) or {}
        finally:
            client.close()
    finally:
        if sampler is not None and sampler.poll() is None:
            sampler.send_signal(signal.SIGTERM)
            try:
                sampler.wait(60)
            except subprocess.TimeoutExpired:
                sampler.kill()
        if engine is not None:
            engine.stop()
        server.stop()
    steps = [{"step": d["step"], **{k: d["values"].get(k) for k in
                                    ("step_s", "wait_s", "publish_s", "publish_export_s", "publish_load_s",
                                     "publish_probe_s", "publish_wait_s", "publish_failures", "tokens",
                                     "samples")}}
             for d in metrics]
    return {"steps": steps, "records": records, "wall_s": wall, "served_weight_version": served.get("weight_version")}


def wait_for_trainer(trainer: subprocess.Popen, sampler: subprocess.Popen, timeout_s: float, work: Path) -> None:
    """Wait for the trainer's exit; fail with both logs when it fails, times out, or the sampler dies first."""
    deadline = time.monotonic() + timeout_s
    problem = None
    while trainer.poll() is None and problem is None:
        if sampler.poll() is not None:
            problem = f"the sampler exited ({sampler.returncode}) before the trainer finished"
        elif time.monotonic() > deadline:
            problem = f"the trainer did not finish in {timeout_s:.0f} s"
        time.sleep(0.5)
    if problem is None and trainer.returncode != 0:
        problem = f"the trainer failed ({trainer.returncode})"
    if problem is not None:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        raise SystemExit(f"{problem}\ntrainer:\n{(work / 'trainer.log').read_text()[-3000:]}\n"
                         f"sampler:\n{(work / 'sampler.log').read_text()[-3000:]}")


def summarise(args: argparse.Namespace, found: dict) -> dict:
    steps = found["steps"]
    measured = steps[1:] or steps

    def median(key: str) -> float:
        return statistics.median(float(s[key] or 0.0) for s in measured)

    figures = {"device": args.device, "model": args.model_config or "tiny llama (2 layers, hidden 64)",
               "steps": len(steps), "records": found["records"], "wall_s": found["wall_s"],
               "step_s_median": median("step_s"), "wait_s_median": median("wait_s"),
               "publish_s_median": median("publish_s"), "publish_export_s_median": median("publish_export_s"),
               "publish_load_s_median": median("publish_load_s"), "publish_probe_s_median": median("publish_probe_s"),
               "publish_wait_s_median": median("publish_wait_s"), "tokens_per_step_median": median("tokens"),
               "publish_failures": sum(float(s["publish_failures"] or 0) for s in steps),
               "served_weight_version": found["served_weight_version"], "per_step": steps}
    print(f"\n{figures['model']} on {args.device}: {len(steps)} steps of {args.train_batch_size} samples, "
          f"{found['records']} trajectories, {found['wall_s']:.1f} s for the trainer's run\n")
    print("| step | compute s | wait for samples s | publish s | of which export s | load s | probe s "
          "| trainer waited for it s | tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in steps:
        print(f"| {s['step']} | {s['step_s'] or 0:.2f} | {s['wait_s'] or 0:.2f} | {s['publish_s'] or 0:.2f} | "
              f"{s['publish_export_s'] or 0:.2f} | {s['publish_load_s'] or 0:.2f} | {s['publish_probe_s'] or 0:.2f} | "
              f"{s['publish_wait_s'] or 0:.2f} | {s['tokens'] or 0:.0f} |")
    print(f"\nmedians without step 1: compute {figures['step_s_median']:.2f} s, publish "
          f"{figures['publish_s_median']:.2f} s (export {figures['publish_export_s_median']:.2f} s, load "
          f"{figures['publish_load_s_median']:.2f} s, probe {figures['publish_probe_s_median']:.2f} s; the trainer "
          f"waited {figures['publish_wait_s_median']:.2f} s of it), wait "
          f"{figures['wait_s_median']:.2f} s; the engine serves version "
          f"{figures['served_weight_version']}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_config", default=None, help="a config.json to build a random-weight model from")
    parser.add_argument("--device", default=None, help="engine and trainer device (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--timeout_s", type=float, default=600.0, help="the trainer's run at most")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--dry_run", action="store_true", help="check the arguments, run nothing")
    args = parser.parse_args()
    if args.model_config and not Path(args.model_config).is_file():
        parser.error(f"--model_config {args.model_config}: no such file")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry_run:
        print(f"dry run: would run {args.steps} RL steps of {args.train_batch_size} samples on {args.device} with "
              f"{args.model_config or 'the tiny model'}")
        return 0
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-loop-") as work:
        figures = summarise(args, run_loop(args, Path(work)))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
