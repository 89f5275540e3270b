"""Sample slots of Tasks handed out as leases, and the once-per-Task group stage.

A Task wants ``num_generations`` samples. ``claim_started`` hands a sampler a never-claimed slot of a group
already started (what admission control never holds back); ``claim`` hands it one slot of any kind:

1. an expired lease (its sampler died or stalled) is taken over as a new attempt of the same slot — looked for
   at most every ``lease_s / 4`` seconds per process, or whenever no never-claimed slot is left;
2. else a never-claimed slot of the first open Task by round, then upload order (groups fill up in that order;
   a new group starts on the curriculum's preferred task types first and on its deferred ones last);
3. else a slot whose claim was interrupted by a crash is recovered (``sweep``).

Every path ends with inserting the slot's Record ``{task_id}/{slot}/{attempt}``; its unique ``_id`` is what makes
a claim exactly-once across processes. The lease lives on that Record (``lease_id``, ``lease_owner``,
``lease_expires_at``); ``heartbeat`` extends it, ``finish`` settles the slot, ``release`` (infrastructure
failure, shutdown) and ``abandon`` (an error of the sampler) give it up early: the Record ends ``failed`` with its
``failure_class`` at once, keeps its lease (expired, ``given_up``) so that another sampler retakes the slot as the
next attempt at once. The caller whose settlement completes a Task's group gets the group-stage lease (exactly one
caller; if it dies, ``claim_group_stage`` hands the stage to another sampler after the lease expires).

Crash safety: a slot not yet settled on its Task always has a Record holding a lease (live or expired), except
in the two crash windows that ``sweep`` repairs (a claim cut off before its Record was inserted; an attempt
retired by a take-over that died before inserting the next attempt or giving the slot up). ``finish`` therefore
writes in this order: the Record's outcome (lease kept) → the slot settled on the Task → the lease dropped. A
crash, SIGTERM or DB error between the writes leaves a scored (or failed) Record whose lease expires; the
take-over path finds it like any expired lease and completes the settlement instead of starting a new attempt,
so the score is kept and the slot is settled exactly once (``settle`` is idempotent).

Fencing: a take-over retires the expired attempt (only if its lease is still expired at that instant, so a late
heartbeat wins) *before* inserting the next attempt; every write of a holder filters on its lease id and
``leased``, so once retired, a dead attempt's heartbeat, outcome and transitions are refused (``LeaseLost``). The
agent passes the fence (``fence``) before each LLM call, tool call and environment step: it goes on only while the
lease is known to hold for at least ``lease_s / 2`` more — from the expiry this process last wrote, else after a
heartbeat — so its side effects happen while the lease holds and no take-over can happen before then. (The
sampler also heartbeats every ``lease_s / 3`` in the background, so the fence rarely costs a round trip.) The
group-stage lease is fenced the same way (a token, heartbeats, and ``complete_group`` refused once expired).

The writes of one trajectory, from claim to settlement (6 round trips whatever its turns; the calls are written
by ``Calls.insert``, the rest here):

1. the slot on the Task (``claim_started`` / ``claim``: unclaimed - 1, its claim id, ``running``);
2. its Record, holding the lease;
3. its LLM calls, all in one insert (``agentrl.store.call_log``): a crash before loses them with the attempt,
   which is retried from scratch;
4. its outcome and score on the Record (``finish``), lease kept;
5. the slot settled on the Task;
6. the lease dropped — and, for the group's last slot, the group-stage lease taken.

Heartbeats happen only every ``lease_s / 3`` (and at a fence whose lease runs short); per group come admission
control (the sampler's, before a claim starts a group, with the curriculum's read of the recent outcomes after a
group stage of its own: ``recent_outcomes``), a claim query for each tier of task types that has no open Task,
and the group stage.

Shutdown: a sampler that stops gives its slots back (``release``) and then marks ``interrupted`` every started
Task that nobody works on (``interrupt_idle``), so a finished run leaves nothing ``running``. Such a Task is open
like a running one (claims, take-over, sweep, admission control) and is ``running`` again as soon as it is claimed
again. Both sides write before they look: the interrupter checks after marking the Task, and counts a slot claimed
on the Task whose Record is not inserted yet as worked on (for a lease after the claim); a fresh claim's first
write (the slot on the Task) marks it ``running``, and the recovery paths, which insert a Record without writing
the Task, mark it after inserting. So a Task being sampled never stays ``interrupted`` (unless its claimer stalls
between its two writes for longer than a lease, like a holder whose lease expired).

All lease times are the database server's (``ServerClock``), so machines with skewed clocks do not steal each
other's leases. Operations marked ``retry_on_reconnect`` are idempotent and re-run after a broken connection.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pymongo import ReturnDocument
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import DuplicateKeyError

from agentrl.failpoints import failpoint
from agentrl.store.clock import ServerClock
from agentrl.store.errors import LeaseLost
from agentrl.store.models import (
    EPOCH,
    OPEN_TASK_STATES,
    STARTED_TASK_STATES,
    FailureClass,
    Record,
    RecordStatus,
    Task,
    TaskStatus,
)
from agentrl.store.outage import retry_on_reconnect

DEFAULT_LEASE_S = 60.0
_LIVE = [str(RecordStatus.RUNNING), str(RecordStatus.COMPLETED)]


def record_id(task_id: str, slot: int, attempt: int) -> str:
    return f"{task_id}/{slot}/{attempt}"


@dataclass(frozen=True)
class SamplingLoad:
    """Samples a split has in the pipeline. ``group_slots``: every slot of the Tasks being sampled (running,
    unclaimed, or finished and waiting for the group stage); ``ready_records``: queued and not yet trained."""

    group_slots: int
    unclaimed_in_started_groups: int
    ready_records: int

    @property
    def pending(self) -> int:
        return self.group_slots + self.ready_records


@dataclass(frozen=True)
class SlotLease:
    """A sampler's hold on one sample slot; pass it back to ``heartbeat`` / ``finish`` / ``release``."""

    task: Task
    slot: int
    attempt: int
    lease_id: str
    owner: str
    record_id: str


