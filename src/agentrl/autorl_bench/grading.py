"""The grading side of a run (AutoRL-Bench's grading server): submissions of one task's workspace, their scores, the
baseline, jobs.

The record lives with the grading server, in its ``state_dir`` (outside the workspace, never read from anything
the agent can write): ``grading.json`` (:class:`GradingState`: the baseline and every grading, in order,
``submission_id`` = position + 1), written atomically after each change and read back when a server restarts;
``models/`` (the copies of submitted models, :mod:`agentrl.autorl_bench.snapshots`); and ``run_meta.json``
(``{start_time, timeout_s, end_time}``, written by the orchestrator, read for ``/time``).

A submission names a model directory inside the workspace (relative paths resolve against it; the default is the
workspace's ``output`` directory); a path outside it is refused (:class:`GradingRequestError`, HTTP 400). The
model is copied before the submission is answered, and the copy is evaluated, through the
:class:`~agentrl.autorl_bench.evaluation.Evaluator` (queued, one at a time). Every grading ends as a recorded
:class:`Submission`, also one that fails (score 0 and its error: a model that cannot be copied or loaded, an
evaluation that crashes or times out, an error in this module, a server that stops). With ``max_evaluations``,
submissions past that many gradings (queued ones included) are refused (HTTP 429).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from agentrl.autorl_bench.evaluation import EvaluationResult, Evaluator, files_problem, model_problem
from agentrl.autorl_bench.scenarios import Scenario
from agentrl.autorl_bench.snapshots import SnapshotError, SnapshotStore, model_files
from agentrl.failpoints import failpoint

logger = logging.getLogger(__name__)

PRIVATE = {"snapshot", "detail"}
"""Fields of a :class:`Submission` that no reply shows (the server's paths, the evaluation's log)."""


class GradingRequestError(ValueError):
    """A request the grading API refuses (HTTP ``status``, 400 unless said; the message is the reply's ``error``,
    ``extra`` more fields of the reply)."""

    def __init__(self, message: str, status: int = 400, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


class GradingStateError(RuntimeError):
    """The grading server's own record cannot be read."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default


class Submission(BaseModel):
    """One grading, as recorded."""

    submission_id: int
    timestamp: str
    model_path: str
    score: float
    baseline_score: float | None
    improvement: float | None
    elapsed_seconds: float
    metrics: dict[str, Any]
    via: str = "submit"
    error: str | None = None
    snapshot: str | None = None
    detail: str | None = None

    def public(self) -> dict[str, Any]:
        """What the API shows: no server paths, no logs, no empty error."""
        return self.model_dump(exclude=PRIVATE | ({"error"} if self.error is None else set()))


