"""The group stage: once all samples of a Task are scored, decide which are trained and with what advantage.

Run by exactly one sampler per Task (the store's group-stage lease). For the ``train`` split, in order:

1. samples without a verdict on the policy (``failed_error``, ``env_start_error``, ``env_error``) are dropped, and so
   are those that cannot be trained (``vision_token_error``: a generated picture placeholder);
2. zero-variance drop: a group whose verdict scores and shaped rewards (3.) span less than
   ``zero_variance_threshold`` teaches nothing;
   with ``balance_sample`` at most ``min(#wrong, #right) + 1`` wrong and ``+ 2`` right samples are kept (shortest
   first); else right samples with at most ``min_turns`` turns are dropped (anti-shortcut) and at most
   ``reserve_context_error_count`` length/turns-limit samples are kept;
3. ``efficient_rewarding`` shifts rewards by turn-count rank (shorter right and longer wrong samples gain, ±0.1);
4. advantages are computed over the kept samples from the (shifted) rewards, so every decision above reaches
   the advantages the trainer uses (in the original they did not); with a per-turn ``adv_estimator`` each call
   gets its own (``agentrl.trajectory.step_credit``), written on the call documents (``advantage``,
   ``step_return``) before the Records move, and a group of equal scores is kept when its turns are credited
   unequally;
5. each kept trajectory is merged into DBRecordData samples (one per branch); its Record becomes ``ready`` (with
   ``advantage`` and ``reward``) and then its samples are queued for the trainer. The others become
   ``abandoned`` with the reason and a failure class (how the trajectory ended, else ``filtered``; a kept one
   without a trainable token or with a sample over the database's document size limit is dropped too);
6. with rounds left (``agentrl.rollout.curriculum``), the Task of the round its content is sampled in next is
   created; then the Task is closed with its pass rate and next round.

Round trips: the group's Records and the kept ones' calls are read in one query each; each kept Record costs two
writes (``ready``, its samples queued), the dropped ones one bulk write in all.

Other splits (evaluation) only mark their scored Records ``ready``. Redoing the stage after a crash is safe:
the decisions are deterministic, queued samples have deterministic ids (queueing them twice, even from two
overlapping runs of the stage, queues each once), and a Record already at or past the state the stage wants
(``ready`` and since trained by the trainer, or abandoned as stale) is left as it is. A Record is ``ready`` before
any of its samples is queued, so the trainer, which moves the Records of the samples it trained from ``ready`` to
``trained``, always finds it ``ready``. Crash windows (failpoints): after the per-turn credits are written on
the calls but before any Record moved (``group_stage.after_credits``; the redo writes the same values), after a
kept Record is ``ready`` but before its samples are queued (``group_stage.after_ready``; the redo queues them), and
after every Record moved and the next round created but before the Task is closed (``group_stage.before_complete``;
the redo creates the next round once: its id is deterministic); the trainer may train the queued samples in the
last two.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import bson

from agentrl.failpoints import failpoint
from agentrl.rollout.config import GroupConfig
from agentrl.rollout.curriculum import CurriculumConfig, next_round, round_task
from agentrl.rollout.mcp_state import history_state_keys, state_tools
from agentrl.rollout.tool_parsers import NEVER_TRAINED_OUTCOMES, NO_VERDICT_OUTCOMES, OUTCOME_FAILURES
from agentrl.rollout.turn_rewards import TURN_REWARDS
from agentrl.store import (
    DBRecordData,
    DispatchedSamplingTask,
    GroupLease,
    InvalidTransition,
    Record,
    RecordStatus,
    Store,
    Task,
)
from agentrl.store.models import RECORD_TRANSITIONS, ZERO_VARIANCE_DECISION, CallStatus, FailureClass, solved
from agentrl.store.transitions import sources_of
from agentrl.trajectory.advantages import AdvantageConfig, AdvEstimator, call_advantages, group_advantages
from agentrl.trajectory.merge import CallTokens, full_prompts, merge_trajectory
from agentrl.trajectory.step_credit import Episode as StepEpisode
from agentrl.trajectory.step_credit import Step, StepCredit, step_credits

logger = logging.getLogger(__name__)

CONTEXT_ERRORS = ("length_limit_error", "turns_limit_error")
MAX_SAMPLE_BYTES = 16 * 1024 * 1024 - 64 * 1024
"""MongoDB's document size limit (16 MiB), less room for the fields the queue adds to a sample."""
_BYTES_PER_TOKEN = 80
"""An upper bound of a sample's BSON bytes per token (5 arrays, each element at most 16 bytes below 10^6 tokens)."""
_CALL_FAILURES = ((CallStatus.FORMATERROR, FailureClass.FORMAT_ERROR),
                  (CallStatus.TOOLFAILED, FailureClass.TOOL_ERROR), (CallStatus.REPEATERROR, FailureClass.REPETITION))


