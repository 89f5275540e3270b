"""`agentrl report`: the summary of a training run — steps, trajectories, group decisions, stale samples, Records
not trained per failure class, mean reward per policy version and held-out evaluations (before / after) — printed
and written as JSON; for a run that trained nothing, why."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agentrl.cli.options import add_db_option
from agentrl.eval.metrics import paired_difference


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="summary of a training run, with held-out evaluations before and after (JSON and text)",
        description=__doc__.replace("\n", " "))
    add_db_option(parser)
    parser.add_argument("--split", default="train", help="training split (default: train)")
    parser.add_argument("--eval", action="append", default=[], metavar="LABEL=FILE",
                        help="an `agentrl eval --output` result to include under LABEL (repeatable, in order: the "
                             "first is the starting point, the last the final model), e.g. before=eval0.json")
    parser.add_argument("--wall_s", type=float, default=None, help="wall time of the run, for the summary")
    parser.add_argument("--train_steps", type=int, default=None, metavar="N",
                        help="the trainer's step budget (--max_steps): the summary says when the run ended short of it")
    parser.add_argument("--out", default=None, metavar="FILE.json", help="write the summary as JSON")
    parser.set_defaults(func=run)


def eval_entry(data: dict[str, Any]) -> dict[str, Any]:
    """The summary's form of one ``agentrl eval`` result."""
    metrics = data.get("metrics") or {}
    return {"accuracy": metrics.get("accuracy"), "mean_reward": metrics.get("mean_reward"),
            "num_tasks": data.get("num_tasks", metrics.get("tasks")), "correct": metrics.get("correct"),
            "errors": metrics.get("errors"), "name": data.get("name"), "model": data.get("model"),
            "per_task": [{"id": row["id"], "correct": row["correct"], "valid": row["valid"]}
                         for row in data.get("per_task") or []],
            "by_type": {name: {"correct": row.get("correct", 0), "samples": row.get("valid_samples", 0)}
                        for name, row in (data.get("by_type") or {}).items()}}


