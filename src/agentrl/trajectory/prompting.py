"""The first messages of a trajectory: system prompt (with tool instructions where the template ignores tools),
and the user prompt built from the Task."""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Think step by step and use the tools when they help."
DEFAULT_QUERY_PROMPT = "{query}"
ANSWER_FORMATS = {
    "boxed": "When you know the final answer, write it as \\boxed{answer}.",
    "answer": "When you know the final answer, write it between <answer> and </answer>.",
    "gsm8k": "When you know the final answer, write it as a number on the last line after ####, e.g. #### 42.",
    "code": "Answer with the complete function, imports included, in one ```python code block.",
}


def template_renders_tools(tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template puts ``tools`` into the prompt (many small models' templates ignore them)."""
    probe = [{"role": "user", "content": "hi"}]
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that chokes on tools does not render them
        return False
    return with_tools != without


def tool_instructions(tools: list[dict[str, Any]]) -> str:
    """Tool descriptions and the ``<tool_call>`` call format, for a system prompt."""
    specs = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call these tools (JSON schemas):\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call a tool, write exactly:\n"
        '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>\n'
        "and stop; the tool's result comes back in the next message."
    )


def system_prompt_for(system_prompt: str | None, answer_schema: str) -> str:
    """A Task's own system prompt as written; else the default one, saying how to mark the answer."""
    return system_prompt or f"{DEFAULT_SYSTEM_PROMPT}\n{ANSWER_FORMATS.get(answer_schema, '')}".rstrip()


def initial_messages(
    *,
    query: str,
    answer_schema: str,
    system_prompt: str | None,
    tools: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    query_prompt: str = DEFAULT_QUERY_PROMPT,
    images: list[str] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools_for_template)``: tools go to the template if it renders them, else into the system prompt.
    A Task's ``images`` (sha256) come before its text in the user message, as ``{"type": "image", "image": SHA256}``
    parts (the order of Qwen-VL's own examples)."""
    system = system_prompt_for(system_prompt, answer_schema)
    template_tools: list[dict[str, Any]] | None = None
    if tools:
        if template_renders_tools(tokenizer, tools):
            template_tools = tools
        else:
            system = f"{system}\n\n{tool_instructions(tools)}"
    user: str | list[dict[str, Any]] = query_prompt.format(query=query)
    if images:
        user = [*({"type": "image", "image": sha256} for sha256 in images), {"type": "text", "text": user}]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}], template_tools
