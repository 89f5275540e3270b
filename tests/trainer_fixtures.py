"""Helpers for the trainer tests: made-up multi-turn trajectories merged into DBRecordData, and trainer runs.

Trajectories are built the way the samplers' group stage builds them: LLM calls (``CallTokens``) with random
token ids, a group baseline over random rewards (``agentrl.trajectory.advantages``) and prefix merging
(``agentrl.trajectory.merge``). Their behaviour logprobs are the tiny model's own logprobs (computed with one causal
pass, as an engine serving the same weights would return them), so a trainer step that starts from the same
weights sees a logprob mismatch near 0 and importance ratios of 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from agentrl.store import DBRecordData, Store, sync_client, with_database
from agentrl.trajectory.advantages import AdvantageConfig, call_advantages, group_advantages
from agentrl.trajectory.merge import CallTokens, merge_trajectory

VOCAB_LOW, VOCAB_HIGH = 100, 4000  # ordinary tokens of the embedded tokenizer
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _behaviour_logprobs(model: torch.nn.Module, input_ids: list[int], **model_kwargs) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([input_ids])
        logprobs = torch.log_softmax(model(input_ids=ids, **model_kwargs).logits[0, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [0.0] + picked.tolist()


def make_samples(model_dir: Path, groups: int, group_size: int = 4, *, seed: int = 0, turns: int = 2,
                 weight_version: int = 0, prefix: str = "g", per_turn: bool = False) -> list[DBRecordData]:
    """``groups × group_size`` trajectories of ``turns`` calls each, as queued DBRecordData (one per trajectory);
    ``per_turn``: each turn's advantage differs from the others' (as a per-turn ``--adv_estimator`` gives)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = AdvantageConfig(drop_zero_advantage=False)
    samples: list[DBRecordData] = []
    for g in range(groups):
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        rewards[0], rewards[-1] = 1.0, 0.0  # never a zero-variance group
        for member, advantage in enumerate(group_advantages(rewards, config)):
            calls, previous = [], None
            for turn in range(turns):
                def tokens(n: int) -> list[int]:
                    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

                output = tokens(rng.randint(3, 7))
                calls.append(CallTokens(
                    call_id=f"{prefix}{g}/{member}/{turn}", output_ids=output, output_logprobs=[0.0] * len(output),
                    input_ids=tokens(rng.randint(6, 12)) if previous is None else None,
                    previous_call_id=previous, prompt_delta_ids=tokens(rng.randint(2, 5)) if previous else (),
                    weight_version=weight_version))
                previous = calls[-1].call_id
            per_call = call_advantages([advantage + 0.5 * (t - (turns - 1) / 2) for t in range(turns)] if per_turn
                                       else advantage, [c.status for c in calls], config)
            calls = [dataclasses.replace(c, advantage=a) for c, a in zip(calls, per_call)]
            (merged,) = merge_trajectory(calls).samples
            behaviour = _behaviour_logprobs(model, merged.input_ids)
            logprobs = [lp if m else 0.0 for lp, m in zip(behaviour, merged.loss_mask)]
            record_id = f"{prefix}{g}/{member}/0"
            samples.append(DBRecordData(
                id=f"{record_id}#b0", record_id=record_id, task_id=f"{prefix}{g}", seq=0,
                input_ids=merged.input_ids, loss_mask=merged.loss_mask, logprobs=logprobs, versions=merged.versions,
                advantages=merged.advantages, reward=rewards[member], turn_boundaries=merged.turn_boundaries,
                num_tokens=merged.num_tokens))
    return samples