def read_evals(specs: list[str]) -> dict[str, dict[str, Any]]:
    evals = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--eval {spec!r}: expected LABEL=FILE")
        try:
            evals[label] = eval_entry(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--eval {spec!r}: cannot read {path}: {error}") from error
    return evals


def build_summary(db, split: str, evals: dict[str, dict[str, Any]], wall_s: float | None,
                  train_steps: int | None = None) -> dict[str, Any]:
    from agentrl.cli.progress_text import diagnose
    from agentrl.store.models import OPEN_TASK_STATES
    from agentrl.store.progress import progress_fields, read_progress
    from agentrl.store.summary import reward_by_version, trained_tokens

    progress = read_progress(db, split)
    summary: dict[str, Any] = {"database": db.name, **progress_fields(progress), "wall_s": wall_s,
                               "train_steps": train_steps, "train_time_s": progress.time_limit_s or None,
                               "tasks_left": db["Task"].count_documents(
                                   {"split": split, "status": {"$in": [str(s) for s in OPEN_TASK_STATES]},
                                    "unclaimed": {"$gt": 0}}),
                               "trained_tokens": trained_tokens(db, split),
                               "eval": evals,
                               "reward_by_version": reward_by_version(db["Record"], split)}
    labels = list(evals)
    if len(labels) >= 2:
        first, last = evals[labels[0]], evals[labels[-1]]
        if first["accuracy"] is not None and last["accuracy"] is not None:
            summary["eval_change"] = {"from": labels[0], "to": labels[-1],
                                      "accuracy": last["accuracy"] - first["accuracy"]}
        # what the last stage (RL) added over the one before it (the warm-up), task by task
        summary["eval_paired"] = {"from": labels[-2], "to": labels[-1],
                                  **paired_difference(evals[labels[-2]], evals[labels[-1]])}
    summary["diagnosis"] = diagnose(progress)
    return summary


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def type_lines(evals: dict[str, dict[str, Any]]) -> list[str]:
    """Where the last stage changed the held-out result, by task type, and the types no evaluation got right (RL
    cannot reinforce a success it never samples); nothing for evaluations of fewer than 2 types."""
    labels = list(evals)
    tables = [evals[label].get("by_type") or {} for label in labels]
    types = sorted(set().union(*tables))
    if len(labels) < 2 or len(types) < 2:
        return []
    before, after = tables[-2], tables[-1]
    changed = [f"{name} {before[name]['correct']} → {after[name]['correct']} of {after[name]['samples']}"
               for name in types if name in before and name in after
               and before[name]["correct"] != after[name]["correct"]]
    lines = [f"by task type, {labels[-2]} → {labels[-1]}: {', '.join(changed) or 'no type changed'}"]
    never = [name for name in types if all(table.get(name, {}).get("correct", 0) == 0 for table in tables)]
    if never:
        lines.append(f"right in no evaluation: {', '.join(never)} ({len(never)} of {len(types)} types)")
    return lines


def render(summary: dict[str, Any]) -> list[str]:
    """The summary in words (what the example scripts print at the end)."""
    from agentrl.cli.progress_text import failure_line, reason_label

    wall = f" (whole run {summary['wall_s'] / 60:.1f} min)" if summary.get("wall_s") else ""
    dropped = summary["groups_dropped"]
    why = (" (" + ", ".join(f"{n} {reason_label(reason)}" for reason, n in dropped.items()) + ")") if dropped else ""
    share = f" (kept share {summary['kept_share']:.0%})" if summary.get("kept_share") is not None else ""
    lines = [f"{summary['steps']} trainer steps: {summary['trajectories']} trajectories, "
             f"{summary['samples_trained']} samples trained, {summary['samples_skipped_stale']} skipped as stale; "
             f"groups {summary['groups_kept']} kept, {sum(dropped.values())} dropped{why}{share}{wall}"]
    tokens = summary.get("trained_tokens") or {}
    if tokens.get("share") is not None:
        lines.append(f"tokens: {tokens['sampled']} sampled, {tokens['trained']} trained, {tokens['nonzero_advantage']}"
                     f" of them with a non-zero advantage ({tokens['share']:.0%} of the sampled)")
    curriculum = summary.get("curriculum") or {}
    if curriculum.get("tasks_deferred") or curriculum.get("revisits"):
        lines.append(f"curriculum: {curriculum['tasks_deferred']} tasks skipped after an all-solved or all-failed "
                     f"group ({curriculum['rounds_skipped']} task rounds skipped in all), {curriculum['revisits']} "
                     "revisited after skipping")
    budget = summary.get("train_steps")
    if budget and 0 < summary["steps"] < budget:
        if summary.get("train_time_s") and summary.get("tasks_left"):
            lines.append(f"the trainer stopped at its time limit of {summary['train_time_s']:.0f} s after "
                         f"{summary['steps']} of {budget} steps ({summary['tasks_left']} tasks not sampled yet)")
        else:
            lines.append(f"the trainer ended after {summary['steps']} of {budget} steps: no task was left to sample;"
                         " more tasks or rounds (NUM_TASKS, ROUNDS in the example scripts) give it more groups to "
                         "keep")
    failures = summary["failures"]
    if failures:
        lines.append(f"{sum(failures.values())} records not trained, by failure class: {failure_line(failures)}")
    versions = summary["reward_by_version"]
    if versions:
        lines.append("mean reward by policy version (trajectories): " + ", ".join(
            f"v{v['policy_version']} {v['mean_score']:.3f} ({v['records']})" for v in versions))
    evals = summary["eval"]
    if evals:
        tasks = next(iter(evals.values()))["num_tasks"]
        chain = " → ".join(f"{label} {_rate(entry['accuracy'])}" for label, entry in evals.items())
        lines.append(f"held-out accuracy ({tasks} tasks, greedy): {chain}")
        rewards = " → ".join(f"{label} {_rate(entry['mean_reward'])}" for label, entry in evals.items())
        lines.append(f"held-out mean reward: {rewards}")
        change = summary.get("eval_change")
        if change:
            labels = list(evals)
            steps = [f"{a} → {b} {evals[b]['accuracy'] - evals[a]['accuracy']:+.3f}" for a, b in zip(labels, labels[1:])
                     if evals[a]["accuracy"] is not None and evals[b]["accuracy"] is not None]
            total = f" (in all {change['accuracy']:+.3f})" if len(labels) > 2 else ""
            lines.append(f"change in held-out accuracy: {', '.join(steps)}{total}")
        paired = summary.get("eval_paired") or {}
        if paired.get("difference") is not None:
            low, high = paired["ci95"]
            lines.append(f"{paired['to']} over {paired['from']}: {paired['difference']:+.3f} held-out accuracy, paired "
                         f"95% interval [{low:+.3f}, {high:+.3f}] over {paired['tasks']} tasks ({paired['better']} "
                         f"better, {paired['worse']} worse)")
        lines += type_lines(evals)
    for problem in summary["diagnosis"]:
        lines.append(f"nothing was trained: {problem}")
    return lines


def run(args: argparse.Namespace) -> int:
    import sys

    from agentrl.store import database_name, resolve_connection_string, sync_client

    try:
        evals = read_evals(args.eval)
    except ValueError as error:
        print(f"agentrl report: error: {error}", file=sys.stderr)
        return 2
    uri = resolve_connection_string(args.db_connection_string)
    client = sync_client(uri, serverSelectionTimeoutMS=5000)
    try:
        summary = build_summary(client[database_name(uri)], args.split, evals, args.wall_s, args.train_steps)
    finally:
        client.close()
    for line in render(summary):
        print(line)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        partial.replace(out)  # a complete summary or none
        print(f"summary written to {out}")
    return 0