@dataclass
class GroupOutcome:
    task_id: str
    kept: dict[str, str] = field(default_factory=dict)  # record id -> decision
    dropped: dict[str, str] = field(default_factory=dict)  # record id -> reason
    advantages: dict[str, float] = field(default_factory=dict)
    samples_queued: int = 0
    tokens_forwarded: int = 0
    tokens_if_unmerged: int = 0


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks of ``values`` in ascending order, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def efficiency_shifts(turns: list[float], prefer_short: bool, spread: float = 0.2) -> list[float]:
    """Zero-sum reward shifts in ``[-spread/2, spread/2]`` by turn-count rank."""
    n = len(turns)
    if n < 2:
        return [0.0] * n
    ranks = average_ranks(turns)
    mean = (n + 1) / 2
    sign = -1.0 if prefer_short else 1.0
    return [sign * (rank - mean) * spread / (n - 1) for rank in ranks]


def zero_variance(rewards: Sequence[float], cfg: GroupConfig) -> bool:
    """Whether rewards span less than ``zero_variance_threshold`` (or fewer than two): all solved or all failed
    alike, they teach nothing."""
    return len(rewards) < 2 or max(rewards) - min(rewards) < cfg.zero_variance_threshold


def with_verdict(records: list[Record]) -> list[Record]:
    """The scored records that judge the policy: not those whose infrastructure failed (scored 0 without a say)."""
    return [r for r in records if r.outcome not in NO_VERDICT_OUTCOMES]


def decide(records: list[Record], cfg: GroupConfig) -> tuple[dict[str, str], dict[str, str], dict[str, float]]:
    """``(kept, dropped, rewards)`` for the scored records of one train group (ids → decision / reason / reward).

    The zero-variance gate drops a group only when neither its scores nor the rewards its advantages are computed
    from (the kept members', after ``efficient_rewarding``'s shifts) vary: an all-solved group whose members took
    different numbers of turns can teach. Samples without a verdict never count (before, three successes and an
    ``env_error`` scored 0 passed the gate and trained with advantages 0)."""
    kept: dict[str, str] = {}
    dropped: dict[str, str] = {r.id: str(r.outcome) for r in records if r.outcome in NEVER_TRAINED_OUTCOMES}
    candidates = [r for r in records if r.id not in dropped]
    if not candidates:
        return {}, dropped, {}
    rng = random.Random(f"{cfg.seed}:{records[0].task_id}")
    right = [r for r in candidates if solved(r)]
    wrong = [r for r in candidates if not solved(r)]
    if cfg.balance_sample:
        least = min(len(right), len(wrong))
        for group, extra, label in ((wrong, 1, "wrong"), (right, 2, "right")):
            ordered = sorted(group, key=lambda r: r.num_turns)
            for record in ordered[: least + extra]:
                kept[record.id] = f"balanced ({label})"
            for record in ordered[least + extra:]:
                dropped[record.id] = f"balance_sample: surplus {label} sample"
    else:
        context_errors = [r for r in candidates if r.outcome in CONTEXT_ERRORS]
        reserve = {r.id for r in context_errors}
        if cfg.reserve_context_error_count >= 0 and len(context_errors) > cfg.reserve_context_error_count:
            reserve = {r.id for r in rng.sample(context_errors, cfg.reserve_context_error_count)}
        for record in candidates:
            if record in right and record.num_turns <= cfg.min_turns:
                dropped[record.id] = f"right with {record.num_turns} <= min_turns {cfg.min_turns} turns"
            elif record.outcome in CONTEXT_ERRORS and record.id not in reserve:
                dropped[record.id] = f"{record.outcome} beyond reserve_context_error_count"
            else:
                kept[record.id] = "kept"
    rewards = {r.id: float(r.score) for r in candidates if r.id in kept}
    if cfg.efficient_rewarding:
        for group, prefer_short in ((right, True), (wrong, False)):
            members = [r for r in group if r.id in kept]
            for record, shift in zip(members, efficiency_shifts([r.num_turns for r in members], prefer_short)):
                rewards[record.id] += shift
    if zero_variance(list(rewards.values()), cfg) and zero_variance([r.score for r in candidates], cfg):
        dropped.update({r.id: ZERO_VARIANCE_DECISION for r in candidates})
        return {}, dropped, {}
    return kept, dropped, rewards


