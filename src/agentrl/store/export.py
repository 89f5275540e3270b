"""Export of Records with their turns, for audits and SFT reuse.

Two formats, one JSON object per Record: ``messages`` (OpenAI chat messages: system, user, then per LLM call the
assistant message with its tool calls and the tool messages that answered them) and ``agentgym`` (AgentGym's
``conversations`` with ``from`` = human/gpt, ``value`` and ``loss``: true on the model's turns).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal, TextIO

from pymongo.database import Database

from agentrl.store.models import DispatchedSamplingTask, Record, Task

ExportFormat = Literal["messages", "agentgym"]


def record_messages(task: Task, calls: list[DispatchedSamplingTask]) -> list[dict[str, Any]]:
    """The conversation of one trajectory as OpenAI chat messages."""
    messages: list[dict[str, Any]] = []
    if task.system_prompt:
        messages.append({"role": "system", "content": task.system_prompt})
    messages.append({"role": "user", "content": task.query})
    for call in calls:
        assistant: dict[str, Any] = {"role": "assistant", "content": call.output_text}
        if call.tool_calls:
            assistant["tool_calls"] = [
                {"id": tc.get("id", f"call_{call.turn}_{i}"), "type": "function",
                 "function": {"name": tc.get("name"), "arguments": json.dumps(tc.get("arguments", {}),
                                                                              ensure_ascii=False)}}
                for i, tc in enumerate(call.tool_calls)]
        messages.append(assistant)
        for i, result in enumerate(call.tool_results):
            messages.append({"role": "tool", "tool_call_id": result.get("id", f"call_{call.turn}_{i}"),
                             "name": result.get("name"), "content": result.get("content", "")})
    return messages


def to_agentgym(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """AgentGym ``conversations``: the system prompt joins the first human turn; tool results are human turns."""
    conversations: list[dict[str, Any]] = []
    pending_system = ""
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system":
            pending_system = content + "\n\n"
            continue
        if role == "assistant":
            calls = message.get("tool_calls") or []
            text = content if not calls else content or "\n".join(
                json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                           ensure_ascii=False) for c in calls)
            conversations.append({"from": "gpt", "value": text, "loss": True})
        else:
            conversations.append({"from": "human", "value": pending_system + content, "loss": False})
            pending_system = ""
    return conversations


def iter_export(db: Database, *, fmt: ExportFormat = "messages", split: str | None = None,
                statuses: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """One export object per Record (ordered by task, slot, attempt)."""
    query: dict[str, Any] = {}
    if split:
        query["split"] = split
    if statuses:
        query["status"] = {"$in": statuses}
    tasks: dict[str, Task | None] = {}
    for doc in db[Record.collection].find(query, sort=[("task_id", 1), ("slot", 1), ("attempt", 1)]):
        record = Record.from_mongo(doc)
        if record.task_id not in tasks:
            tasks[record.task_id] = Task.from_mongo(db[Task.collection].find_one({"_id": record.task_id}))
        task = tasks[record.task_id]
        if task is None:
            continue
        calls = [DispatchedSamplingTask.from_mongo(c) for c in
                 db[DispatchedSamplingTask.collection].find({"record_id": record.id}, sort=[("turn", 1)])]
        messages = record_messages(task, calls)
        item: dict[str, Any] = {
            "record_id": record.id, "task_id": record.task_id, "split": record.split, "slot": record.slot,
            "attempt": record.attempt, "status": str(record.status), "score": record.score,
            "outcome": record.outcome, "answer": task.answer, "final_answer": record.final_answer,
            "num_turns": len(calls), "call_statuses": [str(c.status) for c in calls],
        }
        if fmt == "agentgym":
            item["conversations"] = to_agentgym(messages)
        else:
            item["messages"] = messages
        yield item


def write_export(db: Database, out: TextIO, **kwargs: Any) -> int:
    """Write the export as JSON lines; returns how many Records were written."""
    count = 0
    for item in iter_export(db, **kwargs):
        out.write(json.dumps(item, ensure_ascii=False, default=str) + "\n")
        count += 1
    return count
