"""Export of Records with their turns, for audits and SFT reuse.

Two formats, one JSON object per Record: ``messages`` (OpenAI chat messages: system, user, then per LLM call the
assistant message with its tool calls and the tool messages that answered them) and ``agentgym`` (AgentGym's
``conversations`` with ``from`` = human/gpt, ``value`` and ``loss``: true on the model's turns).

Images (a Task's pictures, a tool result's) are written once each beside the export, as ``<sha256>.<ext>`` in the
images directory (``agentrl export``: ``FILE.images/``), and referenced by their path relative to the export file:
as OpenAI ``image_url`` content parts in ``messages`` (a Task's before its text, a tool result's after), and in
every object's ``images`` (all of the Record's, in order of appearance).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TextIO

from pymongo.database import Database

from agentrl.store.images import read_image_sync
from agentrl.store.models import DispatchedSamplingTask, Record, Task

ExportFormat = Literal["messages", "agentgym"]


def _with_images(text: str, images: list[str], image_path, *, first: bool) -> str | list[dict[str, Any]]:
    """``text`` alone, or OpenAI content parts with ``images`` (before the text with ``first``, else after)."""
    if not images:
        return text
    parts = [{"type": "image_url", "image_url": {"url": image_path(sha256)}} for sha256 in images]
    text_part = [{"type": "text", "text": text}]
    return parts + text_part if first else text_part + parts


def record_messages(task: Task, calls: list[DispatchedSamplingTask],
                    image_path=lambda sha256: sha256) -> list[dict[str, Any]]:
    """The conversation of one trajectory as OpenAI chat messages; ``image_path(sha256)`` is an image's URL."""
    messages: list[dict[str, Any]] = []
    if task.system_prompt:
        messages.append({"role": "system", "content": task.system_prompt})
    messages.append({"role": "user", "content": _with_images(task.query, task.images, image_path, first=True)})
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
                             "name": result.get("name"), "content": _with_images(
                                 result.get("content", ""), result.get("images") or [], image_path, first=False)})
    return messages


def to_agentgym(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """AgentGym ``conversations``: the system prompt joins the first human turn; tool results are human turns."""
    conversations: list[dict[str, Any]] = []
    pending_system = ""
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if isinstance(content, list):  # the pictures are listed in the object's "images"
            content = "\n".join(part["text"] for part in content if part.get("type") == "text")
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
                statuses: list[str] | None = None, images: ImageFiles | None = None) -> Iterator[dict[str, Any]]:
    """One export object per Record (ordered by task, slot, attempt); ``images`` writes its pictures."""
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
        used = list(dict.fromkeys([*task.images, *(sha256 for call in calls for result in call.tool_results
                                                      for sha256 in result.get("images") or [])]))
        paths = {sha256: images.write(sha256) if images is not None else sha256 for sha256 in used}
        messages = record_messages(task, calls, paths.__getitem__)
        item: dict[str, Any] = {
            "record_id": record.id, "task_id": record.task_id, "split": record.split, "slot": record.slot,
            "attempt": record.attempt, "status": str(record.status), "score": record.score,
            "outcome": record.outcome, "answer": task.answer, "final_answer": record.final_answer,
            "num_turns": len(calls), "call_statuses": [str(c.status) for c in calls],
            "images": [paths[sha256] for sha256 in used],
        }
        if fmt == "agentgym":
            item["conversations"] = to_agentgym(messages)
        else:
            item["messages"] = messages
        yield item


class ImageFiles:
    """Writes a database's images once each into ``directory`` (``<sha256>.<ext>``, complete before they appear
    under their name); :meth:`write` returns an image's path as the export refers to it (relative to
    ``relative_to``, the export file's directory)."""

    def __init__(self, db: Database, directory: Path, relative_to: Path):
        self.db, self.directory, self.relative_to = db, directory, relative_to
        self.written: dict[str, str] = {}

    def write(self, sha256: str) -> str:
        if sha256 not in self.written:
            image = read_image_sync(self.db, sha256)
            self.directory.mkdir(parents=True, exist_ok=True)
            target = self.directory / f"{sha256}.{image.format.lower()}"
            if not target.exists():
                partial = target.with_name(target.name + ".partial")
                partial.write_bytes(image.data)
                partial.replace(target)
            self.written[sha256] = os.path.relpath(target, self.relative_to)
        return self.written[sha256]


def write_export(db: Database, out: TextIO, **kwargs: Any) -> int:
    """Write the export as JSON lines; returns how many Records were written."""
    count = 0
    for item in iter_export(db, **kwargs):
        out.write(json.dumps(item, ensure_ascii=False, default=str) + "\n")
        count += 1
    return count
