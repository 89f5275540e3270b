"""Several trainer processes on CPU (gloo): FSDP2 and tensor parallelism give the weights of one process on the
same data; a checkpoint of 2 ranks resumes in 1 (the optimizer state reshards); ``accelerate launch`` works."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.failpoints import ENV
from agentrl.store import DBRecordData, sync_client
from agentrl.train import main
from conftest import with_database
from trainer_fixtures import (
    TRAINER_ENV,
    check_trainer_logprobs,
    enqueue,
    load_weights,
    make_samples,
    max_weight_difference,
    run_trainer,
    trainer_args,
)

pytestmark = pytest.mark.slow(start_rank=10)

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
FLAGS = ("--train_batch_size", "4", "--enable_sampling", "false", "--max_tokens", "64", "--adam_epsilon", "1e-6")
TOLERANCE = 1e-5  # weights move ~1e-3 per step; fp32 sums in another order (adam_epsilon 1e-6 damps Adam on ~0 grads)


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[DBRecordData]:
    return make_samples(tiny_model_dir, groups=3, per_turn=True)  # each turn with its own advantage


@pytest.fixture
def fresh_db(mongo_server_uri: str) -> Iterator:
    """Makes databases holding the samples (dropped afterwards)."""
    names = []

    def make(samples: list[DBRecordData]) -> str:
        names.append("t_" + uuid.uuid4().hex[:12])
        uri = with_database(mongo_server_uri, names[-1])
        asyncio.run(enqueue(uri, samples))
        return uri

    yield make
    client = sync_client(mongo_server_uri)
    for name in names:
        client.drop_database(name)
    client.close()


def _metric(uri: str, step: int) -> dict[str, float]:
    client = sync_client(uri)
    try:
        return client.get_default_database().Metric.find_one({"step": step})["values"]
    finally:
        client.close()


@pytest.fixture(scope="module")
def single_process(tiny_model_dir: Path, samples, tmp_path_factory, mongo_server_uri: str) -> tuple[Path, str]:
    """One process, 3 steps, a checkpoint after step 2: the reference."""
    uri = with_database(mongo_server_uri, "t_" + uuid.uuid4().hex[:12])
    asyncio.run(enqueue(uri, samples))
    out = tmp_path_factory.mktemp("single")
    assert main(trainer_args(uri, tiny_model_dir, out, *FLAGS, "--max_steps", "3", "--save_steps", "2")) == 0
    yield out, uri
    client = sync_client(mongo_server_uri)
    client.drop_database(uri.rsplit("/", 1)[1])
    client.close()


def test_fsdp2_on_two_gloo_ranks_matches_one_process_and_resumes_on_one(
        tiny_model_dir: Path, samples, single_process, fresh_db, tmp_path: Path) -> None:
    reference, reference_uri = single_process
    uri = fresh_db(samples)
    out = tmp_path / "fsdp"
    result = run_trainer(trainer_args(uri, tiny_model_dir, out, *FLAGS, "--max_steps", "2", "--save_steps", "2"),
                         launcher=TORCHRUN)
    assert result.returncode == 0, result.stdout
    assert "2 ranks (dp 2 × tp 1)" in result.stdout
    difference = max_weight_difference(load_weights(out / "checkpoint-2"), load_weights(reference / "checkpoint-2"))
    assert difference < TOLERANCE, difference
    client = sync_client(uri)
    try:  # the step ledger on rank 0 lists both ranks' samples
        ledger = [i for d in client.get_default_database().Metric.find() for i in d["sample_ids"]]
        # each rank keeps its own samples' logprobs (and nothing from the empty passes that pad the shorter rank)
        check_trainer_logprobs(list(client.get_default_database().DBRecordData.find(
            {"claimed_step": {"$ne": None}})), published=False)
    finally:
        client.close()
    assert len(ledger) == len(set(ledger)) == 8
    for step in (1, 2):
        ours, theirs = _metric(uri, step), _metric(reference_uri, step)
        for name in ("loss", "grad_norm", "loss_tokens", "tokens", "samples"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-7), (step, name)
    assert {p.name for p in (out / "checkpoint-2" / "optimizer").iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}

    # the 2-rank checkpoint resumes in one process: the sharded optimizer state is resharded on load
    assert main(trainer_args(uri, tiny_model_dir, out, *FLAGS, "--max_steps", "3", "--save_steps", "2",
                             "--resume_from_checkpoint", "latest")) == 0
    difference = max_weight_difference(load_weights(out / "final"), load_weights(reference / "final"))
    assert difference < TOLERANCE, difference


def test_a_rank_with_fewer_micro_batches_keeps_only_its_own_samples_logprobs(
        tiny_model_dir: Path, samples, fresh_db, tmp_path: Path) -> None:
    # 3 samples over 2 ranks, one micro-batch each: rank 1 runs an empty pass to match rank 0's two passes
    uri = fresh_db(samples[:3])
    result = run_trainer(trainer_args(uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "3",
                                      "--enable_sampling", "false", "--max_tokens", "1", "--max_steps", "1",
                                      "--save_steps", "0"), launcher=TORCHRUN)
    assert result.returncode == 0, result.stdout
    client = sync_client(uri)
    try:
        docs = list(client.get_default_database().DBRecordData.find({"claimed_step": 1}))
    finally:
        client.close()
    assert sorted(d["claimed_rank"] for d in docs) == [0, 0, 1]
    check_trainer_logprobs(docs, published=False)


def test_tensor_parallel_on_two_gloo_ranks_matches_one_process(
        tiny_model_dir: Path, samples, single_process, fresh_db, tmp_path: Path) -> None:
    reference, reference_uri = single_process
    uri = fresh_db(samples)
    out = tmp_path / "tp"
    result = run_trainer(trainer_args(uri, tiny_model_dir, out, *FLAGS, "--max_steps", "2", "--save_steps", "0",
                                      "--tp_size", "2"), launcher=TORCHRUN)
    assert result.returncode == 0, result.stdout
    assert "2 ranks (dp 1 × tp 2)" in result.stdout
    difference = max_weight_difference(load_weights(out / "final"), load_weights(reference / "checkpoint-2"))
    assert difference < TOLERANCE, difference
    for step in (1, 2):
        assert _metric(uri, step)["grad_norm"] == pytest.approx(_metric(reference_uri, step)["grad_norm"], rel=1e-5)


def test_accelerate_launch_with_the_cpu_config(tiny_model_dir: Path, samples, fresh_db, tmp_path: Path) -> None:
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate is a dependency"
    config = Path(__file__).parents[1] / "assets" / "accelerate" / "cpu.yml"
    uri = fresh_db(samples[:4])
    result = run_trainer(trainer_args(uri, tiny_model_dir, tmp_path / "out", *FLAGS, "--save_steps", "0"),
                         launcher=(accelerate, "launch", "--config_file", str(config)))
    assert result.returncode == 0, result.stdout
    assert _metric(uri, 1)["samples"] == 4 and (tmp_path / "out" / "final" / "model.safetensors").is_file()

    # the config's settings are applied: mixed_precision bf16 turns bf16 on
    bf16_config = tmp_path / "bf16.yml"
    bf16_config.write_text(config.read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    uri = fresh_db(samples[:4])
    result = run_trainer(trainer_args(uri, tiny_model_dir, tmp_path / "bf16", *FLAGS, "--save_steps", "0",
                                      dtype=None),
                         launcher=(accelerate, "launch", "--config_file", str(bf16_config)))
    assert result.returncode == 0, result.stdout
    assert ", bf16);" in result.stdout, result.stdout[-3000:]


def test_trainer_collectives_take_backend_tensors_and_only_rank0_reads_weights(
        tiny_model_dir: Path, samples, single_process, fresh_db, tmp_path: Path) -> None:
    """Two gloo ranks run under ``collective_probe.py`` (the stand-in for NCCL: see its docstring). No AgentRL
    collective receives a tensor not placed on the backend's device;
    only rank 0 reads weights from disk; the run (with activation checkpointing, set up on the meta-device model)
    still equals one process: rank-0 loading is exact."""
    reference, _ = single_process
    uri = fresh_db(samples)
    out = tmp_path / "probe"
    out.mkdir()
    probe = Path(__file__).with_name("collective_probe.py")
    command = [*TORCHRUN, str(probe), str(out),
               *trainer_args(uri, tiny_model_dir, out / "run", *FLAGS, "--max_steps", "2", "--save_steps", "2",
                             "--gradient_checkpointing", "true")]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
                            env={**os.environ, **TRAINER_ENV})
    assert result.returncode == 0, result.stdout
    assert "rank 0 read the weights" in result.stdout
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["violations"] == [], report["violations"]
        assert report["calls"], "the probe saw no AgentRL collective: it is not wired in"
    assert [r["loads"] for r in ranks] == [1, 0]
    difference = max_weight_difference(load_weights(out / "run" / "checkpoint-2"),
                                       load_weights(reference / "checkpoint-2"))
    assert difference < TOLERANCE, difference


def test_resume_on_fewer_ranks_settles_the_claims_of_the_missing_ranks(
        tiny_model_dir: Path, samples, fresh_db, tmp_path: Path) -> None:
    """Two ranks die right after checkpoint 2 is complete, before marking its claims trained; one process resumes:
    the checkpoint holds rank 1's updates too, so rank 1's claims become trained (none stays claimed) and every
    sample is trained exactly once (the ledger)."""
    uri = fresh_db(samples)
    out = tmp_path / "out"
    args = trainer_args(uri, tiny_model_dir, out, *FLAGS, "--max_steps", "3", "--save_steps", "2")
    crashed = run_trainer(args, launcher=TORCHRUN, env={ENV: "trainer.checkpoint.before_mark_trained=exit"})
    assert crashed.returncode != 0 and (out / "checkpoint-2").is_dir(), crashed.stdout
    assert main([*args, "--resume_from_checkpoint", "latest"]) == 0
    client = sync_client(uri)
    try:
        db = client.get_default_database()
        statuses = {d["_id"]: d["status"] for d in db.DBRecordData.find()}
        ledger = [i for d in db.Metric.find() for i in d["sample_ids"]]
    finally:
        client.close()
    trained = sorted(i for i, status in statuses.items() if status == "trained")
    assert "claimed" not in statuses.values(), statuses
    assert sorted(ledger) == trained and len(trained) == 3 * 4
