"""Weight reload under load and memory release/resume, against a real ``agentrl engine`` subprocess."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentrl.inference import InferenceRequestError, SGLangClient
from agentrl.inference.process import EngineProcess
from agentrl.inference.tiny_model import build_tiny_model

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}  # workers ask for at most 36 tokens


@pytest.fixture(scope="module")
def engine(launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path) -> Iterator[EngineProcess]:
    process = launch_engine(tiny_model_dir)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output


async def test_update_under_load_keeps_every_request_and_switches_versions(
        engine: EngineProcess, tiny_model_b_dir: Path) -> None:
    results: list[tuple[str, list[int]]] = []
    stop = asyncio.Event()
    async with SGLangClient(engine.url) as client:
        before = await client.generate(PROMPT, GREEDY)
        assert before.weight_version == "0"

        async def worker(index: int) -> None:
            await asyncio.sleep(0.05 * index)  # staggered, with different lengths: requests end at any moment
            while not stop.is_set():
                result = await client.generate(PROMPT, {**GREEDY, "max_new_tokens": 16 + 4 * index})
                results.append((result.weight_version, result.output_ids))

        workers = [asyncio.create_task(worker(i)) for i in range(6)]
        await asyncio.sleep(1.0)
        served_before_update = len(results)
        update = await client.update_weights_from_disk(str(tiny_model_b_dir))
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*workers)  # re-raises any failed request
        after = await client.generate(PROMPT, GREEDY)
        info = await client.get_model_info()

    assert update.success and "weight_version 1" in update.message
    # Whether a request lands inside the millisecond swap of a tiny model is up to timing, so num_paused_requests
    # is not checked here (test_inference_admission.py pins its counting down); what matters is that no request
    # failed and none mixed the two weight sets.
    assert served_before_update > 0
    versions = {version for version, _ in results}
    assert versions == {"0", "1"}, versions
    assert after.weight_version == "1" and info.weight_version == "1"
    assert after.output_ids != before.output_ids
    # Each response was produced by exactly one set of weights: never a mix.
    for version, output_ids in results:
        expected = before.output_ids if version == "0" else after.output_ids
        assert output_ids == expected[: len(output_ids)], version


async def test_failed_updates_keep_the_served_weights(engine: EngineProcess, tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    other_shape = build_tiny_model(tmp_path / "wide", hidden_size=32)
    async with SGLangClient(engine.url) as client:
        reference = await client.generate(PROMPT, GREEDY)
        with pytest.raises(InferenceRequestError, match="do not fit the model"):
            await client.update_weights_from_disk(str(other_shape))
        with pytest.raises(InferenceRequestError, match="not a directory"):
            await client.update_weights_from_disk(str(tmp_path / "missing"))
        unchanged = await client.generate(PROMPT, GREEDY)
        assert (unchanged.output_ids, unchanged.weight_version) == (reference.output_ids, reference.weight_version)
        # an explicit version is reported as given
        named = await client.update_weights_from_disk(str(tiny_model_dir), weight_version=7)
        assert named.success
        assert (await client.generate(PROMPT, GREEDY)).weight_version == "7"


async def test_release_holds_requests_until_resume(engine: EngineProcess) -> None:
    async with SGLangClient(engine.url) as client:
        reference = await client.generate(PROMPT, GREEDY)
        await client.release_memory_occupation()
        assert await client.health()
        assert not await client.health_generate()
        pending = asyncio.create_task(client.generate(PROMPT, GREEDY))
        await asyncio.sleep(1.0)
        assert not pending.done()  # held, not dropped
        resumed_at = time.monotonic()
        await client.resume_memory_occupation()
        result = await asyncio.wait_for(pending, 60)
        assert time.monotonic() >= resumed_at
        assert result.output_ids == reference.output_ids
        assert await client.health_generate()
