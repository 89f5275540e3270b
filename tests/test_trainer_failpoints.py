"""The trainer killed at each failpoint of its step, checkpoint and claim protocol (``agentrl.failpoints``, a real
process ending with ``os._exit``) and resumed: every sample is trained exactly once — checked by the step ledger
(``Metric.sample_ids``) and the claims — and nothing is left claimed; killed while skipping stale samples, it
leaves no Record ``ready``. Only the crashes need processes of their own: the resumed runs go in the test's process
(a trainer process spends ~4 CPU-seconds importing before its first step)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from agentrl.failpoints import ENV, EXIT_CODE, FailpointHit, reset
from agentrl.store import DBRecordData, Record, RecordStatus, sync_client
from agentrl.store.models import EPOCH
from agentrl.train import main
from agentrl.training.checkpoint import list_checkpoints
from agentrl.training.dirs import replace_dir
from trainer_fixtures import enqueue, make_samples, run_trainer, start_trainer, trainer_args

pytestmark = pytest.mark.slow(start_rank=6)

BATCH, STEPS = 4, 4
FLAGS = ("--train_batch_size", str(BATCH), "--max_steps", str(STEPS), "--save_steps", "1", "--enable_sampling",
         "false")


@pytest.mark.parametrize(("point", "save_steps"), [
    ("checkpoint.save.before_rename=exit@2", 1),  # checkpoint-2 complete but not renamed: resume from 1
    ("checkpoint.save.after_rename=exit@2", 1),  # checkpoint-2 in place, old copy not deleted, claims not marked
    ("trainer.checkpoint.before_mark_trained=exit@2", 1),
    ("trainer.step.after_log=exit@3", 1),  # step 3 trained and in the ledger, but not in any checkpoint
    ("samples.claim.after_one=exit@10", 1),  # step 3 half claimed
    ("publish.after_export=exit@2", 1),  # weights of version 2 written, nobody told
    ("publish.before_bump=exit@2", 1),  # version 2 loaded by the (no) services, the Run still says 1
    # checkpoints every 2 steps: step 3's publish overlaps step 4 (claimed, computing) when it crashes before its
    # bump, or when step 3 is logged after step 4's compute; resumed from checkpoint 2
    ("publish.before_bump=exit@3", 2),
    ("trainer.step.after_log=exit@3", 2),
])
def test_a_crash_at_each_trainer_failpoint_loses_and_repeats_nothing(point: str, save_steps: int, db_uri: str,
                                                                     tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(tiny_model_dir, groups=STEPS * BATCH // 4)
    asyncio.run(enqueue(db_uri, samples))
    out = tmp_path / "out"
    flags = (*FLAGS[:5], str(save_steps), *FLAGS[6:])
    # publish: --enable_sampling true, and no staleness bound (the queued samples are all of version 0)
    if point.startswith("publish.") or save_steps > 1:
        flags = (*flags[:-1], "true", "--max_staleness", "none")
    crashed = run_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags), env={ENV: point})
    assert crashed.returncode == EXIT_CODE, crashed.stdout
    # resumed in this process: the crash needs a process of its own, the resume does not (and starts faster here)
    assert main(trainer_args(db_uri, tiny_model_dir, out, *flags, "--resume_from_checkpoint", "latest")) == 0

    docs, metrics, run = _ledger(db_uri)
    if point.startswith("publish."):  # versions only grow, and the newest one's weights exist (the final model)
        assert run["policy_version"] >= STEPS and run["weights_version"] == run["policy_version"]
        assert (Path(run["weights_path"]) / "config.json").exists()
    assert {d["status"] for d in docs} == {"trained"}
    assert Counter(d["claimed_step"] for d in docs) == dict.fromkeys(range(1, STEPS + 1), BATCH)
    assert sorted(m["step"] for m in metrics) == list(range(1, STEPS + 1))
    listed = [sample_id for m in metrics for sample_id in m["sample_ids"]]
    assert sorted(listed) == sorted(s.id for s in samples), "the ledger lists a sample twice or misses one"
    for metric in metrics:
        assert set(metric["sample_ids"]) == {d["_id"] for d in docs if d["claimed_step"] == metric["step"]}
    assert [step for step, _ in list_checkpoints(out)] == list(range(save_steps, STEPS + 1, save_steps))
    assert not [p.name for p in out.iterdir() if p.name.startswith(".checkpoint")], "leftovers of the crash"


@pytest.mark.parametrize("point", [
    "trainer.step.after_log=exit@2",  # step 2 in the ledger, its samples still claimed
    "samples.claim.after_one=exit@6",  # step 2 half claimed; step 1 settled or not (an overlapped publish)
    "trainer.skip.after_abandon=exit",  # not reached: the control run of the same flags
])
def test_without_checkpoints_a_crash_leaves_every_trained_sample_in_the_ledger_once(
        point: str, db_uri: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--save_steps 0``: samples become trained once their step's Metric lists them; a killed trainer's successor
    starts fresh, marks the claims its ledger lists trained, returns the others and numbers its steps after the
    logged ones."""
    samples = make_samples(tiny_model_dir, groups=STEPS * BATCH // 4)
    asyncio.run(enqueue(db_uri, samples))
    flags = trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", str(BATCH), "--max_steps",
                         str(STEPS), "--save_steps", "0", "--max_staleness", "none")
    if point.startswith("trainer.skip"):  # the control, armed but never reached: in-process, raising if it were
        monkeypatch.setenv(ENV, point.removesuffix("=exit"))
        reset()
        try:
            assert main(flags) == 0
        finally:
            monkeypatch.delenv(ENV)
            reset()
    else:
        first = run_trainer(flags, env={ENV: point})
        assert first.returncode == EXIT_CODE, first.stdout
        assert main(flags) == 0
    docs, metrics, _ = _ledger(db_uri)
    assert {d["status"] for d in docs} == {"trained"}
    listed = [sample_id for m in metrics for sample_id in m["sample_ids"]]
    assert sorted(listed) == sorted(s.id for s in samples), "the ledger lists a sample twice or misses one"
    assert sorted(m["step"] for m in metrics) == list(range(1, STEPS + 1))


