"""A sampler process: claims Task slots, rolls out trajectories concurrently, scores them, runs group stages.

Run as many as you like, anywhere (``agentrl sample``). Each claims sample slots as leases (heartbeated while it
works), runs up to ``max_concurrent_samples_per_process`` trajectories on one asyncio loop, and settles each slot with
its score; the sampler that settles a Task's last slot runs that Task's group stage. A trajectory's calls are kept in
memory (``CallLog``) and written in one command when it ends — before its outcome, or before its slot is given back —
so a trajectory costs 6 database round trips from its claim to its settlement (the sequence is in
``agentrl.store.slots``); the sampler counts them (``SamplerStats``, the last line of ``agentrl sample``). On
SIGTERM/SIGINT it stops claiming, cancels its trajectories (their Records end ``failed`` as ``cancelled`` and their
slots are given back), lets group stages already running finish, and marks the started Tasks nobody works on any more
``interrupted``, so nothing is left ``running``.

Failures of the infrastructure are not the policy's: a trajectory cut off by no live inference service, an
unreachable judge or environment server, or a database error gives its slot back unscored (``release``: not a
failed attempt, the Record ``failed`` with its failure class) to be retried. A database outage stalls the process
instead of ending it (``agentrl.store.outage``): lease and group-stage heartbeats keep trying through errors, and
the claim loop retries connection errors with backoff. But ``max_consecutive_failures`` trajectories in a row that
fail for infrastructure (given back, or ended without a verdict: aborted generation, environment error) stop the
sampler with ``SamplerHalted``, which names the failure classes and the count; a trajectory with a verdict resets
the count.

Admission control (train split): a new group (Task) is started only while every slot of the groups being sampled plus
the samples ready but not yet trained fit ``(max_staleness + 1) × train_batch_size`` (values the run records, see
``agentrl.store.models.RunValues``, read again every ``RUN_VALUES_REFRESH_S``: a trainer started after the sampler
records its batch size then; ``max_staleness`` none: no bound); a started group's remaining
slots are always claimed (first, without asking admission control), so every group completes. Counting whole groups
(not only the trajectories running now) keeps finished trajectories that wait for their siblings in the count, which
bounds how stale a trained sample gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from pymongo.errors import ConnectionFailure, PyMongoError

from agentrl.envs.client import EnvUnavailable
from agentrl.failpoints import failpoint
from agentrl.rollout.agent import ANSWER, AgentResources, TrajectoryResult, run_trajectory
from agentrl.rollout.curriculum import TypeOrder, type_order
from agentrl.rollout.episode import episode_of, run_episode
from agentrl.rollout.group_stage import run_group_stage
from agentrl.rollout.inference_pool import NoInferenceService
from agentrl.rollout.keep_alive import KeepAlive
from agentrl.rollout.tool_parsers import NO_VERDICT_OUTCOMES, OUTCOME_FAILURES
from agentrl.rollout.turn_rewards import scorer_turns, turn_rewards_error
from agentrl.scoring import MCPScorerFactory, ScorerUnavailable
from agentrl.store import GroupLease, LeaseLost, RecordStatus, SlotLease
from agentrl.store.call_log import CallLog
from agentrl.store.models import FailureClass
from agentrl.store.outage import is_transient

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 10.0
RUN_VALUES_REFRESH_S = 10.0
SHUTDOWN_GRACE_S = 15.0
ENV_RETRY_PAUSE_S = 5.0
"""How long a trajectory slot waits after its environment server could not be reached (so a sampler whose
environment server is down does not spin claiming and giving back)."""
INFRASTRUCTURE_ERRORS: tuple[tuple[type[Exception], FailureClass], ...] = (
    (NoInferenceService, FailureClass.INFERENCE_UNAVAILABLE), (ScorerUnavailable, FailureClass.JUDGE_UNAVAILABLE),
    (EnvUnavailable, FailureClass.ENVIRONMENT_UNAVAILABLE), (PyMongoError, FailureClass.DATABASE_UNAVAILABLE))
"""Errors that give a trajectory's slot back unscored, and the failure class each gives its Record."""


class SamplerHalted(RuntimeError):
    """The sampler stopped itself after ``max_consecutive_failures`` infrastructure failures in a row."""


def infrastructure_failure(error: BaseException) -> FailureClass:
    return next(failure for kind, failure in INFRASTRUCTURE_ERRORS if isinstance(error, kind))


