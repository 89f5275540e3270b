"""The policy probe after each publish (``agentrl.training.policy_probe``): real ``agentrl engine`` processes whose
weight or adapter update fails *silently* — the engine answers success but keeps serving other weights — are
found by their logprobs of the probe sequence, reported by name, counted in the step's metrics, kept off the
samplers and shown on the dashboard, while a healthy engine next to them passes.

The silent failures are the engine's "return" failpoints (``agentrl.failpoints``): the real update path runs and
answers as usual, only the swap of the weights (or the adapter's layers) is skipped. No real failure of our engine
produces this (it checks every parameter name and shape), but SGLang's silent cases do (verl#7495, unsloth#8701,
ms-swift#9855), and this is the closest real process to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentrl.failpoints import ENV, failpoint, reset
from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineProcess
from agentrl.store import InferenceService, Store, database_name, sync_client
from agentrl.store.summary import run_summary
from agentrl.train import main
from inference_fixtures import start_engine
from trainer_fixtures import enqueue, make_samples, train_here, trainer_args

pytestmark = pytest.mark.slow

LEARNING_RATE = "0.2"  # one step must move the tiny model's logprobs well past the default bound


def _engines(db_uri: str, model_dir: Path, *flags: str, failpoint: str) -> tuple[EngineProcess, EngineProcess]:
    """A healthy engine and one with ``failpoint`` enabled, both registered in the run's database."""
    register = ("--db_connection_string", db_uri, "--heartbeat_interval_s", "1", *flags)
    healthy = start_engine(model_dir, *register)
    try:
        faulty = start_engine(model_dir, *register, env={ENV: failpoint})
    except BaseException:
        healthy.stop()
        raise
    return healthy, faulty


def _train_one_step(db_uri: str, model_dir: Path, out: Path, caplog: pytest.LogCaptureFixture, *flags: str
                    ) -> dict[str, float]:
    asyncio.run(enqueue(db_uri, make_samples(model_dir, groups=1)))
    with caplog.at_level(logging.ERROR, logger="agentrl.training.publish"):
        assert main(trainer_args(db_uri, model_dir, out, "--train_batch_size", "4", "--max_steps", "1",
                                 "--save_steps", "0", "--learning_rate", LEARNING_RATE, *flags)) == 0
    client = sync_client(db_uri)
    try:
        return client.get_default_database().Metric.find_one({"step": 1})["values"]
    finally:
        client.close()


def _check_verdicts(db_uri: str, healthy: EngineProcess, faulty: EngineProcess, values: dict[str, float],
                    caplog: pytest.LogCaptureFixture) -> None:
    """The faulty engine failed the probe, the healthy one passed, and samplers now see the healthy one only."""
    assert values["policy_probe_services"] == 2.0 and values["policy_probe_failures"] == 1.0, values
    assert values["policy_probe_max_mean_abs_diff"] > 0.1, values
    assert values["publish_failures"] == 0.0  # the faulty engine answered the update with success
    parts = [values[f"publish_{part}_s"] for part in ("export", "load", "probe")]
    assert min(parts) > 0 and sum(parts) <= values["publish_s"], values  # where the publish's time went
    errors = [r.getMessage() for r in caplog.records if "policy probe" in r.getMessage()]
    assert len(errors) == 1 and faulty.url in errors[0] and "exceeds" in errors[0], errors

    time.sleep(2.5)  # heartbeats (every second) keep both engines UP: the verdict must outlast them
    assert asyncio.run(_live(db_uri)) == [healthy.url]
    client = sync_client(db_uri)
    try:
        docs = {d["_id"]: InferenceService.from_mongo(d) for d in client.get_default_database().InferenceService.find()}
    finally:
        client.close()
    good, bad = docs[healthy.url], docs[faulty.url]
    assert str(bad.status) == "UP" and bad.policy_probe is not None and not bad.policy_probe.ok
    assert bad.policy_probe.version == 1 and "exceeds" in bad.policy_probe.error
    assert good.policy_probe is not None and good.policy_probe.ok and good.policy_probe.mean_abs_diff < 1e-3


async def _live(db_uri: str) -> list[str]:
    async with Store(db_uri) as store:
        return [s.id for s in await store.services.live()]


