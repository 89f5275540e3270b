"""Weight publishing to a live ``agentrl engine``: the engine switches to each new version and serves exactly the
trainer's weights; Run.policy_version follows; a dead registered service is reported by name, not fatal; an engine
that starts during a run serves the Run's published weights before samplers can pick it; crashes while replacing
published weights are recovered."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from agentrl.failpoints import ENV, EXIT_CODE
from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineStartError
from agentrl.store import Store, sync_client
from agentrl.train import main
from inference_fixtures import start_engine
from trainer_fixtures import enqueue, make_samples, run_trainer, train_here, trainer_args

pytestmark = pytest.mark.slow(start_rank=5)

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def test_publishing_switches_a_live_engine_to_the_trainers_weights(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    dead = f"http://127.0.0.1:{_closed_port()}"
    try:
        client = sync_client(db_uri)
        deadline = time.monotonic() + 30
        while client.get_default_database().InferenceService.count_documents({}) != 1:
            assert time.monotonic() < deadline, "the engine did not register"
            time.sleep(0.1)
        client.close()

        # a registered service that is down: publishing must go on
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2), services=[dead]))
        out = tmp_path / "out"
        with caplog.at_level(logging.ERROR, logger="agentrl.training.publish"):
            assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                                     "--save_steps", "0", "--publish_retries", "0")) == 0

        async def served() -> tuple[str, list[int], list[float]]:
            async with SGLangClient(engine.url) as client:
                info = await client.get_model_info()
                result = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            return info.weight_version, result.output_ids, result.output_token_logprobs

        version, output_ids, engine_logprobs = asyncio.run(served())
    finally:
        engine.stop()

    assert version == "2"
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        assert db.Run.find_one()["policy_version"] == 2
        metrics = {d["step"]: d["values"] for d in db.Metric.find()}
    finally:
        client.close()
    assert [metrics[s]["publish_failures"] for s in (1, 2)] == [1.0, 1.0]
    assert [metrics[s]["policy_version"] for s in (1, 2)] == [1.0, 2.0]
    assert any(dead in record.getMessage() for record in caplog.records), caplog.text

    # the engine's logprobs are those of the published weights (version 2 = the final weights)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "weights" / "2", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
    expected = logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(engine_logprobs), expected, atol=1e-4), (engine_logprobs, expected)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logprobs = torch.log_softmax(base(input_ids=ids).logits[0, :-1], dim=-1)
    base_expected = base_logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    assert not torch.allclose(torch.tensor(engine_logprobs), base_expected, atol=1e-4)  # not the old weights


def test_publishing_adapters_serves_the_trainers_policy_by_name(db_uri: str, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """--lora_publish adapter: each version is a PEFT adapter loaded into the live engine as policy-v<v> (older ones
    unloaded), the Run names the current one, a sampler's pool sends it and stamps its tokens with its version, the
    engine's logprobs are the trainer's merged model's, and an engine that starts later is given the adapter."""
    from transformers import AutoModelForCausalLM

    from agentrl.rollout.inference_pool import InferencePool

    engine = start_engine(tiny_model_dir, "--enable_lora", "--db_connection_string", db_uri,
                          "--heartbeat_interval_s", "1")
    later = None
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
        out = tmp_path / "out"
        assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                                 "--save_steps", "0", "--use_peft", "--lora_target_modules", "all-linear",
                                 "--lora_publish", "adapter", "--keep_published_weights", "1")) == 0
        assert sorted(p.name for p in (out / "weights").iterdir()) == ["2"]
        assert (out / "weights" / "2" / "adapter_config.json").is_file()
        assert not (out / "weights" / "2" / "model.safetensors").exists()

        async def sample(stop_first: bool) -> tuple:
            async with Store(db_uri) as store:
                run = await store.runs.get()
                if stop_first:
                    await asyncio.to_thread(engine.stop)
                    await store.services.mark_down(engine.url)
                pool = InferencePool(store, wait_for_service_s=60)
                try:
                    result, _ = await pool.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True})
                finally:
                    await pool.close()
            async with SGLangClient(later.url if stop_first else engine.url) as client:
                deadline = time.monotonic() + 30
                while True:  # the pruned version's adapter is unloaded in the background
                    try:
                        await client.generate(PROMPT, {"max_new_tokens": 1}, lora_path="policy-v1")
                    except Exception as error:  # noqa: BLE001 - the expected refusal
                        old = str(error)
                        break
                    assert time.monotonic() < deadline, "policy-v1 was not unloaded"
                    await asyncio.sleep(0.2)
            return run, result, old

        run, result, old = asyncio.run(sample(stop_first=False))
        assert (run.policy_version, run.lora_name) == (2, "policy-v2")
        assert result.lora_path == "policy-v2" and result.policy_version == 2 and result.weight_version == "0"
        assert "not loaded: policy-v1" in old

        later = start_engine(tiny_model_dir, "--enable_lora", "--db_connection_string", db_uri,
                             "--heartbeat_interval_s", "1")
        _, again, _ = asyncio.run(sample(stop_first=True))
    finally:
        engine.stop()
        if later is not None:
            later.stop()
    assert again.policy_version == 2 and again.output_ids == result.output_ids

    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + result.output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(final(input_ids=ids).logits[0, :-1], dim=-1)
    expected = logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    for served in (result, again):
        assert torch.allclose(torch.tensor(served.output_token_logprobs), expected, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logprobs = torch.log_softmax(base(input_ids=ids).logits[0, :-1], dim=-1)
    base_expected = base_logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    assert not torch.allclose(torch.tensor(result.output_token_logprobs), base_expected, atol=1e-4)


def test_an_adapter_publish_that_crashed_before_its_bump_is_published_again(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A crash after the engine loaded policy-v2 but before the Run named it: the resumed trainer publishes version
    2 again, and the engine's leftover adapter of that name is replaced, not an error."""
    engine = start_engine(tiny_model_dir, "--enable_lora", "--db_connection_string", db_uri,
                          "--heartbeat_interval_s", "1")
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=3)))
        flags = trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4", "--max_steps", "3",
                             "--max_staleness", "none", "--save_steps", "1", "--use_peft", "--lora_target_modules",
                             "all-linear", "--lora_publish", "adapter", "--publish_retries", "0")
        crashed = run_trainer(flags, env={ENV: "publish.before_bump=exit@2"})
        assert crashed.returncode == EXIT_CODE, crashed.stdout
        code, log = train_here([*flags, "--resume_from_checkpoint", "latest"], caplog)
        assert code == 0 and "resumed from" in log and "did not load them" not in log, log
        client = sync_client(db_uri)
        try:
            run = client.get_default_database().Run.find_one()
        finally:
            client.close()
        assert run["lora_name"] == f"policy-v{run['policy_version']}" and run["policy_version"] >= 3

        async def served() -> str | None:
            async with SGLangClient(engine.url) as client:
                result = await client.generate(PROMPT, {"max_new_tokens": 2}, lora_path=run["lora_name"])
            return result.lora_path

        assert asyncio.run(served()) == run["lora_name"]
    finally:
        engine.stop()
    assert "unloaded LoRA adapter policy-v2" in engine.output, engine.output  # the crashed publish's leftover


