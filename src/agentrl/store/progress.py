"""How far a training run has come, read from its database: the numbers of the live status line and of the run
summary (trajectories and their rate, rewards, group decisions, Records not trained per failure class, the sample
queue, trainer steps and ETA). The words for them are :mod:`agentrl.cli.progress_text`'s."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pymongo.database import Database

from agentrl.store.models import (
    ZERO_VARIANCE_DECISION,
    DBRecordData,
    Metric,
    Record,
    RecordStatus,
    Run,
    SampleStatus,
    Task,
    succeeded,
)
from agentrl.store.runs import RUN_ID
from agentrl.store.summary import failure_counts

FINISHED = [str(s) for s in (RecordStatus.SCORED, RecordStatus.READY, RecordStatus.ABANDONED, RecordStatus.TRAINED)]
KEPT = [str(s) for s in (RecordStatus.READY, RecordStatus.TRAINED)]
RECENT_REWARDS = 32
"""How many of the latest scored trajectories the status line's reward mean covers."""
WARN_AFTER_GROUPS = 4
WARN_DROPPED_FRACTION = 0.75


@dataclass
class Progress:
    """A snapshot of one split of a run (see :func:`read_progress`)."""

    trajectories: int = 0
    running: int = 0
    recent_reward: float | None = None
    reward_mean: float | None = None
    groups_kept: int = 0
    groups_dropped: Counter[str] = field(default_factory=Counter)
    zero_variance_solved: int = 0
    """of the groups dropped for zero variance, those whose samples all succeeded (the others all failed)"""
    tasks_deferred: int = 0
    """groups after which the curriculum skipped rounds of their Task (``agentrl.rollout.curriculum``)"""
    rounds_skipped: int = 0
    """Task rounds the curriculum skipped, in all"""
    revisits: int = 0
    """Task rounds sampled after skipped rounds (the curriculum's revisits)"""
    failures: dict[str, int] = field(default_factory=dict)
    """Records that did not train, per failure class (most first)"""
    samples_queued: int = 0
    samples_skipped: int = 0
    samples_trained: int = 0
    step: int = 0
    max_steps: int = 0
    time_limit_s: float = 0.0
    last_metric: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None
    run_status: str | None = None
    policy_version: int = 0

    @property
    def groups_done(self) -> int:
        return self.groups_kept + sum(self.groups_dropped.values())

    @property
    def kept_share(self) -> float | None:
        """The share of the judged groups that were kept (trained)."""
        return self.groups_kept / self.groups_done if self.groups_done else None

    @property
    def eta_s(self) -> float | None:
        """Seconds until ``max_steps`` at the median pace of the recent steps (None before two steps, or when the
        trainer stops at a time limit)."""
        if self.step_seconds is None or not self.max_steps or self.time_limit_s:
            return None
        return max(self.max_steps - self.step, 0) * self.step_seconds

    def zero_variance_warning(self) -> str | None:
        """A warning when most groups so far were dropped because all their samples scored the same: how many of
        those were always solved and how many never, with what to do about each."""
        dropped = self.groups_dropped.get(ZERO_VARIANCE_DECISION, 0)
        if self.groups_done < WARN_AFTER_GROUPS or dropped < WARN_DROPPED_FRACTION * self.groups_done:
            return None
        solved, failed = self.zero_variance_solved, max(dropped - self.zero_variance_solved, 0)
        advice = sorted([(solved, "For the tasks always solved: use harder tasks."),
                         (failed, "For the tasks never solved: give the model a warm start (WARMUP=N in the example "
                                  "scripts, or `agentrl sft demos` + `agentrl sft upload`), use easier tasks or a "
                                  "shaped scorer (SCORER=math_format).")], key=lambda item: -item[0])
        return " ".join([f"{dropped} of {self.groups_done} groups were dropped for zero reward variance ({solved} "
                         f"always solved, {failed} never solved): every sample of those tasks got the same score, so "
                         "they teach nothing.", *(text for count, text in advice if count),
                         "More samples per task (NUM_GENERATIONS) or a higher TEMPERATURE make scores vary more "
                         "often."])


