"""Pydantic models of the documents AgentRL keeps in MongoDB (one collection per class; docs/data-model.md).

Documents are stored with their ``id`` as ``_id``. Dates are timezone-aware UTC datetimes, so they show as real
dates in Mongo Compass. Every state change goes through the store's atomic operations, never through a
whole-document save.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator


def utcnow() -> datetime:
    """Current time as an aware UTC datetime, truncated to milliseconds (BSON date precision)."""
    now = datetime.now(UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UTCDatetime = Annotated[datetime, AfterValidator(_as_utc)]
"""A datetime read back as aware UTC (drivers return naive UTC; some servers return ISO strings)."""

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Document(BaseModel):
    """Base of every stored document: ``id`` maps to MongoDB's ``_id``."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")
    collection: ClassVar[str]

    id: Any = Field(alias="_id")

    def to_mongo(self) -> dict[str, Any]:
        """The document as stored (``_id`` key, enums as strings)."""
        return self.model_dump(by_alias=True, mode="python", exclude_none=False)

    @classmethod
    def from_mongo(cls, doc: dict[str, Any] | None):
        """Parse a raw document (``None`` stays ``None``); dates come back as aware UTC datetimes."""
        if doc is None:
            return None
        return cls.model_validate(doc)




# ----------------------------------------------------------------------------------------------------------- Task


class TaskStatus(StrEnum):
    CREATED = "created"
    RUNNING = "running"
    INTERRUPTED = "interrupted"
    """Started, then every sampler working on it stopped (shutdown): its given-back slots wait for the next
    sampler, which resumes it (``running`` again)."""
    COMPLETED = "completed"
    FAILED = "failed"


OPEN_TASK_STATES: tuple[str, ...] = (str(TaskStatus.CREATED), str(TaskStatus.RUNNING), str(TaskStatus.INTERRUPTED))
"""Task states of a Task not yet done (slots to sample or a group stage to run)."""
STARTED_TASK_STATES: tuple[str, ...] = (str(TaskStatus.RUNNING), str(TaskStatus.INTERRUPTED))
"""Task states of a started, unfinished group (what admission control and recovery look at)."""


class Task(Document):
    """One prompt to be sampled ``num_generations`` times (a GRPO group), in one round (``round``: a content
    sampled in several rounds has one Task per round, see ``agentrl.rollout.curriculum``).

    A claim appends a lease id to ``claim_ids``; its index is the slot number. The lease itself (owner, expiry,
    heartbeats) lives on the slot's ``Record``. ``unclaimed`` counts slots never handed out, ``remaining`` slots
    not yet settled (scored or given up); the caller whose settlement brings ``remaining`` to 0 is told to run
    the group stage, guarded by its own lease (``group_lease_*``) so a crash there is recovered too.
    """

    collection: ClassVar[str] = "Task"

    split: str = "train"
    order: int = Field(0, description="upload sequence number; claims fill groups in this order (within a round)")
    round: int = Field(1, description="the round this Task samples its content in (``agentrl.rollout.curriculum``)")
    first_round_id: str | None = Field(None, description="the id of the content's round-1 Task (None: this one)")
    skipped_rounds: int = Field(0, description="rounds the curriculum skipped right before this one")
    query: str
    answer: str | None = None
    system_prompt: str | None = None
    images: list[str] = Field(default_factory=list, description="the question's images (sha256 ids in the GridFS "
                              "bucket 'images'), shown before its text")
    scorer: str = "math"
    answer_schema: str = "boxed"
    task_type: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    content_hash: str

    num_generations: int = 1
    max_attempts: int = 3
    unclaimed: int
    remaining: int
    claim_ids: list[str] = Field(default_factory=list)
    settled_slots: list[int] = Field(default_factory=list)
    completed_slots: list[int] = Field(default_factory=list)
    failed_slots: list[int] = Field(default_factory=list)

    status: TaskStatus = TaskStatus.CREATED
    group_stage_done: bool = False
    group_lease_owner: str | None = None
    group_lease_id: str | None = None
    group_lease_expires_at: UTCDatetime = Field(default_factory=lambda: EPOCH)
    claimed_at: UTCDatetime | None = Field(None, description="when a never-claimed slot was last claimed")
    pass_rate: float | None = Field(None, description="set by the group stage: share of its scored samples solved")
    next_round: int | None = Field(None, description="set by the group stage: the round its content is sampled in "
                                                     "next (None: not again)")
    rounds_skipped: int = Field(0, description="set by the group stage: rounds the curriculum skips after it")
    taught: bool | None = Field(None, description="set by the group stage: its rewards varied (the group was not "
                                "dropped for zero variance)")
    created_at: UTCDatetime = Field(default_factory=utcnow)
    updated_at: UTCDatetime = Field(default_factory=utcnow)