class GradingState(BaseModel):
    """``grading.json``: the baseline and every grading."""

    baseline_score: float | None = None
    baseline_set_at: str | None = None
    submissions: list[Submission] = []

    @classmethod
    def load(cls, path: Path) -> GradingState:
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValidationError) as error:
            raise GradingStateError(f"{path}: the grading record cannot be read: {error}") from None

    def best(self) -> Submission | None:
        """The submission with the highest score (of equal ones, a graded one before a failed one, then the
        earliest); None without submissions."""
        if not self.submissions:
            return None
        return max(self.submissions, key=lambda s: (s.score, s.error is None, -s.submission_id))


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
    """Submissions to one scenario from one workspace, recorded in ``state_dir``."""

    def __init__(self, scenario: Scenario, workspace: Path, evaluator: Evaluator, state_dir: Path,
                 output_dir: Path | None = None, max_evaluations: int | None = None):
        self.scenario = scenario
        self.workspace = workspace.resolve()
        self.output_dir = (output_dir or self.workspace / "output").resolve()
        self.evaluator = evaluator
        self.max_evaluations = max_evaluations
        self.state_path = state_dir / "grading.json"
        self.meta_path = state_dir / "run_meta.json"
        self.snapshots = SnapshotStore(state_dir / "models")
        self.state = GradingState.load(self.state_path)
        self.jobs: dict[str, Job] = {}
        self.started = time.time()
        self.last_submit_time: float | None = None
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------------------------------------------- state

    def history(self) -> list[dict[str, Any]]:
        return [entry.public() for entry in self.state.submissions]

    def baseline(self) -> float | None:
        value = self.state.baseline_score
        return self.scenario.baseline_score if value is None else value

    def set_baseline(self, score: Any) -> float:
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise GradingRequestError("'score' is required and must be a number")
        self.state.baseline_score, self.state.baseline_set_at = float(score), now_iso()
        self._save()
        return float(score)

    def best(self) -> dict[str, Any] | None:
        best = self.state.best()
        return None if best is None else best.public()

    def time_info(self) -> dict[str, Any]:
        meta = {"start_time": self.started, "timeout_s": None, "end_time": None, **read_json(self.meta_path, {})}
        now = time.time()
        timeout = meta.get("timeout_s")
        remaining = None if timeout is None else max(0.0, meta["start_time"] + timeout - now)
        return {**meta, "last_submit_time": self.last_submit_time, "now": now, "remaining": remaining}

    def pending(self) -> int:
        return sum(1 for job in self.jobs.values() if job.status in ("queued", "running"))

    def evaluations_left(self) -> int | None:
        if self.max_evaluations is None:
            return None
        return max(0, self.max_evaluations - len(self.state.submissions) - self.pending())

    def _save(self) -> None:
        try:
            write_json_atomic(self.state_path, self.state.model_dump())
        except OSError as error:  # the record stays in memory; the next write tries again
            logger.error("cannot write the grading record %s: %s", self.state_path, error)

    # ---------------------------------------------------------------------------------------------- requests

    def resolve_model_path(self, raw: Any) -> Path:
        """The submitted model's directory, inside the workspace (``GradingRequestError`` otherwise)."""
        if raw is None or raw == "":
            return self.output_dir
        if not isinstance(raw, str):
            raise GradingRequestError("'model_path' must be a string")
        path = Path(raw)
        try:
            path = (path if path.is_absolute() else self.workspace / path).resolve()
        except (OSError, RuntimeError) as error:  # a symbolic link loop
            raise GradingRequestError(f"Invalid request: model_path {raw!r}: {error}") from None
        if path != self.workspace and self.workspace not in path.parents:
            raise GradingRequestError(f"Invalid request: model_path {raw!r} is outside the workspace "
                                      f"{self.workspace}")
        return path

    def validate(self, raw: Any) -> dict[str, Any]:
        """Whether the model would be accepted, judged as a grading would (without following links)."""
        path = self.resolve_model_path(raw)
        try:
            files = model_files(self.workspace, path)
        except SnapshotError as error:
            return {"valid": False, "model_path": str(path), "error": str(error)}
        problem = files_problem(files, path)
        if problem:
            return {"valid": False, "model_path": str(path), "error": problem}
        return {"valid": True, "model_path": str(path), "files": files}

    async def enqueue(self, raw: Any, via: str = "submit") -> Job:
        """Queue a grading of the submitted model and return once the model is copied (or found unfit); the job
        records the submission when it ends, however it ends."""
        path = self.resolve_model_path(raw)
        if self.evaluations_left() == 0:
            raise GradingRequestError(f"no evaluations left: this run allows {self.max_evaluations} and every one "
                                      "is used or queued", status=429, max_evaluations=self.max_evaluations)
        job = Job(id=uuid.uuid4().hex[:12], model_path=str(path))
        self.jobs[job.id] = job
        self.last_submit_time = time.time()
        copied = asyncio.Event()
        job.task = asyncio.create_task(self._grade(job, path, via, copied), name=f"grade-{job.id}")
        waiter = asyncio.ensure_future(copied.wait())
        await asyncio.wait({job.task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        return job

    async def _grade(self, job: Job, path: Path, via: str, copied: asyncio.Event) -> dict[str, Any]:
        snapshot: Path | None = None
        try:
            try:
                snapshot = await asyncio.to_thread(self.snapshots.take, self.workspace, path)
            finally:
                copied.set()
            problem = model_problem(snapshot, shown=path)
            if problem:
                result = EvaluationResult(error=problem)
            else:
                result = await self.evaluator.evaluate(self.scenario, snapshot, f"submission {job.id}",
                                                       on_start=lambda: setattr(job, "status", "running"))
            failpoint("bench.grade.before_record")
        except SnapshotError as error:
            result = EvaluationResult(error=str(error))
        except asyncio.CancelledError:
            self._record(job, path, EvaluationResult(error="the grading server stopped during this grading"),
                         snapshot, via)
            raise
        except Exception as error:  # whatever went wrong, the grading ends as a recorded failure
            logger.exception("grading %s of %s failed", job.id, path)
            result = EvaluationResult(error="the grading failed inside the grading server",
                                      detail=f"{type(error).__name__}: {error}")
        return self._record(job, path, result, snapshot, via)

    def _record(self, job: Job, path: Path, result: EvaluationResult, snapshot: Path | None,
                via: str) -> dict[str, Any]:
        """Append the grading to the record and end the job (no await: nothing interleaves)."""
        baseline = self.baseline()
        score = result.score if result.score is not None else 0.0
        entry = Submission(
            submission_id=len(self.state.submissions) + 1, timestamp=now_iso(), model_path=str(path), score=score,
            baseline_score=baseline, improvement=None if baseline is None else round(score - baseline, 4),
            elapsed_seconds=result.elapsed_seconds, metrics={**result.metrics, "reused": result.reused}, via=via,
            error=result.error, snapshot=None if snapshot is None or result.error else str(snapshot),
            detail=result.detail)
        self.state.submissions.append(entry)
        self._save()
        job.result = {**entry.public(), "best": self.best(), "total_submissions": len(self.state.submissions)}
        job.status = "failed" if result.error else "done"
        if snapshot is not None:
            self.snapshots.release(snapshot)
            best = self.state.best()
            self.snapshots.prune({Path(best.snapshot)} if best is not None and best.snapshot else set())
        return job.result