def read_progress(db: Database, split: str = "train") -> Progress:
    """The progress of ``split`` in the run stored in ``db`` (a few indexed queries; cheap enough for 1 Hz)."""
    records = db[Record.collection]
    progress = Progress()
    for row in records.aggregate([{"$match": {"split": split}}, {"$group": {"_id": "$status", "n": {"$sum": 1}}}]):
        if row["_id"] in FINISHED:
            progress.trajectories += row["n"]
        elif row["_id"] == str(RecordStatus.RUNNING):
            progress.running += row["n"]
    scored = {"split": split, "score": {"$ne": None}}
    for row in records.aggregate([{"$match": scored}, {"$group": {"_id": None, "mean": {"$avg": "$score"}}}]):
        progress.reward_mean = row["mean"]
    recent = [float(doc["score"]) for doc in records.find(scored, {"score": 1}, sort=[("finished_at", -1)],
                                                         limit=RECENT_REWARDS)]
    if recent:
        progress.recent_reward = sum(recent) / len(recent)
    decisions: dict[str, set[str]] = {}
    kept_groups: set[str] = set()
    solved: set[str] = set()
    for doc in records.find({"split": split, "group_decision": {"$ne": None}},
                            {"task_id": 1, "status": 1, "group_decision": 1, "score": 1, "score_details.success": 1}):
        decisions.setdefault(doc["task_id"], set()).add(str(doc["group_decision"]))
        if doc.get("status") in KEPT:
            kept_groups.add(doc["task_id"])
        if doc.get("group_decision") == ZERO_VARIANCE_DECISION and succeeded(
                doc.get("score"), (doc.get("score_details") or {}).get("success")):
            solved.add(doc["task_id"])
    progress.groups_kept = len(kept_groups)
    progress.zero_variance_solved = len(solved)
    for task_id, reasons in decisions.items():
        if task_id not in kept_groups:
            reason = ZERO_VARIANCE_DECISION if ZERO_VARIANCE_DECISION in reasons else sorted(reasons)[0]
            progress.groups_dropped[reason] += 1
    progress.failures = failure_counts(records, split)
    tasks = db[Task.collection]
    for doc in tasks.find({"split": split, "$or": [{"rounds_skipped": {"$gt": 0}}, {"skipped_rounds": {"$gt": 0}}]},
                          {"rounds_skipped": 1, "skipped_rounds": 1}):
        progress.tasks_deferred += int((doc.get("rounds_skipped") or 0) > 0)
        progress.rounds_skipped += int(doc.get("rounds_skipped") or 0)
        progress.revisits += int((doc.get("skipped_rounds") or 0) > 0)
    samples = db[DBRecordData.collection]
    for row in samples.aggregate([{"$match": {"split": split}}, {"$group": {"_id": "$status", "n": {"$sum": 1}}}]):
        if row["_id"] == str(SampleStatus.QUEUED):
            progress.samples_queued = row["n"]
        elif row["_id"] == str(SampleStatus.SKIPPED):
            progress.samples_skipped = row["n"]
        elif row["_id"] == str(SampleStatus.TRAINED):
            progress.samples_trained = row["n"]
    metrics = list(db[Metric.collection].find({"split": split}, {"step": 1, "values": 1, "created_at": 1},
                                              sort=[("step", -1)], limit=6))
    if metrics:
        progress.step = int(metrics[0]["step"])
        progress.last_metric = dict(metrics[0].get("values", {}))
        times = [m["created_at"] for m in metrics]
        gaps = [(a - b).total_seconds() for a, b in zip(times, times[1:])]
        progress.step_seconds = statistics.median(gaps) if gaps else None
    run = db[Run.collection].find_one({"_id": RUN_ID}, {"status": 1, "policy_version": 1, "config": 1})
    if run is not None:
        progress.run_status = str(run.get("status"))
        progress.policy_version = int(run.get("policy_version") or 0)
        config = run.get("config") or {}
        progress.max_steps = max(int(config.get("max_steps") or 0), 0)
        progress.time_limit_s = float(config.get("max_train_time_s") or 0.0)
    return progress


def progress_fields(progress: Progress) -> dict[str, Any]:
    """The JSON form used by run summaries."""
    return {"trajectories": progress.trajectories, "groups_kept": progress.groups_kept,
            "groups_dropped": dict(progress.groups_dropped), "zero_variance_solved": progress.zero_variance_solved,
            "kept_share": progress.kept_share,
            "curriculum": {"tasks_deferred": progress.tasks_deferred, "rounds_skipped": progress.rounds_skipped,
                           "revisits": progress.revisits},
            "samples_trained": progress.samples_trained,
            "samples_skipped_stale": progress.samples_skipped, "failures": dict(progress.failures),
            "steps": progress.step,
            "policy_version": progress.policy_version, "reward_mean": progress.reward_mean}
