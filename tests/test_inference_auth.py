"""``agentrl engine``'s API key (SGLang's ``--api-key``): every endpoint but the health checks wants ``Authorization:
Bearer KEY``; the samplers' pool and the trainer's publish send ``$AGENTRL_INFERENCE_API_KEY``; the key is never
printed; an engine reachable from other machines without a key refuses to start."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentrl.inference import InferenceRequestError, SGLangClient
from agentrl.inference.client import API_KEY_ENV
from agentrl.inference.process import EngineProcess
from agentrl.rollout.inference_pool import InferencePool
from agentrl.store import Store, sync_client
from agentrl.train import main
from inference_fixtures import start_engine
from trainer_fixtures import enqueue, make_samples, trainer_args

pytestmark = pytest.mark.slow

KEY = "k3y-of-the-test-0123456789"
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2]


@pytest.fixture
def guarded(db_uri: str, tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """A registered engine whose key comes from the environment (a command line is visible to other users)."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1",
                          env={API_KEY_ENV: KEY})
    try:
        yield engine
    finally:
        engine.stop()
        assert KEY not in engine.output


async def test_every_endpoint_but_health_wants_the_key(guarded: EngineProcess, tmp_path: Path) -> None:
    calls = [("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}),
             ("POST", "/update_weights_from_disk", {"model_path": str(tmp_path)}),
             ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}),
             ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
             ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                     "world_size": 2, "group_name": "g", "backend": "gloo"}),
             ("POST", "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                           "group_name": "g"}),
             ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
             ("POST", "/begin_weight_update", {}), ("POST", "/end_weight_update", {}),
             ("POST", "/release_memory_occupation", {}), ("GET", "/get_model_info", None),
             ("POST", "/flush_cache", None),
             ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})]
    async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path, body in calls:
                response = await http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                assert "Unauthorized" in response.json()["error"]["message"]
        for path in ("/health", "/health_generate"):
            assert (await http.get(path)).status_code == 200
        answered = await http.post("/generate", json=calls[0][2], headers={"Authorization": f"Bearer {KEY}"})
        assert answered.status_code == 200 and answered.json()["meta_info"]["completion_tokens"] == 1
        info = await http.get("/get_model_info", headers={"Authorization": f"Bearer {KEY}"})
        assert info.json()["weight_version"] == "0"  # no request without the key changed anything
    async with SGLangClient(guarded.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(InferenceRequestError) as refused:
            await client.generate(PROMPT, {"max_new_tokens": 1})
    assert refused.value.status_code == 401


def test_the_samplers_and_the_trainer_send_the_key(guarded: EngineProcess, db_uri: str, tiny_model_dir: Path,
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)

    async def sample() -> list[int]:
        async with Store(db_uri) as store:
            pool = InferencePool(store, wait_for_service_s=30)
            try:
                result, _ = await pool.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True})
            finally:
                await pool.close()
        return result.output_ids

    assert len(asyncio.run(sample())) == 3
    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=1)))
    out = tmp_path / "out"  # the weights go in memory: the group's calls carry the key too
    assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "1",
                             "--save_steps", "0", "--publish_retries", "0", "--weight_transport", "distributed")) == 0
    assert not (out / "weights").exists()
    client = sync_client(db_uri)
    try:
        values = client.get_default_database().Metric.find_one({"step": 1})["values"]
    finally:
        client.close()
    assert values["publish_failures"] == 0.0 and values["policy_probe_failures"] == 0.0, values
    assert values["policy_probe_services"] == 1.0


def test_an_engine_reachable_from_other_machines_needs_a_key(tiny_model_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "agentrl.cli.main", "engine", "--model_name_or_path",
                           str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0", "--no_register"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != API_KEY_ENV})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--host 0.0.0.0 is reachable from other machines" in done.stderr and API_KEY_ENV in done.stderr
