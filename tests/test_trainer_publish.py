"""Weight publishing to a live ``agentrl engine``: the engine switches to each new version and serves exactly the
trainer's weights; Run.policy_version follows; a dead registered service is reported by name, not fatal."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest
import torch
from inference_fixtures import start_engine
from trainer_fixtures import enqueue, make_samples, run_trainer, trainer_args

from agentrl.failpoints import ENV, EXIT_CODE

from agentrl.inference import SGLangClient
from agentrl.store import Store, sync_client
from agentrl.train import main


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

        async def prepare() -> None:
            await enqueue(db_uri, make_samples(tiny_model_dir, groups=2))
            async with Store(db_uri) as store:  # a registered service that is down: publishing must go on
                await store.services.register(dead, kind="sglang")

        asyncio.run(prepare())
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
    from agentrl.rollout.inference_pool import InferencePool
    from transformers import AutoModelForCausalLM

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


def test_an_adapter_publish_that_crashed_before_its_bump_is_published_again(db_uri: str, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """A crash after the engine loaded policy-v2 but before the Run named it: the resumed trainer publishes version
    2 again, and the engine's leftover adapter of that name is replaced, not an error."""
    engine = start_engine(tiny_model_dir, "--enable_lora", "--db_connection_string", db_uri,
                          "--heartbeat_interval_s", "1")
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=3)))
        flags = trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", "4", "--max_steps", "3",
                             "--save_steps", "1", "--use_peft", "--lora_target_modules", "all-linear",
                             "--lora_publish", "adapter", "--publish_retries", "0")
        crashed = run_trainer(flags, env={ENV: "publish.before_bump=exit@2"})
        assert crashed.returncode == EXIT_CODE, crashed.stdout
        resumed = run_trainer([*flags, "--resume_from_checkpoint", "latest"])
        assert resumed.returncode == 0, resumed.stdout
        assert "did not load them" not in resumed.stdout, resumed.stdout
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
