"""Streaming DBRecordData into trainer steps: claims, waiting, staleness, and the samples' per-step statistics.

Each data-parallel rank (its tensor-parallel leader) claims its share of a step from the store's queue, oldest
first, without waiting for any particular group; tensor-parallel peers receive the same samples. Claims are keyed
by (rank, step), so a trainer resumed from a checkpoint gets back exactly the samples it had claimed for the
steps after that checkpoint. Samples more than ``staleness_bound`` policy versions old (0 under
``--sync_sampling``) are claimed and then marked ``skipped`` with the reason, counted, never trained; their
Records leave the ``ready`` state first (``abandoned``, failure class ``stale``), so the samplers' admission
control does not wait for them, unless another sample of the Record is still in play (a Record whose branches
straddle the bound is trained through its fresh one). A crash between the two writes (failpoint
``trainer.skip.after_abandon``) leaves the samples claimed: the next trainer claims them again (claims held for a
step are checked for staleness like new ones; the policy version only grows) and skips them. Samples drawn at
another temperature than the trainer's (``DBRecordData.temperature``: e.g. a sampler that used its default before a
trainer given ``--temperature`` recorded it on the run) are skipped the same way (failure class ``temperature``):
their behaviour logprobs are of another distribution than the one the trainer computes.

While a share is incomplete every rank polls with a growing pause (up to ``poll_interval_s``) and joins one small
all-reduce per poll, so no rank blocks long inside a collective and all ranks agree on when to start, stop or
end the data (offline: the queue is empty; online: also every Task of the split is done). Rank 0 prints a status line
every ``STATUS_EVERY_S`` seconds while waiting. """

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from agentrl.failpoints import failpoint
from agentrl.store import DBRecordData, InvalidTransition, NotFound, RecordStatus, Store
from agentrl.store.models import FailureClass
from agentrl.training.aio import LoopThread
from agentrl.training.errors import TrainerError
from agentrl.training.parallel import ParallelState
from agentrl.training.vision_batch import StepImages
from agentrl.trajectory.merge import MergedSample, TurnSpan
from agentrl.vision.images import ImageError
from agentrl.vision.processor import VisionProcessor

logger = logging.getLogger(__name__)

STATUS_EVERY_S = 30.0
PUBLISH_CHECK_S = 5.0
FIRST_POLL_S = 0.05


class StepEnd(Enum):
    """Why ``SampleStream.next_step`` returned no data."""

    STOPPED = "stopped"  # a stop was requested (SIGTERM) while waiting; the step's claims went back to the queue
    EXHAUSTED = "exhausted"  # no queued sample is left on any rank, and (online) every Task of the split is done
    DEADLINE = "deadline"  # the deadline passed while waiting; the step's claims went back to the queue
    PUBLISH = "publish"  # while waiting, a service needs the current weights sent (its claims are kept: ask again)


@dataclass
class StepData:
    """This rank's samples of one step (the same on tensor-parallel peers)."""

    step: int
    samples: list[DBRecordData]
    skipped_stale: int
    wait_s: float
    images: StepImages | None = None
    """The samples' pictures (a vision-language policy)."""


def sample_staleness(sample: DBRecordData, current_version: int) -> int:
    """Policy versions between ``current_version`` and the oldest version that sampled a loss token (0 if none
    is known)."""
    oldest = sample.oldest_version()
    return max(0, current_version - oldest) if oldest >= 0 else 0


def tokens_if_unmerged(sample: DBRecordData) -> int:
    """Tokens the sample's trained turns would cost with one forward pass each (each turn's prompt + output).

    Turn ``i`` spans ``[turn_boundaries[i], turn_boundaries[i+1])`` (the last one up to the end); a turn is
    trained when it has a loss token, and its own pass covers everything up to its end.
    """
    bounds = sorted(sample.turn_boundaries) or [0]
    ends = bounds[1:] + [sample.num_tokens]
    return sum(end for start, end in zip(bounds, ends) if any(sample.loss_mask[start:end]))


def to_merged(sample: DBRecordData) -> MergedSample:
    """The stored sample as a ``MergedSample`` for ``agentrl.training.batching``, its turns included."""
    n = len(sample.input_ids)
    for name in ("loss_mask", "logprobs", "versions", "advantages"):
        if len(getattr(sample, name)) != n:
            raise ValueError(f"DBRecordData {sample.id}: {name} has {len(getattr(sample, name))} entries for "
                             f"{n} input_ids")
    return MergedSample(input_ids=list(sample.input_ids), loss_mask=list(sample.loss_mask),
                        logprobs=list(sample.logprobs), versions=list(sample.versions),
                        advantages=list(sample.advantages), turns=stored_turns(sample), images=list(sample.images))


