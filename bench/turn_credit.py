"""Credit per turn against credit per episode: one multi-turn environment recipe trained with ``grpo`` and with a
per-turn estimator (default ``turn_loo``) for the same RL time from the same warm start, and held-out success of
the warm start and of each arm.

Each arm is ``minirl_example.sh`` against a database server this benchmark starts (the documents stay readable
until it ends). The first arm warms the embedded model up on ``--warmup`` oracle demonstrations and evaluates the
warm start; every later arm starts from that warm start (``MODEL``, no warm-up) with the same RL tasks, seeds and
time (``--train_time_s``, the trainer's ``--max_train_time_s``); only ``--adv_estimator`` differs. Every arm then
evaluates its final model greedily on the same ``--num_eval_tasks`` test goals. Outputs (``--out``, ``--plot``):

* ``heldout``: success of the warm start and of each arm, and the paired differences (95 % interval, normal
  approximation over per-goal differences): each arm over the warm start, and the last arm over the first;
* per arm: steps, trajectories, samples trained, groups kept and dropped, the zero-variance groups split into
  all-solved and all-failed, groups of equal outcomes kept (only a per-turn estimator keeps them: their turns
  are credited unequally), and the tokens sampled, trained and trained with a non-zero advantage;
* ``reward_per_step``: the trainer's mean reward of the samples of each step, per arm (the plot's left panel).

    .venv/bin/python bench/turn_credit.py [--env textcraft] [--train_time_s 1200] [--num_eval_tasks 64]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from pymongo import MongoClient

from agentrl.eval.metrics import paired_difference
from agentrl.store.embedded import embedded_server
from agentrl.store.models import succeeded

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from learning import run_script, wilson  # noqa: E402  (the calculator benchmark's runner and interval)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="textcraft", help="the AgentGym environment (ENV)")
    parser.add_argument("--estimators", default="grpo,turn_loo", help="the arms, in order (--adv_estimator)")
    parser.add_argument("--train_time_s", type=float, default=1200.0, help="RL time of each arm (TRAIN_TIME_S)")
    parser.add_argument("--train_steps", type=int, default=1000, help="at most this many RL steps (TRAIN_STEPS)")
    parser.add_argument("--num_eval_tasks", type=int, default=64, help="held-out test goals (NUM_EVAL_TASKS)")
    parser.add_argument("--warmup", type=int, default=64, help="oracle demonstrations of the warm start (WARMUP)")
    parser.add_argument("--extra_sample_flags", default="", help="more sampler flags, for every arm")
    parser.add_argument("--time_limit_s", type=float, default=3600.0, help="stop an arm after this long")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "turn_credit.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "turn_credit.png")
    return parser.parse_args()


def run_arm(args: argparse.Namespace, db_uri: str, run_dir: Path, run_name: str, estimator: str,
            model: Path | None) -> tuple[int, float]:
    """One ``minirl_example.sh`` run; past ``--time_limit_s`` it is stopped (it then stops what it started)."""
    env = {**os.environ, "MONGO_URI": db_uri, "RUN_DIR": str(run_dir), "ENV": args.env,
           "TRAIN_TIME_S": str(args.train_time_s), "TRAIN_STEPS": str(args.train_steps),
           "NUM_EVAL_TASKS": str(args.num_eval_tasks), "VAL_BEFORE_TRAIN": "false", "SAVE_STEPS": "0",
           "EXTRA_SAMPLE_FLAGS": f"--adv_estimator {estimator} {args.extra_sample_flags}".strip()}
    if model is None:
        env["WARMUP"] = str(args.warmup)
        env.pop("MODEL", None)
    else:
        env["MODEL"], env["WARMUP"] = str(model), "0"
    return run_script(env, run_name, args.time_limit_s)


def group_outcomes(db) -> dict[str, int]:
    """The judged train groups (their group stage ran) by outcome (all solved, all failed, mixed) and whether any
    of their samples was kept."""
    judged = {doc["_id"] for doc in db.Task.find({"split": "train", "group_stage_done": True}, {"_id": 1})}
    groups: dict[str, list[dict]] = defaultdict(list)
    for doc in db.Record.find({"split": "train", "score": {"$ne": None}},
                              {"task_id": 1, "score": 1, "score_details": 1, "status": 1}):
        if doc["task_id"] in judged:
            groups[doc["task_id"]].append(doc)
    counts: dict[str, int] = defaultdict(int)
    for records in groups.values():
        solved = [succeeded(r["score"], (r.get("score_details") or {}).get("success")) for r in records]
        outcome = "all_solved" if all(solved) else "all_failed" if not any(solved) else "mixed"
        kept = any(r["status"] in ("ready", "trained") for r in records)
        counts[f"{outcome}_{'kept' if kept else 'dropped'}"] += 1
    return dict(sorted(counts.items()))


def reward_per_step(db) -> list[dict]:
    return [{"step": m["step"], "reward_mean": m["values"].get("reward_mean")}
            for m in db.Metric.find({"split": "train"}, sort=[("step", 1)])]


def arm_result(summary: dict, db, estimator: str, code: int, wall_s: float) -> dict:
    return {"estimator": estimator, "exit_code": code, "wall_s": wall_s, "groups": group_outcomes(db),
            "reward_per_step": reward_per_step(db),
            **{key: summary.get(key) for key in ("steps", "trajectories", "samples_trained", "samples_skipped_stale",
                                                 "groups_kept", "groups_dropped", "kept_share", "trained_tokens")}}


def same_ids(entry: dict) -> dict:
    """An evaluation's per-goal rows keyed by the goal alone (the evaluation split's prefix differs per run)."""
    return {**entry, "per_task": [{**row, "id": row["id"].rsplit(":", 1)[-1]} for row in entry.get("per_task") or []]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    colours = ["#6a9fd4", "#2a7f3f", "#c0504d", "#8064a2"]
    for arm, colour in zip(result["arms"], colours):
        steps = [s for s in arm["reward_per_step"] if s["reward_mean"] is not None]
        curve.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], ".-", color=colour, alpha=0.7,
                   label=f"{arm['estimator']}: {arm['steps']} steps, {arm['groups_kept']} groups kept")
    curve.set_xlabel("trainer step")
    curve.set_ylabel("success of the trained samples")
    curve.set_ylim(-0.02, 1.02)
    curve.legend(fontsize=8, loc="upper left")
    curve.set_title(f"{result['config']['train_time_s']:.0f} s of MINIRL per arm, same warm start", fontsize=10)
    heldout = result["heldout"]
    labels = ["warm start", *(arm["estimator"] for arm in result["arms"])]
    entries = [heldout["warm_start"], *(heldout[arm["estimator"]] for arm in result["arms"])]
    values = [entry["accuracy"] or 0.0 for entry in entries]
    intervals = [wilson(entry["correct"] or 0, heldout["num_tasks"]) for entry in entries]
    errors = [[v - low for v, (low, _) in zip(values, intervals)],
              [high - v for v, (_, high) in zip(values, intervals)]]
    bars.bar(labels, values, yerr=errors, capsize=4, color=["#999999", *colours][:len(labels)])
    for index, value in enumerate(values):
        bars.text(index + 0.42, value, f"{value:.3f}", ha="right", va="bottom", fontsize=9)
    bars.set_ylim(0, 1)
    bars.set_title(f"held-out success, {heldout['num_tasks']} goals, greedy (95% CI)", fontsize=10)
    figure.suptitle(f"Embedded SmolLM2-135M on CPU (2 cores), {result['config']['env']}: credit per episode vs per "
                    "turn", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the run and the database server
    estimators = [name.strip() for name in args.estimators.split(",") if name.strip()]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    arms, evals, warm_start, warm_eval = [], {}, None, None
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-turn-credit-") as tmp:
        server = embedded_server(Path(tmp) / "db", port=0)
        server.start()
        client = MongoClient(server.uri())
        try:
            for estimator in estimators:
                run_name, run_dir = f"credit-{estimator}-{stamp}", Path(tmp) / estimator
                print(f"\n=== {estimator} ({'warm start, then ' if warm_start is None else 'from the warm start, '}"
                      f"{args.train_time_s:.0f} s of RL)", flush=True)
                code, wall = run_arm(args, server.uri(), run_dir, run_name, estimator, warm_start)
                summary_file = run_dir / "summary.json"
                if not summary_file.is_file():
                    print(f"the {estimator} arm wrote no summary (exit code {code}); logs in {run_dir / 'logs'}")
                    return 1
                summary = json.loads(summary_file.read_text())
                if warm_start is None:
                    warm_start, warm_eval = run_dir / "warmup" / "final", same_ids(summary["eval"]["warmup"])
                evals[estimator] = same_ids(summary["eval"]["after"])
                arms.append(arm_result(summary, client[run_name], estimator, code, wall))
        finally:
            client.close()
            server.stop()
    assert warm_eval is not None
    heldout: dict = {"num_tasks": args.num_eval_tasks,
                     "warm_start": {key: warm_eval[key] for key in ("accuracy", "correct", "mean_reward")}}
    for estimator, entry in evals.items():
        heldout[estimator] = {key: entry[key] for key in ("accuracy", "correct", "mean_reward")}
        heldout[f"{estimator}_minus_warm_start"] = paired_difference(warm_eval, entry)
    first, last = estimators[0], estimators[-1]
    if len(estimators) > 1:
        heldout[f"{last}_minus_{first}"] = paired_difference(evals[first], evals[last])
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "heldout": heldout, "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.plot)

    print(f"\n| arm | steps | trajectories | samples trained | groups kept / dropped "
          f"| sampled tokens trained with advantage ≠ 0 "
          f"| held-out success ({args.num_eval_tasks}) |\n|---|---:|---:|---:|---|---:|---:|")
    print(f"| warm start | | | | | | {warm_eval['accuracy']:.3f} ({warm_eval['correct']}) |")
    for arm in arms:
        tokens = (arm["trained_tokens"] or {}).get("share")
        entry = heldout[arm["estimator"]]
        print(f"| {arm['estimator']} | {arm['steps']} | {arm['trajectories']} | {arm['samples_trained']} | "
              f"{arm['groups_kept']} / {sum(arm['groups_dropped'].values())} {arm['groups']} | "
              f"{'-' if tokens is None else f'{tokens:.0%}'} | {entry['accuracy']:.3f} ({entry['correct']}) |")
    for key, paired in heldout.items():
        if key.endswith(("_minus_warm_start", f"_minus_{first}")) and paired["difference"] is not None:
            low, high = paired["ci95"]
            print(f"{key}: {paired['difference']:+.3f} (95% CI {low:+.3f} … {high:+.3f}; {paired['better']} better, "
                  f"{paired['worse']} worse of {paired['tasks']})")
    print(f"wrote {args.out} and {args.plot}")
    return 0 if all(arm["exit_code"] == 0 for arm in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
