"""Values samplers and trainers must agree on (RunValues: train_batch_size, max_staleness, temperature): the Run
records only the values a process was given (never a default), whichever process starts first; a process given none
takes the run's value, else the default (a sampler also while it samples); a given value that contradicts a recorded
one is an error naming both and how each was given, and writes nothing. The original's sample-then-train sequence
trains."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from agentrl.rollout.agent import AgentResources
from agentrl.rollout.config import SamplerConfig
from agentrl.rollout.process import agree_run_values
from agentrl.rollout.sampler import Sampler
from agentrl.store import Store, database_name, sync_client
from agentrl.store.runs import RunValuesConflict
from agentrl.training.config import TrainConfig
from inference_fixtures import start_engine
from rollout_fixtures import (
    agentrl_cmd,
    documents,
    run_env,
    sample_args,
    upload,
    write_mcp_config,
    write_script_tasks,
)
from trainer_fixtures import run_trainer, trainer_args


def _database(db_uri: str) -> dict[str, list[dict]]:
    """Every document of every collection of the test's database."""
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        return {name: list(db[name].find(sort=[("_id", 1)])) for name in sorted(db.list_collection_names())}
    finally:
        client.close()


async def test_only_given_values_are_recorded_and_later_processes_take_them(db_uri: str) -> None:
    async with Store(db_uri) as store:
        first = await agree_run_values(store, db_uri, SamplerConfig(train_batch_size=8))
        later = await agree_run_values(store, db_uri, SamplerConfig())
        run = await store.runs.get()
        evaluation = await agree_run_values(store, db_uri, SamplerConfig(split="eval", train_batch_size=3))
    assert run.name == database_name(db_uri)
    assert run.values == {"train_batch_size": 8} and run.value_sources == {
        "train_batch_size": "a sampler's --train_batch_size 8"}
    assert (first.train_batch_size, later.train_batch_size, later.max_staleness) == (8, 8, 1)  # 1: the default
    assert evaluation.train_batch_size == 3  # samplers of other splits do not take part


async def test_flags_not_given_take_the_runs_values(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {"train_batch_size": 4, "max_staleness": None, "temperature": 0.7})
        config = await agree_run_values(store, db_uri, SamplerConfig())
    assert (config.train_batch_size, config.max_staleness, config.rollout.temperature) == (4, None, 0.7)


async def test_a_contradiction_names_both_values_and_writes_nothing(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {"train_batch_size": 32},
                               {"train_batch_size": "a sampler's --train_batch_size 32"})
        before = _database(db_uri)
        with pytest.raises(RunValuesConflict, match=r"--train_batch_size 8 differs from the run's train_batch_size "
                                                    r"32 \(from a sampler's --train_batch_size 32\)"):
            await store.runs.agree("demo", {"train_batch_size": 8, "temperature": 0.5})  # temperature: not recorded
        assert _database(db_uri) == before
        run = await store.runs.agree("demo", {"train_batch_size": 32, "max_staleness": 1})  # agrees, adds one
    assert run.values == {"train_batch_size": 32, "max_staleness": 1} and run.config == {}