async def run_group_stage(store: Store, group: GroupLease, cfg: GroupConfig, adv_cfg: AdvantageConfig,
                          curriculum: CurriculumConfig | None = None) -> GroupOutcome:
    """Apply the group stage to ``group``'s Task and close it (see the module docstring); with ``curriculum``, a
    train Task's next round is scheduled first."""
    task = group.task
    outcome = GroupOutcome(task_id=task.id)
    latest: dict[int, Record] = {}
    for record in await store.records.for_task(task.id):
        latest[record.slot] = record  # attempts come in order: the last one of each slot wins
    # Every Record that was scored, including those a crashed earlier run of this stage already moved on (and the
    # trainer may have trained since): the redo must decide over the same group to reach the same decisions.
    was_scored = reachable_from(RecordStatus.SCORED)
    scored = [r for r in latest.values() if r.score is not None and str(r.status) in was_scored]
    if task.split != "train":
        await _move_many(store, RecordStatus.READY, {r.id: {"group_decision": "evaluation sample"} for r in scored})
        await store.slots.complete_group(group)
        return outcome
    kept, dropped, rewards = decide(scored, cfg)
    per_turn = adv_cfg.adv_estimator != AdvEstimator.GRPO
    tied = per_turn and not kept  # alike in score: the turns may still differ in credit
    if tied:
        rewards = {r.id: float(r.score) for r in with_verdict(scored) if dropped.get(r.id) == ZERO_VARIANCE_DECISION}
    calls = await store.calls.for_records(list(rewards))
    turn_rewards = {r.id: r.score_details.get(TURN_REWARDS) for r in scored if r.id in rewards}
    tools = state_tools(task.metadata) if per_turn else None
    keys = {rid: history_state_keys(calls[rid], tools) if tools else None for rid in rewards}
    credits = _turn_credits(calls, rewards, turn_rewards, keys, adv_cfg) if per_turn else {}
    if tied:  # kept when two or more members' turns differ in credit
        if len(credits) > 1 and any(abs(credit.advantage) >= 1e-12 for row in credits.values() for credit in row):
            kept = dict.fromkeys(credits, "kept (turn credit)")
            dropped = {rid: reason for rid, reason in dropped.items() if rid not in kept}
        else:
            credits = {}
    rewards = {rid: rewards[rid] for rid in kept}
    advantages = dict(zip(rewards, group_advantages(list(rewards.values()), adv_cfg)))
    per_call = {rid: call_advantages([c.advantage for c in credits[rid]] if rid in credits else advantages[rid],
                                     [str(c.status) for c in calls[rid]], adv_cfg) for rid in kept}
    if credits:
        await store.calls.set_credits({
            call.id: {"advantage": advantage, "step_return": credit.step_return,
                      **({} if turn_rewards[rid] is None else {"step_reward": turn_rewards[rid][t]}),
                      **({} if keys[rid] is None or call.state_key else {"state_key": keys[rid][t]})}
            for rid in kept
            for t, (call, credit, advantage) in enumerate(zip(calls[rid], credits[rid], per_call[rid], strict=True))})
        failpoint("group_stage.after_credits")
    abandon: dict[str, dict] = {}
    for record in scored:
        failure = OUTCOME_FAILURES.get(str(record.outcome), FailureClass.FILTERED)
        if record.id in kept:
            samples = _convert(record, calls[record.id], per_call[record.id], rewards[record.id], adv_cfg, outcome)
            too_large = max((_oversize(sample) for sample in samples), default=0)
            if samples and too_large <= MAX_SAMPLE_BYTES:
                await _move_many(store, RecordStatus.READY, {record.id: {
                    "advantage": advantages[record.id], "group_decision": kept[record.id],
                    "meta": {**record.meta, "reward": rewards[record.id]}}})
                failpoint("group_stage.after_ready")
                await store.samples.enqueue(samples)
                outcome.samples_queued += len(samples)
                outcome.kept[record.id] = kept[record.id]
                outcome.advantages[record.id] = advantages[record.id]
                continue
            if samples:
                dropped[record.id] = f"a training sample of {too_large} bytes exceeds the database's document limit"
                failure = FailureClass.SAMPLE_TOO_LARGE
            else:
                dropped[record.id] = "no trainable tokens (advantage dropped on every call)"
                failure = _untrainable(calls[record.id])
        abandon[record.id] = {"group_decision": dropped[record.id], "failure_class": str(failure)}
        outcome.dropped[record.id] = dropped[record.id]
    await _move_many(store, RecordStatus.ABANDONED, abandon)
    fields = await _schedule_next_round(store, task, scored, cfg, curriculum or CurriculumConfig())
    failpoint("group_stage.before_complete")
    await store.slots.complete_group(group, **fields)
    return outcome