# --------------------------------------------------------------------------------------------------------- Record


class RecordStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    SCORED = "scored"
    READY = "ready"
    ABANDONED = "abandoned"
    TRAINED = "trained"


RECORD_TRANSITIONS: dict[RecordStatus, frozenset[RecordStatus]] = {
    RecordStatus.RUNNING: frozenset({RecordStatus.COMPLETED, RecordStatus.FAILED}),
    RecordStatus.COMPLETED: frozenset({RecordStatus.SCORED, RecordStatus.FAILED}),
    RecordStatus.FAILED: frozenset({RecordStatus.SCORED, RecordStatus.ABANDONED}),
    RecordStatus.SCORED: frozenset({RecordStatus.READY, RecordStatus.ABANDONED}),
    RecordStatus.READY: frozenset({RecordStatus.TRAINED, RecordStatus.ABANDONED}),
    RecordStatus.ABANDONED: frozenset(),
    RecordStatus.TRAINED: frozenset(),
}
"""The moves ``Records.transition`` allows (docs/data-model.md). A sampler's own outcome skips ``completed``:
``SlotLeases.finish`` writes running → scored or failed in one update fenced on its lease."""


class FailureClass(StrEnum):
    """Why a Record did not train (``Record.failure_class``, set on every ``failed`` or ``abandoned`` Record)."""

    INFERENCE_UNAVAILABLE = "inference_unavailable"
    """No live inference service answered (infrastructure: the attempt is given back and its slot retried)."""
    ENVIRONMENT_UNAVAILABLE = "environment_unavailable"
    """The environment server could not be reached (infrastructure: given back and retried)."""
    JUDGE_UNAVAILABLE = "judge_unavailable"
    """The scorer (e.g. an LLM judge) stayed unreachable past its bound (infrastructure: given back and retried)."""
    DATABASE_UNAVAILABLE = "database_unavailable"
    """A database error cut the trajectory off (infrastructure: given back and retried)."""
    ABORTED_GENERATION = "aborted_generation"
    """Inference failed or was aborted mid-trajectory (outcome ``failed_error``): no verdict on the policy."""
    ENVIRONMENT_ERROR = "environment_error"
    """The environment failed to start or during the episode (``env_start_error``, ``env_error``)."""
    TOOL_ERROR = "tool_error"
    """No trainable token is left: the trajectory's calls failed in their tools."""
    FORMAT_ERROR = "format_error"
    """No trainable token is left: the trajectory's calls could not be parsed as tool calls."""
    CONTEXT_LIMIT = "context_limit"
    """The context outgrew ``--max_prompt_tokens`` (``length_limit_error``), not kept by the group stage."""
    TURN_LIMIT = "turn_limit"
    """``--max_turns`` turns without an answer (``turns_limit_error``), not kept by the group stage."""
    REPETITION = "repetition"
    """The model repeated itself (``repetition_error``), not kept by the group stage."""
    VISION_TOKEN = "vision_token"
    """The model generated a vision placeholder token (``vision_token_error``): its ids cannot be trained."""
    SCORE_ERROR = "score_error"
    """The scorer could not score the answer (``score_error``): the slot is settled as failed."""
    LEASE_LOST = "lease_lost"
    """Its sampler died or stalled: the lease expired and another sampler took the slot over."""
    CANCELLED = "cancelled"
    """Cancelled at shutdown: its sampler stopped and gave the slot back (retried, not a failed attempt)."""
    SAMPLER_ERROR = "sampler_error"
    """An unexpected error in the sampler (see its log); counts as a failed attempt."""
    FILTERED = "filtered"
    """Dropped by the group stage: zero reward variance, balancing, ``min_turns``, no trainable token."""
    STALE = "stale"
    """Its samples were too many policy versions old when the trainer claimed them (skipped)."""
    TEMPERATURE = "temperature"
    """Its samples were drawn at another temperature than the one the trainer divides its logits by (skipped)."""
    SAMPLE_TOO_LARGE = "sample_too_large"
    """A training sample of it exceeds the database's document size limit."""
    UNKNOWN = "unknown"
    """Stored before failure classes existed (never written: a failed or abandoned Record without the field)."""


