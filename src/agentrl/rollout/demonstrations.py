"""Tool-use demonstrations for a supervised warm start, made by calling the real tool servers.

A demonstration of a Task is the conversation a perfect agent would have: the system prompt and user prompt
exactly as the agent loop renders them (:func:`agentrl.trajectory.prompting.initial_messages`), one assistant turn
per demonstrated tool call (as ``tool_calls``; the upload writes them in the ``<tool_call>`` format the ``qwen``
parser reads, as the model is to write them), the tool's **real** result (the call goes over MCP to the same server the
rollouts use), and a last turn giving the Task's answer in its answer schema. It is written in the OpenAI ``messages``
form that ``agentrl sft upload`` reads, which renders it with the chat template into the same token ids as a rollout
that produced these outputs (the system message holds the prompt without the tool instructions; ``tools`` carries the
specs, and the upload adds the instructions exactly as the agent loop does). A Task's pictures come before its text in
the user message, as ``image_url`` parts with ``data:`` URIs, where the agent loop puts them.

Which calls a Task demonstrates: its ``demo_calls`` metadata (a list of ``{"name", "arguments"}``), or, for
calculator tasks such as the built-in set, ``calculate`` with its ``expression``. A Task with a **worked solution**
needs no tools: its ``demo_response`` metadata, or, under the ``gsm8k`` answer schema, its GSM8K answer (the
reasoning ending ``#### N``), is the one assistant turn.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl.store.models import Task
from agentrl.tools import ToolManager
from agentrl.trajectory.prompting import system_prompt_for
from agentrl.vision.images import LoadedImage

ANSWER_TEMPLATES = {
    "boxed": "The answer is \\boxed{{{answer}}}.",
    "answer": "The answer is <answer>{answer}</answer>.",
    "gsm8k": "#### {answer}",
    "code": "```python\n{answer}\n```",
}


class DemonstrationError(ValueError):
    """A Task cannot be demonstrated (no calls to show, no answer, or a tool call that fails)."""


def demo_calls(task: Task) -> list[dict[str, Any]]:
    """The tool calls that solve ``task``: its ``demo_calls`` metadata, else ``calculate(expression)``."""
    calls = task.metadata.get("demo_calls")
    if calls is None and task.metadata.get("expression"):
        calls = [{"name": "calculate", "arguments": {"expression": str(task.metadata["expression"])}}]
    if not calls:
        raise DemonstrationError("no calls to demonstrate: give the task 'demo_calls' ([{\"name\": ..., "
                                 "\"arguments\": {...}}]) or a calculator 'expression'")
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
            for c in calls):
        raise DemonstrationError("'demo_calls' must be a list of {\"name\": str, \"arguments\": object}")
    return [{"name": c["name"], "arguments": c.get("arguments", {})} for c in calls]


def worked_solution(task: Task) -> str | None:
    """The task's worked solution, which is demonstrated as it is: ``demo_response``, else a GSM8K answer."""
    response = task.metadata.get("demo_response")
    if isinstance(response, str) and response.strip():
        return response
    if task.answer_schema == "gsm8k" and task.answer and "####" in task.answer:
        return task.answer
    return None


def check(task: Task) -> list[dict[str, Any]]:
    """What can be checked without the tools: ``task``'s calls, none for a worked solution (``DemonstrationError``
    if it cannot be shown)."""
    if task.answer is None or task.answer == "":
        raise DemonstrationError("the task has no answer to demonstrate")
    if task.answer_schema not in ANSWER_TEMPLATES:
        raise DemonstrationError(f"answer schema {task.answer_schema!r} has no demonstration form "
                                 f"(known: {', '.join(ANSWER_TEMPLATES)})")
    if worked_solution(task) is not None and "demo_calls" not in task.metadata:
        return []
    return demo_calls(task)


async def demonstrate(task: Task, tools: ToolManager | None, *, query_prompt: str = "{query}",
                      images: dict[str, LoadedImage] | None = None) -> dict[str, Any]:
    """The demonstration of ``task`` in the SFT ``messages`` form (see the module docstring); ``tools`` may be
    None for tasks that need no calls; ``images`` holds the Task's pictures by sha256."""
    calls = check(task)
    user: str | list[dict[str, Any]] = query_prompt.format(query=task.query)
    if task.images:
        missing = [sha256 for sha256 in task.images if sha256 not in (images or {})]
        if missing:
            raise DemonstrationError(f"the task's image {missing[0]} was not loaded")
        user = [*({"type": "image_url", "image_url": {"url": images[sha256].data_uri()}} for sha256 in task.images),
                {"type": "text", "text": user}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt_for(task.system_prompt, task.answer_schema)},
        {"role": "user", "content": user},
    ]
    if calls and tools is None:
        raise DemonstrationError("the task's calls need tool servers: give --tools or --mcp_config")
    for call in calls:
        result = await tools.call_tool(call["name"], call["arguments"])
        if not result.ok:
            raise DemonstrationError(f"the tool call {call['name']}({json.dumps(call['arguments'])}) failed: "
                                     f"{result.error}")
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": call["name"], "content": result.text})
    solution = worked_solution(task) if not calls else None
    final = solution or ANSWER_TEMPLATES[task.answer_schema].format(answer=task.answer)
    messages.append({"role": "assistant", "content": final})
    source = task.id.split(":", 1)[-1]  # without the split prefix
    return {"id": f"demo:{source}", "task_id": source, "tools": tools.openai_tools() if tools else [],
            "messages": messages}