async def test_a_run_created_before_values_were_recorded_has_none(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.get_or_create("old", {"lr": 1e-6})
        await store.runs.collection.update_one({}, {"$set": {"values": None}})  # as such runs were stored
        run = await store.runs.agree("old", {"max_staleness": 3})
        with pytest.raises(RunValuesConflict, match="--max_staleness 2 differs from the run's max_staleness 3"):
            await store.runs.agree("old", {"max_staleness": 2})
    assert run.values == {"max_staleness": 3} and run.config == {"lr": 1e-6}


async def test_a_run_a_sampler_created_gets_the_trainers_snapshot_once(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {})
        first = await store.runs.get_or_create("demo", {"learning_rate": 1e-3})
        second = await store.runs.get_or_create("demo", {"learning_rate": 5.0})
    assert first.config == second.config == {"learning_rate": 1e-3}


async def test_the_sampler_cli_refuses_a_contradicting_flag_with_both_values(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {"train_batch_size": 16, "max_staleness": 1},
                               TrainConfig(train_batch_size=16, max_staleness=1).run_value_sources(dp_size=1))
    before = _database(db_uri)
    done = subprocess.run(agentrl_cmd("sample", "--db_connection_string", db_uri, "--train_batch_size", "8",
                                      "--max_staleness", "1", "--exit_when_done", "true"),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert ("a sampler's --train_batch_size 8 differs from the run's train_batch_size 16 (from the trainer's "
            "--train_batch_size 16)") in done.stderr
    assert "max_staleness" not in done.stderr  # given, and the same as the run's
    assert "Traceback" not in done.stderr
    assert _database(db_uri) == before


TRAINERS = {"explicit": TrainConfig(train_batch_size=2), "derived": TrainConfig(per_device_train_batch_size=2),
            "absent": TrainConfig()}


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
@pytest.mark.parametrize("order", ["sampler_first", "trainer_first", "concurrent"])
async def test_every_start_order_gives_the_same_run(order: str, trainer: str, db_uri: str) -> None:
    """A sampler given no batch size and a trainer given one (or derived from its per-device size, or none),
    started in each order: the same recorded values and the same batch size on both sides."""
    sampler_config, trainer_config = SamplerConfig(), TRAINERS[trainer]

    async def sampler() -> SamplerConfig:
        async with Store(db_uri) as store:
            return await agree_run_values(store, db_uri, sampler_config)

    async def trainer_agrees() -> TrainConfig:
        async with Store(db_uri) as store:
            run = await store.runs.agree(database_name(db_uri), trainer_config.run_values(dp_size=1),
                                         trainer_config.run_value_sources(dp_size=1))
        return trainer_config.with_run_values(run.values)

    if order == "sampler_first":
        sampled, trained = await sampler(), await trainer_agrees()
    elif order == "trainer_first":
        trained, sampled = await trainer_agrees(), await sampler()
    else:
        sampled, trained = await asyncio.gather(sampler(), trainer_agrees())
    async with Store(db_uri) as store:
        run = await store.runs.get()
    expected = 16 if trainer == "absent" else 2
    assert run.values == ({} if trainer == "absent" else {"train_batch_size": 2})
    assert trained.resolved_train_batch_size(dp_size=1) == expected
    assert sampled.with_run_values(run.values).train_batch_size == expected  # at start, or at its next refresh
    if trainer == "derived":
        assert run.value_sources["train_batch_size"] == (
            "the trainer's --per_device_train_batch_size 2 × --gradient_accumulation_steps 1 × 1 data-parallel "
            "rank(s) = 2")


async def test_a_sampling_sampler_takes_up_a_batch_size_recorded_after_it_started(db_uri: str) -> None:
    """The sampler's periodic refresh: values it was given stay, values another process records later apply."""
    async with Store(db_uri) as store:
        config = await agree_run_values(store, db_uri, SamplerConfig(max_staleness=3))
        sampler = Sampler(AgentResources(store=store, tokenizer=None, inference=None, parser=None, config=config),
                          owner="s1")
        await sampler._refresh_run_values()
        assert (sampler.cfg.train_batch_size, sampler.cfg.max_staleness) == (16, 3)
        await store.runs.agree(database_name(db_uri), {"train_batch_size": 2, "temperature": 0.5})
        await sampler._refresh_run_values()
    assert (sampler.cfg.train_batch_size, sampler.cfg.max_staleness, sampler.cfg.rollout.temperature) == (2, 3, 0.5)
    assert sampler.res.config is sampler.cfg


def test_the_original_sequence_samples_then_trains(tmp_path: Path, db_uri: str, scripted_model_dir: Path) -> None:
    """``agentrl tasks upload``, ``agentrl sample --exit_when_done true`` with no batch size, then ``agentrl train
    --per_device_train_batch_size 2 --loss_calculater GRPO --max_steps 1``: the trainer records its batch size
    and trains one step (on an engine of its own: the trainer publishes to it)."""
    upload(db_uri, write_script_tasks(tmp_path / "tasks.jsonl", ("add", "mul")), "--num_generations", "2")
    engine = start_engine(scripted_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    try:
        sampled = subprocess.run(
            sample_args(db_uri, scripted_model_dir, None, write_mcp_config(tmp_path / "mcp.json"),
                        "--zero_variance_threshold", "0", "--drop_zero_advantage", "false"),
            capture_output=True, text=True, env=run_env(), timeout=300)
        assert sampled.returncode == 0, sampled.stderr[-3000:]
        trained = run_trainer(trainer_args(db_uri, scripted_model_dir, tmp_path / "out", "--loss_calculater",
                                           "GRPO", "--max_steps", "1", "--per_device_train_batch_size", "2"),
                              timeout_s=300)
        assert trained.returncode == 0, trained.stdout[-4000:]
        [metric] = documents(db_uri, "Metric")
        assert metric["step"] == 1 and len(metric["sample_ids"]) == 2
        [run] = documents(db_uri, "Run")
        assert run["values"] == {"train_batch_size": 2}
        # A trainer given another temperature than the samples were drawn at records it, and skips them.
        heated = run_trainer(trainer_args(db_uri, scripted_model_dir, tmp_path / "out2", "--loss_calculater",
                                          "GRPO", "--max_steps", "1", "--temperature", "0.7", "--max_staleness",
                                          "5"), timeout_s=300)  # it publishes version 2 at its start
    finally:
        engine.stop()
    assert heated.returncode == 0, heated.stdout[-4000:]
    assert "skipped 2 samples drawn at temperature 1" in heated.stdout
    samples = documents(db_uri, "DBRecordData")
    assert {s["temperature"] for s in samples} == {1.0}
    skipped = [s for s in samples if s["status"] == "skipped"]
    assert len(skipped) == 2 and all(s["skip_reason"].startswith("temperature:") for s in skipped)
    assert {r["failure_class"] for r in documents(db_uri, "Record") if r["status"] == "abandoned"} == {"temperature"}
    [run] = documents(db_uri, "Run")
    assert run["values"] == {"train_batch_size": 2, "temperature": 0.7, "max_staleness": 5}
