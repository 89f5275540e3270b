"""The ``agentcpm`` LLM-judge scorer and the agent config.

No real LLM is available offline, so the judge here is a FAKE: a small FastAPI app, served by uvicorn on
127.0.0.1 for this module, that speaks the OpenAI ``/v1/chat/completions`` protocol. Its behaviour depends on the
model name: ``judge`` compares the reference and candidate lines of the prompt, ``broken`` answers HTTP 500,
``slow`` answers after 3 s, ``babbler`` replies without a verdict, ``keyed`` requires an API key.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.scoring import MCPScorerFactory, load_agent_config
from agentrl.scoring.agent_config import AgentConfigError, JudgeConfig
from agentrl.scoring.judge import parse_verdict
from tools_fixtures import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "agent_config_example.yml"
KEY = "k-test-123"


def fake_judge_app(calls: list[tuple[str, str]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> object:
        body = await request.json()
        model, prompt = body["model"], body["messages"][-1]["content"]
        calls.append((model, prompt))
        if model == "broken":
            return JSONResponse(status_code=500, content={"error": {"message": "overloaded"}})
        if model == "keyed" and request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse(status_code=401, content={"error": {"message": "bad key"}})
        if model == "slow":
            await asyncio.sleep(3)
        if model == "babbler":
            reply = "Hmm, hard to say."
        else:
            reference = re.search(r"Reference answer: (.*)", prompt).group(1).strip()
            candidate = re.search(r"Candidate answer: (.*)", prompt).group(1).strip()
            reply = "Correct" if reference.lower() == candidate.lower() else "Incorrect"
        return {
            "id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


@pytest.fixture(scope="module")
def judge_server():
    calls: list[tuple[str, str]] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_judge_app(calls), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake judge did not start"
        time.sleep(0.02)
    yield {"url": f"http://127.0.0.1:{port}/v1", "calls": calls}
    server.should_exit = True
    thread.join(timeout=10)


def judge(server: dict, *models: str, **settings: object) -> dict:
    endpoints = [{"base_url": server["url"], "model": m} for m in models]
    for endpoint in endpoints:
        if endpoint["model"] == "keyed":
            endpoint["api_key_env"] = "FAKE_JUDGE_KEY"
    server["calls"].clear()
    return {"scorer_agent": JudgeConfig.model_validate({"models": endpoints, "retry_delay": 0, **settings})}


async def test_the_judge_decides(judge_server: dict) -> None:
    config = judge(judge_server, "judge")
    truth = {"query": "Capital of France?", "answer": "paris"}
    right = await MCPScorerFactory.score("agentcpm", "Paris", truth, config)
    assert (right.score, right.error) == (1.0, None)
    assert right.details == {"judge_model": "judge", "judge_reply": "Correct"}
    wrong = await MCPScorerFactory.score("agentcpm", "Lyon", "Paris", config)
    assert (wrong.score, wrong.error) == (0.0, None)
    [(_, first_prompt), _] = judge_server["calls"]
    assert "Question: Capital of France?" in first_prompt


async def test_fail_over_in_order_with_retries(judge_server: dict) -> None:
    config = judge(judge_server, "broken", "judge", max_retries=2)
    result = await MCPScorerFactory.score("agentcpm", "42", "42", config)
    assert result.score == 1.0
    assert [model for model, _ in judge_server["calls"]] == ["broken", "broken", "judge"]


async def test_a_timeout_and_a_reply_without_verdict_count_as_failures(judge_server: dict) -> None:
    config = judge(judge_server, "slow", "babbler", "judge", max_retries=1, timeout=0.5)
    result = await MCPScorerFactory.score("agentcpm", "7", "7", config)
    assert result.score == 1.0
    assert [model for model, _ in judge_server["calls"]] == ["slow", "babbler", "judge"]


async def test_a_judge_that_cannot_answer_is_an_error_not_zero(judge_server: dict) -> None:
    config = judge(judge_server, "broken", "babbler", "keyed", max_retries=2)
    result = await MCPScorerFactory.score("agentcpm", "42", "42", config)
    assert result.score is None and not result.ok
    for fragment in ("broken attempt 1", "broken attempt 2", "InternalServerError", "babbler attempt 2",
                     "no Correct/Incorrect verdict", "FAKE_JUDGE_KEY (API key of keyed) is not set"):
        assert fragment in result.error
    assert [model for model, _ in judge_server["calls"]] == ["broken", "broken", "babbler", "babbler"]


async def test_api_keys_come_from_the_environment(judge_server: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_JUDGE_KEY", KEY)
    result = await MCPScorerFactory.score("agentcpm", "x", "x", judge(judge_server, "keyed"))
    assert result.score == 1.0
    monkeypatch.setenv("FAKE_JUDGE_KEY", "wrong")
    refused = await MCPScorerFactory.score("agentcpm", "x", "x", judge(judge_server, "keyed", max_retries=1))
    assert refused.score is None and "AuthenticationError" in refused.error and "wrong" not in refused.error


async def test_custom_template_and_empty_answers(judge_server: dict) -> None:
    template = "Q={question}\nReference answer: {labeled_answer}\nCandidate answer: {pred_answer}\n{{literal}}"
    config = judge(judge_server, "judge", judge_prompt_template=template)
    result = await MCPScorerFactory.score("agentcpm", "{question}", "4", {**config, "query": "2+2?"})
    assert result.score == 0.0
    [(_, prompt)] = judge_server["calls"]
    assert prompt == "Q=2+2?\nReference answer: 4\nCandidate answer: {question}\n{{literal}}"  # no re-substitution
    empty = await MCPScorerFactory.score("agentcpm", "  ", "4", config)
    assert empty.score == 0.0 and len(judge_server["calls"]) == 1  # nothing to judge: no request
    missing = await MCPScorerFactory.score("agentcpm", "4", "4", {})
    assert missing.score is None and "needs judge settings" in missing.error


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [("Correct", True), ("correct.", True), ("INCORRECT", False), ("The answer is not correct.", False),
     ("Verdict: Incorrect", False)],
)
def test_parse_verdict(reply: str, verdict: bool) -> None:
    assert parse_verdict(reply) is verdict


def test_parse_verdict_without_a_verdict() -> None:
    with pytest.raises(ValueError, match="no Correct/Incorrect verdict"):
        parse_verdict("It depends.")


def test_the_example_agent_config(tmp_path: Path) -> None:
    config = load_agent_config(EXAMPLE)
    assert [m.model for m in config.scorer_agent.models] == ["gpt-4o-mini", "qwen3-8b"]
    assert config.scorer_agent.models[0].api_key_env == "OPENAI_API_KEY"
    assert config.browse_agent is not None and config.browse_agent.extra_body["top_p"] == 0.95
    assert "{pred_answer}" in config.scorer_agent.judge_prompt_template

    literal = tmp_path / "literal.yml"
    literal.write_text("scorer_agent:\n  models: [{base_url: 'http://x/v1', model: m, api_key: sk-secret}]\n")
    with pytest.raises(AgentConfigError, match="'api_key' is not accepted.*api_key_env") as error:
        load_agent_config(literal)
    assert "sk-secret" not in str(error.value)
    template = tmp_path / "template.yml"
    template.write_text("scorer_agent:\n  models: [{base_url: 'http://x/v1', model: m}]\n"
                        "  judge_prompt_template: 'Is {pred_answer} right?'\n")
    with pytest.raises(AgentConfigError, match="lacks \\{labeled_answer\\}"):
        load_agent_config(template)
    with pytest.raises(AgentConfigError, match="cannot read agent config"):
        load_agent_config(tmp_path / "missing.yml")


async def test_a_judge_that_cannot_be_reached_is_unavailable_not_a_judge_error(judge_server: dict) -> None:
    # Every model failing with 5xx, or refusing connections: no verdict could be had (retry later, not an error).
    down = {"scorer_agent": JudgeConfig.model_validate(
        {"models": [{"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "judge"}], "retry_delay": 0})}
    for config in (judge(judge_server, "broken"), down):
        result = await MCPScorerFactory.score("agentcpm", "42", "42", config)
        assert result.unavailable and result.score is None and "cannot be reached" in result.error
    # With retry_unavailable, it is retried with backoff for the judge's unavailable_retry_s.
    config = judge(judge_server, "broken", max_retries=1, unavailable_retry_s=1.5)
    result = await MCPScorerFactory.score("agentcpm", "42", "42", config, retry_unavailable=True)
    assert result.unavailable and [model for model, _ in judge_server["calls"]] == ["broken", "broken"]
    # A judge that answers without a verdict (or refuses the request) stays a judge error.
    for config in (judge(judge_server, "babbler"), judge(judge_server, "broken", "babbler")):
        result = await MCPScorerFactory.score("agentcpm", "42", "42", config, retry_unavailable=True)
        assert not result.unavailable and "no Correct/Incorrect verdict" in result.error