def _served(url: str) -> tuple[str, list[int], list[float]]:
    """The engine's weight version, and its greedy continuation of PROMPT with logprobs."""
    async def ask() -> tuple[str, list[int], list[float]]:
        async with SGLangClient(url) as client:
            info = await client.get_model_info()
            result = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        return info.weight_version, result.output_ids, result.output_token_logprobs

    return asyncio.run(ask())


def _assert_logprobs_of(model_dir: Path, output_ids: list[int], served: list[float]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
    expected = logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(served), expected, atol=1e-4), (served, expected)


class _ServiceWatch:
    """Polls the InferenceService collection from a thread: every (service, status, weight_version) seen."""

    def __init__(self, db_uri: str):
        self.seen: set[tuple[str, str, int]] = set()
        self._stop = threading.Event()
        self._client = sync_client(db_uri)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        collection = self._client.get_default_database().InferenceService
        while not self._stop.is_set():
            for doc in collection.find({}, {"status": 1, "weight_version": 1}):
                self.seen.add((doc["_id"], doc["status"], doc.get("weight_version", 0)))
            time.sleep(0.01)

    def stop(self) -> set[tuple[str, str, int]]:
        self._stop.set()
        self._thread.join(10)
        self._client.close()
        return self.seen


def test_a_restarted_engine_serves_the_published_weights_before_samplers_can_pick_it(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """An engine restarted after a run (full weights published in memory: nothing under weights/) registers as
    STARTING, loads the files the finished trainer recorded for the Run's version (``final``) and only then becomes
    UP: it is never pickable with its start-up weights (version 0)."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    restarted = watch = None
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
        out = tmp_path / "out"
        assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                                 "--save_steps", "0", "--weight_transport", "distributed")) == 0
        engine.stop()
        watch = _ServiceWatch(db_uri)
        restarted = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
        version, output_ids, logprobs = _served(restarted.url)
    finally:
        seen = watch.stop() if watch is not None else set()
        engine.stop()
        if restarted is not None:
            restarted.stop()
    assert version == "2"
    states = {(status, weights) for url, status, weights in seen if url == restarted.url}
    assert ("STARTING", 0) in states, seen  # registered while it loaded: publishes reach it, samplers do not
    assert {weights for status, weights in states if status == "UP"} == {2}, seen
    assert not (out / "weights").exists()
    _assert_logprobs_of(out / "final", output_ids, logprobs)


def test_an_engine_restarted_mid_run_waits_for_the_trainer_to_send_the_weights_published_in_memory(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Version 1 went to the engine in memory; the engine restarts while the trainer waits for step 2's samples:
    it has no file to load, stays STARTING (samplers keep off it), and the waiting trainer sends it the weights
    as a new version; then it is UP and serves exactly the trainer's weights."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    restarted = watch = None
    out = tmp_path / "out"
    outcome: list[int] = []
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=1)))
        trainer = threading.Thread(target=lambda: outcome.append(main(trainer_args(
            db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2", "--save_steps", "0",
            "--max_staleness", "none", "--weight_transport", "distributed"))), daemon=True)
        trainer.start()
        _wait_for(db_uri, lambda db: (db.Run.find_one() or {}).get("policy_version") == 1)
        engine.stop()
        watch = _ServiceWatch(db_uri)
        restarted = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
        _wait_for(db_uri, lambda db: db.InferenceService.find_one({"_id": restarted.url, "status": "UP"}))
        pushed, _, _ = _served(restarted.url)
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=1, seed=1, prefix="h")))
        trainer.join(120)
        version, output_ids, logprobs = _served(restarted.url)
    finally:
        seen = watch.stop() if watch is not None else set()
        engine.stop()
        if restarted is not None:
            restarted.stop()
    assert outcome == [0]
    assert pushed == "2", seen  # the trainer published version 2 for it while it waited
    assert version == "3"  # step 2's publish reached it in memory
    states = {(status, weights) for url, status, weights in seen if url == restarted.url}
    assert ("STARTING", 0) in states and {w for status, w in states if status == "UP"} >= {2}, seen
    assert not (out / "weights").exists()  # nothing went through disk
    final = out / "final"
    assert final.is_dir()
    _assert_logprobs_of(final, output_ids, logprobs)


def _wait_for(db_uri: str, condition, timeout_s: float = 90.0) -> None:
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        deadline = time.monotonic() + timeout_s
        while not condition(db):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)
    finally:
        client.close()


def test_an_engine_that_cannot_load_the_runs_published_weights_does_not_serve(db_uri: str, tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    async def published_elsewhere() -> None:
        async with Store(db_uri) as store:
            await store.runs.get_or_create("run")
            await store.runs.bump_policy_version(str(tmp_path / "weights" / "1"), expected=0)

    asyncio.run(published_elsewhere())
    with pytest.raises(EngineStartError) as failed:
        start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    assert "cannot serve the run's published policy version 1" in str(failed.value), failed.value
    assert str(tmp_path / "weights" / "1") in str(failed.value)
    client = sync_client(db_uri)
    try:
        assert [d["status"] for d in client.get_default_database().InferenceService.find()] == ["DOWN"]
    finally:
        client.close()


def test_a_crash_while_replacing_published_weights_is_recovered(db_uri: str, tiny_model_dir: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The ``weights.replace`` failpoints: a resumed trainer publishes again a version whose directory a crashed
    publish left (``publish.before_bump``), and is killed after renaming that directory aside, then after putting the
    new one in place. Meanwhile the Run's weights stay loadable (a restarted engine catches up to them); the next
    resume publishes, leaves no renamed-aside or temporary directory, and every engine serves the final weights."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    restarted = None
    out = tmp_path / "out"
    weights = out / "weights"
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=3)))
        flags = trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "3",
                             "--max_staleness", "none", "--save_steps", "1", "--publish_retries", "0",
                             "--weight_transport", "disk")
        resume = [*flags, "--resume_from_checkpoint", "latest"]
        assert run_trainer(flags, env={ENV: "publish.before_bump=exit@2"}).returncode == EXIT_CODE
        assert sorted(p.name for p in weights.iterdir()) == ["1", "2"]  # 2 loaded by the engine, not in the Run

        crashed = run_trainer(resume, env={ENV: "weights.replace.after_aside=exit"})
        assert crashed.returncode == EXIT_CODE, crashed.stdout
        assert sorted(p.name for p in weights.iterdir()) == [".2.old", ".2.tmp", "1"]
        assert all((weights / name / "config.json").is_file() for name in (".2.old", ".2.tmp"))
        restarted = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
        assert _served(restarted.url)[0] == "1"  # the Run's version, from its untouched directory

        crashed = run_trainer(resume, env={ENV: "weights.replace.after_rename=exit"})
        assert crashed.returncode == EXIT_CODE, crashed.stdout
        assert sorted(p.name for p in weights.iterdir()) == [".2.old", "1", "2"]

        code, log = train_here(resume, caplog)
        assert code == 0 and "resumed from" in log, log  # the log is captured: the next line can fail
        assert "did not load them" not in log and "policy probe" not in log, log
        client = sync_client(db_uri)
        try:
            run = client.get_default_database().Run.find_one()
        finally:
            client.close()
        # the finished trainer recorded its final model as the files of the last version
        assert run["policy_version"] == 4 and run["weights_path"] == str((out / "final").resolve())
        assert run["weights_version"] == 4
        assert sorted(p.name for p in weights.iterdir()) == ["3", "4"]
        served = [_served(e.url) for e in (engine, restarted)]
    finally:
        engine.stop()
        if restarted is not None:
            restarted.stop()
    for version, output_ids, logprobs in served:
        assert version == "4"
        _assert_logprobs_of(weights / "4", output_ids, logprobs)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_claimed_and_trained_while_the_last_one_publishes(overlap: bool, db_uri: str,
                                                                          tiny_model_dir: Path, tmp_path: Path) -> None:
    # Every sample is queued up front, so the trainer never waits for one: only --overlap_publish decides whether
    # step N+1 is claimed (and computed) before step N is settled, i.e. served, its Records released, logged.
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=3)))
    assert main(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4", "--max_steps", "3",
                             "--save_steps", "0", "--max_staleness", "none",
                             "--overlap_publish", str(overlap).lower())) == 0
    client = sync_client(db_uri)
    try:
        db = client.get_default_database()
        logged = {d["step"]: d for d in db.Metric.find()}
        docs = list(db.DBRecordData.find())
        run = db.Run.find_one()
    finally:
        client.close()
    assert run["policy_version"] == 3 and {d["status"] for d in docs} == {"trained"}
    for step in (1, 2):
        next_claimed = min(d["claimed_at"] for d in docs if d["claimed_step"] == step + 1)
        assert (next_claimed < logged[step]["created_at"]) is overlap, (step, next_claimed, logged[step])
        assert logged[step]["values"]["policy_version"] == step
        assert 0 <= logged[step]["values"]["publish_wait_s"] <= logged[step]["values"]["publish_s"] + 1


async def test_another_rank_stops_waiting_for_a_publish_rank_0_never_announces(db_uri: str) -> None:
    """A data-parallel rank waits for rank 0's bump of the version it exported; when rank 0's publish failed (the
    Run stays at the old version), the wait ends after ``--ddp_timeout`` with an error naming rank 0, instead of
    polling forever (a launcher that does not kill the other ranks would hang). Driven on the real store; the
    trainer around it is not built (the wait is one coroutine)."""
    from agentrl.training.publish import PublishError
    from agentrl.training.settlement import served_by_main

    async with Store(db_uri) as store:
        await store.runs.get_or_create("run")
        started = time.monotonic()
        with pytest.raises(PublishError, match="rank 0 did not publish weights version 1 within --ddp_timeout 1 s"):
            await asyncio.wait_for(served_by_main(store, 1, timeout_s=1, poll_interval_s=0.1), 30)
    assert time.monotonic() - started < 10
