"""`agentrl chat`: the session logic against a fake generator, and the real command (piped stdin) against an
engine serving the scripted tiny model, with the real calculator MCP server."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from agentrl.inference.client import InferenceServiceError
from agentrl.inference.embedded_model import default_tokenizer_path
from agentrl.rollout.chat_session import ChatSession, ChatSettings, EventKind
from agentrl.rollout.tool_parsers import get_parser
from rollout_fixtures import agentrl_cmd, run_env

pytestmark = pytest.mark.slow


class FakeModel:
    """Answers with scripted texts (token ids + eos, as an engine returns them); records the prompts it got."""

    def __init__(self, tokenizer, outputs: list[str | Exception]):
        self.tokenizer, self.outputs, self.prompts = tokenizer, list(outputs), []

    async def __call__(self, input_ids: list[int], params: dict) -> SimpleNamespace:
        self.prompts.append(list(input_ids))
        output = self.outputs.pop(0)
        if isinstance(output, Exception):
            raise output
        ids = self.tokenizer(output, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return SimpleNamespace(output_ids=ids, text=output, finish_reason="stop")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_tokenizer_path())


def test_session_runs_tool_rounds_keeps_token_continuity_and_survives_errors(tokenizer) -> None:
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "1 + 1"}}</tool_call>'
    model = FakeModel(tokenizer, [call, "It is \\boxed{2}.", InferenceServiceError("http://x", "/generate", "down"),
                                  "Hello again.", call, call])
    session = ChatSession(tokenizer, model, get_parser("qwen"), settings=ChatSettings(max_turns=2))

    events = []
    reply = asyncio.run(session.send("What is 1 + 1?", events.append))
    assert reply.text == "It is \\boxed{2}." and reply.model_calls == 2 and reply.tool_calls == 1 and reply.finished
    assert [e.kind for e in events] == [EventKind.TOOL_CALL, EventKind.TOOL_RESULT, EventKind.ASSISTANT]
    assert events[0].text == 'calculate({"expression": "1 + 1"})'
    assert not events[1].ok and "no tools are available" in events[1].text  # no ToolManager in this session
    first, second = model.prompts
    assert tokenizer.decode(first).endswith("<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")
    assert second[:len(first)] == first  # each prompt extends the previous prompt + output, token for token
    assert tokenizer.decode(second[len(first):]).startswith(call + "<|im_end|>\n<|im_start|>tool\n")

    before = list(session.conversation.prompt_ids)
    with pytest.raises(InferenceServiceError):  # a failed turn leaves the conversation as it was
        asyncio.run(session.send("Are you there?"))
    assert session.conversation.prompt_ids == before
    reply = asyncio.run(session.send("Hi again"))
    assert reply.text == "Hello again."
    third = model.prompts[-1]
    assert third[:len(second)] == second
    assert tokenizer.decode(third[len(second):]) == ("It is \\boxed{2}.<|im_end|>\n<|im_start|>user\nHi again"
                                                     "<|im_end|>\n<|im_start|>assistant\n")

    reply = asyncio.run(session.send("Loop please"))  # tool calls on every call: stopped by max_turns
    assert not reply.finished and reply.model_calls == 2 and reply.events[-1].kind == EventKind.NOTICE
    session.reset()
    assert session.conversation is None


def run_chat(stdin: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(agentrl_cmd("chat", *args), input=stdin, capture_output=True, text=True, env=run_env(),
                          timeout=timeout)


def test_chat_calls_the_calculator_and_answers(scripted_model_dir: Path, scripted_engine_url: str) -> None:
    common = ("--url", scripted_engine_url, "--model_name_or_path", str(scripted_model_dir), "--tools", "calculator",
              "--temperature", "0", "--max_new_tokens", "40")
    done = run_chat("What is 12 + 30?\nquit\nWhat is 7 * 8?\n", *common)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tools: calculate" in out
    assert '[tool call] calculate({"expression": "12 + 30"})' in out and "[tool result] 42" in out
    assert "[assistant] The answer is \\boxed{42}." in out
    assert "7 * 8" not in out and "boxed{56}" not in out  # nothing after quit is read (the URL's port may hold 56)

    eof = run_chat("What is 7 * 8?\n", *common)  # end of input (Ctrl-D) ends the chat cleanly
    assert eof.returncode == 0, eof.stdout + eof.stderr
    assert "[tool result] 56" in eof.stdout and "\\boxed{56}" in eof.stdout


def test_chat_rejects_unknown_tools_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    from agentrl.cli.main import main

    assert main(["chat", "--url", "http://127.0.0.1:9", "--tools", "calculator,shell"]) == 2
    assert "unknown built-in tool server(s) shell" in capsys.readouterr().err
    assert main(["chat", "--url", "http://127.0.0.1:9", "--tool_call_parser", "nope"]) == 2
    assert "unknown tool-call parser 'nope'" in capsys.readouterr().err
    assert main(["chat", "--url", "http://127.0.0.1:9", "--temperature", "-1"]) == 2
    assert "invalid sampling options" in capsys.readouterr().err
