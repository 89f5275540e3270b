"""Weight reload under load and memory release/resume, against a real ``agentrl engine`` subprocess."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from agentrl.inference import InferenceRequestError, SGLangClient
from agentrl.inference.client import GenerateResult
from agentrl.inference.process import EngineProcess
from agentrl.inference.protocol import UpdateWeightsFromDiskResponse
from agentrl.inference.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}  # workers ask for at most 36 tokens


@pytest.fixture(scope="module")
def engine(launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path) -> Iterator[EngineProcess]:
    process = launch_engine(tiny_model_dir)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output


async def run_under_load(client: SGLangClient, update: Callable[[], Awaitable[UpdateWeightsFromDiskResponse]]
                         ) -> tuple[list[GenerateResult], UpdateWeightsFromDiskResponse]:
    """Six workers generate without pause (staggered, with different lengths: requests end at any moment) for a
    second before ``update`` and a second after it; returns every result and the update's answer."""
    results: list[GenerateResult] = []
    stop = asyncio.Event()

    async def worker(index: int) -> None:
        await asyncio.sleep(0.05 * index)
        while not stop.is_set():
            results.append(await client.generate(PROMPT, {**GREEDY, "max_new_tokens": 16 + 4 * index}))

    workers = [asyncio.create_task(worker(i)) for i in range(6)]
    await asyncio.sleep(1.0)
    assert results, "no request finished before the update"
    answer = await update()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*workers)  # re-raises any failed request
    return results, answer


async def test_update_under_load_swaps_between_decoding_steps_and_labels_each_token(
        engine: EngineProcess, tiny_model_b_dir: Path) -> None:
    async with SGLangClient(engine.url) as client:
        before = await client.generate(PROMPT, GREEDY)
        assert before.weight_version == "0" and before.weight_version_spans is None
        results, update = await run_under_load(
            client, lambda: client.update_weights_from_disk(str(tiny_model_b_dir)))
        after = await client.generate(PROMPT, GREEDY)
        info = await client.get_model_info()

    assert update.success and "weight_version 1" in update.message and update.num_paused_requests == 0
    assert after.weight_version == "1" and info.weight_version == "1" and after.output_ids != before.output_ids
    straddled = [r for r in results if r.weight_version_spans]
    assert straddled, "no request was running at the swap"
    for result in straddled:  # the old weights' tokens, then the new weights' (on the old KV cache)
        (old, n_old), (new, n_new) = result.weight_version_spans
        assert (old, new, result.weight_version) == ("0", "1", "1") and n_old + n_new == len(result.output_ids)
        assert result.output_ids[:n_old] == before.output_ids[:n_old]
        assert result.policy_version_spans == [(0, n_old), (1, n_new)]
    for result in results:
        if not result.weight_version_spans:  # wholly one version: exactly that version's greedy tokens
            expected = before.output_ids if result.weight_version == "0" else after.output_ids
            assert result.output_ids == expected[: len(result.output_ids)], result.weight_version
    assert {r.weight_version for r in results} == {"0", "1"}


async def test_update_in_drain_mode_lets_running_requests_finish_on_the_old_weights(
        launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    engine = launch_engine(tiny_model_dir, "--weight_update_mode", "drain")
    try:
        async with SGLangClient(engine.url) as client:
            before = await client.generate(PROMPT, GREEDY)
            results, update = await run_under_load(
                client, lambda: client.update_weights_from_disk(str(tiny_model_b_dir)))
            after = await client.generate(PROMPT, GREEDY)
    finally:
        assert engine.stop() == 0, engine.output
    assert update.success and after.weight_version == "1"
    assert {r.weight_version for r in results} == {"0", "1"}
    for result in results:  # each response was produced by exactly one set of weights
        assert result.weight_version_spans is None
        expected = before.output_ids if result.weight_version == "0" else after.output_ids
        assert result.output_ids == expected[: len(result.output_ids)], result.weight_version


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
