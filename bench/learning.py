"""Learning evidence: the MINIRL recipe (``minirl_example.sh``) on the built-in calculator task with the embedded
model on CPU, and the mean reward per step.

The run is the example script itself, pointed at a database server this benchmark starts (so the documents stay
readable afterwards) and stopped after ``--time_limit_s`` at the latest. Two curves come out of it:

* **mean score per policy version**: the mean reward of *every* scored trajectory, grouped by the policy version
  (= trainer step) that sampled it — the learning curve;
* **trainer reward mean per step**: the mean reward of the samples each step trained on (after the group stage
  dropped zero-variance groups, so it sits near 0.5 by construction; shown for reference).

The baseline is the first three versions' mean score, measured in the same run; the target is the mean of the
last three being at least 0.2 higher. Writes ``--out`` (JSON) and ``--plot`` (PNG).

``--sft_demos N`` first fine-tunes the embedded model (CrossEntropy, ``agentrl sft upload`` + ``agentrl.train
--enable_sampling false``) on N calculator demonstrations of freshly generated tasks (another seed than the RL
tasks): system prompt and tool instructions exactly as the sampler renders them, a ``calculate`` call with the
task's expression, the calculator's real answer over MCP, then ``\boxed{answer}``. The RL run then starts from
that model; its time limit does not include the warm start.

    .venv/bin/python bench/learning.py [--steps 30] [--num_tasks 200] [--time_limit_s 1800] [--sft_demos 32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pymongo import MongoClient

from agentrl.store.embedded import embedded_server

ROOT = Path(__file__).resolve().parent.parent
AGENTRL = Path(sys.executable).parent / "agentrl"
TARGET_GAIN = 0.2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps (TRAIN_STEPS)")
    parser.add_argument("--num_tasks", type=int, default=200, help="first N tasks of the built-in task set")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--max_turns", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--max_staleness", type=int, default=2, help="policy versions a sample may lag behind")
    parser.add_argument("--time_limit_s", type=float, default=1800.0, help="stop the run after this long")
    parser.add_argument("--sft_demos", type=int, default=0,
                        help="warm start: fine-tune on this many calculator demonstrations first (0: none)")
    parser.add_argument("--sft_epochs", type=int, default=1)
    parser.add_argument("--sft_learning_rate", type=float, default=3e-5)
    parser.add_argument("--sft_seed", type=int, default=1, help="task generator seed of the demonstrations")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learning.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "learning.png")
    return parser.parse_args()


async def build_demonstrations(count: int, seed: int) -> list[dict]:
    """Calculator demonstrations in the SFT ``messages`` format, rendered by ``agentrl sft upload`` exactly as the
    sampler renders a rollout (same system prompt, tool instructions and ``<tool_call>`` format)."""
    from agentrl.envs.arith import generate_arith_tasks
    from agentrl.rollout.prompting import DEFAULT_SYSTEM_PROMPT, ANSWER_FORMATS
    from agentrl.tools.config import MCPConfig
    from agentrl.tools.manager import ToolManager

    config = MCPConfig.model_validate({"servers": [
        {"name": "calculator", "command": str(AGENTRL), "args": ["tools", "serve", "calculator"]}]})
    demos = []
    async with ToolManager(config) as tools:
        for task in generate_arith_tasks(count, seed):
            result = await tools.call_tool("calculate", {"expression": task["expression"]})
            if not result.ok:
                raise RuntimeError(f"the calculator refused {task['expression']!r}: {result.error}")
            demos.append({"id": f"demo-{seed}-{task['id']}", "tools": tools.openai_tools(), "messages": [
                {"role": "system", "content": f"{DEFAULT_SYSTEM_PROMPT}\n{ANSWER_FORMATS['boxed']}"},
                {"role": "user", "content": task["query"]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"name": "calculate", "arguments": {"expression": task["expression"]}}]},
                {"role": "tool", "name": "calculate", "content": result.text},
                {"role": "assistant", "content": f"The answer is \\boxed{{{task['answer']}}}."},
            ]})
    return demos


def warm_start(args: argparse.Namespace, db_uri: str, work_dir: Path) -> tuple[Path, float]:
    """Fine-tune the embedded model on calculator demonstrations; the final model's directory and the seconds."""
    import asyncio

    started = time.monotonic()
    demos_path = work_dir / "demos.jsonl"
    demos_path.parent.mkdir(parents=True, exist_ok=True)
    demos_path.write_text("".join(json.dumps(d) + "\n" for d in asyncio.run(
        build_demonstrations(args.sft_demos, args.sft_seed))))
    sft_uri = db_uri.rstrip("/") + "/sft-warm-start"
    subprocess.run([str(AGENTRL), "sft", "upload", str(demos_path), "--db_connection_string", sft_uri], check=True)
    subprocess.run([sys.executable, "-m", "agentrl.train", "--db_connection_string", sft_uri,
                    "--loss_calculater", "CrossEntropy", "--enable_sampling", "false",
                    "--train_batch_size", "8", "--num_train_epochs", str(args.sft_epochs),
                    "--learning_rate", str(args.sft_learning_rate), "--save_steps", "0",
                    "--output_dir", str(work_dir / "output")], check=True)
    return work_dir / "output" / "final", time.monotonic() - started


