"""A tiny real vision-language model taught one scripted tool-use trajectory with pictures, so that rollout and
training tests see a Qwen2.5-VL agent call a third-party MCP tool that returns an image.

The script: a Task shows :func:`task_picture` and asks whether it matches the reference image; the model calls
``get-tiny-image`` of the MCP project's reference server (``@modelcontextprotocol/server-everything``, npm), whose
result holds a PNG, and answers ``\\boxed{yes}`` or ``\\boxed{no}`` (both endings are trained: sampling picks
among them, which gives groups with reward variance). The sequences are rendered exactly as the agent loop renders
them (``TokenConversation`` with the model's image processor, the tool's picture in the tool message) and trained
with the pictures' pixel values, as :mod:`scripted_model` trains the text model.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from agentrl.inference.tiny_model import build_tiny_vision_model
from agentrl.rollout.conversation import TokenConversation
from agentrl.tools import ToolManager
from agentrl.tools.config import MCPConfig
from agentrl.trajectory.prompting import initial_messages
from agentrl.vision.images import load_image
from agentrl.vision.processor import VisionProcessor

QUESTION = "Does this picture match the reference image? Fetch the reference with the tool."
ANSWER = "yes"
TOOL_CALL = '<tool_call>' + json.dumps({"name": "get-tiny-image", "arguments": {}}) + '</tool_call>'
ENDINGS = ("They match: \\boxed{yes}.", "They differ: \\boxed{no}.")


def task_picture() -> bytes:
    """The Task's picture (PNG, 56 x 56: four image tokens)."""
    pixels = np.random.default_rng(7).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def everything_config(entry: Path) -> MCPConfig:
    """server-everything over stdio, offering only its image tool (its other twelve would make a long prompt)."""
    return MCPConfig.model_validate({"servers": [{"name": "everything", "command": "node",
                                                  "args": [str(entry), "stdio"], "tools": ["get-tiny-image"]}]})