INFRASTRUCTURE_FAILURES: frozenset[FailureClass] = frozenset({
    FailureClass.INFERENCE_UNAVAILABLE, FailureClass.ENVIRONMENT_UNAVAILABLE, FailureClass.JUDGE_UNAVAILABLE,
    FailureClass.DATABASE_UNAVAILABLE, FailureClass.ABORTED_GENERATION, FailureClass.ENVIRONMENT_ERROR})
"""Failures of the infrastructure, not the policy: what ``agentrl sample --max_consecutive_failures`` counts."""
NOT_TRAINED_STATES: tuple[str, ...] = (str(RecordStatus.FAILED), str(RecordStatus.ABANDONED))
"""Record states that end without training (each such Record has a ``failure_class``)."""


SUCCESS_SCORE = 0.5
"""A trajectory scoring at least this is a success: right for the group stage, correct for evaluations (an
environment episode's success is its environment's own: ``solved``)."""

ZERO_VARIANCE_DECISION = "zero variance in the group"
"""``Record.group_decision`` of every member of a train group whose rewards do not vary (dropped)."""


def succeeded(score: float | None, success: Any = None) -> bool:
    """Whether a trajectory with this score succeeded: an environment episode by its environment's own rule (the
    ``success`` its score details carry: a SciWorld episode at half its score has not), anything else by
    ``SUCCESS_SCORE``."""
    if isinstance(success, bool):
        return success
    return score is not None and score >= SUCCESS_SCORE


def solved(record: Record) -> bool:
    """:func:`succeeded` for a Record."""
    return succeeded(record.score, record.score_details.get("success"))


class Record(Document):
    """One trajectory: the sample in slot ``slot`` of a Task, attempt ``attempt``.

    ``_id`` is ``"{task_id}/{slot}/{attempt}"``: the unique key makes every (re)claim of a slot exactly-once.
    While ``leased`` is true the sampler ``lease_owner`` holds the slot until ``lease_expires_at`` (extended by
    heartbeats); an expired lease is reclaimed by another sampler as attempt ``attempt + 1`` — or, when the Record
    already has its outcome (its ``finish`` was cut off before settling the slot), the settlement is completed.
    Turns live in ``DispatchedSamplingTask`` (one document per LLM call), not here.
    """

    collection: ClassVar[str] = "Record"

    task_id: str
    split: str = "train"
    slot: int
    attempt: int
    failures: int = Field(0, description="failed attempts of this slot before this one (release does not count)")
    lease_id: str
    lease_owner: str
    leased: bool = True
    lease_expires_at: UTCDatetime
    released: bool = False
    given_up: bool = Field(False, description="its holder ended it (``release``, ``abandon``): its slot is retaken "
                                              "as the next attempt, not settled with this one")
    status: RecordStatus = RecordStatus.RUNNING
    num_turns: int = 0
    outcome: str | None = Field(None, description="answer | turns_limit_error | length_limit_error | ...")
    final_answer: str | None = None
    score: float | None = None
    score_error: str | None = Field(None, description="scorer/judge failure; never silently a 0 reward")
    score_details: dict[str, Any] = Field(default_factory=dict)
    advantage: float | None = Field(None, description="set by the group stage")
    group_decision: str | None = Field(None, description="why the group stage kept or dropped this sample")
    policy_version: int | None = Field(None, description="policy version at the first LLM call")
    error: str | None = None
    failure_class: FailureClass | None = Field(None, description="why it did not train (failed or abandoned)")
    env_instance: dict[str, Any] | None = Field(
        None, description="an environment episode's instance {name, url, id}: recorded before the first step, so "
                          "an attempt that dies is closed by the next attempt of its slot; the field env_open "
                          "exists while it is not known to be closed (set and unset by Records, never inserted)")
    meta: dict[str, Any] = Field(default_factory=dict)
    created_at: UTCDatetime = Field(default_factory=utcnow)
    updated_at: UTCDatetime = Field(default_factory=utcnow)
    finished_at: UTCDatetime | None = None

    @model_validator(mode="after")
    def _unknown_failure(self) -> Record:
        """A failed or abandoned Record stored before failure classes existed reads as ``unknown``."""
        if self.failure_class is None and str(self.status) in NOT_TRAINED_STATES:
            self.failure_class = FailureClass.UNKNOWN
        return self


