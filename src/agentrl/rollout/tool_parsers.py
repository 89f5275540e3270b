"""Tool-call parsers, selected by name (``--tool_call_parser``), and the error taxonomy of agent turns.

``get_parser(name).parse(text)`` turns one model output into a ``ParseResult``: the visible text (after the
last ``</think>``, tool calls removed), the reasoning before it, and the tool calls in order. A call that cannot
be understood is kept in place with ``error`` set to a message for the model (``ParseResult.error`` sums them
up); the agent loop records it as ``formaterror`` and the trajectory goes on.

Parsers:

- ``qwen`` / ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, with the original's
  tolerant fallbacks: an unclosed block at the end of the output, code fences, the first balanced ``{...}``
  when there is text around the JSON, Python-style literals (single quotes, ``True``), arguments given as a
  JSON string, ``{"content": {...}}`` / ``{"function": {...}}`` wrappers, and a ``<code>...</code>`` block after
  the JSON that becomes the ``code`` argument when the JSON has none.
- ``openai``: structured ``tool_calls`` of a chat-completion message (objects or dicts, arguments as a JSON
  string or an object); when there are none, the text is parsed like ``qwen`` (as the original did).
- ``minicpm``: ``<|tool_call_start|> ... <|tool_call_end|>`` blocks holding Python call syntax
  (``search(query="x", top_k=3)``, optionally in a ```` ```python ```` fence, several calls allowed).
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel, Field

from agentrl.store.models import CallStatus, FailureClass

# ------------------------------------------------------------------------------------------------ error taxonomy

FORMATERROR = CallStatus.FORMATERROR
"""A call that could not be parsed, names an unknown tool, or violates the tool's schema (the model is told why)."""
TOOLFAILED = CallStatus.TOOLFAILED
"""A call the tool could not serve: the server died, timed out, or reported an error."""
REPEATERROR = CallStatus.REPEATERROR
"""The model repeated an earlier turn verbatim."""
CALL_ERROR_STATUSES: tuple[CallStatus, ...] = (FORMATERROR, TOOLFAILED, REPEATERROR)


class TrajectoryOutcome(StrEnum):
    """How a trajectory ended (``Record.outcome``)."""

    ANSWER = "answer"
    """The model gave a final answer in the task's answer schema."""
    TURNS_LIMIT_ERROR = "turns_limit_error"
    """``--max_turns`` turns without an answer."""
    LENGTH_LIMIT_ERROR = "length_limit_error"
    """The context outgrew ``--max_prompt_tokens`` and no context strategy could shrink it."""
    REPETITION_ERROR = "repetition_error"
    """The model repeated itself ``--repetition_early_stop_times`` times."""
    FAILED_ERROR = "failed_error"
    """Inference failed (after retries) or another error ended the trajectory."""
    DONE = "done"
    """An environment episode ended: the environment reported ``done`` (its reward is the score)."""
    ENV_START_ERROR = "env_start_error"
    """The environment instance could not be created or reset (no verdict on the policy)."""
    ENV_ERROR = "env_error"
    """The environment failed during the episode (no verdict on the policy)."""
    VISION_TOKEN_ERROR = "vision_token_error"
    """A vision-language policy generated an image or video placeholder token (``<|image_pad|>``) that no picture
    stands behind: its ids can be neither served again nor trained (a verdict on the policy, never trained)."""


NO_VERDICT_OUTCOMES: frozenset[str] = frozenset({TrajectoryOutcome.FAILED_ERROR, TrajectoryOutcome.ENV_START_ERROR,
                                                 TrajectoryOutcome.ENV_ERROR})
"""Outcomes that say nothing about the policy (infrastructure failed): never trained, errors in evaluations."""
NEVER_TRAINED_OUTCOMES: frozenset[str] = NO_VERDICT_OUTCOMES | {TrajectoryOutcome.VISION_TOKEN_ERROR}
"""Outcomes the group stage always drops: no verdict, or ids no trainer can forward (a generated picture placeholder:
a verdict on the policy, wrong in evaluations)."""

OUTCOME_FAILURES: dict[str, FailureClass] = {
    TrajectoryOutcome.FAILED_ERROR: FailureClass.ABORTED_GENERATION,
    TrajectoryOutcome.ENV_START_ERROR: FailureClass.ENVIRONMENT_ERROR,
    TrajectoryOutcome.ENV_ERROR: FailureClass.ENVIRONMENT_ERROR,
    TrajectoryOutcome.LENGTH_LIMIT_ERROR: FailureClass.CONTEXT_LIMIT,
    TrajectoryOutcome.TURNS_LIMIT_ERROR: FailureClass.TURN_LIMIT,
    TrajectoryOutcome.REPETITION_ERROR: FailureClass.REPETITION,
    TrajectoryOutcome.VISION_TOKEN_ERROR: FailureClass.VISION_TOKEN,
}
"""The failure class of a Record not trained because of how its trajectory ended (outcomes not listed: its group
stage decision says why)."""


# ------------------------------------------------------------------------------------------------ parse results