def run_recipe(args: argparse.Namespace, db_uri: str, run_dir: Path, run_name: str,
               model: Path | None) -> tuple[int, float]:
    """Run ``minirl_example.sh``; at the time limit stop it (it then stops everything it started)."""
    env = {**os.environ, **({"MODEL": str(model)} if model else {}), "MONGO_URI": db_uri, "RUN_DIR": str(run_dir),
           "TRAIN_STEPS": str(args.steps),
           "NUM_TASKS": str(args.num_tasks), "NUM_GENERATIONS": str(args.num_generations),
           "TRAIN_BATCH_SIZE": str(args.train_batch_size), "MAX_NEW_TOKENS": str(args.max_new_tokens),
           "MAX_TURNS": str(args.max_turns), "TEMPERATURE": str(args.temperature),
           "LEARNING_RATE": str(args.learning_rate), "MAX_STALENESS": str(args.max_staleness), "SAVE_STEPS": "0"}
    started = time.monotonic()
    process = subprocess.Popen([str(ROOT / "minirl_example.sh"), run_name], env=env, start_new_session=True)
    try:
        return process.wait(timeout=args.time_limit_s), time.monotonic() - started
    except subprocess.TimeoutExpired:
        print(f"time limit of {args.time_limit_s:.0f} s reached: stopping the run", flush=True)
    elapsed = time.monotonic() - started
    process.terminate()  # SIGTERM (SIGINT may be ignored by a script started in the background)
    try:
        return process.wait(timeout=180), elapsed
    except subprocess.TimeoutExpired:  # the script did not stop its processes: stop its whole session
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait(), elapsed


def collect(db_uri: str, run_name: str) -> dict:
    client = MongoClient(db_uri)
    try:
        db = client[run_name]
        by_version: dict[int, list[float]] = {}
        for doc in db.Record.find({"score": {"$ne": None}}, {"policy_version": 1, "score": 1}):
            by_version.setdefault(doc.get("policy_version") or 0, []).append(float(doc["score"]))
        metrics = sorted(db.Metric.find({}), key=lambda m: m["step"])
        return {
            "score_by_version": [{"policy_version": v, "trajectories": len(s), "mean_score": statistics.fmean(s)}
                                 for v, s in sorted(by_version.items())],
            "trainer_steps": [{"step": m["step"], "reward_mean": m["values"].get("reward_mean"),
                               "loss": m["values"].get("loss")} for m in metrics],
            "outcomes": {o["_id"] or "none": o["n"] for o in db.Record.aggregate(
                [{"$group": {"_id": "$outcome", "n": {"$sum": 1}}}])},
        }
    finally:
        client.close()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    versions = result["score_by_version"]
    axis.plot([v["policy_version"] for v in versions], [v["mean_score"] for v in versions], "o-",
              label="mean score of all trajectories, by policy version")
    steps = [s for s in result["trainer_steps"] if s["reward_mean"] is not None]
    axis.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], "s--", alpha=0.6,
              label="mean reward of the trained samples, by step")
    axis.set_xlabel("policy version / trainer step")
    axis.set_ylabel("reward")
    axis.set_ylim(-0.02, 1.02)
    demos = result["config"].get("sft_demos")
    warm = f"\nstarting from SFT on {demos} calculator demonstrations" if demos else ""
    axis.set_title(f"MINIRL, embedded SmolLM2-135M, calculator task (CPU){warm}", fontsize=10)
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> int:
    args = parse_args()
    run_name = f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-learning-") as tmp:
        server = embedded_server(Path(tmp) / "db", port=0)
        server.start()
        try:
            model, sft_s = warm_start(args, server.uri(), Path(tmp) / "sft") if args.sft_demos else (None, 0.0)
            code, elapsed = run_recipe(args, server.uri(), Path(tmp) / "run", run_name, model)
            result = collect(server.uri(), run_name)
        finally:
            server.stop()
    versions = result["score_by_version"]
    first = [v["mean_score"] for v in versions[:3]]
    last = [v["mean_score"] for v in versions[-3:]]
    result.update(config=vars(args) | {"out": str(args.out), "plot": str(args.plot)}, exit_code=code,
                  wall_s=elapsed, warm_start_s=sft_s, first3_mean=statistics.fmean(first) if first else None,
                  last3_mean=statistics.fmean(last) if last else None)
    gain = (result["last3_mean"] - result["first3_mean"]) if first and last else None
    result["gain"] = gain
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.plot)

    warm = f" after a {sft_s:.0f} s warm start on {args.sft_demos} demonstrations" if args.sft_demos else ""
    print(f"\nrun {run_name}: exit code {code}, {elapsed:.0f} s{warm}; outcomes {result['outcomes']}")
    print("| policy version | trajectories | mean score | trainer reward mean (step) | loss |")
    print("|---:|---:|---:|---:|---:|")
    steps = {s["step"]: s for s in result["trainer_steps"]}
    for v in versions:
        step = steps.get(v["policy_version"] + 1, {})
        reward, loss = step.get("reward_mean"), step.get("loss")
        print(f"| {v['policy_version']} | {v['trajectories']} | {v['mean_score']:.3f} | "
              f"{'-' if reward is None else f'{reward:.3f}'} | {'-' if loss is None else f'{loss:.4f}'} |")
    if gain is None:
        print("no scored trajectories: nothing to compare")
    else:
        verdict = "meets" if gain >= TARGET_GAIN else "misses"
        print(f"mean score, first 3 versions {result['first3_mean']:.3f} → last 3 {result['last3_mean']:.3f}: "
              f"gain {gain:+.3f} ({verdict} the +{TARGET_GAIN} target)")
    print(f"wrote {args.out} and {args.plot}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