# -------------------------------------------------------------------------------------------- DispatchedSamplingTask


class CallStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    FORMATERROR = "formaterror"
    TOOLFAILED = "toolfailed"
    REPEATERROR = "repeaterror"


CALL_TRANSITIONS: dict[CallStatus, frozenset[CallStatus]] = {
    CallStatus.RUNNING: frozenset({CallStatus.COMPLETED, CallStatus.FAILED}),
    CallStatus.COMPLETED: frozenset({CallStatus.FORMATERROR, CallStatus.TOOLFAILED, CallStatus.REPEATERROR}),
    CallStatus.FAILED: frozenset(),
    CallStatus.FORMATERROR: frozenset(),
    CallStatus.TOOLFAILED: frozenset(),
    CallStatus.REPEATERROR: frozenset(),
}
"""Allowed DispatchedSamplingTask transitions (a completed call may be re-labelled by the tool stage)."""


class DispatchedSamplingTask(Document):
    """One LLM call of a trajectory, token-exact.

    The prompt is stored either whole (``input_ids``, first turn of a branch) or as the previous call of the same
    branch plus ``prompt_delta_ids`` (its tool/user messages rendered by the chat template), so that
    ``prompt(turn) == prompt(turn-1) + output(turn-1) + delta``. Decoded texts sit next to the ids for audits.
    """

    collection: ClassVar[str] = "DispatchedSamplingTask"

    record_id: str
    task_id: str
    turn: int
    branch: int = 0
    status: CallStatus = CallStatus.RUNNING
    previous_call_id: str | None = None
    input_ids: list[int] | None = None
    prompt_delta_ids: list[int] = Field(default_factory=list)
    prompt_delta_text: str = ""
    images: list[str] = Field(default_factory=list, description="the prompt's images in order (sha256 ids in the "
                              "GridFS bucket 'images'): its <|image_pad|> runs, expanded in the ids, are theirs")
    output_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    output_text: str = ""
    weight_version: int | None = Field(None, description="the policy version of the first output token")
    weight_version_spans: list[tuple[int, int]] | None = Field(
        None, description="(policy version, tokens) in order when the output spans several versions (the service "
        "swapped weights while generating it); None: every token has weight_version")
    finish_reason: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tool_results: list[dict[str, Any]] = Field(default_factory=list)
    service_id: str | None = None
    error: str | None = None
    created_at: UTCDatetime = Field(default_factory=utcnow)
    finished_at: UTCDatetime | None = None
    latency_s: float | None = None
    step_reward: float | None = Field(None, description="the reward of the step this call's action made (scaled as "
                                      "the episode's score); None: no per-turn reward")
    done: bool | None = Field(None, description="whether this call's step ended the episode")
    state_key: str | None = Field(None, description="key of the state this call acted in, before its action (the "
                                  "environment's, else a hash of the observation text or of the prompt)")
    advantage: float | None = Field(None, description="this call's advantage, set by the group stage")
    step_return: float | None = Field(None, description="the return to go the advantage was computed from "
                                      "(per-turn estimators)")


# ---------------------------------------------------------------------------------------------------- DBRecordData


