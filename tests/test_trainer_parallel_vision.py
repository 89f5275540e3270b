"""A vision-language policy trained by two FSDP2 ranks on CPU (gloo) gives the weights of one process, also when one
rank's pass has pictures and the other's has none (text-only samples, the empty pass that aligns the ranks): every
rank runs the vision tower in every pass (``agentrl.training.vision_parallel``; without it the ranks' collectives
part and gloo fails). Qwen3-VL's deepstack mergers too; a frozen tower stays as it was; two tensor-parallel ranks
(the language model split, the tower replicated) give the same weights."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import pytest

from agentrl.inference.tiny_model import build_tiny_vision_model
from agentrl.store import sync_client, with_database
from agentrl.train import main
from trainer_fixtures import (
    check_trainer_logprobs,
    enqueue,
    load_weights,
    make_vision_samples,
    max_weight_difference,
    run_trainer,
    trainer_args,
)

pytestmark = pytest.mark.slow(start_rank=10)

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
# 3 samples a step, one per micro-batch: rank 1 runs an empty pass beside rank 0's second (step 1: all pictured);
# step 2 mixes a pictured sample with two text-only ones
PICTURED = (True, True, True, True, False, False)
FLAGS = ("--train_batch_size", "3", "--enable_sampling", "false", "--max_tokens", "1", "--adam_epsilon", "1e-6",
         "--max_steps", "2", "--save_steps", "0")
LORA = ("--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--lora_r", "4", "--lora_dropout", "0")
TOLERANCE = 1e-5  # as for a text model (test_trainer_parallel): fp32 sums in another order


@pytest.fixture
def database(mongo_server_uri: str):
    """Makes databases holding the given samples and pictures (dropped afterwards)."""
    names = []

    def make(samples: list, pictures: list) -> str:
        names.append("t_" + uuid.uuid4().hex[:12])
        uri = with_database(mongo_server_uri, names[-1])
        asyncio.run(enqueue(uri, samples, pictures=pictures))
        return uri

    yield make
    client = sync_client(mongo_server_uri)
    for name in names:
        client.drop_database(name)
    client.close()


def _steps(uri: str) -> list[dict]:
    client = sync_client(uri)
    try:
        return [d["values"] for d in client.get_default_database().Metric.find().sort("step")]
    finally:
        client.close()


def _trained(uri: str) -> list[dict]:
    client = sync_client(uri)
    try:
        return list(client.get_default_database().DBRecordData.find({"claimed_step": {"$ne": None}}))
    finally:
        client.close()


@pytest.mark.parametrize("family, extra", [("qwen2_5_vl", ()), ("qwen3_vl", ("--freeze_vision_tower", "true")),
                                           ("qwen2_5_vl", ("--tp_size", "2")), ("qwen2_5_vl", LORA)],
                         ids=["fsdp2", "qwen3-frozen", "tp", "lora"])
def test_two_ranks_train_a_vision_language_model_as_one_process(
        family: str, extra: tuple[str, ...], database, tmp_path: Path) -> None:
    model = build_tiny_vision_model(tmp_path / "vlm", family=family)
    samples, pictures = make_vision_samples(model, PICTURED)
    single_uri = database(samples, pictures)
    one_process = extra[2:] if extra[:1] == ("--tp_size",) else extra
    assert main(trainer_args(single_uri, model, tmp_path / "single", *FLAGS, *one_process)) == 0

    uri = database(samples, pictures)
    result = run_trainer(trainer_args(uri, model, tmp_path / "two", *FLAGS, *extra),
                         launcher=TORCHRUN, timeout_s=300)
    assert result.returncode == 0, result.stdout[-4000:]
    tensor_parallel = "--tp_size" in extra
    assert ("2 ranks (dp 1 × tp 2)" if tensor_parallel else "2 ranks (dp 2 × tp 1)") in result.stdout
    ours, reference = load_weights(tmp_path / "two" / "final"), load_weights(tmp_path / "single" / "final")
    difference = max_weight_difference(ours, reference)
    assert difference < TOLERANCE, difference
    for step, (mine, theirs) in enumerate(zip(_steps(uri), _steps(single_uri), strict=True), 1):
        for name in ("loss", "grad_norm", "loss_tokens", "samples"):  # rel 1e-4: step 2 follows one of gnorm ~15
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-7), (step, name)
    # each rank's logprobs saw its samples' pictures (a blind forward would miss the engine's by far more)
    docs = _trained(uri)
    assert sorted(d["claimed_rank"] for d in docs) == ([0] * 6 if tensor_parallel else [0, 0, 0, 0, 1, 1])
    check_trainer_logprobs(docs, published=False)

    base = load_weights(model)
    tower = [name for name in base if ".visual." in name or name.startswith("visual.")]
    assert tower
    moved = max(float((ours[name] - base[name]).abs().max()) for name in tower)
    if "--freeze_vision_tower" in extra or extra == LORA:
        assert moved == 0.0  # a frozen tower (or one LoRA leaves out) takes no gradient on any rank
    else:
        assert moved > 1e-4  # the tower trains (the pictured passes' gradients reach it on both ranks)