def _dashboard_shows(db_uri: str, faulty_url: str) -> None:
    """The run page's services table names the failed check, and the probe curve is drawn."""
    from agentrl.dashboard.app import create_app

    client = sync_client(db_uri)
    try:
        run = database_name(db_uri)
        summary = run_summary(client.get_default_database())
        assert {s["id"]: s["state"] for s in summary["services"]}[faulty_url] == "probe-failed"
        page = TestClient(create_app(client, default_database=run)).get(f"/runs/{run}")
    finally:
        client.close()
    assert page.status_code == 200
    row = next(line for line in page.text.splitlines() if faulty_url in line)
    assert "probe-failed" in page.text and "exceeds" in page.text, row
    assert "policy probe after publish" in page.text


def test_an_engine_that_ignores_the_publish_fails_the_probe(db_uri: str, tiny_model_dir: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    healthy, faulty = _engines(db_uri, tiny_model_dir, failpoint="engine.update_weights.swap=return@1")
    try:
        values = _train_one_step(db_uri, tiny_model_dir, tmp_path / "out", caplog)

        async def versions() -> list[str | None]:
            infos = []
            for engine in (healthy, faulty):
                async with SGLangClient(engine.url) as client:
                    infos.append((await client.get_model_info()).weight_version)
            return infos

        assert asyncio.run(versions()) == ["1", "1"]  # the faulty engine claims the version it did not load
        _check_verdicts(db_uri, healthy, faulty, values, caplog)
        _dashboard_shows(db_uri, faulty.url)

        # the verdict belongs to the process: restarted, the engine loads the published weights itself (as any
        # engine joining a run) and is picked again
        faulty.stop()
        faulty = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--port", faulty.url.rsplit(":")[-1])
        assert sorted(asyncio.run(_live(db_uri))) == sorted([healthy.url, faulty.url])
    finally:
        healthy.stop()
        faulty.stop()


def test_an_adapter_that_was_not_applied_fails_the_probe(db_uri: str, tiny_model_dir: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    healthy, faulty = _engines(db_uri, tiny_model_dir, "--enable_lora",
                               failpoint="engine.load_lora_adapter.apply=return@1")
    try:
        values = _train_one_step(db_uri, tiny_model_dir, tmp_path / "out", caplog, "--use_peft",
                                 "--lora_target_modules", "all-linear", "--lora_publish", "adapter")

        async def adapters() -> list[dict]:
            loaded = []
            for engine in (healthy, faulty):
                async with SGLangClient(engine.url) as client:  # both list the adapter as loaded
                    result = await client.generate([1, 2, 3], {"max_new_tokens": 1}, lora_path="policy-v1")
                    loaded.append(result.lora_path)
            return loaded

        assert asyncio.run(adapters()) == ["policy-v1", "policy-v1"]
        _check_verdicts(db_uri, healthy, faulty, values, caplog)
    finally:
        healthy.stop()
        faulty.stop()


def test_return_fires_once_and_only_where_an_operation_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "engine.update_weights.swap=return@2")
    reset()
    try:
        assert [failpoint("engine.update_weights.swap") for _ in range(3)] == [False, True, False]
        monkeypatch.setenv(ENV, "publish.before_bump=return")
        reset()
        with pytest.raises(ValueError, match="only engine.load_lora_adapter.apply, engine.update_weights.swap take"):
            failpoint("publish.before_bump")
    finally:
        monkeypatch.delenv(ENV)
        reset()


def test_when_every_service_fails_the_probe_the_trainer_publishes_again_then_stops_the_run(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The only service (an SGLang stand-in: no model, fixed logprobs) never serves the trainer's policy: no sampler
    may use it, so no sample would ever come. The trainer publishes once more, then stops with a clear error
    instead of waiting for samples forever."""
    from sglang_standin import StandInProcess

    with StandInProcess(reply_ids=[5, 6, 2]) as standin:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=4), services=[standin.url]))
        code, log = train_here(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4",
                                            "--max_steps", "4", "--save_steps", "0", "--max_staleness", "none"), caplog)
        loads = standin.requests("/update_weights_from_disk")
    assert code != 0, log
    assert "publishing the trainer's weights again" in log
    assert "every inference service failed the policy probe after weights version 2, published 2 times" \
        in log and "stopping the run" in log, log
    assert [r["body"]["weight_version"] for r in loads] == ["1", "2"]