class SampleStatus(StrEnum):
    QUEUED = "queued"
    CLAIMED = "claimed"
    TRAINED = "trained"
    SKIPPED = "skipped"  # claimed, then not trained on purpose (e.g. too stale); ``skip_reason`` says why


class DBRecordData(Document):
    """One training sample: a trajectory branch merged into one sequence, with per-token training labels."""

    collection: ClassVar[str] = "DBRecordData"

    record_id: str
    task_id: str
    split: str = "train"
    branch: int = 0
    seq: int = Field(description="enqueue order; among samples of the same first_version, trainers claim the "
                                 "oldest first")
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] = Field(description="behaviour-policy logprob per token (0 where loss_mask is 0)")
    versions: list[int] = Field(description="policy version that produced each token (-1 for prompt tokens)")
    advantages: list[float]
    reward: float | None = None
    turn_boundaries: list[int] = Field(default_factory=list, description="token offset where each turn starts")
    images: list[str] = Field(default_factory=list, description="the images of input_ids in order (sha256 ids in the "
                              "GridFS bucket 'images'), one per <|image_pad|> run")
    num_tokens: int
    status: SampleStatus = SampleStatus.QUEUED
    claimed_rank: int | None = None
    claimed_step: int | None = None
    claimed_at: UTCDatetime | None = None
    epoch: int = Field(0, description="pass over the data this sample is queued for (offline multi-epoch training)")
    first_version: int = Field(-1, description="oldest policy version that produced a trained token (-1: none "
                                               "known, e.g. SFT data); set on enqueue; trainers claim the oldest "
                                               "policy first, so groups that finished late are not left to go stale")
    skip_reason: str | None = None
    trainer_logprobs: list[float] | None = Field(None, description="the trainer's logprob of each token under the "
                                                 "policy that trained it (0 where loss_mask is 0; None: not "
                                                 "trained, or trained with cross-entropy)")
    trainer_version: int | None = Field(None, description="the policy version of trainer_logprobs (none when the "
                                        "trainer's weights had updates not yet published: --sync_every > 1)")
    temperature: float | None = Field(None, description="the sampling temperature of its LLM calls (NaN: they "
                                      "differ; None: not known, e.g. SFT data); a trainer skips a sample drawn at "
                                      "another temperature than its own")
    created_at: UTCDatetime = Field(default_factory=utcnow)
    trained_at: UTCDatetime | None = None

    def oldest_version(self) -> int:
        """The oldest policy version that sampled a loss token (-1 if none is known)."""
        versions = [v for v, m in zip(self.versions, self.loss_mask) if m and v >= 0]
        return min(versions) if versions else -1


# ------------------------------------------------------------------------------------------------ InferenceService


class ServiceStatus(StrEnum):
    UP = "UP"
    DOWN = "DOWN"
    STARTING = "STARTING"  # registered, loading the run's published weights: publishes reach it, samplers do not


class PolicyProbe(BaseModel):
    """The trainer's last check of the policy a service serves (``agentrl.training.policy_probe``): after
    publishing ``version`` the service scored a fixed token sequence and its logprobs were compared with the
    trainer's. A failed check keeps the service out of the samplers' choice until a later one passes or it
    registers afresh (a restart)."""

    version: int
    ok: bool
    mean_abs_diff: float | None = Field(None, description="mean |served − trainer| logprob over the sequence")
    max_abs_diff: float | None = None
    error: str | None = Field(None, description="why the check failed (mismatch, refusal, wrong weight_version)")
    at: UTCDatetime = Field(default_factory=utcnow)


