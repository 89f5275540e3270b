"""A tiny real model taught to follow scripted tool-use trajectories, so rollout tests see real tool calls.

The tiny random model of ``agentrl.inference.tiny_model`` only babbles. Here it is trained (cross-entropy on the
assistant tokens, a few hundred steps on CPU) on the exact token sequences the agent loop renders for a handful
of questions: system prompt with the calculator's tool description, the question, a ``<tool_call>``, the real
calculator result, the boxed answer. Greedy decoding then reproduces the scripts; sampling at temperature 1
follows them too, except where a script deliberately has two endings (a right and a wrong answer), which gives
groups with reward variance.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrl.inference.tiny_model import build_tiny_model
from agentrl.rollout.conversation import TokenConversation
from agentrl.tools import ToolManager
from agentrl.tools.config import MCPConfig
from agentrl.trajectory.prompting import initial_messages


def calculator_config() -> MCPConfig:
    return MCPConfig.model_validate({"servers": [{
        "name": "calculator", "command": sys.executable,
        "args": ["-m", "agentrl.cli.main", "tools", "serve", "calculator"], "env": {"OMP_NUM_THREADS": "1"}}]})


def call(expression: str, key: str = "expression") -> str:
    return '<tool_call>' + json.dumps({"name": "calculate", "arguments": {key: expression}}) + '</tool_call>'


@dataclass(frozen=True)
class Script:
    task_id: str
    question: str
    answer: str
    turns: tuple[tuple[str, ...], ...]
    """assistant outputs in order; a tool call's result is fetched from the real calculator. The last turn may
    list several alternative endings (each is trained, so sampling picks among them)."""


SCRIPTS = (
    Script("add", "What is 12 + 30?", "42", ((call("12 + 30"),), ("The answer is \\boxed{42}.",))),
    Script("mul", "What is 7 * 8?", "56", ((call("7 * 8"),), ("So 7 * 8 = \\boxed{56}.",))),
    Script("coin", "What is 9 + 10?", "19",
           ((call("9 + 10"),), ("The sum is \\boxed{19}.", "The sum is \\boxed{21}."))),
    Script("bad", "What is 5 - 9?", "-4", ((call("5 - 9", key="expr"),), ("It is \\boxed{-4}.",))),
)


async def _sequences(tokenizer, tools: ToolManager) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every scripted path, rendered exactly as the agent loop renders it."""
    sequences = []
    for script in SCRIPTS:
        for ending in script.turns[-1]:
            messages, template_tools = initial_messages(
                query=script.question, answer_schema="boxed", system_prompt=None, tools=tools.openai_tools(),
                tokenizer=tokenizer)
            conversation = TokenConversation(tokenizer, messages, template_tools)
            ids, mask = list(conversation.prompt_ids), [0] * len(conversation.prompt_ids)
            outputs = [turn[0] for turn in script.turns[:-1]] + [ending]
            for index, text in enumerate(outputs):
                out_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids += out_ids
                mask += [1] * len(out_ids)
                if index == len(outputs) - 1:
                    break
                parsed = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
                result = await tools.call_tool(parsed["name"], parsed["arguments"])
                delta = conversation.append(out_ids, text, [{"role": "tool", "name": parsed["name"],
                                                             "content": result.text}])
                ids += delta.delta_ids
                mask += [0] * len(delta.delta_ids)
            sequences.append((ids, mask))
    return sequences


def build_scripted_model(out_dir: Path, steps: int = 400, seed: int = 0) -> Path:
    """Train the tiny model on ``SCRIPTS`` and save it (with the tokenizer) into ``out_dir``."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    path = build_tiny_model(out_dir, seed=seed, hidden_size=128, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(path)

    async def collect() -> list[tuple[list[int], list[int]]]:
        async with ToolManager(calculator_config()) as tools:
            return await _sequences(tokenizer, tools)

    return train_on_sequences(path, asyncio.run(collect()), steps)


def train_on_sequences(path: Path, sequences: list[tuple[list[int], list[int]]], steps: int) -> Path:
    """Fit the model at ``path`` to ``(input_ids, loss_mask)`` sequences (full batch, AdamW) and save it there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # seconds on a GPU machine
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    width = max(len(ids) for ids, _ in sequences)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in sequences], device=device)
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in sequences], device=device)
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in sequences], dtype=torch.bool, device=device)
    # Position i predicts token i + 1: the logits are computed only where the next token is trained.
    predict_at, targets = mask[:, 1:], input_ids[:, 1:][mask[:, 1:]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[predict_at]), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.cpu().save_pretrained(path)
    return path
