"""`agentrl sft demos`: warm-up demonstrations made with the real calculator server are token for token what a
rollout producing the same outputs looks like to the trainer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.envs.arith import generate_arith_tasks
from agentrl.rollout.conversation import TokenConversation
from agentrl.rollout.demonstrations import demonstrate
from agentrl.rollout.tool_parsers import get_parser
from agentrl.scoring.math_equiv import math_score
from agentrl.store.task_files import UploadDefaults, parse_entry
from agentrl.tools import ToolManager
from agentrl.training.sft_data import ChatTokeniser, normalise
from agentrl.trajectory.prompting import initial_messages
from rollout_fixtures import (
    agentrl_cmd,
    documents,
    run_env,
    sample_args,
    upload,
    write_mcp_config,
)
from scripted_model import calculator_config
from test_rollout_sampler import run_sampler

pytestmark = pytest.mark.slow

DEFAULTS = UploadDefaults(scorer="math", answer_schema="boxed")
CALL = "<tool_call>{}</tool_call>"
"""How the model writes a call (what the ``qwen`` parser reads), written out here independently of the code."""


def demos_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(agentrl_cmd("sft", "demos", *args), capture_output=True, text=True, env=run_env(),
                          timeout=120)


def rollout_rendering(tokenizer, demo: dict, tools: list[dict], task) -> tuple[list[int], list[int]]:
    """The agent loop's token ids and loss mask for a rollout whose outputs are the demo's assistant turns."""
    messages, template_tools = initial_messages(query=task.query, answer_schema=task.answer_schema,
                                                system_prompt=None, tools=tools, tokenizer=tokenizer)
    conversation = TokenConversation(tokenizer, messages, template_tools)
    ids, mask = list(conversation.prompt_ids), [0] * len(conversation.prompt_ids)
    turns = demo["messages"][2:]
    for index, message in enumerate(turns):
        if message["role"] != "assistant":
            continue
        text = message["content"] or "".join(CALL.format(json.dumps(c)) for c in message["tool_calls"])
        out_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += out_ids
        mask += [1] * len(out_ids)
        following = [m for m in turns[index + 1:index + 2] if m["role"] == "tool"]
        if following:
            delta = conversation.append(out_ids, text,
                                        [{"role": "tool", "name": m["name"], "content": m["content"]}
                                         for m in following])
            assert not delta.new_branch
            ids += delta.delta_ids
            mask += [0] * len(delta.delta_ids)
    return ids, mask


async def test_demonstrations_render_exactly_as_rollouts_with_real_results(tmp_path: Path) -> None:
    from agentrl.inference.embedded_model import default_tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_path())
    chat = ChatTokeniser(tokenizer)
    parser = get_parser("qwen")
    async with ToolManager(calculator_config()) as tools:
        for order, raw in enumerate(generate_arith_tasks(8, seed=2, prefix="warmup")):
            task = parse_entry(raw, DEFAULTS, order)
            demo = await demonstrate(task, tools)
            call, result, answer = demo["messages"][2], demo["messages"][3], demo["messages"][4]
            # The call is the task's expression; the result is the real calculator's answer.
            parsed = parser.parse(CALL.format(json.dumps(call["tool_calls"][0]))).calls
            assert [(c.name, c.arguments, c.error) for c in parsed] == [
                ("calculate", {"expression": raw["expression"]}, None)]
            assert math_score(f"\\boxed{{{result['content']}}}", raw["answer"]) == 1.0
            assert math_score(answer["content"], raw["answer"]) == 1.0
            # What `agentrl sft upload` trains on is what the trainer would get from such a rollout.
            tokens = chat.tokenise(normalise(demo))
            ids, mask = rollout_rendering(tokenizer, demo, tools.openai_tools(), task)
            assert tokens.input_ids == ids
            assert tokens.loss_mask == mask


def test_a_demonstration_equals_a_real_greedy_rollout_of_the_same_outputs(
        db_uri: str, tmp_path: Path, scripted_model_dir: Path, scripted_engine_url: str) -> None:
    # The scripted model answers "What is 12 + 30?" with exactly the demonstration's two turns (calculate, then
    # "The answer is \boxed{42}."), so its queued training sample must equal the demonstration's rendering.
    task_file = tmp_path / "add.jsonl"
    task_file.write_text(json.dumps({"id": "add", "question": "What is 12 + 30?", "answer": "42",
                                     "expression": "12 + 30"}) + "\n")
    upload(db_uri, task_file, "--num_generations", "2")
    done = run_sampler(sample_args(db_uri, scripted_model_dir, scripted_engine_url,
                                   write_mcp_config(tmp_path / "mcp.json"), "--temperature", "0",
                                   "--zero_variance_threshold", "0", "--drop_zero_advantage", "false"))
    assert "2 scored" in done.stdout
    samples = documents(db_uri, "DBRecordData")
    assert len(samples) == 2 and samples[0]["input_ids"] == samples[1]["input_ids"]  # greedy: the same twice
    sample = samples[0]

    made = demos_cli(str(task_file), "--out", str(tmp_path / "demos.jsonl"), "--answer_schema", "boxed")
    assert made.returncode == 0, made.stderr
    assert "wrote 1 demonstrations (1 real tool calls)" in made.stdout
    [demo] = [json.loads(line) for line in (tmp_path / "demos.jsonl").read_text().splitlines()]
    tokens = ChatTokeniser(AutoTokenizer.from_pretrained(scripted_model_dir)).tokenise(normalise(demo))
    assert tokens.input_ids == sample["input_ids"]
    assert tokens.loss_mask == sample["loss_mask"]


def test_tasks_that_cannot_be_demonstrated_are_reported_and_nothing_is_written(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in [
        {"id": "ok", "question": "What is 2 + 2?", "answer": "4", "expression": "2 + 2"},
        {"id": "none", "question": "What is 3 + 3?", "answer": "6"},
        {"id": "bad", "question": "What is 1 / 0?", "answer": "1", "expression": "1 / 0"},
    ]) + "\n")
    out = tmp_path / "demos.jsonl"
    first = demos_cli(str(tasks), "--out", str(out))
    assert first.returncode == 2
    assert f"{tasks}:2: no calls to demonstrate" in first.stderr
    assert "nothing was written" in first.stderr and not out.exists()
    # Only line 3 left: it fails at the calculator, which says why.
    second = demos_cli(str(tasks), "--out", str(out), "--limit", "1")
    assert second.returncode == 0 and out.exists()
    lines = tasks.read_text().splitlines()
    tasks.write_text("\n".join([lines[0], lines[2]]) + "\n")
    out.unlink()
    third = demos_cli(str(tasks), "--out", str(out))
    assert third.returncode == 2
    assert f"{tasks}:2: the tool call calculate" in third.stderr and "failed" in third.stderr
    assert not out.exists()


def test_worked_solutions_are_demonstrated_without_tools(tmp_path: Path) -> None:
    """A GSM8K row (answer = reasoning ending '#### N', gsm8k schema) is demonstrated by its own solution with the
    rollout's prompt; no tool server is started, and the upload reads it token for token."""
    solution = "Ann has 3 + 4 = 7 apples.\n#### 7"
    tasks = tmp_path / "gsm.jsonl"
    tasks.write_text(json.dumps({"id": "g1", "question": "Ann has 3 apples and gets 4. How many?",
                                 "answer": solution, "answer_schema": "gsm8k"}) + "\n"
                     + json.dumps({"id": "g2", "question": "Say hi.", "answer": "hi",
                                   "demo_response": "Hi! <answer>hi</answer>"}) + "\n")
    out = tmp_path / "demos.jsonl"
    done = demos_cli(str(tasks), "--out", str(out), "--tools", "", "--query_prompt", "Question: {query}")
    assert done.returncode == 0, done.stderr
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["tools"] == [] and [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert first["messages"][1]["content"] == "Question: Ann has 3 apples and gets 4. How many?"
    assert first["messages"][2]["content"] == solution and "####" in first["messages"][0]["content"]
    assert second["messages"][2]["content"] == "Hi! <answer>hi</answer>"
    # A task that needs calls still needs tool servers.
    calc = tmp_path / "calc.jsonl"
    calc.write_text(json.dumps({"id": "c", "question": "2 + 2?", "answer": "4", "expression": "2 + 2"}) + "\n")
    refused = demos_cli(str(calc), "--out", str(tmp_path / "x.jsonl"), "--tools", "")
    assert refused.returncode == 2 and "no tool servers" in refused.stderr
