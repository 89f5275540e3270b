"""Task files (JSON or JSONL) → validated ``Task`` documents, and their idempotent upload.

Field aliases follow the original AgentRL's dataset loader: the question may be called ``q``, ``Question``,
``question``, ``query``, ``content``, ``instruction`` or ``traj_question`` (or be the first user message of
``messages`` / ``raw.messages``); the answer ``a``, ``Final answer``, ``Final Answer``, ``Final sample answer``,
``answer`` or ``expected_answer`` (or ``raw.expected_answer`` / ``raw.answer``). Per-task fields ``id``
(or ``task_id``), ``scorer``, ``answer_schema``, ``system_prompt``, ``num_generations`` and ``task_type``
override the upload's defaults; ``images`` (a list of image files, relative to the task file, or ``data:`` URIs) are
the pictures the question is about, each checked (``agentrl.vision.images.load_image``) and stored once in the
database's GridFS bucket before the Tasks (which refer to them by sha256); any other field is kept in ``metadata``.
``env: {"name", "data_idx"}`` makes the Task an environment episode (``agentrl.rollout.episode``; ``agentrl envs
tasks`` writes such rows).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pymongo.database import Database

from agentrl.scoring.answers import ANSWER_SCHEMAS
from agentrl.store.images import put_images_sync
from agentrl.store.models import Task
from agentrl.vision.images import ImageError, LoadedImage, decode_image_string, load_image

QUERY_KEYS = ("q", "Question", "question", "query", "content", "instruction", "traj_question")
ANSWER_KEYS = ("a", "Final answer", "Final Answer", "Final sample answer", "answer", "expected_answer")
ID_KEYS = ("id", "task_id")
SCORERS_WITHOUT_ANSWER = ("env_reward", "humaneval")
_KNOWN = set(QUERY_KEYS) | set(ANSWER_KEYS) | set(ID_KEYS) | {
    "messages", "raw", "scorer", "answer_schema", "system_prompt", "num_generations", "task_type", "split", "images"}
_SCORER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class TaskFileError(ValueError):
    """A task file could not be read or has invalid entries; ``problems`` lists ``FILE:LINE: message``."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class UploadDefaults:
    split: str = "train"
    num_generations: int | None = None
    scorer: str = "agentcpm"
    answer_schema: str = "answer"
    max_attempts: int = 3

    def generations(self) -> int:
        """Group size: ``num_generations`` if set, else 8 for ``train`` and 1 for other splits."""
        if self.num_generations is not None:
            return self.num_generations
        return 8 if self.split == "train" else 1