def _ledger(db_uri: str) -> tuple[list[dict], list[dict], dict]:
    """The samples, the step ledger (Metric documents) and the Run."""
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        return list(db.DBRecordData.find()), list(db.Metric.find()), db.Run.find_one()
    finally:
        client.close()


def test_a_directory_is_never_half_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crashed between renaming the old checkpoint aside and putting the new one in place: neither counts as a
    checkpoint (``latest`` is the previous complete one), and the next save cleans up."""
    def checkpoint(name: str, step: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "trainer_state.json").write_text(f'{{"step": {step}}}')
        return path

    checkpoint("checkpoint-1", 1)
    checkpoint("checkpoint-2", 2)
    monkeypatch.setenv(ENV, "checkpoint.save.after_aside")
    reset()
    try:
        with pytest.raises(FailpointHit):
            replace_dir(checkpoint(".checkpoint-2.tmp", 2), tmp_path / "checkpoint-2",
                        failpoint_prefix="checkpoint.save")
        assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
        monkeypatch.delenv(ENV)
        reset()
        replace_dir(tmp_path / ".checkpoint-2.tmp", tmp_path / "checkpoint-2", failpoint_prefix="checkpoint.save")
    finally:
        reset()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def _ready_records(db_uri: str, samples: Sequence[DBRecordData], *, branches: Sequence[DBRecordData] = ()) -> None:
    """The samples (and more ``branches`` of their Records, in the same insert) queued with their Records
    ``ready``, as a group stage leaves them."""
    asyncio.run(enqueue(db_uri, [*branches, *samples]))
    client = sync_client(db_uri)
    try:
        client.get_default_database().Record.insert_many([Record(
            id=sample.record_id, task_id=sample.task_id, slot=int(sample.record_id.split("/")[1]), attempt=1,
            lease_id="done", lease_owner="sampler", leased=False, lease_expires_at=EPOCH, status=RecordStatus.READY,
        ).to_mongo() for sample in samples])
    finally:
        client.close()


def test_a_crash_while_skipping_stale_samples_leaves_no_record_ready(db_uri: str, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """Killed between the two writes of the stale skip (the samples' Records and the samples themselves), then
    resumed: the stale samples end ``skipped`` and their Records ``abandoned`` as ``stale``; none stays ``ready``
    (the samplers' admission control would count it for the rest of the run)."""
    _ready_records(db_uri, make_samples(tiny_model_dir, 1, prefix="first"))
    out = tmp_path / "out"
    flags = ("--sync_sampling", "true", "--train_batch_size", "4", "--max_steps", "2", "--save_steps", "1")
    trainer = start_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags),
                            env={ENV: "trainer.skip.after_abandon=exit"})
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        deadline = time.monotonic() + 120
        while db.Metric.count_documents({"step": 1}) == 0:  # step 1 trained: the policy is version 1 now
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0]
            time.sleep(0.2)
        _ready_records(db_uri, make_samples(tiny_model_dir, 1, prefix="late", weight_version=0))  # too stale
        output, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == EXIT_CODE, output
        assert {d["status"] for d in db.DBRecordData.find({"task_id": "late0"})} == {"claimed"}
        # the resumed trainer publishes once more (version 2): fresh samples for its second step
        _ready_records(db_uri, make_samples(tiny_model_dir, 1, prefix="fresh", weight_version=2))
        assert main(trainer_args(db_uri, tiny_model_dir, out, *flags, "--resume_from_checkpoint", "latest")) == 0
        samples = {d["_id"]: d["status"] for d in db.DBRecordData.find()}
        records = {d["_id"]: d for d in db.Record.find()}
    finally:
        client.close()
    assert {status for sample_id, status in samples.items() if sample_id.startswith("late")} == {"skipped"}
    assert {status for sample_id, status in samples.items() if not sample_id.startswith("late")} == {"trained"}
    assert {(r["status"], r.get("failure_class")) for r in records.values() if r["_id"].startswith("late")} == {
        ("abandoned", "stale")}
    assert {r["status"] for r in records.values() if not r["_id"].startswith("late")} == {"trained"}


