"""The trainer end to end on the tiny model, in-process: a short RL run, SFT, --sync_sampling, SIGTERM."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path

import pytest

from agentrl.store import Record, RecordStatus, sync_client
from agentrl.store.models import utcnow
from agentrl.train import main
from trainer_fixtures import (
    check_trainer_logprobs,
    enqueue,
    load_weights,
    make_samples,
    max_weight_difference,
    sft_samples,
    start_trainer,
    trainer_args,
)

pytestmark = pytest.mark.slow


def _db(db_uri: str):
    client = sync_client(db_uri)
    return client, client.get_default_database()


def _metrics(db_uri: str) -> dict[int, dict[str, float]]:
    client, db = _db(db_uri)
    try:
        return {doc["step"]: doc["values"] for doc in db.Metric.find({"split": "train"})}
    finally:
        client.close()


def _insert_ready_records(db_uri: str, samples) -> None:
    client, db = _db(db_uri)
    try:
        db.Record.insert_many([Record(
            id=s.record_id, task_id=s.task_id, slot=0, attempt=0, lease_id="l", lease_owner="sampler", leased=False,
            lease_expires_at=utcnow(), status=RecordStatus.READY).to_mongo() for s in samples])
    finally:
        client.close()


def test_short_run_trains_publishes_logs_and_checkpoints(db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(tiny_model_dir, groups=4)
    asyncio.run(enqueue(db_uri, samples))
    _insert_ready_records(db_uri, samples)
    out = tmp_path / "out"
    # no staleness bound: the queued samples are all of version 0, and their staleness is what is measured
    assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "4",
                             "--save_steps", "2", "--max_staleness", "none", "--weight_transport", "disk")) == 0

    metrics = _metrics(db_uri)
    assert sorted(metrics) == [1, 2, 3, 4]
    for step, values in metrics.items():
        assert math.isfinite(values["loss"]) and values["samples"] == 4 and values["grad_norm"] > 0
        assert values["learning_rate"] == pytest.approx(1e-3) and values["tokens_per_s"] > 0
        assert 0.3 < values["merge_ratio"] < 1.0  # two turns merged: fewer tokens than one pass per turn
        assert values["policy_version"] == step  # published after every step
        # the samples were produced by version 0: staleness grows with the trainer's version
        assert values["staleness_mean"] == values["staleness_max"] == step - 1
        assert values["sampled_at_step"] == 0
        for name in ("reward_mean", "reward_std", "advantage_mean", "advantage_std", "clip_fraction",
                     "masked_fraction", "logprob_mismatch_mean", "logprob_mismatch_max"):
            assert name in values, name
    # before the first update the trainer's logprobs are the behaviour logprobs: alignment is token-exact
    assert metrics[1]["logprob_mismatch_max"] < 1e-4 and metrics[1]["logprob_mismatch_max_fresh"] < 1e-4
    assert metrics[2]["logprob_mismatch_max"] > 1e-3  # the weights moved

    client, db = _db(db_uri)
    try:
        docs = list(db.DBRecordData.find())
        assert {d["status"] for d in docs} == {"trained"}
        assert sorted(d["claimed_step"] for d in docs) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
        check_trainer_logprobs(docs, published=True)  # kept for audits, token-aligned with the engine's
        assert {d["status"] for d in db.Record.find()} == {"trained"}
        run = db.Run.find_one()
        # the last version's files: the final model, recorded when the trainer finished
        assert run["policy_version"] == 4 and run["weights_path"] == str((out / "final").resolve())
        assert run["status"] == "finished"
    finally:
        client.close()
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["3", "4"]  # keep_published_weights 2

    initial, final = load_weights(tiny_model_dir), load_weights(out / "final")
    assert max_weight_difference(initial, final) > 1e-4
    assert max_weight_difference(final, load_weights(out / "checkpoint-4")) == 0.0
    assert max_weight_difference(final, load_weights(out / "weights" / "4")) == 0.0
    from transformers import AutoModelForCausalLM  # a checkpoint is a plain Hugging Face model directory

    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert {p.name for p in (out / "checkpoint-2").iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "optimizer", "scheduler.pt", "rng_state_0.pt",
        "trainer_state.json"}


def test_sft_cross_entropy_decreases_over_epochs(db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    asyncio.run(enqueue(db_uri, sft_samples(8)))
    out = tmp_path / "out"
    assert main(trainer_args(db_uri, tiny_model_dir, out, "--loss_calculater", "CrossEntropy", "--enable_sampling",
                             "false", "--train_batch_size", "4", "--num_train_epochs", "4", "--save_steps", "3",
                             "--learning_rate", "1e-2")) == 0
    metrics = _metrics(db_uri)
    assert sorted(metrics) == list(range(1, 9))  # 8 samples, 4 per step, 4 epochs
    losses = [metrics[step]["loss"] for step in sorted(metrics)]
    assert losses[-1] < 0.5 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert [metrics[s]["epoch"] for s in sorted(metrics)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "logprob_mismatch_mean" not in metrics[1]  # SFT data has no behaviour logprobs
    client, db = _db(db_uri)
    try:
        assert {(d["status"], d["epoch"]) for d in db.DBRecordData.find()} == {("trained", 3)}
        run = db.Run.find_one()
        assert run["policy_version"] == 0  # offline: nothing published
        assert run["config"]["loss_calculater"] == "CrossEntropy" and "loss" not in run["config"]  # flat flags
    finally:
        client.close()
    assert not (out / "weights").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4",
                                                               "checkpoint-6", "checkpoint-8"]


async def test_sync_sampling_skips_stale_samples_and_waits_for_fresh_ones(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    await enqueue(db_uri, make_samples(tiny_model_dir, 1, prefix="first"))
    args = trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--sync_sampling", "true", "--train_batch_size",
                        "4", "--max_steps", "2", "--save_steps", "0")
    trainer = asyncio.create_task(asyncio.to_thread(main, args))
    client, db = _db(db_uri)
    try:
        async def until(predicate, what: str) -> None:
            deadline = time.monotonic() + 60
            while not predicate():
                assert not trainer.done(), f"trainer ended while waiting for {what}: {trainer.result()}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.1)

        await until(lambda: (db.Run.find_one() or {}).get("policy_version") == 1, "version 1")
        # a trajectory still sampled by version 0 arrives after the update: never trained in sync mode
        await enqueue(db_uri, make_samples(tiny_model_dir, 1, prefix="late", weight_version=0))
        await until(lambda: db.DBRecordData.count_documents({"status": "skipped"}) == 4, "stale samples skipped")
        await asyncio.sleep(0.5)
        assert not trainer.done()  # still waiting for version-1 samples
        await enqueue(db_uri, make_samples(tiny_model_dir, 1, prefix="fresh", weight_version=1))
        assert await asyncio.wait_for(trainer, 60) == 0
        skipped = list(db.DBRecordData.find({"status": "skipped"}))
        assert {d["_id"].split("/")[0] for d in skipped} == {"late0"}
        assert all("stale" in d["skip_reason"] for d in skipped)
        trained = {d["_id"].split("/")[0] for d in db.DBRecordData.find({"status": "trained"})}
        assert trained == {"first0", "fresh0"}
    finally:
        client.close()
    metrics = _metrics(db_uri)
    assert metrics[1]["staleness_max"] == metrics[2]["staleness_max"] == 0
    assert metrics[2]["skipped_stale"] == 4 and metrics[2]["wait_s"] > 0.5


def test_sigterm_while_waiting_stops_cleanly_with_a_checkpoint(db_uri: str, tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, 2)))
    out = tmp_path / "out"
    process = start_trainer(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps",
                                         "10", "--save_steps", "100"))
    try:
        deadline = time.monotonic() + 120
        while 2 not in _metrics(db_uri):  # both steps done; now it waits for samples of step 3
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the trainer did not train 2 steps"
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "SIGTERM received" in output and "stop requested: leaving after step 2" in output, output
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (out / "final").exists()  # stopped, not finished
    client, db = _db(db_uri)
    try:  # the checkpoint holds both steps: their samples are trained, nothing is left claimed
        assert {d["status"] for d in db.DBRecordData.find()} == {"trained"}
        assert db.Run.find_one()["status"] == "running"
    finally:
        client.close()


def test_the_training_time_limit_also_ends_a_wait_for_samples(db_uri: str, tiny_model_dir: Path,
                                                              tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Samplers slower than the time limit (half a batch in the queue, none coming): the trainer still finishes
    at the limit, as at max_steps, and gives the step's claims back."""
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, 1, group_size=2)))
    out = tmp_path / "out"
    started = time.monotonic()
    with caplog.at_level("INFO", logger="agentrl"):
        assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "10",
                                 "--max_train_time_s", "2", "--save_steps", "0")) == 0
    assert time.monotonic() - started < 60
    assert "reached while waiting for the samples of step 1" in caplog.text
    assert (out / "final" / "config.json").is_file()
    client, db = _db(db_uri)
    try:
        assert {d["status"] for d in db.DBRecordData.find()} == {"queued"}
        assert db.Run.find_one()["status"] == "finished"
    finally:
        client.close()


