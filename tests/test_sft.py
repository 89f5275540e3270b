"""SFT data: `agentrl sft upload` (OpenAI `messages` and AgentGym `conversations`), assistant-only loss masks,
FILE:LINE validation, idempotence, --max_length, and CrossEntropy training on the uploaded data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pymongo import MongoClient
from transformers import AutoTokenizer

from agentrl.inference.embedded_model import default_tokenizer_path
from agentrl.train import main as train_main
from agentrl.training.sft_data import ChatTokeniser, SFTOptions, normalise, parse_sft_file
from cli_helpers import agentrl
from trainer_fixtures import trainer_args

pytestmark = pytest.mark.slow

CALC_TOOL = {"type": "function", "function": {"name": "calculate", "description": "Evaluate an expression.",
                                              "parameters": {"type": "object", "properties": {
                                                  "expression": {"type": "string"}}}}}
MESSAGES_LINE = {"id": "add", "tools": [CALC_TOOL], "messages": [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "12 + 30"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "assistant", "content": [{"type": "text", "text": "The answer is \\boxed{42}."}]},
]}
GYM_LINE = {"item_id": "gym-1", "conversations": [
    {"from": "human", "loss": None, "value": "You are in a room. Say ok."},
    {"from": "gpt", "loss": False, "value": "Ok."},
    {"from": "human", "loss": None, "value": "Open the door."},
    {"from": "gpt", "loss": True, "value": "Action: open door"},
]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def masked_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def sft_docs(db_uri: str) -> list[dict]:
    client = MongoClient(db_uri)
    try:
        return list(client.get_default_database().DBRecordData.find({}, sort=[("seq", 1)]))
    finally:
        client.close()


def test_mask_is_exactly_the_assistant_tokens_with_their_end_token(tokenizer) -> None:
    chat = ChatTokeniser(tokenizer)
    tokens = chat.tokenise(normalise(MESSAGES_LINE))
    text = tokenizer.decode(tokens.input_ids)
    # the template ignores tools: they are described in the system prompt as in rollouts; the call becomes text
    assert text.startswith("<|im_start|>system\nYou are a calculator.\n\nYou can call these tools")
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 + 30"}}</tool_call>'
    assert masked_spans(tokenizer, tokens.input_ids, tokens.loss_mask) == [
        call + "<|im_end|>", "The answer is \\boxed{42}.<|im_end|>"]
    assert text.endswith("<|im_start|>assistant\nThe answer is \\boxed{42}.<|im_end|>")  # as a rollout ends
    # turns start at 0 and right after each assistant turn (where the next prompt delta begins)
    second_turn = tokens.turn_boundaries[1]
    assert len(tokens.turn_boundaries) == 2 and tokenizer.decode(tokens.input_ids[:second_turn]).endswith(
        call + "<|im_end|>\n")

    exported = {"messages": [  # `agentrl export` writes the raw output next to the parsed calls: rendered once
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": call, "tool_calls": MESSAGES_LINE["messages"][2]["tool_calls"]},
        {"role": "tool", "tool_call_id": "c1", "name": "calculate", "content": "42"},
        {"role": "assistant", "content": "The answer is \\boxed{42}."}]}
    again = chat.tokenise(normalise(exported))
    assert masked_spans(tokenizer, again.input_ids, again.loss_mask)[0] == call + "<|im_end|>"

    gym = chat.tokenise(normalise(GYM_LINE))  # loss: false on the first reply: not trained
    assert masked_spans(tokenizer, gym.input_ids, gym.loss_mask) == ["Action: open door<|im_end|>"]
    assert "<|im_start|>assistant\nOk.<|im_end|>" in tokenizer.decode(gym.input_ids)


def test_a_template_that_rewrites_earlier_turns_is_rejected_with_the_line(tokenizer, tmp_path: Path) -> None:
    rewriting = AutoTokenizer.from_pretrained(default_tokenizer_path())
    rewriting.chat_template = (  # hides every assistant message but the last, like templates that strip reasoning
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(hidden){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_jsonl(tmp_path / "two_turns.jsonl", [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        GYM_LINE,
    ])
    parsed = parse_sft_file(path, rewriting)
    assert len(parsed.samples) == 1
    [problem] = parsed.problems
    assert problem.startswith(f"{path}:2: message 2 (assistant): ") and "not a token prefix" in problem
    assert len(parse_sft_file(path, tokenizer).samples) == 2  # the real template extends its prefixes


TINY_PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgZGIGAAAOAAfXb+R4AAAAAElF"
            "TkSuQmCC")
"""A 1 x 1 PNG."""


def test_invalid_lines_are_reported_and_nothing_is_inserted(db_uri: str, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [
        MESSAGES_LINE,
        "{not json",
        {"prompt": "x", "completion": "y"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "calculate", "arguments": "{oops"}}]}]},
        {"conversations": [{"from": "human", "value": "hi", "loss": True}, {"from": "gpt", "value": "yo"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": TINY_PNG}}]},
                      {"role": "assistant", "content": "a cat"}]},
        GYM_LINE,
    ])
    args = ("sft", "upload", str(path), "--db_connection_string", db_uri)
    result = agentrl(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith(f"{path}:")]
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "5", "6", "7", "8"], result.stderr
    assert "invalid JSON" in problems[0] and "'messages' list" in problems[1] and "'robot'" in problems[2]
    assert "no assistant message to train on" in problems[3] and "'arguments' is not valid JSON" in problems[4]
    assert "only assistant messages can be trained" in problems[5]
    assert "pictures need a vision-language model" in problems[6]  # the embedded model is a text model
    assert "7 invalid lines; nothing was inserted" in result.stderr
    assert sft_docs(db_uri) == []

    skipped = agentrl(*args, "--skip_invalid")
    assert skipped.returncode == 0, skipped.stderr
    assert "inserted 2 SFT samples" in skipped.stdout and "7 invalid skipped" in skipped.stdout
    docs = sft_docs(db_uri)
    assert [d["task_id"] for d in docs] == ["sft:train:add", "sft:train:gym-1"]
    assert all(d["status"] == "queued" and d["split"] == "train" and d["num_tokens"] == len(d["input_ids"])
               == len(d["loss_mask"]) == len(d["logprobs"]) == len(d["versions"]) == len(d["advantages"])
               for d in docs)


def test_upload_is_idempotent_and_max_length_rejects_or_truncates(db_uri: str, tmp_path: Path, tokenizer) -> None:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is \\boxed{{{2 * i}}}."}]} for i in range(5)]
    path = write_jsonl(tmp_path / "sft.jsonl", rows + [rows[0]])  # a duplicate line is stored once
    args = ("sft", "upload", str(path), "--db_connection_string", db_uri)
    first = agentrl(*args)
    assert first.returncode == 0, first.stderr
    assert "inserted 5 SFT samples" in first.stdout and "1 duplicate lines counted once" in first.stdout
    ids = [d["_id"] for d in sft_docs(db_uri)]
    second = agentrl(*args)
    assert second.returncode == 0 and "inserted 0 SFT samples" in second.stdout, second.stdout + second.stderr
    assert "5 already present" in second.stdout and [d["_id"] for d in sft_docs(db_uri)] == ids
    other = agentrl(*args, "--split", "heldout")
    assert "inserted 5 SFT samples" in other.stdout and len(sft_docs(db_uri)) == 10

    # --max_length: rejected by default (reported like any invalid line), truncated with --truncate
    full = len(parse_sft_file(path, tokenizer).samples[0][1].input_ids)
    limit = full - 3
    rejected = parse_sft_file(path, tokenizer, SFTOptions(max_length=limit))
    assert len(rejected.problems) == 6 and f"longer than --max_length {limit}" in rejected.problems[0]
    truncated = parse_sft_file(path, tokenizer, SFTOptions(max_length=limit, overlong="truncate"))
    assert not truncated.problems and truncated.truncated == 5
    sample = truncated.samples[0][1]
    assert sample.num_tokens == limit and sum(sample.loss_mask) > 0
    too_short = parse_sft_file(path, tokenizer, SFTOptions(max_length=8, overlong="truncate"))
    assert "no trained token within the first 8 tokens" in too_short.problems[0]


def arithmetic_rows() -> list[dict]:
    rows = []
    for i in range(4):
        a, b = 3 * i + 2, 7 * i + 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                  {"role": "assistant", "content": f"{a} + {b} = \\boxed{{{a + b}}}."}]})
        rows.append({"conversations": [{"from": "human", "value": f"Name the number {a}."},
                                       {"from": "gpt", "value": f"The number is {a}."},
                                       {"from": "human", "value": "And doubled?"},
                                       {"from": "gpt", "value": f"Doubled it is {2 * a}."}]})
    return rows


def test_sft_upload_then_cross_entropy_training_lowers_the_loss(db_uri: str, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", arithmetic_rows())
    upload = agentrl("sft", "upload", str(path), "--db_connection_string", db_uri, "--model_name_or_path",
                     str(tiny_model_dir))
    assert upload.returncode == 0 and "inserted 8 SFT samples" in upload.stdout, upload.stdout + upload.stderr

    assert train_main(trainer_args(
        db_uri, tiny_model_dir, tmp_path / "out", "--loss_calculater", "CrossEntropy", "--enable_sampling", "false",
        "--train_batch_size", "4", "--num_train_epochs", "4", "--save_steps", "0", "--learning_rate", "1e-2")) == 0
    client = MongoClient(db_uri)
    try:
        db = client.get_default_database()
        metrics = {d["step"]: d["values"] for d in db.Metric.find({"split": "train"})}
        assert {(d["status"], d["epoch"]) for d in db.DBRecordData.find()} == {("trained", 3)}
    finally:
        client.close()
    assert sorted(metrics) == list(range(1, 9))  # 8 conversations, 4 per step, 4 epochs
    losses = [metrics[step]["loss"] for step in sorted(metrics)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.6 * losses[0], losses
    assert all(metrics[s]["samples"] == 4 for s in metrics)


def test_a_training_time_limit_ends_the_run_after_the_step_that_passes_it(db_uri: str, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", arithmetic_rows())
    assert agentrl("sft", "upload", str(path), "--db_connection_string", db_uri, "--model_name_or_path",
                   str(tiny_model_dir)).returncode == 0
    assert train_main(trainer_args(
        db_uri, tiny_model_dir, tmp_path / "out", "--loss_calculater", "CrossEntropy", "--enable_sampling", "false",
        "--train_batch_size", "4", "--num_train_epochs", "4", "--save_steps", "0",
        "--max_train_time_s", "0.001")) == 0
    client = MongoClient(db_uri)
    try:
        db = client.get_default_database()
        assert [d["step"] for d in db.Metric.find({"split": "train"})] == [1]  # 8 steps without the limit
        assert db.Run.find_one()["status"] == "finished"
    finally:
        client.close()
    assert (tmp_path / "out" / "final" / "config.json").is_file()  # finished as at max_steps