@dataclass
class ParsedFile:
    tasks: list[tuple[int, Task]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    images: dict[str, LoadedImage] = field(default_factory=dict)
    """The Tasks' images by sha256 (stored before the Tasks)."""


def iter_entries(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line, object)`` for every entry of a JSONL file or a JSON file (a list, or one object).

    A line that is not valid JSON yields ``(line, JSONDecodeError)`` so the caller can report it with the others.
    """
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix.lower() == ".json" or (path.suffix.lower() != ".jsonl" and stripped.startswith("[")):
        yield from _iter_json(text)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                yield number, error


def _iter_json(text: str) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    line_of = lambda p: text.count("\n", 0, p) + 1  # noqa: E731
    if pos < len(text) and text[pos] != "[":
        try:
            obj, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            yield error.lineno, error
            return
        yield line_of(pos), obj
        return
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            yield error.lineno, error
            return
        yield line_of(pos), obj
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _first_user_message(messages: Any) -> str | None:
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "user" and message.get("content"):
                return str(message["content"])
    return None


def _pick(obj: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = obj.get(key)
        if value is not None and value != "":
            return value
    return None


def content_hash(query: str, answer: str | None, system_prompt: str | None, images: list[str] | None = None) -> str:
    """The hash of a Task's content (its images' hashes count when it has any)."""
    content = [query, answer, system_prompt, *([images] if images else [])]
    canonical = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def entry_images(value: Any, base_dir: Path | None) -> list[LoadedImage]:
    """The images of an entry's ``images`` field: file paths (relative to ``base_dir``) or ``data:`` URIs;
    ``ValueError`` naming the item and what is wrong."""
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"field 'images': expected a list of image file paths or data: URIs, got {value!r}")
    images = []
    for i, item in enumerate(value):
        where = f"field 'images[{i}]'"
        if item.startswith("data:"):
            images.append(decode_image_string(item, where))
            continue
        path = Path(item) if base_dir is None else base_dir / item
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ValueError(f"{where}: cannot read {str(path)!r} ({error.strerror or error})") from None
        images.append(load_image(data, f"{where} ({item})"))
    return images


def parse_entry(obj: Any, defaults: UploadDefaults, order: int, base_dir: Path | None = None,
                images: dict[str, LoadedImage] | None = None) -> Task:
    """Validate one entry and build its Task; raises ``ValueError`` with a message naming the field. Its images
    (paths relative to ``base_dir``) are added to ``images`` by sha256."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    raw = obj.get("raw") if isinstance(obj.get("raw"), dict) else {}
    query = _pick(obj, QUERY_KEYS) or _first_user_message(obj.get("messages")) or _first_user_message(
        raw.get("messages"))
    if query is None:
        raise ValueError(f"no question: expected one of the fields {', '.join(QUERY_KEYS)} or a user message "
                         "in 'messages'")
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"the question must be a non-empty string, got {query!r}")
    answer = _pick(obj, ANSWER_KEYS)
    if answer is None:
        answer = _pick(raw, ("expected_answer", "answer"))
    if isinstance(answer, (dict, list)):
        raise ValueError(f"the answer must be a string or a number, got {type(answer).__name__}")
    answer = None if answer is None else str(answer).strip()

    scorer = obj.get("scorer", defaults.scorer)
    if not isinstance(scorer, str) or not _SCORER_NAME.match(scorer):
        raise ValueError(f"field 'scorer': expected a scorer name such as 'math' or 'agentcpm', got {scorer!r}")
    if not answer and scorer not in SCORERS_WITHOUT_ANSWER:
        raise ValueError(f"no answer: expected one of the fields {', '.join(ANSWER_KEYS)} "
                         f"(scorer {scorer!r} compares against it)")
    schema = obj.get("answer_schema", defaults.answer_schema)
    if schema not in ANSWER_SCHEMAS:
        raise ValueError(f"field 'answer_schema': expected one of {', '.join(ANSWER_SCHEMAS)}, got {schema!r}")
    system_prompt = obj.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"field 'system_prompt': expected a string, got {type(system_prompt).__name__}")
    generations = obj.get("num_generations", defaults.generations())
    if not isinstance(generations, int) or isinstance(generations, bool) or generations < 1:
        raise ValueError(f"field 'num_generations': expected a positive integer, got {generations!r}")
    task_type = obj.get("task_type")
    if task_type is not None and not isinstance(task_type, str):
        raise ValueError(f"field 'task_type': expected a string, got {type(task_type).__name__}")

    env = obj.get("env")
    if env is not None and not (isinstance(env, dict) and isinstance(env.get("name"), str) and env["name"]
                                and isinstance(env.get("data_idx"), int) and not isinstance(env["data_idx"], bool)
                                and env["data_idx"] >= 0):
        raise ValueError(f"field 'env': expected {{\"name\": ENVIRONMENT, \"data_idx\": TASK INDEX >= 0}}, "
                         f"got {env!r}")
    try:
        loaded = entry_images(obj["images"], base_dir) if "images" in obj else []
    except ImageError as error:
        raise ValueError(str(error)) from None
    image_ids = [image.sha256 for image in loaded]
    digest = content_hash(query, answer, system_prompt, image_ids)
    data_id = _pick(obj, ID_KEYS)
    if data_id is not None and not isinstance(data_id, (str, int)):
        raise ValueError(f"field 'id': expected a string or an integer, got {type(data_id).__name__}")
    task_id = f"{defaults.split}:{data_id if data_id is not None else digest}"
    if images is not None:
        images.update((image.sha256, image) for image in loaded)
    return Task(
        id=task_id, split=defaults.split, order=order, query=query, answer=answer, system_prompt=system_prompt,
        images=image_ids, scorer=scorer, answer_schema=schema, task_type=task_type,
        metadata={k: v for k, v in obj.items() if k not in _KNOWN}, content_hash=digest,
        num_generations=generations, max_attempts=defaults.max_attempts, unclaimed=generations,
        remaining=generations,
    )