async def _schedule_next_round(store: Store, task: Task, scored: list[Record], cfg: GroupConfig,
                               curriculum: CurriculumConfig) -> dict[str, Any]:
    """Create the Task of the round its content is sampled in next, if any (``agentrl.rollout.curriculum``);
    returns what the closing Task records: its pass rate, next round, the rounds skipped until then and whether
    the group taught anything."""
    successes = [solved(r) for r in with_verdict(scored) if r.score is not None]
    taught = not zero_variance([r.score for r in with_verdict(scored) if r.score is not None], cfg)
    following = next_round(curriculum, task.first_round_id or task.id, task.round, taught)
    if following is not None:
        await store.slots.add_task(round_task(task, following))
    skipped = (following if following is not None else curriculum.rounds + 1) - task.round - 1
    return {"pass_rate": sum(successes) / len(successes) if successes else None, "next_round": following,
            "rounds_skipped": max(skipped, 0), "taught": taught}


def turn_episode(calls: list[DispatchedSamplingTask], score: float, turn_rewards: list[float] | None = None,
                 state_keys: list[str] | None = None) -> StepEpisode:
    """A trajectory's calls as steps for per-turn credit: each call's ``step_reward`` and ``state_key`` (an
    environment episode's); for calls without (tool tasks) the scorer's ``turn_rewards`` if it gave them, else the
    score as the last call's reward, and ``state_keys`` (a stateful MCP server's, ``mcp_state.state_tools``) if
    given, else the call's whole prompt as its state (identical histories are one state)."""
    rewarded = any(call.step_reward is not None for call in calls)
    keys = [call.state_key or (state_keys[t] if state_keys is not None else None) for t, call in enumerate(calls)]
    prompts = [None] * len(calls) if all(keys) else full_prompts([CallTokens.from_document(c, None) for c in calls])

    def reward(t: int, call: DispatchedSamplingTask) -> float:
        if rewarded:
            return float(call.step_reward or 0.0)
        if turn_rewards is not None:
            return float(turn_rewards[t])
        return score if t == len(calls) - 1 else 0.0

    steps = [Step(reward=reward(t, call),
                  state_key=key or "prompt:" + hashlib.sha256(str(prompt).encode()).hexdigest()[:24])
             for t, (call, key, prompt) in enumerate(zip(calls, keys, prompts))]
    return StepEpisode(score=score, steps=steps)


