"""The grading side of a run (seed 001): submissions of one task's workspace, their scores, the baseline, jobs.

State on disk, in the workspace (so a restarted server continues, and the orchestrator reads the same files):

- ``scores.json``: every submission, in order (``submission_id`` = position + 1); written atomically after each;
- ``baseline_score.json``: ``{"baseline_score": S}`` once set (``/set_baseline`` or the orchestrator);
- ``run_meta.json``: ``{start_time, timeout_s, last_submit_time, end_time}`` (the orchestrator writes it; ``/time``
  reads it and this module updates ``last_submit_time``).

A submission names a model directory inside the workspace (relative paths resolve against it; the default is the
workspace's ``output`` directory). A path outside the workspace is refused (:class:`GradingRequestError`, HTTP
400). A failed evaluation is still a submission: score 0 and its error. Submissions run as jobs through the
:class:`~agentrl.bench.evaluation.Evaluator`, so they are queued behind one another, never evaluated in parallel.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentrl.bench.evaluation import Evaluator, model_problem
from agentrl.bench.scenarios import Scenario


class GradingRequestError(ValueError):
    """A request the grading API refuses (HTTP ``status``, 400 unless said; the message is the reply's ``error``,
    ``extra`` more fields of the reply)."""

    def __init__(self, message: str, status: int = 400, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default


def best_entry(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The submission with the highest score (the earliest of equal ones); None without submissions."""
    return max(entries, key=lambda e: (e.get("score") or 0.0, -e["submission_id"])) if entries else None


@dataclass
class Job:
    """One queued or finished submission (``/submit`` with ``"async": true`` returns its id)."""

    id: str
    model_path: str
    status: str = "queued"
    created: str = field(default_factory=now_iso)
    result: dict[str, Any] | None = None
    task: asyncio.Task | None = None

    def public(self) -> dict[str, Any]:
        return {"job_id": self.id, "status": self.status, "model_path": self.model_path, "created": self.created,
                "result": self.result}


class GradingRun:
    """Submissions to one scenario from one workspace."""

    def __init__(self, scenario: Scenario, workspace: Path, evaluator: Evaluator, output_dir: Path | None = None):
        self.scenario = scenario
        self.workspace = workspace.resolve()
        self.output_dir = (output_dir or self.workspace / "output").resolve()
        self.evaluator = evaluator
        self.scores_path = self.workspace / "scores.json"
        self.baseline_path = self.workspace / "baseline_score.json"
        self.meta_path = self.workspace / "run_meta.json"
        self.jobs: dict[str, Job] = {}
        self._write_lock = asyncio.Lock()
        self.started = time.time()
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------------------------------------------- state

    def history(self) -> list[dict[str, Any]]:
        return read_json(self.scores_path, [])

    def baseline(self) -> float | None:
        value = read_json(self.baseline_path, {}).get("baseline_score")
        return self.scenario.baseline_score if value is None else value

    def set_baseline(self, score: Any) -> float:
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise GradingRequestError("'score' is required and must be a number")
        write_json_atomic(self.baseline_path, {"baseline_score": float(score), "set_at": now_iso()})
        return float(score)

    def best(self) -> dict[str, Any] | None:
        return best_entry(self.history())

    def time_info(self) -> dict[str, Any]:
        meta = read_json(self.meta_path, {"start_time": self.started, "timeout_s": None, "last_submit_time": None,
                                          "end_time": None})
        now = time.time()
        timeout = meta.get("timeout_s")
        remaining = None if timeout is None else max(0.0, meta["start_time"] + timeout - now)
        return {**meta, "now": now, "remaining": remaining}

    # ---------------------------------------------------------------------------------------------- requests

    def resolve_model_path(self, raw: Any) -> Path:
        """The submitted model's directory, inside the workspace (``GradingRequestError`` otherwise)."""
        if raw is None or raw == "":
            return self.output_dir
        if not isinstance(raw, str):
            raise GradingRequestError("'model_path' must be a string")
        path = Path(raw)
        path = (path if path.is_absolute() else self.workspace / path).resolve()
        if path != self.workspace and self.workspace not in path.parents:
            raise GradingRequestError(f"Invalid request: model_path {raw!r} is outside the workspace "
                                      f"{self.workspace}")
        return path

    def validate(self, raw: Any) -> dict[str, Any]:
        path = self.resolve_model_path(raw)
        problem = model_problem(path)
        if problem:
            return {"valid": False, "model_path": str(path), "error": problem}
        return {"valid": True, "model_path": str(path), "files": sorted(p.name for p in path.iterdir())}

    def enqueue(self, raw: Any) -> Job:
        """Queue an evaluation of the submitted model; the job records the submission when it finishes."""
        path = self.resolve_model_path(raw)
        job = Job(id=uuid.uuid4().hex[:12], model_path=str(path))
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._grade(job, path), name=f"grade-{job.id}")
        return job

    async def _grade(self, job: Job, path: Path) -> dict[str, Any]:
        self._note_submit_time()
        try:
            result = await self.evaluator.evaluate(self.scenario, path, f"submission {job.id}",
                                                   on_start=lambda: setattr(job, "status", "running"))
        except BaseException:
            job.status = "failed"
            raise
        async with self._write_lock:
            entries = self.history()
            baseline = self.baseline()
            score = result.score if result.score is not None else 0.0
            entry: dict[str, Any] = {
                "submission_id": len(entries) + 1, "timestamp": now_iso(), "model_path": str(path), "score": score,
                "baseline_score": baseline, "improvement": None if baseline is None else round(score - baseline, 4),
                "elapsed_seconds": result.elapsed_seconds, "metrics": {**result.metrics, "reused": result.reused}}
            if result.error:
                entry["error"] = result.error
            entries.append(entry)
            write_json_atomic(self.scores_path, entries)
        best = self.best()
        job.result = {**entry, "best": best, "total_submissions": len(entries)}
        job.status = "failed" if result.error else "done"
        return job.result

    def _note_submit_time(self) -> None:
        meta = read_json(self.meta_path, None)
        if meta is not None:
            meta["last_submit_time"] = time.time()
            write_json_atomic(self.meta_path, meta)

    def pending(self) -> int:
        return sum(1 for job in self.jobs.values() if job.status in ("queued", "running"))