def parse_file(path: str | Path, defaults: UploadDefaults) -> ParsedFile:
    """Parse and validate every entry; problems are collected (``FILE:LINE: message``), never raised one by one."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError([f"{path}: no such file"])
    parsed = ParsedFile()
    first_line: dict[str, tuple[int, str]] = {}
    base = time.time_ns()
    try:
        entries = list(iter_entries(path))
    except UnicodeDecodeError as error:
        raise TaskFileError([f"{path}: not UTF-8 text ({error})"]) from error
    for index, (line, obj) in enumerate(entries):
        if isinstance(obj, json.JSONDecodeError):
            parsed.problems.append(f"{path}:{line}: invalid JSON: {obj.msg} (column {obj.colno})")
            continue
        try:
            task = parse_entry(obj, defaults, order=base + index, base_dir=path.parent, images=parsed.images)
        except ValueError as error:
            parsed.problems.append(f"{path}:{line}: {error}")
            continue
        if task.id in first_line:
            seen_line, seen_hash = first_line[task.id]
            if seen_hash != task.content_hash:
                parsed.problems.append(f"{path}:{line}: duplicate id {task.id.split(':', 1)[1]!r} (first at line "
                                       f"{seen_line}) with different content")
            continue
        first_line[task.id] = (line, task.content_hash)
        parsed.tasks.append((line, task))
    if not parsed.tasks and not parsed.problems:
        parsed.problems.append(f"{path}: no tasks found")
    return parsed


@dataclass(frozen=True)
class UploadResult:
    inserted: int
    already_present: int
    changed: list[str]
    problems: list[str]


def upload_tasks(db: Database, path: str | Path, defaults: UploadDefaults, *, skip_invalid: bool = False
                 ) -> UploadResult:
    """Validate the whole file, then insert the Tasks not already present.

    Raises ``TaskFileError`` (and inserts nothing) if any entry is invalid, unless ``skip_invalid``. Tasks whose id
    is already in the database are left as they are (``changed`` lists those whose content differs). The new Tasks'
    images are stored (GridFS, once each) before the Tasks that refer to them.
    """
    parsed = parse_file(path, defaults)
    if parsed.problems and (not skip_invalid or not parsed.tasks):
        raise TaskFileError(parsed.problems)
    collection = db[Task.collection]
    ids = [task.id for _, task in parsed.tasks]
    existing: dict[str, str] = {}
    for start in range(0, len(ids), 1000):
        for doc in collection.find({"_id": {"$in": ids[start:start + 1000]}}, {"content_hash": 1}):
            existing[doc["_id"]] = doc.get("content_hash", "")
    new = [task.to_mongo() for _, task in parsed.tasks if task.id not in existing]
    changed = [task.id for _, task in parsed.tasks if task.id in existing and existing[task.id] != task.content_hash]
    if new:
        wanted = {sha256 for doc in new for sha256 in doc.get("images", [])}
        put_images_sync(db, [image for sha256, image in parsed.images.items() if sha256 in wanted])
        collection.insert_many(new, ordered=True)
    return UploadResult(inserted=len(new), already_present=len(existing), changed=changed,
                        problems=parsed.problems)