def test_kl_to_the_reference_model_grows_from_zero(db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
    assert main(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4", "--max_steps", "2",
                             "--save_steps", "0", "--enable_sampling", "false", "--loss_calculater", "GSPO",
                             "--token_level_loss", "false", "--kl_coef", "0.1")) == 0
    metrics = _metrics(db_uri)
    assert metrics[1]["ref_kl"] < 1e-9  # the reference is the starting policy
    assert metrics[2]["ref_kl"] > 1e-7 and metrics[2]["sequences"] == 4


def test_sync_every_2_labels_unpublished_weights_and_publishes_the_last_step(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """With ``--sync_every 2`` the weights of step 2 are version 0 plus step 1's update, which no service serves:
    their logprobs are not labelled version 0, and no token counts as sampled by them (``_fresh``). A run ending on
    step 3 publishes it, so the services serve the trained policy (what an after-evaluation measures)."""
    from agentrl.inference import SGLangClient
    from inference_fixtures import start_engine

    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=3)))
        assert main(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4", "--max_steps",
                                 "3", "--save_steps", "0", "--max_staleness", "none", "--sync_every", "2")) == 0

        async def served_version() -> str:
            async with SGLangClient(engine.url) as client:
                return (await client.get_model_info()).weight_version

        served = asyncio.run(served_version())
    finally:
        engine.stop()
    metrics = _metrics(db_uri)
    assert "logprob_mismatch_mean_fresh" in metrics[1]  # version 0's own weights scored version 0's tokens
    assert "logprob_mismatch_mean_fresh" not in metrics[2] and "logprob_mismatch_mean_fresh" not in metrics[3]
    client, db = _db(db_uri)
    try:
        by_step = {d["claimed_step"]: d.get("trainer_version", "absent") for d in db.DBRecordData.find()}
        run = db.Run.find_one()
    finally:
        client.close()
    assert by_step == {1: 0, 2: None, 3: 1}
    assert run["policy_version"] == 2 and run["weights_version"] == 2 and served == "2"