class ParsedToolCall(BaseModel):
    """One tool call; ``error`` is set (and ``name`` may be empty) when it could not be understood."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")
    name: str = ""
    arguments: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    raw: str = Field("", description="the text of the call as the model wrote it")

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_openai(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


class ParseResult(BaseModel):
    """What a model output contains."""

    content: str = Field(description="visible text: after the last </think>, with the tool calls removed")
    reasoning: str | None = Field(None, description="text before the last </think>, if any")
    calls: list[ParsedToolCall] = Field(default_factory=list)

    @property
    def format_errors(self) -> list[ParsedToolCall]:
        """The calls that could not be understood."""
        return [call for call in self.calls if not call.ok]

    @property
    def error(self) -> str | None:
        """A message for the model naming every call that could not be understood (``None`` if there is none)."""
        errors = self.format_errors
        if not errors:
            return None
        if len(errors) == 1:
            return errors[0].error
        return " ".join(f"Call {self.calls.index(call) + 1}: {call.error}" for call in errors)


class ParseFunction(Protocol):
    def __call__(self, text: str, tool_calls: Sequence[Any] | None = None) -> ParseResult: ...


@dataclass(frozen=True)
class ToolParser:
    """A named parser: ``parse(text, tool_calls=None)``, ``tool_calls`` being structured calls where an API gives
    them (OpenAI chat completions)."""

    name: str
    function: ParseFunction

    def parse(self, text: str, tool_calls: Sequence[Any] | None = None) -> ParseResult:
        return self.function(text, tool_calls)


# ---------------------------------------------------------------------------------------------- tolerant JSON

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_LITERALS = {"true": "True", "false": "False", "null": "None"}


def _strip_fence(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1) if match else text


def first_balanced_object(text: str) -> str | None:
    """The balanced ``{...}`` starting at the first ``{`` of ``text`` (braces in quoted strings skipped); ``None`` if
    there is no ``{`` or it is never closed."""
    start = text.find("{")
    if start == -1:
        return None
    depth, quote, escaped = 0, "", False
    for index in range(start, len(text)):
        char = text[index]
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start : index + 1]
    return None


def _python_literal(text: str) -> Any:
    """Parse JSON-like text as a Python literal (``true``/``false``/``null`` mapped outside strings)."""
    tokens = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME and token.string in _LITERALS:
            token = token._replace(string=_LITERALS[token.string])
        tokens.append(token)
    return ast.literal_eval(tokenize.untokenize(tokens).strip())


def load_json_object(text: str) -> dict[str, Any]:
    """Parse a JSON object leniently (see the module docstring); ``ValueError`` says what is wrong."""
    candidate = _strip_fence(text.strip())
    attempts = [candidate]
    balanced = first_balanced_object(candidate)
    if balanced is not None and balanced != candidate:
        attempts.append(balanced)
    for attempt in attempts:
        try:
            value = json.loads(attempt)
        except json.JSONDecodeError:
            try:
                value = _python_literal(attempt)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, tokenize.TokenError):
                continue
        if isinstance(value, dict):
            return value
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    if balanced is None:
        raise ValueError("unbalanced braces" if "{" in candidate else "no JSON object found")
    raise ValueError("invalid JSON")


# --------------------------------------------------------------------------------------------------- helpers

_THINK_END = "</think>"
_HERMES_FORMAT = (
    'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>.'
)


def _split_reasoning(text: str) -> tuple[str | None, str]:
    if _THINK_END in text:
        reasoning, _, visible = text.rpartition(_THINK_END)
        return reasoning.replace("<think>", "", 1).strip(), visible
    return None, text


def _blocks(text: str, start_tag: str, end_tag: str) -> tuple[list[str], str]:
    """Bodies of ``start_tag ... end_tag`` blocks (the last may be unclosed) and the text around them."""
    bodies: list[str] = []
    outside: list[str] = []
    position = 0
    while True:
        start = text.find(start_tag, position)
        if start == -1:
            outside.append(text[position:])
            break
        outside.append(text[position:start])
        body_start = start + len(start_tag)
        end = text.find(end_tag, body_start)
        if end == -1:
            bodies.append(text[body_start:])
            break
        bodies.append(text[body_start:end])
        position = end + len(end_tag)
    return bodies, "".join(outside).strip()


def _coerce_arguments(value: Any) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return load_json_object(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise ValueError(f"'arguments' must be a JSON object, got {type(value).__name__}")


def _call_from_object(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    for wrapper in ("function", "content"):
        inner = obj.get(wrapper)
        if isinstance(inner, dict) and "name" in inner and "name" not in obj:
            obj = inner
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError('missing the tool "name"')
    arguments = obj.get("arguments", obj.get("parameters"))
    return name.strip(), _coerce_arguments(arguments)


# --------------------------------------------------------------------------------------------------- parsers

_CODE_BLOCK = re.compile(r"<code>(.*?)(?:</code>|$)", re.DOTALL)


def _hermes_call(body: str) -> ParsedToolCall:
    json_part, code = body, None
    code_match = _CODE_BLOCK.search(body)
    if code_match:
        json_part, code = body[: code_match.start()], code_match.group(1).strip("\n")
    try:
        name, arguments = _call_from_object(load_json_object(json_part))
    except ValueError as exc:
        return ParsedToolCall(error=f"Could not parse the tool call ({exc}). {_HERMES_FORMAT}", raw=body)
    if code is not None and "code" not in arguments:
        arguments["code"] = code
    return ParsedToolCall(name=name, arguments=arguments, raw=body)


def parse_hermes(text: str, tool_calls: Sequence[Any] | None = None) -> ParseResult:
    """Qwen / Hermes ``<tool_call>`` JSON blocks (``tool_calls`` is ignored)."""
    reasoning, visible = _split_reasoning(text)
    bodies, content = _blocks(visible, "<tool_call>", "</tool_call>")
    return ParseResult(content=content, reasoning=reasoning, calls=[_hermes_call(body) for body in bodies])


def _as_dict(obj: Any) -> dict[str, Any]:
    """A tool call (or its ``function``) as a dict: mappings, pydantic models and plain objects."""
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return {key: getattr(obj, key) for key in ("id", "type", "function", "name", "arguments") if hasattr(obj, key)}


def parse_openai(text: str, tool_calls: Sequence[Any] | None = None) -> ParseResult:
    """Structured OpenAI ``tool_calls``; without any, the text is parsed like ``qwen``."""
    if not tool_calls:
        return parse_hermes(text or "")
    reasoning, visible = _split_reasoning(text or "")
    calls: list[ParsedToolCall] = []
    for item in tool_calls:
        entry = _as_dict(item)
        function = _as_dict(entry.get("function") or {})
        raw = json.dumps({"function": function}, ensure_ascii=False, default=str)
        call_id = entry.get("id") or f"call_{uuid.uuid4().hex[:16]}"
        try:
            name, arguments = _call_from_object(function)
        except ValueError as exc:
            calls.append(ParsedToolCall(id=call_id, name=str(function.get("name") or ""), raw=raw,
                                        error=f"Could not parse the tool call ({exc})."))
            continue
        calls.append(ParsedToolCall(id=call_id, name=name, arguments=arguments, raw=raw))
    return ParseResult(content=visible.strip(), reasoning=reasoning, calls=calls)


_MINICPM_FORMAT = (
    'Write calls as <|tool_call_start|>```python\ntool_name(argument="value")\n```<|tool_call_end|> '
    "with keyword arguments and literal values."
)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("the called object must be a tool name")


def _minicpm_calls(body: str) -> list[ParsedToolCall]:
    source = _strip_fence(body.strip())
    try:
        tree = ast.parse(source, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return [ParsedToolCall(error=f"Could not parse the tool call ({exc}). {_MINICPM_FORMAT}", raw=body)]
    nodes: list[ast.expr] = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            return [ParsedToolCall(error=f"Expected only tool calls. {_MINICPM_FORMAT}", raw=body)]
        value = statement.value
        nodes.extend(value.elts if isinstance(value, ast.List | ast.Tuple) else [value])
    calls: list[ParsedToolCall] = []
    for node in nodes:
        raw = ast.get_source_segment(source, node) or ""
        try:
            if not isinstance(node, ast.Call):
                raise ValueError("expected a call such as tool_name(argument=value)")
            if node.args:
                raise ValueError("use keyword arguments only")
            arguments: dict[str, Any] = {}
            for keyword in node.keywords:
                if keyword.arg is None:
                    raise ValueError("**kwargs is not supported")
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            calls.append(ParsedToolCall(name=_dotted_name(node.func), arguments=arguments, raw=raw))
        except ValueError as exc:
            calls.append(ParsedToolCall(error=f"Could not parse the tool call ({exc}). {_MINICPM_FORMAT}", raw=raw))
    return calls


def parse_minicpm(text: str, tool_calls: Sequence[Any] | None = None) -> ParseResult:
    """MiniCPM ``<|tool_call_start|>`` blocks of Python call syntax (``tool_calls`` is ignored)."""
    reasoning, visible = _split_reasoning(text)
    bodies, content = _blocks(visible, "<|tool_call_start|>", "<|tool_call_end|>")
    return ParseResult(content=content, reasoning=reasoning,
                       calls=[call for body in bodies for call in _minicpm_calls(body)])


# --------------------------------------------------------------------------------------------------- registry

PARSERS: dict[str, ToolParser] = {
    name: ToolParser(name, function)
    for name, function in (
        ("qwen", parse_hermes), ("hermes", parse_hermes), ("openai", parse_openai), ("minicpm", parse_minicpm),
    )
}


def register_parser(name: str, function: ParseFunction) -> ToolParser:
    """Add (or replace) a parser under ``name``; ``function(text, tool_calls=None)`` returns a ``ParseResult``."""
    parser = PARSERS[name] = ToolParser(name, function)
    return parser


def get_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ``KeyError`` lists the known names."""
    try:
        return PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; available: {', '.join(sorted(PARSERS))}") from None