def stored_turns(sample: DBRecordData) -> list[TurnSpan]:
    """The sample's turns from its ``turn_boundaries`` and loss mask (a trained turn's output is its run of loss
    tokens; an untrained one's output is not stored and spans nothing), for ``collate(sequence_unit="turn")``."""
    bounds = sorted(sample.turn_boundaries) or [0]
    turns = []
    for index, (start, end) in enumerate(zip(bounds, [*bounds[1:], len(sample.input_ids)])):
        trained = [i for i in range(start, end) if sample.loss_mask[i]]
        output = (trained[0], trained[-1] + 1) if trained else (end, end)
        turns.append(TurnSpan(f"{sample.id}:{index}", start, *output, trained=bool(trained)))
    return turns


def split_shares(total: int, parts: int) -> list[int]:
    """``total`` samples over ``parts`` ranks, as evenly as possible (lower ranks get the remainder)."""
    base, extra = divmod(total, parts)
    return [base + (1 if rank < extra else 0) for rank in range(parts)]


class SampleStream:
    """Claims each step's samples for this rank (see the module docstring)."""

    def __init__(self, store: Store, io: LoopThread, parallel: ParallelState, *, split: str, batch_size: int,
                 staleness_bound: int | None, offline: bool, poll_interval_s: float, stop: threading.Event,
                 temperature: float | None = None, vision: VisionProcessor | None = None):
        self.store, self.io, self.parallel = store, io, parallel
        self.vision = vision
        self.split, self.offline, self.poll_interval_s, self.stop = split, offline, poll_interval_s, stop
        self.staleness_bound, self.temperature = staleness_bound, temperature
        self.share = split_shares(batch_size, parallel.dp_size)[parallel.dp_rank]
        self._finished_logged = False

    def next_step(self, step: int, current_version: int, deadline: float | None = None,
                  before_waiting: Callable[[], None] | None = None,
                  publish_due: Callable[[], bool] | None = None) -> StepData | StepEnd:
        """This rank's samples for ``step``, waiting for the queue as needed until ``deadline`` (``time.monotonic``
        on any rank); or why there are none. ``before_waiting`` runs once, on every rank at the same point, if the
        step's samples are not all there at once (the trainer finishes its last step then). ``publish_due`` (asked
        on the main rank every ``PUBLISH_CHECK_S`` while waiting): true returns ``StepEnd.PUBLISH``, the claims
        made so far kept for the next call."""
        started = time.monotonic()
        samples: list[DBRecordData] = []
        skipped = 0
        exhausted = False
        if self.parallel.is_tp_leader:  # claims this rank already holds for the step (a resumed run) come first
            held = self.io.run(self.store.samples.claim_batch(self.parallel.dp_rank, step, 0, self.split))
            samples, skipped = self._sort_out(step, held, current_version)
        pause, last_status, last_check = FIRST_POLL_S, started, started
        while True:
            if self.parallel.is_tp_leader and len(samples) < self.share:
                fresh, stale, exhausted = self._claim_more(step, samples, current_version)
                samples += fresh
                skipped += stale
                if exhausted and not self.offline:  # online, the data is used up once sampling has finished
                    exhausted = self._sampling_finished()
            short = self.parallel.is_tp_leader and len(samples) < self.share  # peers get the leader's samples
            late = short and deadline is not None and time.monotonic() >= deadline
            publish = False
            if publish_due is not None and self.parallel.is_main and time.monotonic() - last_check >= PUBLISH_CHECK_S:
                publish, last_check = publish_due(), time.monotonic()
            short_open, any_short, stop, nonempty, any_late, any_publish = self.parallel.all_reduce(
                [float(short and not exhausted), float(short), float(self.stop.is_set()), float(bool(samples)),
                 float(late), float(publish)], op="max")
            if stop or any_late:
                self.give_back(step)
                return StepEnd.STOPPED if stop else StepEnd.DEADLINE
            if not any_short:
                break
            if any_publish:
                return StepEnd.PUBLISH
            if not short_open:  # every short rank found the queue empty for good: the data is used up
                if nonempty:
                    break  # a last, partial step
                return StepEnd.EXHAUSTED
            if before_waiting is not None:  # not waiting for samples: its time is left out of wait_s
                settling = time.monotonic()
                before_waiting()
                before_waiting, started = None, started + time.monotonic() - settling
            now = time.monotonic()
            if self.parallel.is_main and now - last_status >= STATUS_EVERY_S:
                self._status_line(step, len(samples), current_version, now - started)
                last_status = now
            self.stop.wait(pause)
            pause = min(pause * 2, self.poll_interval_s)
        samples = self.parallel.broadcast_from_tp_leader(samples)
        return StepData(step=step, samples=samples, skipped_stale=skipped, wait_s=time.monotonic() - started,
                        images=self._images(samples))

    def _images(self, samples: list[DBRecordData]) -> StepImages | None:
        """The samples' pictures, read from the database (a vision-language policy); :class:`TrainerError` for
        samples with images and a text-only policy, or a picture the database does not hold whole."""
        wanted = list(dict.fromkeys(sha256 for sample in samples for sha256 in sample.images))
        if self.vision is None:
            if wanted:
                with_images = next(sample for sample in samples if sample.images)
                raise TrainerError(f"sample {with_images.id} has {len(with_images.images)} image(s) but the policy "
                                   "is a text-only model: train a vision-language model on this data")
            return None
        try:
            pictures = self.io.run(self.store.images.get_many(wanted)) if wanted else {}
        except ImageError as error:
            raise TrainerError(f"cannot read a sample's image: {error}") from None
        return StepImages(self.vision, pictures)

    def _sampling_finished(self) -> bool:
        finished = self.io.run(self.store.slots.sampling_finished(self.split))
        if finished and not self._finished_logged:
            logger.info("every Task of split %r is done and the queue is empty: no more samples will come",
                        self.split)
            self._finished_logged = True
        return finished

    def _claim_more(self, step: int, have: list[DBRecordData], current_version: int
                    ) -> tuple[list[DBRecordData], int, bool]:
        """Top the step's claims up; returns (new fresh samples, how many new ones were skipped, queue empty)."""
        batch = self.io.run(self.store.samples.claim_batch(self.parallel.dp_rank, step, self.share, self.split))
        known = {s.id for s in have}
        fresh, stale = self._sort_out(step, [s for s in batch if s.id not in known], current_version)
        return fresh, stale, len(batch) < self.share

    def _sort_out(self, step: int, claimed: list[DBRecordData], current_version: int
                  ) -> tuple[list[DBRecordData], int]:
        """Skip the stale ones of ``claimed`` and those drawn at another temperature; returns (the fresh ones, how
        many were skipped as stale)."""
        fresh, stale, heated = [], [], []
        for sample in claimed:
            lag = sample_staleness(sample, current_version)
            if self.staleness_bound is not None and lag > self.staleness_bound:
                stale.append(sample)
            elif (self.temperature is not None and sample.temperature is not None
                  and not math.isclose(sample.temperature, self.temperature)):
                heated.append(sample)
            else:
                fresh.append(sample)
        if stale:
            # One wording for every step, so that the run's summary counts these groups under one reason.
            reason = f"stale: sampled more than {self.staleness_bound} policy versions before the step trained them"
            self.io.run(self._skip(self.parallel.dp_rank, step, stale, reason, FailureClass.STALE))
            logger.info("step %d: skipped %d stale samples (%s, version %d)", step, len(stale), reason,
                        current_version)
        if heated:
            reason = (f"temperature: sampled at another temperature than the {self.temperature:g} the trainer "
                      "divides its logits by")
            self.io.run(self._skip(self.parallel.dp_rank, step, heated, reason, FailureClass.TEMPERATURE))
            logger.warning("step %d: skipped %d samples drawn at temperature %s (%s)", step, len(heated),
                           ", ".join(sorted({f"{s.temperature:g}" for s in heated})), reason)
        return fresh, len(stale)

    async def _skip(self, rank: int, step: int, samples: Sequence[DBRecordData], reason: str,
                    failure_class: FailureClass) -> None:
        """Abandon the samples' Records, then mark the samples skipped (see the module docstring). A Record with
        another sample that is not skipped stays ``ready`` (it is trained through that one), and is abandoned once
        that one is skipped too (checked again after the mark: two ranks may skip a Record's last two at once)."""
        ids = [s.id for s in samples]
        fields = {"group_decision": f"skipped by the trainer: {reason}", "failure_class": str(failure_class)}
        kept = []
        for record_id in dict.fromkeys(s.record_id for s in samples):
            if await self.store.samples.others_in_play(record_id, ids):
                kept.append(record_id)
            else:
                await move_record(self.store, record_id, RecordStatus.ABANDONED, **fields)
        failpoint("trainer.skip.after_abandon")
        await self.store.samples.skip(rank, step, ids, reason)
        for record_id in kept:
            if not await self.store.samples.others_in_play(record_id, ids):
                await move_record(self.store, record_id, RecordStatus.ABANDONED, **fields)

    def give_back(self, step: int) -> None:
        """Claims of steps ``>= step`` on this rank go back to the queue (the trainer leaves before training them)."""
        if self.parallel.is_tp_leader:
            returned = self.io.run(self.store.samples.requeue(rank=self.parallel.dp_rank, from_step=step))
            if returned:
                logger.info("step %d abandoned: %d claimed samples went back to the queue", step, returned)

    def _status_line(self, step: int, have: int, version: int, waited_s: float) -> None:
        counts = self.io.run(self.store.samples.counts(self.split))
        services = self.io.run(self.store.services.live())
        hint = "" if self.offline or services else " (no live inference service: is an engine running?)"
        logger.info("step %d: waiting %.0fs for samples: rank 0 has %d of %d; queue %s; policy version %d; "
                    "%d live inference services%s", step, waited_s, have, self.share, counts, version,
                    len(services), hint)


async def move_record(store: Store, record_id: str, target: RecordStatus, **fields) -> bool:
    """Move a sample's Record to ``target`` if it is still ``ready``; False when another sample of it already did,
    or when the sample has no Record (e.g. uploaded SFT data)."""
    try:
        await store.records.transition(record_id, target, **fields)
        return True
    except (InvalidTransition, NotFound):
        return False
