"""The picture demo's parts: the embedded vision-language model (the embedded model with a vision tower), the
picture task sets (answered by the picture alone), their warm-up demonstrations (with the pictures) and the vision
tower's own learning rate."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from agentrl.envs.pictures import BACKGROUND, COLOURS, SHIPPED_SETS, SIZE, generate_picture_tasks
from agentrl.inference.tiny_model import build_tiny_model, build_tiny_vision_model
from agentrl.run.config import TASK_SETS
from agentrl.training.config import TrainConfig
from agentrl.training.errors import TrainerError
from agentrl.training.policy_setup import build_optimizer, vision_setup
from rollout_fixtures import agentrl_cmd, run_env


def _picture(task: dict) -> Image.Image:
    (uri,) = task["images"]
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def _regions(picture: Image.Image) -> list[tuple[str, int, float, float]]:
    """The picture's shapes, read from its pixels: (colour, pixels, centre x, centre y) of each connected region
    that is not background."""
    pixels, names = picture.load(), {rgb: name for name, rgb in COLOURS.items()}
    seen, regions = set(), []
    for start in ((x, y) for y in range(SIZE) for x in range(SIZE)):
        if start in seen or pixels[start] == BACKGROUND:
            continue
        colour, stack, points = pixels[start], [start], []
        seen.add(start)
        while stack:
            x, y = stack.pop()
            points.append((x, y))
            for near in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= near[0] < SIZE and 0 <= near[1] < SIZE and near not in seen and pixels[near] == colour:
                    seen.add(near)
                    stack.append(near)
        regions.append((names[colour], len(points), sum(p[0] for p in points) / len(points),
                        sum(p[1] for p in points) / len(points)))
    return regions


def _answer_from_pixels(task: dict) -> str:
    """What the picture says, by task type, computed here from its pixels."""
    regions, kind = _regions(_picture(task)), task["task_type"]
    if kind == "count":
        return str(len(regions))
    if kind in ("colour_large", "colour_small", "colour_of_larger"):
        return max(regions, key=lambda r: r[1])[0]
    (_, _, x, y), = regions
    if kind == "side":
        return "left" if x < SIZE / 2 else "right"
    return "top" if y < SIZE / 2 else "bottom"


def test_the_picture_tasks_are_answered_by_the_picture_alone() -> None:
    shipped = {name: [json.loads(line) for line in (TASK_SETS / name).read_text().splitlines()]
               for name in SHIPPED_SETS}
    for name, (n, seed, prefix) in SHIPPED_SETS.items():
        assert shipped[name] == generate_picture_tasks(n, seed, prefix), f"{name} is not the generator's output"
    for name, tasks in shipped.items():
        for task in tasks:
            assert _answer_from_pixels(task) == task["answer"], (name, task["id"])
            assert task["demo_response"] == f"The answer is \\boxed{{{task['answer']}}}."
        by_type: dict[str, set[str]] = {}
        for task in tasks:
            by_type.setdefault(task["task_type"], set()).add(task["query"])
        # one question per task type: the text says nothing about the answer
        assert all(len(queries) == 1 for queries in by_type.values()), by_type
        answers = Counter((task["task_type"], task["answer"]) for task in tasks)
        for kind in by_type:  # every answer of a type occurs: a constant answer cannot score well
            options = {answer for (k, answer) in answers if k == kind}
            assert len(options) == {"side": 2, "half": 2, "count": 4}.get(kind, len(COLOURS)), (name, kind, options)
    pictures = {name: {hashlib.sha256(_picture(t).tobytes()).hexdigest() for t in tasks}
                for name, tasks in shipped.items()}
    assert not pictures["pictures_heldout.jsonl"] & (pictures["pictures_rl.jsonl"] | pictures["pictures_warmup.jsonl"])


def test_demonstrations_of_picture_tasks_carry_their_pictures(tmp_path: Path) -> None:
    out = tmp_path / "demos.jsonl"
    done = subprocess.run(agentrl_cmd("sft", "demos", str(TASK_SETS / "pictures_warmup.jsonl"), "--limit", "3",
                                      "--tools", "", "--answer_schema", "boxed", "--out", str(out)),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    tasks = generate_picture_tasks(3, *SHIPPED_SETS["pictures_warmup.jsonl"][1:])
    for demo, task in zip((json.loads(line) for line in out.read_text().splitlines()), tasks, strict=True):
        system, user, answer = demo["messages"]
        picture, text = user["content"]
        assert picture == {"type": "image_url", "image_url": {"url": task["images"][0]}}  # before the text
        assert text == {"type": "text", "text": task["query"]}
        assert answer == {"role": "assistant", "content": task["demo_response"]}
    model = build_tiny_vision_model(tmp_path / "vlm", max_pixels=SIZE * SIZE)
    done = subprocess.run(agentrl_cmd("sft", "upload", str(out), "--model_name_or_path", str(model), "--dry_run"),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 0 and "dry run: 3 conversations" in done.stdout, done.stdout + done.stderr


def test_a_vision_tower_learns_at_its_own_rate(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vision_model(tmp_path / "vlm")
    model = AutoModelForImageTextToText.from_pretrained(path)
    tower = {id(p) for p in model.model.visual.parameters()}
    config = TrainConfig(learning_rate=1e-5, vision_learning_rate=1e-3, weight_decay=0.1)
    assert vision_setup(config, path) is not None
    groups = build_optimizer(config, model).param_groups
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    for group in groups:
        in_tower = {id(p) in tower for p in group["params"]}
        assert len(in_tower) == 1
        assert group["lr"] == (1e-3 if in_tower == {True} else 1e-5)
        assert group["weight_decay"] == (0.1 if group["params"][0].ndim >= 2 else 0.0)
    assert groups[0]["lr"] == 1e-5  # the rate logged is the language model's
    assert {g["lr"] for g in build_optimizer(TrainConfig(learning_rate=1e-5), model).param_groups} == {1e-5}
    with pytest.raises(TrainerError, match="frozen"):
        vision_setup(TrainConfig(vision_learning_rate=1e-3, freeze_vision_tower=True), path)
    text = build_tiny_model(tmp_path / "text")
    with pytest.raises(TrainerError, match="--vision_learning_rate: .* is a text model"):
        vision_setup(TrainConfig(vision_learning_rate=1e-3), text)


@pytest.mark.slow
def test_the_embedded_vision_model_answers_text_as_the_embedded_model_does(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from agentrl.inference.embedded_model import default_model_path
    from agentrl.inference.embedded_vision_model import build_vision_model
    from agentrl.vision.images import load_image
    from agentrl.vision.processor import VisionProcessor

    path = build_vision_model(default_model_path(), tmp_path / "vlm")
    text = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    seeing = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}],
                                           add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected, got = text(input_ids=ids).logits, seeing(input_ids=ids).logits
    assert got.shape[-1] == expected.shape[-1] + 4  # the four vision tokens
    assert torch.equal(got[..., : expected.shape[-1]], expected)
    assert torch.equal(seeing.generate(ids, max_new_tokens=12, do_sample=False),
                       text.generate(ids, max_new_tokens=12, do_sample=False))
    vision = VisionProcessor.of(path)
    assert vision is not None
    tasks = generate_picture_tasks(2)
    pictures = [load_image(base64.b64decode(t["images"][0].split(",", 1)[1]), t["id"]) for t in tasks]
    inputs = vision.inputs(pictures)
    assert inputs.grids() == [(1, 8, 8)] * 2  # 16 image tokens a picture
    with torch.no_grad():
        features = torch.cat(seeing.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw)
                             .pooler_output)
    words = seeing.model.language_model.embed_tokens.weight.norm(dim=-1).mean()
    assert 0.5 < float(features.norm(dim=-1).mean() / words) < 2  # scaled to the text embeddings
    assert not torch.allclose(features[:16], features[16:])  # two pictures, two encodings