@dataclass
class FailureStreak:
    """Trajectories in a row that failed for infrastructure, by failure class (one with a verdict resets it)."""

    limit: int
    classes: Counter[str] = field(default_factory=Counter)
    last_error: str = ""

    def failed(self, failure: FailureClass, error: str) -> bool:
        """Count one failure; ``True`` once ``limit`` (> 0) failures are in a row."""
        self.classes[str(failure)] += 1
        self.last_error = error
        return 0 < self.limit <= self.total

    def succeeded(self) -> None:
        self.classes.clear()

    @property
    def total(self) -> int:
        return sum(self.classes.values())

    def message(self, owner: str) -> str:
        counts = ", ".join(f"{n} {name}" for name, n in self.classes.most_common())
        return (f"sampler {owner} stopped: {self.total} trajectories in a row failed for infrastructure ({counts}; "
                f"last error: {self.last_error}). Fix what they need (inference services, environment servers, "
                f"judge, database) and start it again; --max_consecutive_failures {self.limit} sets this limit "
                f"(0: never stop)")


@dataclass
class SamplerStats:
    trajectories: int = 0
    scored: int = 0
    score_errors: int = 0
    lost_leases: int = 0
    group_stages: int = 0
    samples_queued: int = 0
    reward_sum: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    db_commands: Counter[str] = field(default_factory=Counter)
    """Database commands the sampler sent while it ran, by name."""
    commands_by_part: Counter[str] = field(default_factory=Counter)
    """The same, by what sent them: ``claim`` (claims that got a slot), ``admission`` (admission control, before a
    claim starts a new group), ``trajectory`` (rolling out and settling it; the group's last also claims the group
    stage), ``group_stage``; the rest (``other``) is polling, recovery and the inference pool's load syncs."""
    trajectory_commands: Counter[int] = field(default_factory=Counter)
    """How many trajectories cost how many commands from their claim to their settlement (a histogram)."""

    def commands_per_trajectory(self, *parts: str) -> float:
        """Commands of ``parts`` (all when none is named) per finished trajectory."""
        counts = [self.commands_by_part[part] for part in parts] if parts else self.db_commands.values()
        return sum(counts) / max(self.trajectories, 1)

    @property
    def median_trajectory_commands(self) -> float | None:
        """The median number of commands from a trajectory's claim to its settlement."""
        values = sorted(self.trajectory_commands.elements())
        return statistics.median(values) if values else None

    def line(self, elapsed: float, active: int) -> str:
        mean = self.reward_sum / self.scored if self.scored else 0.0
        return (f"{self.trajectories} trajectories ({self.trajectories / max(elapsed, 1e-9):.2f}/s), {active} running, "
                f"mean reward {mean:.3f}, {self.group_stages} groups done, {self.samples_queued} samples queued")


