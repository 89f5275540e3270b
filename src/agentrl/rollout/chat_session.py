"""An interactive chat over the agent loop's building blocks (behind ``agentrl chat``).

Each user message is appended to a :class:`~agentrl.rollout.conversation.TokenConversation` (token ids in and
out, rendered by the model's chat template exactly as in training rollouts, with the same system prompt and tool
instructions as :func:`~agentrl.trajectory.prompting.initial_messages`); the model generates; tool calls in its
output are parsed with the ``--tool_call_parser`` parser and run through the :class:`~agentrl.tools.ToolManager`,
their results appended as ``tool`` messages; generation goes on until the model replies without a tool call, at
most ``max_turns`` model calls per user message. Everything that happens is reported as :class:`ChatEvent` s
through a callback, as it happens, so a front end can print it line by line.

A failed or interrupted user turn (inference error, Ctrl-C) leaves the conversation as it was before it.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from agentrl.rollout.conversation import TokenConversation
from agentrl.rollout.tool_parsers import ToolParser
from agentrl.trajectory.prompting import initial_messages


class EventKind(StrEnum):
    REASONING = "reasoning"  # text before the last </think>
    ASSISTANT = "assistant"  # the visible reply (tool calls removed)
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    NOTICE = "notice"  # something about the session itself (limits hit, truncated output)


@dataclass(frozen=True)
class ChatEvent:
    kind: EventKind
    text: str
    name: str | None = None
    ok: bool = True


class Generator(Protocol):
    """What generates: ``SGLangClient.generate`` (token ids in; a ``GenerateResult`` out)."""

    def __call__(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Awaitable[Any]: ...


@dataclass
class ChatSettings:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_turns: int = 8
    system_prompt: str | None = None
    answer_schema: str = "boxed"
    """How the default system prompt asks for final answers (an answer schema, or ``none``)."""
    tool_timeout: float = 60.0

    def sampling_params(self, call: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k}
        if self.seed is not None:
            params["sampling_seed"] = self.seed + call
        return params


@dataclass
class ChatReply:
    """The outcome of one user message."""

    text: str = ""
    model_calls: int = 0
    tool_calls: int = 0
    finished: bool = True
    """False when ``max_turns`` model calls ended without a reply free of tool calls."""
    events: list[ChatEvent] = field(default_factory=list)


class ChatSession:
    """A multi-turn conversation with one model (see the module docstring)."""

    def __init__(self, tokenizer: Any, generate: Generator, parser: ToolParser, *, tools: Any | None = None,
                 settings: ChatSettings | None = None):
        self.tokenizer, self.generate, self.parser, self.tools = tokenizer, generate, parser, tools
        self.settings = settings or ChatSettings()
        self.conversation: TokenConversation | None = None
        self._pending: tuple[list[int], str] | None = None  # the last reply, appended with the next user message
        self._calls = 0

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        return self.tools.openai_tools() if self.tools is not None else []

    def reset(self) -> None:
        """Forget the conversation (the next message starts a new one)."""
        self.conversation, self._pending = None, None

    def _add_user_message(self, text: str) -> None:
        if self.conversation is None:
            messages, template_tools = initial_messages(
                query=text, answer_schema=self.settings.answer_schema, system_prompt=self.settings.system_prompt,
                tools=self.tool_specs, tokenizer=self.tokenizer)
            self.conversation = TokenConversation(self.tokenizer, messages, template_tools)
        elif self._pending is not None:
            output_ids, output_text = self._pending
            self.conversation.append(output_ids, output_text, [{"role": "user", "content": text}])
        else:  # the last turn ended on tool results (max_turns): render afresh with the new message
            self.conversation.restart([*self.conversation.messages, {"role": "user", "content": text}])
        self._pending = None

    async def send(self, text: str, on_event: Callable[[ChatEvent], None] | None = None) -> ChatReply:
        """Answer one user message: generate, run tool calls, repeat until a reply without tool calls."""
        snapshot = (copy.copy(self.conversation), self._pending)
        reply = ChatReply()

        def emit(event: ChatEvent) -> None:
            reply.events.append(event)
            if on_event is not None:
                on_event(event)

        try:
            self._add_user_message(text)
            conversation = self.conversation
            assert conversation is not None
            for _ in range(self.settings.max_turns):
                result = await self.generate(list(conversation.prompt_ids),
                                             self.settings.sampling_params(self._calls))
                self._calls += 1
                reply.model_calls += 1
                parsed = self.parser.parse(result.text)
                if parsed.reasoning and parsed.reasoning.strip():
                    emit(ChatEvent(EventKind.REASONING, parsed.reasoning.strip()))
                if parsed.content.strip():
                    emit(ChatEvent(EventKind.ASSISTANT, parsed.content.strip()))
                if result.finish_reason == "length":
                    emit(ChatEvent(EventKind.NOTICE, f"output cut at max_new_tokens "
                                                     f"({self.settings.max_new_tokens})", ok=False))
                if not parsed.calls:
                    reply.text = parsed.content.strip()
                    self._pending = (list(result.output_ids), result.text)
                    return reply
                messages = await self._run_tools(parsed.calls, emit)
                reply.tool_calls += len(parsed.calls)
                conversation.append(list(result.output_ids), result.text, messages)
            reply.finished = False
            emit(ChatEvent(EventKind.NOTICE, f"stopped after {self.settings.max_turns} model calls without a reply "
                                             "free of tool calls (--max_turns)", ok=False))
            return reply
        except BaseException:
            self.conversation, self._pending = snapshot
            raise

    async def _run_tools(self, calls: list[Any], emit: Callable[[ChatEvent], None]) -> list[dict[str, Any]]:
        import json

        messages = []
        for call in calls:
            shown = call.raw.strip() if call.error is not None else (
                f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})")
            emit(ChatEvent(EventKind.TOOL_CALL, shown, name=call.name or None, ok=call.error is None))
            if call.error is not None:
                ok, content = False, call.error
            elif self.tools is None:
                ok, content = False, "no tools are available in this environment; answer directly"
            else:
                result = await self.tools.call_tool(call.name, call.arguments, timeout=self.settings.tool_timeout)
                ok, content = result.ok, result.text
            emit(ChatEvent(EventKind.TOOL_RESULT, content, name=call.name or None, ok=ok))
            messages.append({"role": "tool", "name": call.name or "invalid_call", "content": content})
        return messages