def make_vision_samples(model_dir: Path, pictured: Sequence[bool], *, seed: int = 0, prefix: str = "v"
                        ) -> tuple[list[DBRecordData], list]:
    """One single-turn trajectory per entry of ``pictured`` for the tiny vision-language model at ``model_dir``
    (those marked True show a random picture of 56×56 or 84×56 pixels, its ``<|image_pad|>`` run expanded, the
    others are text only), as queued DBRecordData with the model's own logprobs (it sees the pictures); returns
    ``(samples, pictures)`` (``LoadedImage``s, to store in GridFS)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from agentrl.vision.images import load_image
    from agentrl.vision.processor import VisionProcessor

    rng = random.Random(seed)
    processor = VisionProcessor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples, pictures = [], []
    for index, with_picture in enumerate(pictured):
        def tokens(n: int) -> list[int]:
            return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

        prompt, images = tokens(rng.randint(3, 6)), []
        if with_picture:
            pixels = np.random.default_rng(seed * 1000 + index).integers(0, 255, (56, rng.choice((56, 84)), 3),
                                                                         dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, "PNG")
            images = [load_image(buffer.getvalue(), f"picture {index}")]
            prompt = processor.expand(prompt + processor.placeholder + tokens(2),
                                      [processor.image_tokens(images[0])])
        output = tokens(rng.randint(3, 6))
        input_ids = prompt + output
        loss_mask = [0] * len(prompt) + [1] * len(output)
        extra = {}
        if images:
            inputs = processor.inputs(images)
            extra = {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.image_grid_thw,
                     "mm_token_type_ids": (torch.tensor([input_ids]) == processor.image_token_id).int()}
        behaviour = _behaviour_logprobs(model, input_ids, **extra)
        record_id = f"{prefix}{index}/0/0"
        samples.append(DBRecordData(
            id=f"{record_id}#b0", record_id=record_id, task_id=f"{prefix}{index}", seq=0, input_ids=input_ids,
            loss_mask=loss_mask, logprobs=[lp if m else 0.0 for lp, m in zip(behaviour, loss_mask)],
            versions=[0 if m else -1 for m in loss_mask], advantages=[(1.0 if index % 2 else -1.0) if m else 0.0
                                                                      for m in loss_mask],
            reward=float(index % 2), turn_boundaries=[0], num_tokens=len(input_ids),
            images=[image.sha256 for image in images]))
        pictures += images
    return samples, pictures


def sft_samples(count: int, *, seed: int = 0, length: int = 24, prefix: str = "sft") -> list[DBRecordData]:
    """``count`` copies-with-new-ids of a few fixed token sequences, loss on their second half (SFT data)."""
    rng = random.Random(seed)
    patterns = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(2)]
    samples = []
    for i in range(count):
        ids = patterns[i % len(patterns)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        samples.append(DBRecordData(
            id=f"{prefix}{i}", record_id=f"{prefix}-record{i}", task_id="sft", seq=i + 1, input_ids=ids,
            loss_mask=mask, logprobs=[0.0] * length, versions=[-1] * length, advantages=[0.0] * length,
            turn_boundaries=[0], num_tokens=length))
    return samples


async def enqueue(db_uri: str, samples: Sequence[DBRecordData], *, services: Sequence[str] = (),
                  pictures: Sequence = ()) -> None:
    """Queue ``samples``, their ``pictures`` (``LoadedImage``s) stored first; register ``services`` (base URLs, e.g.
    an SGLang stand-in's) as SGLang services."""
    async with Store(db_uri) as store:
        for picture in pictures:
            await store.images.put(picture)
        assert await store.samples.enqueue(list(samples)) == len(samples)
        for url in services:
            await store.services.register(url, kind="sglang")


def trainer_args(db_uri: str, model_dir: Path, output_dir: Path, *extra: str, dtype: str | None = "float32"
                 ) -> list[str]:
    """Flags every test run shares: tiny model, one thread, fast polling, a visible learning rate, and fp32 compute
    (tests compare with fp32 references; ``dtype=None`` leaves the precision to the trainer's default or ``extra``)."""
    precision = ["--dtype", dtype] if dtype and "--bf16" not in extra and "--dtype" not in extra else []
    return ["--db_connection_string", db_uri, "--model_name_or_path", str(model_dir), "--output_dir",
            str(output_dir), "--num_threads", "1", "--poll_interval_s", "0.2", "--learning_rate", "1e-3",
            "--seed", "0", *precision, *extra]


def start_trainer(args: Sequence[str], *, launcher: Sequence[str] = (), env: dict[str, str] | None = None
                  ) -> subprocess.Popen:
    """``python -m agentrl.train ARGS`` (or ``LAUNCHER -m agentrl.train ARGS``) as a subprocess, output piped;
    ``env`` adds environment variables (e.g. ``AGENTRL_FAILPOINTS``)."""
    command = list(launcher) or [sys.executable]
    return subprocess.Popen([*command, "-m", "agentrl.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **TRAINER_ENV, **(env or {})})


def run_trainer(args: Sequence[str], *, launcher: Sequence[str] = (), timeout_s: float = 180.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    process = start_trainer(args, launcher=launcher, env=env)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"the trainer did not finish in {timeout_s}s:\n{output}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def train_here(args: Sequence[str], caplog: pytest.LogCaptureFixture) -> tuple[int, str]:
    """``agentrl.train.main(args)`` in this process — a resumed, control or reference run: only a crash, a signal or
    a launcher needs a process of its own, and a trainer process spends ~4 CPU-seconds importing — with the
    ``agentrl`` log captured: ``(exit code, log)``. A flag error's ``SystemExit`` gives its code (argparse's message
    is on stderr: ``capsys``)."""
    from agentrl.train import main

    with caplog.at_level(logging.INFO, logger="agentrl"):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return int(code or 0), caplog.text


def train_uninterrupted(mongo_server_uri: str, samples: Sequence[DBRecordData], model_dir: Path, output_dir: Path,
                        *flags: str, launcher: Sequence[str] = ()) -> subprocess.CompletedProcess | None:
    """A reference run: the trainer on ``samples`` in a database of its own (dropped afterwards), in this process,
    or as ``launcher -m agentrl.train`` when a launcher is given (its completed process is returned)."""
    from agentrl.train import main

    uri = with_database(mongo_server_uri, "t_" + uuid.uuid4().hex[:12])
    asyncio.run(enqueue(uri, samples))
    try:
        if launcher:
            return run_trainer(trainer_args(uri, model_dir, output_dir, *flags), launcher=launcher)
        assert main(trainer_args(uri, model_dir, output_dir, *flags)) == 0
        return None
    finally:
        admin = sync_client(mongo_server_uri)
        admin.drop_database(uri.rsplit("/", 1)[1])
        admin.close()


def check_trainer_logprobs(docs: Sequence[dict], *, published: bool) -> None:
    """Every trained sample keeps the trainer's logprobs, token-aligned with the engine's, 0 off the loss tokens,
    under the policy version of its step (``published``: a version per step; else version 0 for step 1 and none
    after, when the weights have moved without a publish); the samples of step 1 were
    sampled by the policy that trained them, so there the two agree (``make_samples`` gives the tiny model's own
    logprobs), and after the first update they differ."""
    assert docs
    for doc in docs:
        expected = doc["claimed_step"] - 1 if published else (0 if doc["claimed_step"] == 1 else None)
        assert doc["trainer_version"] == expected, doc["_id"]
        assert len(doc["trainer_logprobs"]) == len(doc["logprobs"]), doc["_id"]
        assert all(t == 0.0 for t, m in zip(doc["trainer_logprobs"], doc["loss_mask"]) if not m), doc["_id"]
        gaps = [abs(t - e) for t, e, m in zip(doc["trainer_logprobs"], doc["logprobs"], doc["loss_mask"]) if m]
        assert (max(gaps) < 1e-4) if doc["claimed_step"] == 1 else (max(gaps) > 1e-4), (doc["_id"], max(gaps))


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