@dataclass(frozen=True)
class GroupLease:
    """The right (and duty) to run the group stage of ``task`` once all its slots are settled; keep it alive with
    ``heartbeat_group`` while the stage runs."""

    task: Task
    owner: str
    lease_id: str


class SlotLeases:
    """Lease operations on the ``Task`` and ``Record`` collections of one database."""

    def __init__(self, db: AsyncDatabase, lease_s: float = DEFAULT_LEASE_S, *, clock: ServerClock | None = None):
        self.tasks = db[Task.collection]
        self.records = db[Record.collection]
        self.lease_s = lease_s
        self.clock = clock or ServerClock(db.client)
        self._next_expiry_probe = 0.0
        self._started_may_have_slots = True  # the last claim left its group unclaimed slots (or none was made yet)
        self._expiry: dict[str, datetime] = {}  # record id -> the lease expiry this process last wrote for it

    def now(self):
        """The database server's time: leases are measured against one clock, whatever the machines' skew."""
        return self.clock.now()

    # ------------------------------------------------------------------------------------------------- claiming

    async def claim(self, split: str, owner: str, *, preferred_types: Collection[str] = (),
                    deferred_types: Collection[str] = ()) -> SlotLease | None:
        """Claim one sample slot of ``split`` for ``owner``; ``None`` when no slot is available. Never-claimed
        slots of Tasks whose ``task_type`` is in ``preferred_types`` are claimed first, those of Tasks whose
        ``task_type`` is in ``deferred_types`` only when no other Task is open (the curriculum by type,
        ``agentrl.rollout.curriculum``): one query per tier that is tried."""
        if time.monotonic() >= self._next_expiry_probe:
            self._next_expiry_probe = time.monotonic() + self.lease_s / 4
            lease = await self._take_over_expired(split, owner)
            if lease is not None:
                return lease
        preferred = sorted(set(preferred_types) - set(deferred_types))
        tiers = [*([{"task_type": {"$in": preferred}}] if preferred else []),
                 {"task_type": {"$nin": sorted(deferred_types)}} if deferred_types else {},
                 *([{}] if deferred_types else [])]
        for among in tiers:
            lease = await self._claim_unclaimed(split, owner, OPEN_TASK_STATES, among)
            if lease is not None:
                return lease
        return await self.recover(split, owner)

    async def claim_started(self, split: str, owner: str) -> SlotLease | None:
        """Claim a never-claimed slot of a group already started (running or interrupted), which admission control
        never holds back; ``None`` when there is none. Skipped without a query while the last claim of this
        process emptied its group (``claim`` then finds any started group first, after admission control)."""
        if not self._started_may_have_slots:
            return None
        return await self._claim_unclaimed(split, owner, STARTED_TASK_STATES)

    async def recover(self, split: str, owner: str) -> SlotLease | None:
        """Only the recovery paths of ``claim`` (take over an expired lease, else ``sweep``): never starts a new
        slot, so a sampler calls it even while admission control holds new groups back — otherwise lost slots
        of the started groups, which count against admission, could never be recovered."""
        return await self._take_over_expired(split, owner) or await self.sweep(split, owner)

    async def _take_over_expired(self, split: str, owner: str, max_candidates: int = 8) -> SlotLease | None:
        for _ in range(max_candidates):
            expired = await self.records.find_one(
                {"split": split, "leased": True, "lease_expires_at": {"$lt": self.now()}},
                sort=[("lease_expires_at", 1)],
            )
            if expired is None:
                break
            lease = await self._take_over(Record.from_mongo(expired), owner, expired["lease_expires_at"])
            if lease is not None:
                return lease
        return None

    async def _claim_unclaimed(self, split: str, owner: str, states: tuple[str, ...],
                               among: dict[str, Any] | None = None) -> SlotLease | None:
        """Claim a never-claimed slot of the first Task in ``states`` (by round, then upload order) that matches
        ``among`` (a filter on its ``task_type``): two writes, the slot on the Task (which also marks it
        ``running``: the write an interrupter looks after, see ``interrupt_idle``) and then its Record."""
        lease_id = uuid.uuid4().hex
        status = {"$in": list(states)} if len(states) > 1 else states[0]
        doc = await self.tasks.find_one_and_update(
            {"split": split, "status": status, "unclaimed": {"$gt": 0}, **(among or {})},
            {"$inc": {"unclaimed": -1}, "$push": {"claim_ids": lease_id},
             "$set": {"status": str(TaskStatus.RUNNING), "updated_at": self.now(), "claimed_at": self.now()}},
            sort=[("round", 1), ("order", 1)],
            return_document=ReturnDocument.AFTER,
        )
        self._started_may_have_slots = doc is not None and doc["unclaimed"] > 0
        if doc is None:
            return None
        task = Task.from_mongo(doc)
        slot = task.claim_ids.index(lease_id)
        failpoint("slots.claim.before_record")  # the slot is claimed on the Task, its Record not inserted: sweep
        return await self._insert_record(task, slot, attempt=1, failures=0, owner=owner, lease_id=lease_id,
                                         resume=False)

    async def _insert_record(self, task: Task, slot: int, *, attempt: int, failures: int, owner: str,
                             lease_id: str | None = None, resume: bool = True) -> SlotLease | None:
        """Insert the slot's Record for ``attempt``; ``None`` if another claimer inserted it first. With
        ``resume``, an interrupted Task is marked ``running`` afterwards (paths that did not write the Task first)."""
        lease_id = lease_id or uuid.uuid4().hex
        now = self.now()
        record = Record(
            id=record_id(task.id, slot, attempt), task_id=task.id, split=task.split, slot=slot, attempt=attempt,
            failures=failures, lease_id=lease_id, lease_owner=owner, lease_expires_at=now + self._ttl(),
            created_at=now, updated_at=now,
        )
        try:
            await self.records.insert_one(record.to_mongo())
        except DuplicateKeyError:
            return None
        self._expiry[record.id] = record.lease_expires_at
        if resume:
            await self._resume_task(task.id)
        return SlotLease(task=task, slot=slot, attempt=attempt, lease_id=lease_id, owner=owner, record_id=record.id)

    async def _take_over(self, expired: Record, owner: str, seen_expiry: Any) -> SlotLease | None:
        """Retire an expired attempt and claim the next attempt of its slot (or give the slot up).

        ``seen_expiry`` is the ``lease_expires_at`` value (as stored) that was seen expired: the retirement happens
        only if it is unchanged, so a holder whose heartbeat landed meanwhile keeps its lease. An attempt whose
        holder already wrote its outcome (``finish`` cut off before settling the slot) is not retried: its
        settlement is completed instead; one its holder gave up (``release``, ``abandon``) is retried."""
        if expired.status not in (RecordStatus.RUNNING, RecordStatus.COMPLETED) and not expired.given_up:
            await self._complete_settlement(expired)
            return None
        task = Task.from_mongo(await self.tasks.find_one({"_id": expired.task_id}))
        failures = expired.failures + (0 if expired.released else 1)
        if task is None or failures >= task.max_attempts:
            retired = await self._retire(expired, seen_expiry, f"slot given up after {failures} failed attempts")
            if retired and task is not None:
                await self.settle(task.id, expired.slot, failed=True)
            return None
        # Fencing: the old attempt is retired before its successor exists, so from here on every write of the old
        # holder (heartbeat, outcome, transition) is refused. A crash between the two writes leaves a retired
        # attempt without successor, which ``sweep`` recovers.
        if not await self._retire(expired, seen_expiry, f"taken over by attempt {expired.attempt + 1}"):
            return None  # its holder heartbeated in time, or another claimer took it over first
        failpoint("slots.take_over.between_writes")
        return await self._insert_record(task, expired.slot, attempt=expired.attempt + 1, failures=failures,
                                          owner=owner)

    async def _complete_settlement(self, record: Record) -> None:
        """Finish a ``finish`` that died after writing the Record's outcome: settle its slot (a no-op if that was
        done) and drop the lease. A Task completed here gets its group stage from ``claim_group_stage``."""
        await self.settle(record.task_id, record.slot, failed=record.status == RecordStatus.FAILED)
        await self._drop_lease(record.id, record.lease_id)

    @retry_on_reconnect
    async def _drop_lease(self, rid: str, lease_id: str) -> None:
        await self.records.update_one({"_id": rid, "lease_id": lease_id, "leased": True},
                                      {"$set": {"leased": False}})

    async def _retire(self, record: Record, seen_expiry: Any, what_next: str) -> bool:
        """End an attempt whose lease was seen expired, if that lease is unchanged (compare-and-set on the stored
        expiry: a heartbeat landed meanwhile wins); ``True`` if this call retired it. An attempt its holder gave up
        keeps its failure; one whose holder vanished fails as ``lease_lost``."""
        held = {"_id": record.id, "lease_id": record.lease_id, "leased": True, "lease_expires_at": seen_expiry}
        now = self.now()
        if record.given_up:
            query = {**held, "given_up": True}
            update = {"leased": False, "error": f"{record.error}; {what_next}", "updated_at": now}
        else:
            why = "released by its sampler" if record.released else (
                f"lease of sampler {record.lease_owner} expired without heartbeat")
            query = {**held, "status": {"$in": _LIVE}}
            update = {"leased": False, "status": str(RecordStatus.FAILED), "error": f"{why}; {what_next}",
                      "updated_at": now, "finished_at": now}
            if not record.released:  # (one released by a version without failure classes: its cause is unknown)
                update["failure_class"] = str(FailureClass.LEASE_LOST)
        result = await self.records.update_one(query, {"$set": update})
        return result.modified_count == 1

    async def sweep(self, split: str, owner: str, *, max_tasks: int = 256) -> SlotLease | None:
        """Recover slots that no lease covers: a claim cut off by a crash before its Record was inserted, an
        attempt retired by a take-over that died before the next attempt, a Record given an outcome but never
        settled (written by versions whose ``finish`` dropped the lease first).

        Only Tasks untouched for longer than a lease are examined, so a claim in progress is never taken; the
        ``max_tasks`` least recently touched first (index ``sweep_stale``). A healthy Task has one leased Record
        per claimed, unsettled slot, so one query counting the leases of those Tasks singles out the ones that
        need recovery; Tasks whose long trajectories are merely still running cannot crowd them out.
        """
        stale = []
        for status in STARTED_TASK_STATES:  # one query per state: NX-27017 drops date ranges next to an ``$in``
            stale += [doc async for doc in self.tasks.find(
                {"split": split, "status": status, "updated_at": {"$lt": self.now() - self._ttl()}},
                {"remaining": 1, "unclaimed": 1, "updated_at": 1}, sort=[("updated_at", 1)], limit=max_tasks)]
        if not stale:
            return None
        stale = sorted(stale, key=lambda doc: str(doc["updated_at"]))[:max_tasks]  # datetimes or ISO strings
        leases: dict[str, int] = {}
        async for rec in self.records.find({"task_id": {"$in": [doc["_id"] for doc in stale]}, "leased": True},
                                           {"task_id": 1}):
            leases[rec["task_id"]] = leases.get(rec["task_id"], 0) + 1
        for doc in stale:
            if leases.get(doc["_id"], 0) >= doc["remaining"] - doc["unclaimed"]:
                continue  # every claimed, unsettled slot is leased: take-over handles any expiry
            lease = await self._recover_task(doc["_id"], owner)
            if lease is not None:
                return lease
        return None

    async def _recover_task(self, task_id: str, owner: str) -> SlotLease | None:
        task = Task.from_mongo(await self.tasks.find_one({"_id": task_id}))
        if task is None or str(task.status) not in STARTED_TASK_STATES:
            return None
        latest: dict[int, dict[str, Any]] = {}
        async for rec in self.records.find({"task_id": task.id}, {"slot": 1, "attempt": 1, "status": 1,
                                                                   "failures": 1, "leased": 1, "released": 1}):
            if rec["slot"] not in latest or rec["attempt"] > latest[rec["slot"]]["attempt"]:
                latest[rec["slot"]] = rec
        for slot in range(len(task.claim_ids)):
            if slot in task.settled_slots:
                continue
            rec = latest.get(slot)
            if rec is None:
                lease = await self._insert_record(task, slot, attempt=1, failures=0, owner=owner)
            elif rec["leased"]:
                continue  # live, or expired and left to take-over
            elif rec["status"] == str(RecordStatus.FAILED):
                failures = rec.get("failures", 0) + (0 if rec.get("released") else 1)
                if failures >= task.max_attempts:
                    await self.settle(task.id, slot, failed=True)
                    continue
                lease = await self._insert_record(task, slot, attempt=rec["attempt"] + 1, failures=failures,
                                                  owner=owner)
            elif rec["status"] not in _LIVE:  # an outcome written, its settlement lost
                await self.settle(task.id, slot, failed=False)
                continue
            else:
                continue
            if lease is not None:
                return lease
        return None

    async def sampling_load(self, split: str) -> SamplingLoad:
        """What admission control weighs: the slots of started groups and the ready Records not yet trained."""
        group_slots = unclaimed = 0
        async for doc in self.tasks.find({"split": split, "status": {"$in": list(STARTED_TASK_STATES)}},
                                         {"num_generations": 1, "unclaimed": 1}):
            group_slots += doc["num_generations"]
            unclaimed += doc["unclaimed"]
        ready = await self.records.count_documents({"split": split, "status": str(RecordStatus.READY)})
        return SamplingLoad(group_slots=group_slots, unclaimed_in_started_groups=unclaimed, ready_records=ready)

    async def recent_outcomes(self, split: str, limit: int = 256) -> list[tuple[str | None, bool]]:
        """``(task_type, taught)`` of the last ``limit`` groups of ``split`` closed by a group stage, oldest first."""
        docs = [doc async for doc in self.tasks.find(
            {"split": split, "status": str(TaskStatus.COMPLETED), "taught": {"$in": [True, False]}},
            {"task_type": 1, "taught": 1}, sort=[("updated_at", -1)], limit=limit)]
        return [(doc.get("task_type"), bool(doc["taught"])) for doc in reversed(docs)]

    async def completed_groups(self, split: str) -> int:
        """How many groups of ``split`` a group stage has closed (with a ``taught`` verdict)."""
        return await self.tasks.count_documents(
            {"split": split, "status": str(TaskStatus.COMPLETED), "taught": {"$in": [True, False]}})

    async def sampling_finished(self, split: str) -> bool:
        """Whether ``split`` has Tasks and every one of them is done (all slots settled, group stage run)."""
        if await self.tasks.count_documents({"split": split}, limit=1) == 0:
            return False
        open_tasks = await self.tasks.count_documents({"split": split, "status": {"$in": list(OPEN_TASK_STATES)}},
                                                      limit=1)
        return open_tasks == 0

    async def interrupt_idle(self, split: str) -> list[str]:
        """Mark ``interrupted`` the started Tasks of ``split`` that no live lease (slot or group stage) works on —
        what a stopping sampler calls after giving its slots back. Returns their ids."""
        interrupted = []
        async for doc in self.tasks.find({"split": split, "status": str(TaskStatus.RUNNING)}, {"_id": 1}):
            if await self._busy(doc["_id"]):
                continue
            result = await self.tasks.update_one({"_id": doc["_id"], "status": str(TaskStatus.RUNNING)},
                                                 {"$set": {"status": str(TaskStatus.INTERRUPTED)}})
            if result.modified_count != 1:
                continue
            if await self._busy(doc["_id"]):  # a claim landed before the mark: it is being sampled after all
                await self._resume_task(doc["_id"])
            else:
                interrupted.append(doc["_id"])
        return interrupted

    async def _busy(self, task_id: str) -> bool:
        """Whether anyone works on ``task_id``: a claim in flight (a slot claimed on the Task, its Record not
        inserted yet, the last claim younger than a lease: a claim cut off by a crash counts like a lease that
        expires a lease after it), a live slot lease (not given up) or a live group-stage lease. Read in that order,
        so a claim is seen at one step or the next: its slot on the Task before its Record, its Record (with a
        fresh lease) before the lease ends."""
        task = await self.tasks.find_one({"_id": task_id}, {"claim_ids": 1, "settled_slots": 1})
        if task is None:
            return False
        now = self.now()  # (find_one, not count_documents: NX-27017's aggregation misreads dates set by $set)
        claimed = set(range(len(task.get("claim_ids") or []))) - set(task.get("settled_slots") or [])
        if claimed:
            recorded = {rec["slot"] async for rec in self.records.find(
                {"task_id": task_id, "slot": {"$in": sorted(claimed)}}, {"slot": 1})}
            if claimed - recorded and await self.tasks.find_one(
                    {"_id": task_id, "claimed_at": {"$gt": now - self._ttl()}}, {"_id": 1}) is not None:
                return True
        if await self.records.find_one({"task_id": task_id, "leased": True, "given_up": {"$ne": True},
                                        "lease_expires_at": {"$gt": now}}, {"_id": 1}) is not None:
            return True
        return await self.tasks.find_one({"_id": task_id, "group_stage_done": False,
                                          "group_lease_expires_at": {"$gt": now}}, {"_id": 1}) is not None

    @retry_on_reconnect
    async def _resume_task(self, task_id: str) -> None:
        """An interrupted Task gets a Record again: it is ``running``."""
        await self.tasks.update_one({"_id": task_id, "status": str(TaskStatus.INTERRUPTED)},
                                    {"$set": {"status": str(TaskStatus.RUNNING)}})

    # --------------------------------------------------------------------------------------------- lease holder

    @retry_on_reconnect
    async def heartbeat(self, lease: SlotLease) -> None:
        """Extend the lease; raises ``LeaseLost`` if it was taken over or released meanwhile."""
        expires_at = self.now() + self._ttl()
        result = await self.records.update_one(
            {"_id": lease.record_id, "lease_id": lease.lease_id, "leased": True, "given_up": {"$ne": True}},
            {"$set": {"lease_expires_at": expires_at}},
        )
        if result.matched_count != 1:
            self._expiry.pop(lease.record_id, None)
            raise LeaseLost(f"lease on {lease.record_id} is no longer held by {lease.owner}")
        if lease.record_id in self._expiry:  # (not once finish or release forgot it)
            self._expiry[lease.record_id] = expires_at

    async def fence(self, lease: SlotLease) -> None:
        """The fence before a side effect (an LLM call, a tool call, an environment step): returns once the lease
        is known to hold for at least ``lease_s / 2`` more, so no take-over can happen before then; raises
        ``LeaseLost`` if it was taken over or released.

        Only a take-over ends a lease its holder did not give up, and a take-over needs the stored expiry to be in
        the past (``_retire``). This process knows the expiry it last wrote (claim, heartbeat); while that is more
        than ``lease_s / 2`` ahead on the server's clock, no heartbeat is needed (the sampler's background
        heartbeats, every ``lease_s / 3``, normally keep it so). Otherwise it heartbeats, which fails once the lease
        is lost (e.g. this process stalled or lost the database for longer than the lease)."""
        expires_at = self._expiry.get(lease.record_id)
        if expires_at is not None and (expires_at - self.now()).total_seconds() > self.lease_s / 2:
            return
        await self.heartbeat(lease)

    async def finish(self, lease: SlotLease, status: RecordStatus, **fields: Any) -> GroupLease | None:
        """Settle the slot: its Record goes to ``status`` (``scored`` or ``failed``) with ``fields``.

        Returns a ``GroupLease`` when this settlement completed the Task's group (exactly one caller gets it).
        Raises ``LeaseLost`` if the lease was lost; nothing is written then.
        """
        if status not in (RecordStatus.SCORED, RecordStatus.FAILED):
            raise ValueError(f"a slot is settled as scored or failed, not {status}")
        self._expiry.pop(lease.record_id, None)  # no side effect follows the outcome
        await self._record_outcome(lease, status, fields)
        failpoint("slots.finish.after_record")
        # If we die here, the Record keeps its (expiring) lease: take-over completes the settlement.
        completed = await self.settle(lease.task.id, lease.slot, failed=status == RecordStatus.FAILED)
        failpoint("slots.finish.after_settle")  # settled, lease kept: take-over drops it; the stage is recovered
        await self._drop_lease(lease.record_id, lease.lease_id)
        return await self.claim_group_stage(lease.task.id, lease.owner) if completed else None

    @retry_on_reconnect
    async def _record_outcome(self, lease: SlotLease, status: RecordStatus, fields: dict[str, Any]) -> None:
        """First write of ``finish``: the Record's outcome, keeping the lease until the slot is settled. Idempotent:
        an outcome this lease already wrote (a retry after a broken connection) counts as written."""
        now = self.now()
        held = {"_id": lease.record_id, "lease_id": lease.lease_id, "leased": True}
        result = await self.records.update_one(
            {**held, "status": {"$in": _LIVE}},
            {"$set": {**fields, "status": str(status), "updated_at": now, "finished_at": now}},
        )
        if result.modified_count != 1 and await self.records.count_documents({**held, "status": str(status)}) != 1:
            raise LeaseLost(f"lease on {lease.record_id} is no longer held by {lease.owner}")

    async def abandon(self, lease: SlotLease, reason: str,
                      failure_class: FailureClass = FailureClass.SAMPLER_ERROR) -> None:
        """Give the slot up after a failure: the Record ends ``failed``; another sampler retakes the slot at once,
        as the next attempt (this one counts as failed)."""
        self._expiry.pop(lease.record_id, None)
        await self._give_up(lease, released=False, failure_class=failure_class, reason=reason)

    async def release(self, lease: SlotLease, reason: str = "sampler shutting down",
                      failure_class: FailureClass = FailureClass.CANCELLED) -> None:
        """Give the slot back now (shutdown, an infrastructure failure): a running attempt ends ``failed`` with
        ``failure_class`` and another sampler retakes the slot at once (not counted as a failed attempt); one whose
        outcome is already written (``finish`` cut off) has its settlement completed."""
        self._expiry.pop(lease.record_id, None)
        if await self._give_up(lease, released=True, failure_class=failure_class, reason=reason):
            return
        doc = await self.records.find_one({"_id": lease.record_id, "lease_id": lease.lease_id, "leased": True,
                                           "given_up": {"$ne": True}})
        record = Record.from_mongo(doc)
        if record is not None and record.status in (RecordStatus.SCORED, RecordStatus.FAILED):
            await self._complete_settlement(record)

    @retry_on_reconnect
    async def _give_up(self, lease: SlotLease, *, released: bool, failure_class: FailureClass, reason: str
                       ) -> bool:
        """End a running attempt as ``failed`` with its lease expired at once (``given_up``: the slot is retaken,
        not settled); ``True`` if this call did."""
        now = self.now()
        result = await self.records.update_one(
            {"_id": lease.record_id, "lease_id": lease.lease_id, "leased": True, "status": {"$in": _LIVE}},
            {"$set": {"status": str(RecordStatus.FAILED), "failure_class": str(failure_class), "given_up": True,
                      "released": released, "error": reason, "lease_expires_at": EPOCH, "updated_at": now,
                      "finished_at": now}},
        )
        return result.modified_count == 1

    # ------------------------------------------------------------------------------------------------ group stage

    @retry_on_reconnect
    async def add_task(self, task: Task) -> bool:
        """Insert a Task (the next round of a content, from a group stage); ``False`` if it exists already (the
        stage is being redone after a crash)."""
        try:
            await self.tasks.insert_one(task.to_mongo())
        except DuplicateKeyError:
            return False
        return True

    @retry_on_reconnect
    async def settle(self, task_id: str, slot: int, *, failed: bool) -> bool:
        """Count ``slot`` as settled once (idempotent); ``True`` if this call settled the Task's last slot."""
        doc = await self.tasks.find_one_and_update(
            {"_id": task_id, "settled_slots": {"$nin": [slot]}},
            {"$push": {"settled_slots": slot, ("failed_slots" if failed else "completed_slots"): slot},
             "$inc": {"remaining": -1}, "$set": {"updated_at": self.now()}},
            return_document=ReturnDocument.AFTER,
        )
        return doc is not None and doc["remaining"] == 0

    async def claim_group_stage(self, task_id: str | None, owner: str, *, split: str | None = None
                                ) -> GroupLease | None:
        """Take the group-stage lease of ``task_id`` (or of any finished Task of ``split`` whose stage is pending)."""
        return await self._claim_group_stage(task_id, owner, split, uuid.uuid4().hex)

    @retry_on_reconnect
    async def _claim_group_stage(self, task_id: str | None, owner: str, split: str | None, lease_id: str
                                 ) -> GroupLease | None:
        """One claim attempt under the token ``lease_id``; re-running it after it was applied finds the lease by
        its token (so a broken connection does not lose the stage)."""
        query: dict[str, Any] = {"remaining": 0, "group_stage_done": False,
                                 "$or": [{"group_lease_expires_at": {"$lt": self.now()}}, {"group_lease_id": lease_id}]}
        if task_id is not None:
            query["_id"] = task_id
        if split is not None:
            query["split"] = split
        doc = await self.tasks.find_one_and_update(
            query,
            {"$set": {"group_lease_owner": owner, "group_lease_id": lease_id,
                      "group_lease_expires_at": self.now() + self._ttl()}},
            return_document=ReturnDocument.AFTER,
        )
        return GroupLease(task=Task.from_mongo(doc), owner=owner, lease_id=lease_id) if doc is not None else None

    @staticmethod
    def _group_held(group: GroupLease) -> dict[str, Any]:
        """The filter of a group-stage lease that is still ``group``'s: stage not done, and its token, which any
        later claim replaces (an expired lease that nobody took over may still finish: that harms nothing)."""
        return {"_id": group.task.id, "group_stage_done": False, "group_lease_id": group.lease_id}

    @retry_on_reconnect
    async def heartbeat_group(self, group: GroupLease) -> None:
        """Extend the group-stage lease; raises ``LeaseLost`` if another sampler took the stage over."""
        result = await self.tasks.update_one(self._group_held(group),
                                             {"$set": {"group_lease_expires_at": self.now() + self._ttl()}})
        if result.matched_count != 1:
            raise LeaseLost(f"group stage of Task {group.task.id} is no longer held by {group.owner}")

    @retry_on_reconnect
    async def release_group(self, group: GroupLease) -> None:
        """Give the group-stage lease back now (shutdown): another sampler takes the stage over at once."""
        await self.tasks.update_one(self._group_held(group), {"$set": {"group_lease_expires_at": EPOCH}})

    @retry_on_reconnect
    async def complete_group(self, group: GroupLease, **fields: Any) -> Task:
        """Close the Task after its group stage: ``completed``, or ``failed`` when no slot produced a sample.

        Only while the group lease is this one's: a stage that outlived its lease and was taken over is refused
        (``LeaseLost``). Idempotent for the same lease."""
        status = TaskStatus.COMPLETED if group.task.completed_slots else TaskStatus.FAILED
        doc = await self.tasks.find_one_and_update(
            self._group_held(group),
            {"$set": {**fields, "status": str(status), "group_stage_done": True, "updated_at": self.now()}},
            return_document=ReturnDocument.AFTER,
        )
        if doc is None:
            doc = await self.tasks.find_one({"_id": group.task.id, "group_stage_done": True,
                                             "group_lease_id": group.lease_id})
        if doc is None:
            raise LeaseLost(f"group stage of Task {group.task.id} is no longer held by {group.owner}")
        return Task.from_mongo(doc)

    def _ttl(self) -> timedelta:
        return timedelta(seconds=self.lease_s)