class InferenceService(Document):
    """An inference server (SGLang or ``agentrl engine``) that samplers may send requests to.

    ``_id`` is the service's base URL. ``running_requests`` is the load counter samplers maintain: the sum of
    the shares in ``running_by`` (``{owner key: {"n": in-flight requests, "seen": epoch seconds}}``, see
    :mod:`agentrl.store.services`). A service is live while ``status == UP``, its ``heartbeat_at`` is recent and
    its last ``policy_probe`` did not fail (``probe_failed``, a field of its own: every registration sets it).
    """

    collection: ClassVar[str] = "InferenceService"

    base_url: str
    kind: str = "sglang"
    models: list[str] = Field(default_factory=list)
    status: ServiceStatus = ServiceStatus.UP
    weight_version: int = 0
    running_requests: int = 0
    running_by: dict[str, dict[str, int | float]] = Field(
        default_factory=dict, description="each owner's in-flight requests (n) and when it was last seen")
    total_requests: int = 0
    engine_load: dict[str, Any] = Field(default_factory=dict, description="load the server reports about itself")
    policy_probe: PolicyProbe | None = None
    probe_failed: bool = Field(False, description="the last policy probe failed: samplers keep off the service")
    heartbeat_at: UTCDatetime = Field(default_factory=utcnow)
    started_at: UTCDatetime = Field(default_factory=utcnow)


# ----------------------------------------------------------------------------------------------------- Run, Metric


class RunStatus(StrEnum):
    CREATED = "created"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


RUN_VALUE_HELP = ("the run records it when given (docs/configuration.md): left out, the run's value applies if a "
                  "process was given one, else the default; a value other than the one given before is an error")


class RunValues(BaseModel):
    """Values every trainer and every sampler of the train split must agree on. The run's ``Run`` document records
    a value only when a process was given it (a flag, a config file, a preset, or a value derived from such flags,
    e.g. the trainer's per-device batch size × accumulation × ranks); a process given none uses the recorded value,
    else these defaults, without recording them. So which process starts first changes nothing, and only two
    values that were both chosen can contradict each other (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train_batch_size: int = Field(16, ge=1, description="samples per trainer step (over all ranks); the samplers' "
                                  "admission control counts in these")
    max_staleness: int | None = Field(
        1, ge=0, description="policy versions a trained sample may lag behind; the samplers' admission control keeps "
        "at most (max_staleness + 1) batches sampled ahead (None: no bound)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of the samplers, by which the trainer "
                               "divides its logits to compute the behaviour logprobs")


def _chosen_values(values: dict[str, Any] | None) -> dict[str, Any]:
    """The recorded :class:`RunValues`, checked; ``None`` (a run from before values were recorded) is none."""
    if values is None:
        return {}
    return RunValues(**values).model_dump(include=set(values))


class Run(Document):
    """The one document describing a run (the database is the run): config snapshot and policy version."""

    collection: ClassVar[str] = "Run"

    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = 0
    weights_path: str | None = None
    weights_version: int | None = Field(None, description="the policy version the files at weights_path hold (a "
                                        "publish in memory writes none: it may be older than policy_version)")
    publish_id: str | None = Field(None, description="the id of the publish that made policy_version (a retried "
                                   "bump recognises its own)")
    lora_name: str | None = Field(None, description="the published LoRA adapter samplers name (lora_publish "
                                                    "adapter); None: the services serve the policy's full weights")
    status: RunStatus = RunStatus.CREATED
    values: Annotated[dict[str, Any], BeforeValidator(_chosen_values)] = Field(
        default_factory=dict, description="the RunValues some sampler or trainer was given, by name (a value no "
        "process was given is absent: each uses its own default)")
    value_sources: dict[str, str] = Field(default_factory=dict, description="how each recorded value was given, "
                                          "e.g. 'trainer: --per_device_train_batch_size 2 x 1 rank'")
    created_at: UTCDatetime = Field(default_factory=utcnow)
    updated_at: UTCDatetime = Field(default_factory=utcnow)


class Metric(Document):
    """Metrics of one trainer step (``_id`` is ``"{split}/{step}"``)."""

    collection: ClassVar[str] = "Metric"

    step: int
    split: str = "train"
    values: dict[str, float] = Field(default_factory=dict)
    sample_ids: list[str] = Field(default_factory=list, description="the step ledger: the DBRecordData this step "
                                  "trained (all ranks); after a resume only steps whose update survived are listed")
    created_at: UTCDatetime = Field(default_factory=utcnow)


ALL_DOCUMENTS: tuple[type[Document], ...] = (
    Task,
    Record,
    DispatchedSamplingTask,
    DBRecordData,
    InferenceService,
    Run,
    Metric,
)
