"""Learning evidence: SFT warm start → RL on the built-in calculator task with the embedded model on CPU, and
held-out accuracy of the base, warmed-up and final models.

The run is ``minirl_example.sh`` itself with bench settings — ``--num_eval_tasks`` held-out tasks (greedy, the
same for all three models), a warm-up on ``--warmup`` demonstrations made with the real calculator, then MINIRL
for ``--train_time_s`` seconds (the trainer's ``--max_train_time_s``) — against a database server this
benchmark starts, so the documents stay readable afterwards. Outputs:

* ``heldout``: ``{base, sft, rl}`` (each ``{accuracy, mean_reward, correct}``) and ``num_tasks``, and
  ``rl_minus_sft``: the paired difference of RL and SFT accuracy over the same tasks with its 95 % interval
  (normal approximation over per-task differences); the target is ``rl_minus_sft.difference >= 0.10``;
* ``reward_per_step``: the trainer's mean reward of the samples each step trained on, and
  ``score_by_version``: the mean score of *all* trajectories sampled by each policy version;
* ``samples_skipped_stale`` and the other run figures of the script's ``summary.json``;
* ``--plot``: a PNG with the reward per step and the held-out bars.

    .venv/bin/python bench/learning.py [--train_time_s 600] [--num_eval_tasks 64] [--warmup 32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pymongo import MongoClient

from agentrl.eval.metrics import paired_difference
from agentrl.store.embedded import embedded_server

ROOT = Path(__file__).resolve().parent.parent
TARGET_GAIN = 0.10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_time_s", type=float, default=600.0, help="RL training time (TRAIN_TIME_S)")
    parser.add_argument("--train_steps", type=int, default=500, help="at most this many RL steps (TRAIN_STEPS)")
    parser.add_argument("--num_eval_tasks", type=int, default=64, help="held-out tasks (NUM_EVAL_TASKS)")
    parser.add_argument("--warmup", type=int, default=32, help="warm-up demonstrations (WARMUP)")
    parser.add_argument("--num_tasks", type=int, default=200, help="RL tasks: first N of the built-in set")
    parser.add_argument("--rounds", type=int, default=1, help="rounds each RL task is sampled in (the recorded "
                        "result: one; `agentrl run` defaults to 3 on its 32 tasks)")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--max_turns", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning_rate", type=float, default=2e-6)
    parser.add_argument("--max_staleness", type=int, default=1, help="policy versions a sample may lag behind")
    parser.add_argument("--time_limit_s", type=float, default=1800.0,
                        help="stop the whole run after this long (it should end by itself well before)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "learning.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "learning.png")
    return parser.parse_args()


def run_example(args: argparse.Namespace, db_uri: str, run_dir: Path, run_name: str) -> tuple[int, float]:
    """Run ``minirl_example.sh``; past ``--time_limit_s`` stop it (it then stops everything it started)."""
    env = {**os.environ, "MONGO_URI": db_uri, "RUN_DIR": str(run_dir), "TRAIN_TIME_S": str(args.train_time_s),
           "TRAIN_STEPS": str(args.train_steps), "NUM_EVAL_TASKS": str(args.num_eval_tasks),
           "WARMUP": str(args.warmup), "NUM_TASKS": str(args.num_tasks), "ROUNDS": str(args.rounds),
           "NUM_GENERATIONS": str(args.num_generations), "TRAIN_BATCH_SIZE": str(args.train_batch_size),
           "MAX_NEW_TOKENS": str(args.max_new_tokens), "MAX_TURNS": str(args.max_turns),
           "TEMPERATURE": str(args.temperature), "LEARNING_RATE": str(args.learning_rate),
           "MAX_STALENESS": str(args.max_staleness), "SAVE_STEPS": "0"}
    env.pop("MODEL", None)
    return run_script(env, run_name, args.time_limit_s)


def run_script(env: dict[str, str], run_name: str, time_limit_s: float) -> tuple[int, float]:
    """``minirl_example.sh RUN_NAME`` with ``env``: its exit code and wall time; past ``time_limit_s`` (or on
    SIGTERM) it is stopped, and it then stops everything it started."""
    started = time.monotonic()
    process = subprocess.Popen([str(ROOT / "minirl_example.sh"), run_name], env=env, start_new_session=True)
    try:
        return process.wait(timeout=time_limit_s), time.monotonic() - started
    except subprocess.TimeoutExpired:
        print(f"time limit of {time_limit_s:.0f} s reached: stopping the run", flush=True)
    except SystemExit:  # SIGTERM: stop the run too
        process.terminate()
        process.wait(timeout=180)
        raise
    process.terminate()
    try:
        return process.wait(timeout=180), time.monotonic() - started
    except subprocess.TimeoutExpired:  # the script did not stop its processes: stop its whole session
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait(), time.monotonic() - started


def wilson(correct: int, n: int) -> tuple[float, float]:
    """95 % Wilson interval of a proportion."""
    if n == 0:
        return 0.0, 0.0
    z, p = 1.96, correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def reward_per_step(db_uri: str, run_name: str) -> list[dict]:
    client = MongoClient(db_uri)
    try:
        return [{"step": m["step"], "reward_mean": m["values"].get("reward_mean"), "loss": m["values"].get("loss"),
                 "skipped_stale": m["values"].get("skipped_stale", 0.0)}
                for m in client[run_name].Metric.find({"split": "train"}, sort=[("step", 1)])]
    finally:
        client.close()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    steps = [s for s in result["reward_per_step"] if s["reward_mean"] is not None]
    curve.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], ".", alpha=0.4,
               label="trained samples, per step")
    window = 5
    if len(steps) >= window:
        smooth = [statistics.fmean(s["reward_mean"] for s in steps[i - window + 1:i + 1])
                  for i in range(window - 1, len(steps))]
        curve.plot([s["step"] for s in steps[window - 1:]], smooth, "-", label=f"trained samples, mean of {window}")
    versions = result["score_by_version"]
    curve.plot([v["policy_version"] for v in versions], [v["mean_score"] for v in versions], "s--", alpha=0.6,
               markersize=3, label="all trajectories, by policy version")
    curve.set_xlabel("trainer step / policy version")
    curve.set_ylabel("reward (math)")
    curve.set_ylim(-0.02, 1.02)
    curve.legend(fontsize=8, loc="upper left")
    curve.set_title("MINIRL reward during training", fontsize=10)
    heldout = result["heldout"]
    labels = [label for label in ("base", "sft", "rl") if heldout.get(label)]
    values = [heldout[label]["accuracy"] or 0.0 for label in labels]
    intervals = [wilson(heldout[label]["correct"] or 0, heldout["num_tasks"]) for label in labels]
    errors = [[v - low for v, (low, _) in zip(values, intervals)],
              [high - v for v, (_, high) in zip(values, intervals)]]
    bars.bar(["base", "SFT warm-up", "SFT + RL"][:len(labels)], values, yerr=errors, capsize=4,
             color=["#999999", "#6a9fd4", "#2a7f3f"][:len(labels)])
    for index, value in enumerate(values):
        bars.text(index + 0.42, value, f"{value:.3f}", ha="right", va="bottom", fontsize=9)
    bars.set_ylim(0, 1)
    bars.set_title(f"held-out accuracy, {heldout['num_tasks']} tasks, greedy (95% CI)", fontsize=10)
    figure.suptitle("Embedded SmolLM2-135M on CPU (2 cores), calculator tool: SFT warm start → MINIRL", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the run and the database server
    run_name = f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-learning-") as tmp:
        server = embedded_server(Path(tmp) / "db", port=0)
        server.start()
        try:
            run_dir = Path(tmp) / "run"
            code, elapsed = run_example(args, server.uri(), run_dir, run_name)
            summary_file = run_dir / "summary.json"
            if not summary_file.is_file():
                print(f"the run wrote no summary (exit code {code}); logs were in {run_dir / 'logs'}")
                return 1
            summary = json.loads(summary_file.read_text())
            steps = reward_per_step(server.uri(), run_name)
        finally:
            server.stop()
    evals = summary["eval"]
    heldout = {"num_tasks": args.num_eval_tasks}
    for label, key in (("base", "before"), ("sft", "warmup"), ("rl", "after")):
        entry = evals.get(key)
        heldout[label] = entry and {"accuracy": entry["accuracy"], "mean_reward": entry["mean_reward"],
                                    "correct": entry["correct"]}
    if evals.get("warmup") and evals.get("after"):
        heldout["rl_minus_sft"] = paired_difference(evals["warmup"], evals["after"])
    result = {"config": vars(args) | {"out": str(args.out), "plot": str(args.plot)}, "exit_code": code,
              "wall_s": elapsed, "heldout": heldout, "reward_per_step": steps,
              "score_by_version": summary["reward_by_version"],
              **{key: summary[key] for key in ("steps", "trajectories", "samples_trained", "samples_skipped_stale",
                                               "groups_kept", "groups_dropped")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.plot)

    print(f"\nrun {run_name}: exit code {code}, {elapsed / 60:.1f} min, {result['steps']} RL steps, "
          f"{result['trajectories']} trajectories, {result['samples_trained']} samples trained, "
          f"{result['samples_skipped_stale']} skipped as stale")
    print("| model | held-out accuracy | mean reward |\n|---|---:|---:|")
    for label in ("base", "sft", "rl"):
        if heldout.get(label):
            print(f"| {label} | {heldout[label]['accuracy']:.3f} ({heldout[label]['correct']}/{args.num_eval_tasks}) "
                  f"| {heldout[label]['mean_reward']:.3f} |")
    paired = heldout.get("rl_minus_sft")
    if paired and paired["difference"] is not None:
        verdict = "meets" if paired["difference"] >= TARGET_GAIN else "misses"
        low, high = paired["ci95"]
        print(f"RL − SFT held-out accuracy: {paired['difference']:+.3f} (95% CI {low:+.3f} … {high:+.3f}; "
              f"{paired['better']} tasks better, {paired['worse']} worse) — {verdict} the +{TARGET_GAIN:.2f} target")
    print(f"wrote {args.out} and {args.plot}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
