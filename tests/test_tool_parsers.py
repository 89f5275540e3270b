"""Tool-call parsers on well-formed and malformed model outputs, and the error taxonomy's values."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agentrl.rollout.tool_parsers import (
    CALL_ERROR_STATUSES,
    NO_VERDICT_OUTCOMES,
    PARSERS,
    ParseResult,
    TrajectoryOutcome,
    get_parser,
    load_json_object,
    register_parser,
)


def calls(result: ParseResult) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in result.calls]


# ------------------------------------------------------------------------------------------------ qwen / hermes


def test_hermes_well_formed_calls_with_thinking() -> None:
    text = (
        "<think>I should compute this.</think>Let me use the calculator.\n"
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 7"}}\n</tool_call>\n'
        '<tool_call>{"name": "execute_code", "arguments": {"code": "print(1)"}}</tool_call>'
    )
    result = get_parser("qwen").parse(text)
    assert result.reasoning == "I should compute this."
    assert result.content == "Let me use the calculator."
    assert calls(result) == [("calculate", {"expression": "12 * 7"}), ("execute_code", {"code": "print(1)"})]
    assert all(call.ok for call in result.calls) and result.format_errors == [] and result.error is None
    assert len({call.id for call in result.calls}) == 2
    openai_call = result.calls[0].to_openai()
    assert openai_call["function"] == {"name": "calculate", "arguments": json.dumps({"expression": "12 * 7"})}
    assert get_parser("hermes").function is get_parser("qwen").function


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": "{\\"x\\": 1}"}', ("f", {"x": 1})),  # arguments as a JSON string
        ("{'name': 'f', 'arguments': {'x': True, 'y': None}}", ("f", {"x": True, "y": None})),  # Python literals
        ('{"name": "f", "arguments": {"x": true, "y": null, "z": "true"}}', ("f", {"x": True, "y": None, "z": "true"})),
        ('```json\n{"name": "f", "arguments": {"x": 1}}\n```', ("f", {"x": 1})),  # code fence
        ('Sure! {"name": "f", "arguments": {"q": "a } b"}} hope that helps', ("f", {"q": "a } b"})),  # text around
        ('{"name": "f", "arguments": {"x": 1,},}', ("f", {"x": 1})),  # trailing commas
        ('{"content": {"name": "f", "arguments": {"x": 1}}}', ("f", {"x": 1})),  # wrapped
        ('{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}', ("f", {"x": 1})),
        ('{"name": "f", "parameters": {"x": 1}}', ("f", {"x": 1})),
        ('{"name": "f"}', ("f", {})),
        ('{"name": "execute_code", "arguments": {}}\n<code>\nprint(2 + 2)\n</code>',
         ("execute_code", {"code": "print(2 + 2)"})),
    ],
)
def test_hermes_tolerant_fallbacks(body: str, expected: tuple[str, dict]) -> None:
    result = get_parser("qwen").parse(f"<tool_call>{body}</tool_call>")
    assert calls(result) == [expected]
    assert result.calls[0].ok


def test_hermes_unclosed_call_at_the_end_is_parsed() -> None:
    result = get_parser("qwen").parse('Computing. <tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}')
    assert calls(result) == [("calculate", {"expression": "1+1"})]
    assert result.content == "Computing."


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "f", "arguments": {"x": 1}', "unbalanced braces"),
        ("calculate(expression='1')", "no JSON object found"),
        ('{"arguments": {"x": 1}}', 'missing the tool "name"'),
        ('{"name": "", "arguments": {}}', 'missing the tool "name"'),
        ('{"name": "f", "arguments": [1, 2]}', "'arguments' must be a JSON object"),
        ('{"name": "f", "arguments": "not json"}', "no JSON object found"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"name": f, arguments: {}}', "invalid JSON"),
    ],
)
def test_hermes_malformed_calls_become_format_errors(body: str, reason: str) -> None:
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    result = get_parser("qwen").parse(text)
    bad, good = result.calls
    assert not bad.ok and bad.name == "" and bad.arguments == {} and bad.raw == body
    assert reason in bad.error and "<tool_call>" in bad.error  # tells the model the expected format
    assert good.ok and good.name == "ok"  # one bad call does not spoil the others
    assert result.format_errors == [bad] and result.error == bad.error


def test_hermes_without_calls() -> None:
    result = get_parser("qwen").parse("<think>easy</think>The answer is \\boxed{4}.")
    assert (result.content, result.reasoning, result.calls) == ("The answer is \\boxed{4}.", "easy", [])


def test_calls_inside_thinking_are_not_executed() -> None:
    text = '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call></think>No call after all.'
    assert get_parser("qwen").parse(text).calls == []


# ------------------------------------------------------------------------------------------------------ openai


def test_openai_structured_calls() -> None:
    structured = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        SimpleNamespace(id="call_2", type="function", function=SimpleNamespace(name="g", arguments={"y": 2})),
        {"id": "call_3", "type": "function", "function": {"name": "h", "arguments": '{"broken": '}},
    ]
    result = get_parser("openai").parse("Calling tools.", structured)
    assert [(c.id, c.name, c.arguments, c.ok) for c in result.calls] == [
        ("call_1", "f", {"x": 1}, True), ("call_2", "g", {"y": 2}, True), ("call_3", "h", {}, False)]
    assert "Could not parse the tool call" in result.calls[2].error
    assert result.content == "Calling tools."


def test_openai_without_structured_calls_parses_the_text() -> None:
    result = get_parser("openai").parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', None)
    assert calls(result) == [("f", {"x": 1})]


# ----------------------------------------------------------------------------------------------------- minicpm


def test_minicpm_python_call_syntax() -> None:
    text = (
        "<think>search first</think>I will search.<|tool_call_start|>\n```python\n"
        "search(query=\"agent rl\", top_k=3)\nfetch.url(url=['a', 'b'], raw=True)\n```\n<|tool_call_end|>"
    )
    result = get_parser("minicpm").parse(text)
    assert result.reasoning == "search first" and result.content == "I will search."
    assert calls(result) == [("search", {"query": "agent rl", "top_k": 3}),
                             ("fetch.url", {"url": ["a", "b"], "raw": True})]


def test_minicpm_list_of_calls_and_malformed_ones() -> None:
    text = (
        "<|tool_call_start|>[f(x=1), g(y='2')]<|tool_call_end|>"
        "<|tool_call_start|>h(1)<|tool_call_end|>"
        "<|tool_call_start|>k(x=open('f'))<|tool_call_end|>"
        "<|tool_call_start|>import os<|tool_call_end|>"
        "<|tool_call_start|>f(x=<|tool_call_end|>"
    )
    result = get_parser("minicpm").parse(text)
    assert [(c.name, c.arguments, c.ok) for c in result.calls[:2]] == [("f", {"x": 1}, True), ("g", {"y": "2"}, True)]
    errors = [c.error for c in result.calls[2:]]
    assert result.error.startswith("Call 3: Could not parse the tool call (use keyword arguments only)")
    assert "Call 6:" in result.error
    assert len(errors) == 4 and all(e and "<|tool_call_start|>" in e for e in errors)
    assert "keyword arguments only" in errors[0]
    assert "malformed node" in errors[1] or "literal" in errors[1].lower()  # no code runs: literals only
    assert "Expected only tool calls" in errors[2]


# ------------------------------------------------------------------------------------------------ the registry


def test_registry() -> None:
    assert {"qwen", "hermes", "openai", "minicpm"} <= set(PARSERS)
    with pytest.raises(KeyError, match="unknown tool-call parser 'nope'; available: .*minicpm"):
        get_parser("nope")

    def shout(text: str, tool_calls: object = None) -> ParseResult:
        return ParseResult(content=text.upper())

    parser = register_parser("test-shout", shout)
    try:
        assert get_parser("test-shout") is parser and parser.name == "test-shout"
        assert parser.parse("hi").content == "HI"
    finally:
        PARSERS.pop("test-shout")


def test_error_taxonomy_values() -> None:
    assert [str(s) for s in CALL_ERROR_STATUSES] == ["formaterror", "toolfailed", "repeaterror"]
    assert [o.value for o in TrajectoryOutcome] == [
        "answer", "turns_limit_error", "length_limit_error", "repetition_error", "failed_error", "done",
        "env_start_error", "env_error", "vision_token_error"]
    assert {"failed_error", "env_start_error", "env_error"} == NO_VERDICT_OUTCOMES


def test_load_json_object_rejects_non_objects() -> None:
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        load_json_object("[1, 2]")