async def _sequences(path: Path, tools: ToolManager) -> list[tuple[list[int], list[int], list]]:
    """``(input_ids, loss_mask, images)`` of both endings, rendered as the agent loop renders them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = VisionProcessor(path)
    picture = load_image(task_picture(), "task picture")
    sequences = []
    for ending in ENDINGS:
        messages, template_tools = initial_messages(
            query=QUESTION, answer_schema="boxed", system_prompt=None, tools=tools.openai_tools(),
            tokenizer=tokenizer, images=[picture.sha256])
        conversation = TokenConversation(tokenizer, messages, template_tools, vision=processor,
                                         pictures={picture.sha256: picture})
        ids, mask = list(conversation.prompt_ids), [0] * len(conversation.prompt_ids)
        call_ids = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += call_ids
        mask += [1] * len(call_ids)
        result = await tools.call_tool("get-tiny-image", {}, images=True)
        assert result.ok and len(result.images) == 1, result
        image = result.images[0]
        conversation.pictures[image.sha256] = image
        delta = conversation.append(call_ids, TOOL_CALL, [{"role": "tool", "name": "get-tiny-image", "content": [
            {"type": "text", "text": result.text}, {"type": "image", "image": image.sha256}]}])
        ids += delta.delta_ids
        mask += [0] * len(delta.delta_ids)
        end_ids = tokenizer(ending, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += end_ids
        mask += [1] * len(end_ids)
        sequences.append((ids, mask, [conversation.pictures[sha] for sha in conversation.images]))
    return sequences


def build_scripted_vision_model(out_dir: Path, entry: Path, steps: int = 100, seed: int = 0) -> Path:
    """Train a tiny Qwen2.5-VL on the script (``entry``: server-everything's ``dist/index.js``) and save it."""
    torch.manual_seed(seed)
    path = build_tiny_vision_model(out_dir, family="qwen2_5_vl", seed=seed, hidden_size=128)

    async def collect() -> list[tuple[list[int], list[int], list]]:
        async with ToolManager(everything_config(entry)) as tools:
            return await _sequences(path, tools)

    return train_on_vision_sequences(path, asyncio.run(collect()), steps)


def babyai_sequences(path: Path) -> list[tuple[list[int], list[int], list]]:
    """BabyAI episodes 0 and 1 with pictures (``agentrl envs serve babyai --images``), rendered as the episode
    loop renders them: each observation's picture before its text, the model turning left three times."""
    from transformers import AutoTokenizer

    from agentrl.envs.actions import episode_messages, format_action, observation_message
    from agentrl.envs.babyai import BabyAIEnv
    from agentrl.envs.babyai import spec as babyai_spec

    tokenizer, processor, spec = AutoTokenizer.from_pretrained(path), VisionProcessor(path), babyai_spec()

    def seen(message: dict, picture) -> dict:
        return {**message, "content": [{"type": "image", "image": picture.sha256},
                                       {"type": "text", "text": message["content"]}]}

    sequences = []
    for data_idx in (0, 1):
        env = BabyAIEnv()
        observation = env.reset(data_idx)
        picture = load_image(env.image(), "view")
        messages = episode_messages(spec.instruction, observation)
        messages[-1] = seen(messages[-1], picture)
        conversation = TokenConversation(tokenizer, messages, None, vision=processor,
                                         pictures={picture.sha256: picture})
        ids, mask = list(conversation.prompt_ids), [0] * len(conversation.prompt_ids)
        for turn in range(3):
            text = format_action("turn left", spec.action_format)
            out = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, mask = ids + out, mask + [1] * len(out)
            if turn == 2:
                break
            step = env.step("turn left")
            picture = load_image(env.image(), "view")
            conversation.pictures[picture.sha256] = picture
            delta = conversation.append(out, text, [seen(observation_message(step.observation), picture)])
            ids, mask = ids + delta.delta_ids, mask + [0] * len(delta.delta_ids)
        sequences.append((ids, mask, [conversation.pictures[sha] for sha in conversation.images]))
    return sequences


def build_babyai_vision_model(out_dir: Path, steps: int = 80, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL that answers BabyAI's pictures and observations with ``Action: turn left``."""
    torch.manual_seed(seed)
    path = build_tiny_vision_model(out_dir, family="qwen2_5_vl", seed=seed, hidden_size=128)
    return train_on_vision_sequences(path, babyai_sequences(path), steps)


def train_on_vision_sequences(path: Path, sequences: list[tuple[list[int], list[int], list]], steps: int) -> Path:
    """Fit the vision-language model at ``path`` to ``(input_ids, loss_mask, images)`` sequences and save it."""
    from transformers import AutoModelForImageTextToText

    processor = VisionProcessor(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    batches = []
    for ids, mask, images in sequences:
        inputs = processor.inputs(images)
        x = torch.tensor([ids])
        batches.append((x, torch.tensor(mask[1:], dtype=torch.bool), inputs))
    for _ in range(steps):
        loss = 0.0
        for x, mask, inputs in batches:
            logits = model(input_ids=x, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                           mm_token_type_ids=(x == processor.image_token_id).int()).logits[0, :-1]
            loss = loss + torch.nn.functional.cross_entropy(logits[mask], x[0, 1:][mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def build_placeholder_vision_model(out_dir: Path, picture: bytes, query: str, steps: int = 30, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL whose first reply to ``query`` about ``picture`` (as the agent loop renders them, no tools)
    is ``<|image_pad|>``: a policy that generates a picture's placeholder token. Trained on the prompt alone (a
    placeholder among the forward pass's inputs would need an image of its own)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(seed)
    path = build_tiny_vision_model(out_dir, family="qwen2_5_vl", seed=seed, hidden_size=128)
    tokenizer, processor = AutoTokenizer.from_pretrained(path), VisionProcessor(path)
    image = load_image(picture, "task picture")
    messages, template_tools = initial_messages(query=query, answer_schema="boxed", system_prompt=None, tools=[],
                                                tokenizer=tokenizer, images=[image.sha256])
    conversation = TokenConversation(tokenizer, messages, template_tools, vision=processor,
                                     pictures={image.sha256: image})
    x, inputs = torch.tensor([conversation.prompt_ids]), processor.inputs([image])
    model = AutoModelForImageTextToText.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(input_ids=x, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                       mm_token_type_ids=(x == processor.image_token_id).int()).logits[0, -1]
        loss = torch.nn.functional.cross_entropy(logits[None], torch.tensor([processor.image_token_id]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path
