"""An evaluation's result as a table (terminal) and as JSON (file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agentrl.eval.metrics import pass_ks
from agentrl.store.evals import Eval


def result_json(job: Eval, *, reused: bool, database: str) -> dict[str, Any]:
    """The ``Eval`` document as JSON-able data (``key`` is its ``_id``), plus whether it was reused."""
    data = job.model_dump(mode="json", by_alias=False)
    key = data.pop("id")
    return {"key": key, "reused": reused, "database": database, **data}


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


ERROR_LABELS = {"failed_error": "generation (failed_error)", "env_start_error": "environment start (env_start_error)",
                "env_error": "environment step (env_error)", "score_error": "scorer (score_error)",
                "slot_failed": "slot given up (slot_failed)", "missing": "missing"}


def _rate(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


def columns(k: int) -> list[tuple[str, str]]:
    """``(header, metrics key)`` of the rate columns."""
    return ([("accuracy", "accuracy"), ("reward", "mean_reward"), (f"avg@{k}", f"avg@{k}")]
            + [(f"pass@{j}", f"pass@{j}") for j in pass_ks(k)])


def render(job: Eval, *, reused: bool, database: str, file=None) -> None:
    """Print the result table (one row per task type, then all tasks) and a few lines of context."""
    from rich.console import Console
    from rich.table import Table

    out = file or sys.stdout
    console = Console(file=out, width=None if out.isatty() else 160)
    metrics, k = job.metrics, job.num_samples_per_task
    sampling = job.sampling
    profile = "greedy" if not sampling.get("temperature") else (
        f"temperature {sampling['temperature']}, top_p {sampling.get('top_p')}, top_k {sampling.get('top_k')}, "
        f"seed {job.seed}")
    when = job.finished_at.strftime("%Y-%m-%d %H:%M:%S UTC") if job.finished_at else "?"
    console.print(f"[bold]{job.name}[/bold] — {job.num_tasks} tasks × {k} samples"
                  + (f" × {job.repeats} repeats" if job.repeats > 1 else "") + f", {profile}")
    console.print(("reused the stored result" if reused else "evaluated") + f" (Eval {job.id} in database "
                  f"{database}, split {job.split}, finished {when}"
                  + (f", {job.duration_s:.0f}s" if job.duration_s is not None else "") + ")"
                  + ("; --force recomputes it" if reused else ""))
    table = Table(show_header=True)
    for header in ("type", "tasks", "samples", "errors"):
        table.add_column(header, justify="left" if header == "type" else "right")
    cols = columns(k)
    for header, _ in cols:
        table.add_column(header, justify="right")

    def row(name: str, m: dict[str, Any], style: str | None = None) -> None:
        table.add_row(name, str(m.get("tasks", 0)), str(m.get("samples", 0)), str(m.get("errors", 0)),
                      *[_rate(m.get(key)) for _, key in cols], style=style)

    for name, m in job.by_type.items():
        row(name, m)
    if job.by_type:
        table.add_section()
    row("all", metrics, style="bold")
    console.print(table)
    if metrics.get("errors"):
        kinds = ", ".join(f"{ERROR_LABELS.get(kind, kind)} {n}" for kind, n in metrics["errors_by_kind"].items())
        console.print(f"errors (excluded from the rates): {kinds}")
    if metrics.get("mean_env_reward") is not None:
        console.print(f"environment episodes: accuracy is the success rate (the environment's own success: reward "
                      f"1, 0.5 for BabyAI, 100 for SciWorld); mean environment reward "
                      f"{metrics['mean_env_reward']:.3f} (its own "
                      "scale; the reward column is the score, reward × the environment's reward_scale)")
    if metrics.get("outcomes"):
        console.print("outcomes: " + ", ".join(f"{name} {n}" for name, n in metrics["outcomes"].items()))
    if metrics.get("by_repeat"):
        accs = ", ".join(_rate(r["accuracy"]) for r in metrics["by_repeat"])
        console.print(f"accuracy per repeat: {accs} (std {_rate(metrics.get('accuracy_std'))}); "
                      f"pass@{k} std {_rate(metrics.get(f'pass@{k}_std'))}")
    if metrics.get("tasks_short_of_k") or metrics.get("tasks_all_errors"):
        console.print(f"{metrics.get('tasks_short_of_k', 0)} tasks had fewer than {k} valid samples (pass@{k} "
                      f"falls back to pass@n there), {metrics.get('tasks_all_errors', 0)} tasks had only errors")