def test_a_record_whose_branches_straddle_the_staleness_bound_ends_trained(db_uri: str, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """One Record, two branches (samples ``#b0`` and ``#b1``): one sampled before the last publish (stale under
    ``--sync_sampling``), one after. The stale one is skipped, the fresh one trained: the Record is ``trained``
    (abandoning it at the skip would have left it ``abandoned`` though one of its samples trained)."""
    _ready_records(db_uri, make_samples(tiny_model_dir, 1, prefix="first"))
    out = tmp_path / "out"
    flags = ("--sync_sampling", "true", "--train_batch_size", "4", "--max_steps", "2", "--save_steps", "0")
    trainer = start_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags))
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        deadline = time.monotonic() + 120
        while db.Run.find_one({"policy_version": 1}) is None:  # step 1 published: the policy is version 1 now
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0]
            time.sleep(0.2)
        fresh = make_samples(tiny_model_dir, 1, prefix="late", weight_version=1)
        stale = make_samples(tiny_model_dir, 1, prefix="late", weight_version=0, seed=1)[0]
        branch = stale.model_copy(update={"id": f"{fresh[0].record_id}#b1", "record_id": fresh[0].record_id})
        _ready_records(db_uri, fresh, branches=[branch])  # one insert: the trainer claims the stale one first
        output, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, output
        samples = {d["_id"]: d["status"] for d in db.DBRecordData.find()}
        record = db.Record.find_one({"_id": fresh[0].record_id})
    finally:
        client.close()
    assert samples[branch.id] == "skipped" and samples[fresh[0].id] == "trained"
    assert record["status"] == "trained", record


def test_a_resumed_trainer_already_at_its_step_limit_gives_back_the_claims_it_adopted(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Killed with step 3 half claimed (checkpoint 2), resumed with ``--max_steps 2``: it has nothing to train and
    returns step 3's claims to the queue instead of leaving them claimed for good."""
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=STEPS * BATCH // 4)))
    out = tmp_path / "out"
    crashed = run_trainer(trainer_args(db_uri, tiny_model_dir, out, *FLAGS),
                          env={ENV: "samples.claim.after_one=exit@10"})
    assert crashed.returncode == EXIT_CODE, crashed.stdout
    limited = (*FLAGS[:3], "2", *FLAGS[4:])
    assert main(trainer_args(db_uri, tiny_model_dir, out, *limited, "--resume_from_checkpoint", "latest")) == 0
    client = sync_client(db_uri)
    try:
        statuses = Counter(d["status"] for d in client.get_default_database().DBRecordData.find())
    finally:
        client.close()
    assert statuses == {"trained": 2 * BATCH, "queued": (STEPS - 2) * BATCH}, statuses
