"""Environment fixtures: a real TextCraft server (``agentrl envs serve``) and a tiny model taught two TextCraft
episodes, so rollout tests see real episodes with rewards that vary within a group.

The model is trained on the exact token sequences an episode renders (the environment's instruction, the first
observation, the oracle's first action, the real observation, then one of two endings): the oracle's last craft
(reward 1) or ``inventory`` (no reward; with ``--max_turns 2`` the episode ends there). Sampling at temperature 1
picks among the endings, which gives groups with reward variance. Kept in pytest's cache like the scripted model.

Registered as a plugin by ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agentrl.envs.actions import episode_messages, format_action, observation_message
from agentrl.envs.textcraft import spec as textcraft_spec
from agentrl.inference.tiny_model import build_tiny_model
from agentrl.rollout.conversation import TokenConversation
from inference_fixtures import start_engine
from rollout_fixtures import cached_model_dir
from scripted_model import train_on_sequences

EPISODE_TASKS = (0, 3)
"""TextCraft tasks whose oracle is two actions (get logs, craft planks)."""
ENV_MODEL_STEPS = 150


def episode_sequences(tokenizer) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of both endings of every scripted episode, rendered as the episode loop does."""
    spec = textcraft_spec()
    sequences = []
    for data_idx in EPISODE_TASKS:
        oracle = spec.oracle(data_idx)
        for ending in (oracle[-1], "inventory"):
            env = spec.factory()
            try:
                first = env.reset(data_idx)
                conversation = TokenConversation(tokenizer, episode_messages(spec.instruction, first), None)
                ids, mask = list(conversation.prompt_ids), [0] * len(conversation.prompt_ids)
                actions = [*oracle[:-1], ending]
                for index, action in enumerate(actions):
                    text = format_action(action, spec.action_format)
                    out = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    ids, mask = ids + out, mask + [1] * len(out)
                    if index == len(actions) - 1:
                        break
                    delta = conversation.append(out, text, [observation_message(env.step(action).observation)])
                    ids, mask = ids + delta.delta_ids, mask + [0] * len(delta.delta_ids)
            finally:
                env.close()
            sequences.append((ids, mask))
    return sequences


def build_textcraft_model(out_dir: Path, steps: int = ENV_MODEL_STEPS, seed: int = 0) -> Path:
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    path = build_tiny_model(out_dir, seed=seed, hidden_size=128, num_layers=2)
    return train_on_sequences(path, episode_sequences(AutoTokenizer.from_pretrained(path)), steps)


@pytest.fixture(scope="session")
def textcraft_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = (Path(__file__).read_bytes() + (Path(__file__).parent / "scripted_model.py").read_bytes()
              + Path(textcraft_spec.__code__.co_filename).read_bytes())
    return cached_model_dir(request, tmp_path_factory, "textcraft-model", source, build_textcraft_model)


@pytest.fixture(scope="session")
def textcraft_engine_url(textcraft_model_dir: Path) -> Iterator[str]:
    engine = start_engine(textcraft_model_dir)
    try:
        yield engine.url
    finally:
        engine.stop()


@pytest.fixture()
def textcraft_server() -> Iterator[str]:
    """A fresh ``agentrl envs serve textcraft`` on a free loopback port (its instances are the test's own)."""
    from agentrl.envs.local import start_local_server

    url, stop = start_local_server("textcraft")
    try:
        yield url
    finally:
        stop()