class Sampler:
    """The claim → roll out → score → settle loop of one process."""

    def __init__(self, resources: AgentResources, owner: str | None = None):
        self.res = resources
        self.cfg = resources.config
        self.owner = owner or self.cfg.sampler_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.stats = SamplerStats()
        self.streak = FailureStreak(self.cfg.failure_limit)
        self._halted: str | None = None
        self._stop = asyncio.Event()
        self._active: set[asyncio.Task] = set()
        self._staging: set[asyncio.Task] = set()  # trajectory tasks that went on to their group stage
        self._leases: dict[asyncio.Task, SlotLease] = {}
        self._next_slot_recovery = 0.0  # while admission control holds new groups back
        self._type_order = TypeOrder()  # the curriculum by type: task types new groups start on first and last
        self._next_types_refresh = 0.0  # after each group stage of this sampler, else every quarter lease
        self._typed_tasks = False  # whether it claimed a Task with a task_type (else no type can be deferred)
        self._admission_commands = 0  # what admission control cost the last claim

    def stop(self) -> None:
        """Ask the loop to stop: no new claims; running trajectories are cancelled and their slots released."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)

    async def run(self) -> SamplerStats:
        """Sample until stopped (or, with ``exit_when_done``, until the split has no open Task left); raises
        ``SamplerHalted`` after ``max_consecutive_failures`` infrastructure failures in a row."""
        started = last_status = time.monotonic()
        commands_before = self.res.store.commands.snapshot()
        next_group_probe = next_values_refresh = 0.0
        backoff = 0.5
        logger.info("sampler %s started on split %s", self.owner, self.cfg.split)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_status >= STATUS_INTERVAL_S:
                    logger.info("sampler %s: %s", self.owner, self.stats.line(now - started, len(self._active)))
                    last_status = now
                try:
                    if now >= next_values_refresh:
                        next_values_refresh = now + RUN_VALUES_REFRESH_S
                        await self._refresh_run_values()
                    if now >= next_group_probe:
                        next_group_probe = now + self.cfg.concurrency.lease_s / 2
                        await self._recover_group_stages()
                    claimed = False
                    if len(self._active) < self.cfg.concurrency.max_concurrent_samples_per_process:
                        self._admission_commands = 0
                        with self.res.store.commands.tally() as used:
                            lease = await self._claim(now)
                        if lease is not None:
                            self._typed_tasks |= lease.task.task_type is not None
                            self.stats.commands_by_part["claim"] += sum(used.values())
                            self.stats.commands_by_part["admission"] += self._admission_commands
                            task = asyncio.create_task(self._sample(lease, sum(used.values())), name=lease.record_id)
                            self._active.add(task)
                            self._leases[task] = lease
                            task.add_done_callback(self._forget)
                            claimed = True
                    if claimed:
                        continue
                    if (not self._active and self.cfg.exit_when_done
                            and await self.res.store.slots.sampling_finished(self.cfg.split)):
                        break
                    backoff = 0.5
                except PyMongoError as error:
                    # A connection broken mid-operation (an unreachable database makes operations wait instead,
                    # see agentrl.store.outage). A claim cut off this way is an orphaned lease: it expires and is
                    # taken over. Past the outage tolerance the error is not transient and the sampler stops.
                    if not is_transient(error):
                        logger.error("sampler %s: the database stayed unreachable (%s); stopping (leases of its "
                                     "trajectories expire and other samplers take them over)", self.owner, error)
                        raise
                    logger.warning("sampler %s: database connection broke (%s); retrying in %.1f s", self.owner,
                                   error, backoff)
                    await self._wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                await self._wait(0.5 if self._active else 1.0)
        finally:
            await self._shutdown()
            self.stats.db_commands = self.res.store.commands.snapshot() - commands_before
            self.stats.commands_by_part["other"] = max(
                sum(self.stats.db_commands.values()) - sum(self.stats.commands_by_part.values()), 0)
            logger.info("sampler %s stopped: %s; database commands: %s (%s); trajectories by their commands from "
                        "claim to settlement: %s", self.owner,
                        self.stats.line(time.monotonic() - started, len(self._active)),
                        ", ".join(f"{name} {n}" for name, n in self.stats.db_commands.most_common()) or "none",
                        ", ".join(f"{part} {n}" for part, n in self.stats.commands_by_part.most_common()),
                        json.dumps(dict(sorted(self.stats.trajectory_commands.items()))))
        if self._halted is not None:
            raise SamplerHalted(self._halted)
        return self.stats

    async def _wait(self, timeout: float) -> None:
        waiters = [asyncio.create_task(self._stop.wait())]
        waiters.extend(self._active)
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiters[0].cancel()

    def _forget(self, task: asyncio.Task) -> None:
        self._active.discard(task)
        self._staging.discard(task)
        self._leases.pop(task, None)

    async def _shutdown(self) -> None:
        """Within ``SHUTDOWN_GRACE_S`` in all: cancel the trajectories (each gives its slot back as ``cancelled``)
        and let the group stages already running finish (those still running at the end are cancelled and give their
        lease back); then mark ``interrupted`` the started Tasks nobody works on. What cannot reach the database in
        time is left to lease expiry."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S

        def left() -> float:
            return max(deadline - time.monotonic(), 0.5)

        leases = list(self._leases.values())
        for task in self._active - self._staging:
            task.cancel()
        if self._active:
            await asyncio.wait(list(self._active), timeout=left())
        for task in list(self._active):  # group stages past the grace
            task.cancel()
        if self._active:
            await asyncio.wait(list(self._active), timeout=left())
        with contextlib.suppress(Exception):  # a task cancelled before it ran never gave its slot back (a no-op
            # for the others)
            await asyncio.wait_for(asyncio.gather(*(self.res.store.slots.release(lease) for lease in leases),
                                                  return_exceptions=True), left())
        try:
            interrupted = await asyncio.wait_for(self.res.store.slots.interrupt_idle(self.cfg.split), left())
        except (TimeoutError, PyMongoError) as error:
            logger.warning("sampler %s: could not mark its idle Tasks interrupted (%s)", self.owner, error)
        else:
            if interrupted:
                logger.info("sampler %s: %d started Tasks left for a later sampler (interrupted)", self.owner,
                            len(interrupted))

    async def _claim(self, now: float) -> SlotLease | None:
        """One claim: a slot of a started group (never held back), else, once admission control lets a new group
        start, any open slot (``SlotLeases.claim``: an expired lease first, then the first open Task, then a lost
        slot), else only a lost slot of a started group."""
        slots, split = self.res.store.slots, self.cfg.split
        lease = await slots.claim_started(split, self.owner)
        if lease is not None:
            return lease
        with self.res.store.commands.tally() as used:  # per new group, not per trajectory
            admitted = await self._admit()
            order = await self._refresh_type_order(now) if admitted else TypeOrder()
        self._admission_commands = sum(used.values())
        if admitted:
            return await slots.claim(split, self.owner, preferred_types=order.preferred,
                                     deferred_types=order.deferred)
        if now < self._next_slot_recovery:
            return None
        # Not admitted: no new slot, but lost slots of started groups are still recovered (they count against
        # admission, so waiting for admission could wait forever). A lease is lost only once it expires, so looking
        # every quarter lease is soon enough.
        lease = await slots.recover(split, self.owner)
        if lease is None:
            self._next_slot_recovery = now + self.cfg.concurrency.lease_s / 4
        return lease

    async def _refresh_type_order(self, now: float) -> TypeOrder:
        """The task types new groups start on first and last (``agentrl.rollout.curriculum.type_order``), from the
        recent groups of the train split: read again after each group stage of this sampler, else every quarter
        lease (other samplers' stages); never read while this sampler has claimed no Task with a ``task_type``."""
        curriculum = self.cfg.curriculum
        if (self.cfg.split != "train" or curriculum.mode != "pass_rate" or not curriculum.by_type
                or not self._typed_tasks):
            return TypeOrder()
        if now >= self._next_types_refresh:
            self._next_types_refresh = now + self.cfg.concurrency.lease_s / 4
            outcomes = await self.res.store.slots.recent_outcomes(self.cfg.split)
            order = type_order(curriculum, outcomes, await self.res.store.slots.completed_groups(self.cfg.split))
            if order.deferred != self._type_order.deferred:
                logger.info("curriculum: new groups of %s wait until no other Task is open",
                            ", ".join(sorted(order.deferred)) or "no task type")
            if order.preferred != self._type_order.preferred:
                logger.info("curriculum: task types whose last group taught something, claimed first: %s",
                            ", ".join(sorted(order.preferred)) or "none")
            self._type_order = order
        return self._type_order

    async def _refresh_run_values(self) -> None:
        """Take up the run values (``Run.values``) another process recorded since this sampler started, e.g. the
        batch size of a trainer started after it, for the values this sampler was not given."""
        if self.cfg.split != "train" or (run := await self.res.store.runs.get()) is None:
            return
        updated = self.cfg.with_run_values(run.values)
        if updated != self.cfg:
            changes = ", ".join(f"{key} {run.values[key]} (from {run.value_sources.get(key, 'another process')})"
                                for key in sorted(run.values) if key not in self.cfg.run_values())
            logger.info("sampler %s: the run's values now %s", self.owner, changes)
            self.cfg = self.res.config = updated

    async def _admit(self) -> bool:
        if self.cfg.split != "train":
            return True
        load = await self.res.store.slots.sampling_load("train")
        if load.unclaimed_in_started_groups:  # finish what was started: claims fill groups in order
            return True
        if self.cfg.max_staleness is None:  # the run bounds no staleness
            return True
        return load.pending < (self.cfg.max_staleness + 1) * self.cfg.train_batch_size

    async def _recover_group_stages(self) -> None:
        """Run the group stages whose sampler died (their lease expired) or that no one started."""
        while (group := await self.res.store.slots.claim_group_stage(None, self.owner, split=self.cfg.split)):
            with self.res.store.commands.tally() as used:
                try:
                    await self._run_group_stage(group, outage_raises=True)
                finally:
                    self.stats.commands_by_part["group_stage"] += sum(used.values())

    async def _run_group_stage(self, group: GroupLease, *, outage_raises: bool) -> None:
        """Run ``group``'s stage. A stage that fails must not stop the sampler (nor every sampler that takes it over
        next): the failure is logged, its lease expires and another attempt follows. With ``outage_raises``, an
        unreachable database is raised (the run loop rides it out, or stops on it)."""
        try:
            await self._group_stage(group)
        except ConnectionFailure as error:
            if outage_raises:
                raise
            logger.error("group stage of Task %s cut off by the database (%s); another attempt follows when its "
                         "lease expires", group.task.id, error)
        except LeaseLost as error:
            logger.warning("%s", error)
        except PyMongoError as error:  # permanent (its message may quote whole samples: cut short)
            logger.error("group stage of Task %s failed: %s: %.500s; another attempt follows when its lease "
                         "expires", group.task.id, type(error).__name__, error)
        except Exception:
            logger.exception("group stage of Task %s failed; another attempt follows when its lease expires",
                             group.task.id)

    async def _group_stage(self, group: GroupLease) -> None:
        """Run ``group``'s stage in its own task, heartbeating its lease; stop it if another sampler took it over."""
        stage = asyncio.create_task(run_group_stage(self.res.store, group, self.cfg.group, self.cfg.advantage,
                                                    self.cfg.curriculum))
        beat = KeepAlive(lambda: self.res.store.slots.heartbeat_group(group), stage,
                         f"the group stage of Task {group.task.id}", self.cfg.concurrency.lease_s)
        try:
            outcome = await stage
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if stage.cancelled() and not (current is not None and current.cancelling()):
                return  # the lease was lost: the sampler that took the stage over completes it
            with contextlib.suppress(Exception):  # shutdown: another sampler takes the stage over at once
                await asyncio.shield(self.res.store.slots.release_group(group))
            raise
        finally:
            beat.cancel()
        self.stats.group_stages += 1
        self._next_types_refresh = 0.0
        self.stats.samples_queued += outcome.samples_queued

    async def _sample(self, lease: SlotLease, claim_commands: int) -> None:
        """Roll out, score and settle ``lease``'s slot (see the module docstring for the writes), then run the
        Task's group stage if this settlement completed it. ``claim_commands``: what its claim cost."""
        store = self.res.store
        worker = asyncio.current_task()
        calls = CallLog()
        given_back: Exception | None = None  # an infrastructure failure, which may call for a pause
        group: GroupLease | None = None
        with store.commands.tally() as used:  # this trajectory's commands, its heartbeat task's included
            beat = KeepAlive(lambda: store.slots.heartbeat(lease), worker, f"trajectory {lease.record_id}",
                             self.cfg.concurrency.lease_s)
            try:
                episode = episode_of(lease.task.metadata) is not None
                result = await (run_episode if episode else run_trajectory)(self.res, lease, calls)
                await store.calls.insert(calls.calls())
                failpoint("sampler.sample.before_finish")
                score, score_error, details = await self._score(lease, result, calls)
                self.stats.trajectories += 1
                self.stats.outcomes[result.outcome] = self.stats.outcomes.get(result.outcome, 0) + 1
                ended = {"num_turns": result.num_turns, "outcome": result.outcome, "final_answer": result.final_answer,
                         "policy_version": result.policy_version, "error": result.error,
                         "meta": {"branches": result.num_branches}, "score_details": details}
                # No heartbeat from here: one landing after finish dropped the lease would find it gone and cancel
                # this task mid-way (the group stage it claims then waits a whole lease for another sampler).
                await beat.stop()
                if score_error is None:
                    self.stats.scored += 1
                    self.stats.reward_sum += score
                    group = await store.slots.finish(lease, RecordStatus.SCORED, **ended, score=score)
                else:
                    self.stats.score_errors += 1
                    group = await store.slots.finish(lease, RecordStatus.FAILED, **ended, score_error=score_error,
                                                     failure_class=str(FailureClass.SCORE_ERROR))
                self._count(result)
                self.stats.trajectory_commands[claim_commands + sum(used.values())] += 1
            except LeaseLost as error:
                self.stats.lost_leases += 1
                logger.warning("%s", error)
                await self._write_calls(calls, f"the lease was lost: {error}")
            except (NoInferenceService, ScorerUnavailable, EnvUnavailable, PyMongoError) as error:
                # Infrastructure (no inference service, the judge, an environment server, the database), not the
                # policy: no score; the attempt is given back without counting as failed. If the database stays
                # unreachable, the lease expires and the slot is taken over just the same.
                await beat.stop()  # no heartbeat may extend the lease after it is given back
                given_back = error
                logger.warning("%s: giving %s back unscored, to be retried%s", error, lease.record_id,
                               "; pausing until an inference service is live" if isinstance(error, NoInferenceService)
                               else f"; pausing {ENV_RETRY_PAUSE_S:.0f} s" if isinstance(error, EnvUnavailable) else "")
                failure, reason = infrastructure_failure(error), f"{type(error).__name__}: {error}"
                await self._write_calls(calls, reason)
                with contextlib.suppress(Exception):
                    await store.slots.release(lease, reason, failure)
                self._failed(failure, reason)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._give_back_cancelled(lease, calls))
                raise
            except Exception as error:  # one broken trajectory must not stop the sampler
                logger.exception("trajectory %s failed", lease.record_id)
                reason = f"{type(error).__name__}: {error}"
                await self._write_calls(calls, reason)
                with contextlib.suppress(Exception):
                    await store.slots.abandon(lease, reason)
            finally:
                beat.cancel()
        self.stats.commands_by_part["trajectory"] += sum(used.values())
        if group is not None:
            self._staging.add(worker)  # a shutdown lets the stage finish
            with store.commands.tally() as used:
                try:
                    await self._run_group_stage(group, outage_raises=False)
                finally:
                    self.stats.commands_by_part["group_stage"] += sum(used.values())
        # this task stays active while it pauses, so a sampler whose tasks all wait claims nothing
        if isinstance(given_back, NoInferenceService):
            await self.res.inference.wait_until_live()
        elif isinstance(given_back, EnvUnavailable):
            await asyncio.sleep(ENV_RETRY_PAUSE_S)

    async def _write_calls(self, calls: CallLog, error: str) -> None:
        """Write the calls of a trajectory that ended early (best effort: its slot is retried anyway); a call cut off
        mid-generation is written ``failed`` with ``error``."""
        calls.end_running(error)
        try:
            await self.res.store.calls.insert(calls.calls())
        except PyMongoError as failure:
            logger.warning("could not write the %d calls of an ended trajectory: %s", len(calls), failure)

    async def _give_back_cancelled(self, lease: SlotLease, calls: CallLog) -> None:
        await self._write_calls(calls, "cancelled: the sampler is shutting down")
        await self.res.store.slots.release(lease)

    def _count(self, result: TrajectoryResult) -> None:
        """Feed the failure streak with a finished trajectory: no verdict (aborted generation, environment error)
        is an infrastructure failure, one with a verdict ends the streak."""
        failure = OUTCOME_FAILURES.get(result.outcome) if result.outcome in NO_VERDICT_OUTCOMES else None
        if failure is not None:
            self._failed(failure, result.error or str(result.outcome))
        else:
            self.streak.succeeded()

    def _failed(self, failure: FailureClass, error: str) -> None:
        if self.streak.failed(failure, error) and self._halted is None:
            self._halted = self.streak.message(self.owner)
            logger.error("%s", self._halted)
            self.stop()

    async def _score(self, lease: SlotLease, result: TrajectoryResult, calls: CallLog
                     ) -> tuple[float, str | None, dict]:
        """``(score, error, details)``; no answer scores 0 without asking the scorer. A tool task's scorer sees its
        turns and may give each a reward (``agentrl.rollout.turn_rewards``).

        A scorer that cannot be reached (e.g. the LLM judge down) is retried with backoff while the lease is
        heartbeated; ``ScorerUnavailable`` when it stays down past its bound (the slot is then given back).
        """
        task = lease.task
        if result.env is not None:  # an environment episode: its reward is the verdict, however it ended
            if result.outcome in NO_VERDICT_OUTCOMES:
                return 0.0, None, {**result.env, "reason": f"no verdict ({result.outcome})"}
            answer, extra = result.final_answer or "", {"env_reward": result.env["score"]}
        elif result.outcome != ANSWER or result.final_answer is None:
            return 0.0, None, {"reason": f"no answer ({result.outcome})"}
        else:
            answer, extra = result.final_answer, {"turns": scorer_turns(calls.calls())}
        if result.final_state is not None:
            extra["mcp_final_state"] = result.final_state
        config = {**self.res.agent_config.model_dump(exclude_none=True), "query": task.query, **task.metadata,
                  **extra}
        scored = await MCPScorerFactory.score(
            task.scorer, answer, {"query": task.query, "answer": task.answer, **task.metadata}, config,
            retry_unavailable=True)
        if scored.unavailable:
            raise ScorerUnavailable(scored.error or f"scorer {task.scorer!r} unavailable")
        details = {**(result.env or {}), **scored.details}
        error = scored.error or turn_rewards_error(scored.details, len(calls), task.scorer,
                                                   episode=result.env is not None)
        if error is not None:
            return 0.0, error, details
        return float(scored.score), None, details