def _turn_credits(calls: dict[str, list[DispatchedSamplingTask]], rewards: dict[str, float],
                  turn_rewards: dict[str, list[float] | None], state_keys: dict[str, list[str] | None],
                  adv_cfg: AdvantageConfig) -> dict[str, list[StepCredit]]:
    """Each member's per-turn credit (by record id), over the members ``rewards`` names."""
    rows = step_credits([turn_episode(calls[rid], reward, turn_rewards.get(rid), state_keys.get(rid))
                         for rid, reward in rewards.items()], adv_cfg)
    return dict(zip(rewards, rows, strict=True))


def _convert(record: Record, calls: list[DispatchedSamplingTask], per_call: list[float | None], reward: float,
             adv_cfg: AdvantageConfig, outcome: GroupOutcome) -> list[DBRecordData]:
    """Merge a kept trajectory into DBRecordData samples (one per branch), each call's tokens with its advantage
    (``call_advantages``)."""
    merged = merge_trajectory([CallTokens.from_document(c, a) for c, a in zip(calls, per_call)],
                              adv_cfg.trainable_statuses)
    outcome.tokens_forwarded += merged.tokens_forwarded
    outcome.tokens_if_unmerged += merged.tokens_if_unmerged
    return [
        DBRecordData(id=f"{record.id}#b{index}", record_id=record.id, task_id=record.task_id, split=record.split,
                     branch=index, seq=0, input_ids=s.input_ids, loss_mask=s.loss_mask, logprobs=s.logprobs,
                     versions=s.versions, advantages=s.advantages, reward=reward, turn_boundaries=s.turn_boundaries,
                     images=s.images, num_tokens=s.num_tokens, temperature=_temperature(calls))
        for index, s in enumerate(merged.samples)]


def _temperature(calls: list[DispatchedSamplingTask]) -> float | None:
    """The calls' sampling temperature: NaN where they differ (a sampler took up a new run value mid-trajectory),
    None where none is recorded."""
    temperatures = {call.sampling_params.get("temperature") for call in calls} - {None}
    return None if not temperatures else temperatures.pop() if len(temperatures) == 1 else math.nan


def _oversize(sample: DBRecordData) -> int:
    """0 for a sample certainly below ``MAX_SAMPLE_BYTES`` by the bound per token, else its size in BSON bytes."""
    if len(sample.input_ids) * _BYTES_PER_TOKEN < MAX_SAMPLE_BYTES:
        return 0
    return len(bson.encode(sample.to_mongo()))


def _untrainable(calls: Sequence[DispatchedSamplingTask]) -> FailureClass:
    """Why a kept trajectory has no trainable token: its calls' worst error, else its advantage was dropped."""
    statuses = {str(call.status) for call in calls}
    return next((failure for status, failure in _CALL_FAILURES if str(status) in statuses), FailureClass.FILTERED)


def reachable_from(state: RecordStatus) -> set[str]:
    """``state`` and every state a Record can reach from it."""
    seen, todo = {str(state)}, [state]
    while todo:
        for target in RECORD_TRANSITIONS[todo.pop()]:
            if str(target) not in seen:
                seen.add(str(target))
                todo.append(target)
    return seen


async def _move_many(store: Store, target: RecordStatus, updates: dict[str, dict]) -> None:
    """Move Records to ``target`` in one command. One already at or past it is left as it is: the stage is being
    redone after a crash (and e.g. the trainer trained the Record)."""
    states = await store.records.transition_many(target, updates)
    for record_id, state in states.items():
        if state not in reachable_from(target):
            raise InvalidTransition(Record.collection, record_id, state, str(target),
                                    sources_of(RECORD_TRANSITIONS, target))
