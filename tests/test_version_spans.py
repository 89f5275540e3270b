"""A trajectory whose tokens span two policy versions, end to end: a real engine swaps weights while a group's
calls are being generated, each call is stored as the sampler stores it (its version spans next to its tokens),
merged into a training sample with one version per token, trained by the trainer (staleness counted from the
oldest token, the importance ratio from each token's own behaviour logprob), and shown by the dashboard's token
views with both versions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrl.dashboard.tokens import calls_views, sample_view
from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineProcess
from agentrl.store.models import CallStatus, DBRecordData, DispatchedSamplingTask
from agentrl.train import main
from agentrl.training.data import sample_staleness
from agentrl.trajectory.advantages import AdvantageConfig, call_advantages, group_advantages
from agentrl.trajectory.merge import CallTokens, merge_trajectory
from rollout_fixtures import documents
from trainer_fixtures import enqueue, trainer_args

pytestmark = pytest.mark.slow

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
GROUP = 4
ADVANTAGES = AdvantageConfig(drop_zero_advantage=False)


async def generate_across_a_swap(url: str, new_weights: Path) -> list:
    """The group's four calls, with the weights replaced by version 1 while all four run."""
    async with SGLangClient(url) as client:
        running = [asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 400, "temperature": 1.0,
                                                                "ignore_eos": True, "sampling_seed": i}))
                   for i in range(GROUP)]
        await asyncio.sleep(0.3)  # each call takes seconds: 400 tokens, four at a time, on one thread
        await client.update_weights_from_disk(str(new_weights), weight_version=1)
        return await asyncio.gather(*running)


def stored_call(index: int, result) -> DispatchedSamplingTask:
    """The call document the sampler writes for ``result`` (``agentrl.rollout.agent.generate_turn``)."""
    spans = result.policy_version_spans
    return DispatchedSamplingTask(
        id=f"r{index}#0", record_id=f"r{index}", task_id="t", turn=0, input_ids=PROMPT, status=CallStatus.COMPLETED,
        output_ids=result.output_ids, output_logprobs=result.output_token_logprobs, weight_version=spans[0][0],
        weight_version_spans=spans if len(spans) > 1 else None)


def test_a_group_sampled_across_a_weight_swap_is_trained_and_shown_token_by_token(
        launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path, tiny_model_b_dir: Path, db_uri: str,
        tmp_path: Path) -> None:
    engine = launch_engine(tiny_model_dir)
    try:
        results = asyncio.run(generate_across_a_swap(engine.url, tiny_model_b_dir))
    finally:
        assert engine.stop() == 0, engine.output
    calls = [stored_call(i, r) for i, r in enumerate(results)]
    for call in calls:
        (old, n_old), (new, n_new) = call.weight_version_spans
        assert (old, new, call.weight_version) == (0, 1, 0) and n_old > 0 and n_new > 0

    rewards = [1.0, 0.0, 1.0, 0.0]
    samples = []
    for call, reward, advantage in zip(calls, rewards, group_advantages(rewards, ADVANTAGES), strict=True):
        stored = DispatchedSamplingTask.model_validate(call.model_dump())  # as read back from the database
        (per_call,) = call_advantages(advantage, [stored.status], ADVANTAGES)
        (merged,) = merge_trajectory([CallTokens.from_document(stored, per_call)]).samples
        samples.append(DBRecordData(
            id=f"{call.record_id}#b0", record_id=call.record_id, task_id="t", seq=0, input_ids=merged.input_ids,
            loss_mask=merged.loss_mask, logprobs=merged.logprobs, versions=merged.versions,
            advantages=merged.advantages, reward=reward, turn_boundaries=merged.turn_boundaries,
            num_tokens=merged.num_tokens))
    for sample, call in zip(samples, calls, strict=True):
        n_old, n_new = (count for _, count in call.weight_version_spans)
        assert sample.versions == [-1] * len(PROMPT) + [0] * n_old + [1] * n_new
        assert sample_staleness(sample, 1) == 1  # the oldest token counts, not the newest

    asyncio.run(enqueue(db_uri, samples))
    assert main(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", "--train_batch_size", str(GROUP),
                             "--max_steps", "1", "--max_staleness", "1", "--save_steps", "0")) == 0
    trained = documents(db_uri, "DBRecordData")
    assert [s["status"] for s in trained] == ["trained"] * GROUP

    for stored, call in zip(trained, calls, strict=True):
        view = sample_view({**stored, "id": stored["_id"]})  # as the dashboard's queries name it
        (old, n_old), (new, n_new) = call.weight_version_spans
        outputs = slice(len(PROMPT), len(PROMPT) + n_old + n_new)
        assert view["versions"][outputs] == [0] * n_old + [1] * n_new
        assert len(view["trainer_logprobs"]) == len(view["ids"])
        (rebuilt,) = calls_views([call.model_dump()])
        assert rebuilt["versions"] == view["versions"]
