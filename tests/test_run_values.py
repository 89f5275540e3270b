"""Values samplers and trainers must agree on (RunValues: train_batch_size, max_staleness, temperature) are written
once on the Run by whoever creates it, read from it when not given, and a flag that contradicts the run is an error
naming both values that writes nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agentrl.rollout.config import SamplerConfig
from agentrl.rollout.process import agree_run_values
from agentrl.store import Store, database_name, sync_client
from agentrl.store.models import RunStatus, RunValues
from agentrl.store.runs import RunValuesConflict
from agentrl.train import main as train_main
from agentrl.training.config import TrainConfig
from rollout_fixtures import agentrl_cmd, run_env
from trainer_fixtures import trainer_args


def _database(db_uri: str) -> dict[str, list[dict]]:
    """Every document of every collection of the test's database."""
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        return {name: list(db[name].find(sort=[("_id", 1)])) for name in sorted(db.list_collection_names())}
    finally:
        client.close()


async def test_the_first_sampler_records_the_values_and_later_ones_take_them(db_uri: str) -> None:
    async with Store(db_uri) as store:
        first = await agree_run_values(store, db_uri, SamplerConfig(train_batch_size=8))
        later = await agree_run_values(store, db_uri, SamplerConfig())
        run = await store.runs.get()
        evaluation = await agree_run_values(store, db_uri, SamplerConfig(split="eval", train_batch_size=3))
    assert run.name == database_name(db_uri)
    assert run.values == RunValues(train_batch_size=8, max_staleness=1, temperature=1.0)
    assert (first.train_batch_size, later.train_batch_size, later.max_staleness) == (8, 8, 1)
    assert evaluation.train_batch_size == 3  # samplers of other splits do not take part


async def test_flags_not_given_take_the_runs_values(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {"train_batch_size": 4, "max_staleness": None, "temperature": 0.7})
        config = await agree_run_values(store, db_uri, SamplerConfig())
    assert (config.train_batch_size, config.max_staleness, config.rollout.temperature) == (4, None, 0.7)


async def test_a_contradiction_names_both_values_and_writes_nothing(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {"train_batch_size": 32})
        before = _database(db_uri)
        with pytest.raises(RunValuesConflict, match=r"--train_batch_size 8 differs from the run's train_batch_size "
                                                    r"32.*--temperature 0.5 differs from the run's temperature 1"):
            await store.runs.agree("demo", {"train_batch_size": 8, "temperature": 0.5})
        assert _database(db_uri) == before
        run = await store.runs.agree("demo", {"train_batch_size": 32, "max_staleness": 1})  # the same values
    assert run.values.train_batch_size == 32 and run.config == {}


async def test_a_run_created_before_values_were_recorded_gets_them_once(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.get_or_create("old", {"lr": 1e-6})
        run = await store.runs.agree("old", {"max_staleness": 3})
        with pytest.raises(RunValuesConflict, match="--max_staleness 2 differs from the run's max_staleness 3"):
            await store.runs.agree("old", {"max_staleness": 2})
    assert run.values == RunValues(max_staleness=3) and run.config == {"lr": 1e-6}


async def test_a_run_a_sampler_created_gets_the_trainers_snapshot_once(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {})
        first = await store.runs.get_or_create("demo", {"learning_rate": 1e-3})
        second = await store.runs.get_or_create("demo", {"learning_rate": 5.0})
    assert first.config == second.config == {"learning_rate": 1e-3}


async def test_the_sampler_cli_refuses_a_contradicting_flag_with_both_values(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree("demo", {})
    before = _database(db_uri)
    done = subprocess.run(agentrl_cmd("sample", "--db_connection_string", db_uri, "--train_batch_size", "8",
                                      "--max_staleness", "1", "--exit_when_done", "true"),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--train_batch_size 8 differs from the run's train_batch_size 16" in done.stderr
    assert "max_staleness" not in done.stderr  # given, and the same as the run's
    assert _database(db_uri) == before


def test_the_trainers_given_values() -> None:
    assert TrainConfig().run_values(dp_size=2) == {}
    assert TrainConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2).run_values(dp_size=2) == {
        "train_batch_size": 16}
    assert TrainConfig(train_batch_size=6, max_staleness=None).run_values(dp_size=2) == {
        "train_batch_size": 6, "max_staleness": None}
    assert TrainConfig(sync_sampling=True).run_values(dp_size=1) == {"max_staleness": 0}
    assert TrainConfig(preferred_sampling_params={"temperature": 0.7}).run_values(dp_size=1) == {"temperature": 0.7}


@pytest.mark.parametrize(("recorded", "flags", "message"), [
    ({"train_batch_size": 4}, ["--train_batch_size", "2"], "--train_batch_size 2 differs from the run's "
                                                           "train_batch_size 4"),
    ({"temperature": 0.0}, [], "records temperature 0 (greedy samplers): the trainer divides its logits"),
])
async def test_the_trainer_refuses_a_contradicting_flag_and_leaves_the_run_as_it_was(
        recorded: dict, flags: list[str], message: str, db_uri: str, tiny_model_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    async with Store(db_uri) as store:
        await store.runs.agree(database_name(db_uri), recorded)
        await store.runs.set_status(RunStatus.RUNNING)
    before = _database(db_uri)
    status = train_main(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", *flags, "--max_steps", "1"))
    assert status == 2
    assert message in caplog.text
    assert _database(db_uri) == before  # not marked failed: the run is not this trainer's to fail
