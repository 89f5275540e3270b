"""A trainer's start in a run: what becomes of the sample claims earlier trainers left (exactly-once training).

A sample stays ``claimed(rank, step)`` until a checkpoint holding its update is complete (or, with ``--save_steps
0``, until the step's ledger lists it). A trainer resumed from a checkpoint therefore marks the claims of the
checkpoint's steps trained and replays the later ones (:func:`adopt_claims`); a fresh one settles what the ledger
lists and returns every other claim to the queue (:func:`release_stale_claims`), and numbers its steps after those
an earlier trainer logged (:func:`earlier_steps`).
"""

from __future__ import annotations

import logging

from agentrl.store import Store
from agentrl.training.aio import LoopThread
from agentrl.training.checkpoint import TrainerState
from agentrl.training.parallel import ParallelState

logger = logging.getLogger(__name__)


def adopt_claims(store: Store, io: LoopThread, parallel: ParallelState, saved: TrainerState,
                 batch_size: int) -> None:
    """After loading checkpoint ``saved``: its steps' claims are trained; later claims are replayed as they are, or
    returned to the queue when the data-parallel layout or the batch size changed."""
    if parallel.is_main and (saved.dp_size, saved.train_batch_size) != (parallel.dp_size, batch_size):
        returned = io.run(store.samples.requeue(from_step=saved.step + 1))
        logger.info("layout changed (dp %d → %d, batch %d → %d): %d claims of later steps went back to the queue",
                    saved.dp_size, parallel.dp_size, saved.train_batch_size, batch_size, returned)
    parallel.barrier()
    if parallel.is_tp_leader:
        io.run(store.samples.mark_trained_through(parallel.dp_rank, saved.step))
    if parallel.is_main:  # ranks of the checkpoint's layout that no longer exist: their updates are in it too
        for rank in range(parallel.dp_size, saved.dp_size):
            io.run(store.samples.mark_trained_through(rank, saved.step))
    parallel.barrier()


def release_stale_claims(store: Store, io: LoopThread, parallel: ParallelState) -> None:
    """A fresh start: claims an earlier trainer of this run left behind go back to the queue, except those its
    ledger lists (``--save_steps 0``: it died between logging a step and marking its samples trained)."""
    if parallel.is_main:
        for step in io.run(store.samples.claimed_steps()):
            logged = io.run(store.runs.ledger(step))
            if logged and (settled := io.run(store.samples.mark_logged_trained(step, logged))):
                logger.info("step %d of an earlier trainer is in the ledger: its %d samples still claimed are "
                            "trained", step, settled)
        returned = io.run(store.samples.requeue(from_step=0))
        if returned:
            logger.info("%d samples claimed by an earlier trainer of this run went back to the queue", returned)
    parallel.barrier()


def earlier_steps(store: Store, io: LoopThread, parallel: ParallelState, interrupted: bool) -> tuple[int, int]:
    """A fresh start online in a run whose earlier trainer logged steps (without a checkpoint to resume, e.g.
    ``--save_steps 0``): ``(last, first)``, the last step logged, after which this trainer numbers its own (the
    ledger keeps every step it logged), and the steps ``--max_steps`` leaves out: none when that trainer did not
    finish (``interrupted``: this one takes its place), else all of them."""
    last = parallel.broadcast_from_main(io.run(store.runs.last_step()) if parallel.is_main else None)
    interrupted = parallel.broadcast_from_main(interrupted if parallel.is_main else None)
    if not last:
        return 0, 0
    logger.info("an earlier trainer of this run logged %d steps (no checkpoint resumed: this one starts from the base "
                "weights): numbering the steps from %d on%s", last, last + 1,
                "; it did not finish, so --max_steps counts them too" if interrupted else "")
    return last, 0 if interrupted else last
