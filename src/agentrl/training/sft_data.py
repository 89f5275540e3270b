"""SFT conversations (JSONL or JSON) → token ids with an assistant-only loss mask → queued ``DBRecordData``.

Two line formats are accepted (one conversation per line, or a JSON list of them):

- OpenAI chat (fine-tuning) format: ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}``.
  Roles ``system`` (``developer`` is read as ``system``), ``user``, ``assistant`` and ``tool``. ``content`` is a
  string or a list of ``{"type": "text", "text": ...}`` parts and, for a vision-language model, ``{"type":
  "image_url", "image_url": {"url": ...}}`` parts (a ``data:`` URI, or an image file relative to the SFT file: what
  ``agentrl export`` writes), kept in their order, each checked, stored once in GridFS with the samples and expanded
  to its image tokens as the agent loop expands them. An assistant message may carry ``tool_calls``
  (OpenAI objects, arguments as a JSON string or an object): they are given to the chat template when it renders
  them, else written into the message as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` text (the
  format the ``qwen`` tool-call parser reads back); when the content already holds ``<tool_call>`` blocks (the
  model's raw output, as ``agentrl export`` writes it) it is kept verbatim instead. ``tools`` (OpenAI function
  specs) go to the template when it renders them, else into the system prompt exactly as the agent loop puts
  them there (:func:`agentrl.trajectory.prompting.tool_instructions`).
- AgentGym / ShareGPT format: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": ...}]}``
  (``gpt``/``assistant`` → assistant, ``human``/``user`` → user, ``system``, and ``tool``/``observation``/
  ``function`` → tool).

Which assistant messages are trained: all of them, except those with ``"loss": false`` (AgentGym) or
``"weight": 0`` (OpenAI). ``loss``/``weight`` on a non-assistant message may only say "not trained".

The conversation is rendered once with the model's chat template (the same text → ids path as the agent loop,
:class:`agentrl.rollout.conversation.TokenConversation`), and each assistant message's tokens are located by
rendering the prefixes: the messages before it with the generation prompt (ends after the assistant role header)
and the messages up to it (ends after its end-of-turn). Both must be token prefixes of the whole conversation; a
template that rewrites earlier turns (e.g. one that strips past reasoning) fails with a clear error, since its
training sequence would not match what the model sees while generating. The loss mask is 1 exactly on the
assistant's tokens, from the first content token through the end-of-turn token (``<|im_end|>``, the eos token or
another end-of-turn special token); the role header and the separator after the end-of-turn token are 0. A
conversation that ends with an assistant message ends at its end-of-turn token, as a rollout does (the template's
trailing separator is not part of the sample).

Sample ids are a hash of the split and the tokens, so re-uploading a file inserts nothing twice.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.store.models import DBRecordData
from agentrl.vision.images import ImageError, LoadedImage, decode_image_string, load_image
from agentrl.vision.processor import VisionInputError, VisionProcessor, message_images

ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}
"""Accepted roles (``role`` of a ``messages`` entry, ``from`` of a ``conversations`` entry) → chat roles."""

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                      "<|end_of_text|>", "<｜end▁of▁sentence｜>")
"""Special tokens that close an assistant turn (besides the tokenizer's eos token), when the vocabulary has them."""

TOOL_CALL_TAG = "<tool_call>"
"""An assistant message whose content already holds its calls in this form (as ``agentrl export`` writes the
model's raw output next to the parsed ``tool_calls``) is rendered as it is, its ``tool_calls`` not again."""

Overlong = Literal["reject", "truncate"]
_PROBE_TOOL = "agentrl_probe_tool_7f3a"


class SFTFileError(ValueError):
    """An SFT file could not be read or has invalid lines; ``problems`` lists ``FILE:LINE: message``."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class SFTOptions:
    split: str = "train"
    max_length: int | None = None
    overlong: Overlong = "reject"
    """``reject``: a conversation longer than ``max_length`` tokens is an invalid line; ``truncate``: keep its
    first ``max_length`` tokens (invalid only if no trained token is left)."""


@dataclass
class Conversation:
    """A normalised conversation: chat messages, which of them are trained, and the tools offered."""

    messages: list[dict[str, Any]]
    trained: list[bool]
    tools: list[dict[str, Any]] | None = None
    source_id: str | None = None
    pictures: dict[str, LoadedImage] = field(default_factory=dict)
    """The pictures its messages show (``{"type": "image", "image": SHA256}`` parts), by sha256."""


@dataclass(frozen=True)
class TokenisedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    turn_boundaries: list[int]
    truncated: bool = False
    images: list[str] = field(default_factory=list)  # sha256 of the pictures of input_ids, in order

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


# ------------------------------------------------------------------------------------------------ normalising


def _content(value: Any, where: str, pictures: dict[str, LoadedImage] | None,
             base_dir: Path | None) -> str | list[dict[str, Any]]:
    """A message's content: its text, or (with an image part) text and ``{"type": "image", "image": SHA256}``
    parts in order, the pictures added to ``pictures``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'content' must be a string or a list of parts, got {type(value).__name__}")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(value):
        if isinstance(part, str) or (isinstance(part, dict) and part.get("type", "text") == "text"
                                     and isinstance(part.get("text"), str)):
            text = part if isinstance(part, str) else part["text"]
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
            else:
                parts.append({"type": "text", "text": text})
        elif isinstance(part, dict) and part.get("type") == "image_url" and pictures is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            image = _picture(url, f"{where}: content part {index + 1}", base_dir)
            pictures[image.sha256] = image
            parts.append({"type": "image", "image": image.sha256})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}: content part {index + 1} is neither text nor an image_url ({kind!r})")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _picture(url: Any, where: str, base_dir: Path | None) -> LoadedImage:
    """An ``image_url``'s picture: a ``data:`` URI, or a file relative to ``base_dir``; ``ValueError`` naming it."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: expected {{'image_url': {{'url': 'data:image/...' or a file path}}}}")
    try:
        if url.startswith("data:"):
            return decode_image_string(url, where)
        path = Path(url) if base_dir is None else base_dir / url
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ValueError(f"{where}: cannot read the image {str(path)!r} ({error.strerror or error})") from None
        return load_image(data, f"{where} ({url})")
    except ImageError as error:
        raise ValueError(str(error)) from None


def _text(value: Any, where: str) -> str:
    """A message's text content (no pictures: AgentGym conversations, tool call ids)."""
    content = _content(value, where, None, None)
    assert isinstance(content, str)
    return content


def _trained_flag(entry: dict[str, Any], role: str, where: str) -> bool:
    """Whether this message is trained: assistant messages unless ``loss: false`` / ``weight: 0``."""
    loss, weight = entry.get("loss"), entry.get("weight")
    if loss is not None and not isinstance(loss, bool):
        raise ValueError(f"{where}: 'loss' must be true, false or null, got {loss!r}")
    if weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
        raise ValueError(f"{where}: 'weight' must be 0 or 1, got {weight!r}")
    wanted = [flag for flag in (loss, None if weight is None else bool(weight)) if flag is not None]
    if role != "assistant":
        if any(wanted):
            raise ValueError(f"{where}: only assistant messages can be trained ({role} message has "
                             f"{'loss: true' if loss else 'weight: 1'})")
        return False
    return all(wanted)


def _tool_call_text(call: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": call["name"], "arguments": call["arguments"]},
                                      ensure_ascii=False) + "</tool_call>"


def _normalise_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """``tool_calls`` as ``[{"id", "name", "arguments": dict}]`` (OpenAI objects or plain ``{name, arguments}``)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'tool_calls' must be a list, got {type(value).__name__}")
    calls = []
    for index, raw in enumerate(value):
        here = f"{where}, tool call {index + 1}"
        if not isinstance(raw, dict):
            raise ValueError(f"{here}: expected an object, got {type(raw).__name__}")
        function = raw.get("function", raw)
        if not isinstance(function, dict):
            raise ValueError(f"{here}: 'function' must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{here}: no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"{here}: 'arguments' is not valid JSON ({error.msg})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{here}: 'arguments' must be a JSON object, got {type(arguments).__name__}")
        calls.append({"id": str(raw.get("id") or f"call_{index}"), "name": name, "arguments": arguments})
    return calls


def normalise(obj: Any, base_dir: Path | None = None) -> Conversation:
    """Validate one line (``messages`` or ``conversations`` format); raises ``ValueError`` saying what is wrong.
    Image files of ``image_url`` parts are read relative to ``base_dir``."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        entries, role_key, content_key, kind = obj["messages"], "role", "content", "messages"
    elif "conversations" in obj:
        entries, role_key, content_key, kind = obj["conversations"], "from", "value", "conversations"
    else:
        raise ValueError("no conversation: expected a 'messages' list (OpenAI chat format) or a 'conversations' "
                         "list (AgentGym format)")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"'{kind}' must be a non-empty list")
    messages: list[dict[str, Any]] = []
    trained: list[bool] = []
    tool_names: dict[str, str] = {}
    pictures: dict[str, LoadedImage] = {}
    for index, entry in enumerate(entries):
        where = f"{kind}[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        raw_role = entry.get(role_key)
        role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise ValueError(f"{where}: '{role_key}' must be one of {', '.join(ROLE_ALIASES)}, got {raw_role!r}")
        where = f"{where} ({raw_role})"
        message: dict[str, Any] = {"role": role}
        content = entry.get(content_key)
        calls = _normalise_tool_calls(entry["tool_calls"], where) if entry.get("tool_calls") else []
        if calls and role != "assistant":
            raise ValueError(f"{where}: only assistant messages can have tool_calls")
        if content is None and not calls:
            raise ValueError(f"{where}: no '{content_key}'")
        message["content"] = _content(content, where, pictures if kind == "messages" else None, base_dir) \
            if content is not None else ""
        if isinstance(message["content"], list) and role not in ("user", "tool"):
            raise ValueError(f"{where}: pictures may be in user and tool messages only")
        if calls:
            message["tool_calls"] = calls
            tool_names.update({call["id"]: call["name"] for call in calls})
        if role == "tool":
            name = entry.get("name") or tool_names.get(str(entry.get("tool_call_id")))
            if name:
                message["name"] = str(name)
            if entry.get("tool_call_id") is not None:
                message["tool_call_id"] = str(entry["tool_call_id"])
        messages.append(message)
        trained.append(_trained_flag(entry, role, where))
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{kind}[0]: a conversation must start with a system or user message, not an assistant one")
    if not any(trained):
        raise ValueError("no assistant message to train on" + (
            " (every assistant message has loss: false or weight: 0)" if any(
                m["role"] == "assistant" for m in messages) else ""))
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError("'tools' must be a list of OpenAI function specifications (objects)")
        tools = tools or None
    source_id = next((obj[k] for k in ("id", "item_id", "task_id") if obj.get(k) not in (None, "")), None)
    if source_id is not None and not isinstance(source_id, (str, int)):
        raise ValueError(f"field 'id': expected a string or an integer, got {type(source_id).__name__}")
    return Conversation(messages, trained, tools, None if source_id is None else str(source_id), pictures)


# ------------------------------------------------------------------------------------------------- tokenising


class ChatTokeniser:
    """Renders conversations with one tokenizer's chat template and builds their assistant-only loss masks."""

    def __init__(self, tokenizer: Any, vision: VisionProcessor | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (SFT data is rendered with it)")
        self.tokenizer = tokenizer
        self.vision = vision  # a vision-language model's image tokens (None: pictures are refused)
        vocab = tokenizer.get_vocab()
        ends = {vocab[token] for token in END_OF_TURN_TOKENS if token in vocab}
        if tokenizer.eos_token_id is not None:
            ends.add(tokenizer.eos_token_id)
        self.end_ids = frozenset(ends)
        self.renders_tool_calls = self._probe_tool_calls()
        self._renders_tools: dict[str, bool] = {}

    def _probe_tool_calls(self) -> bool:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"x": 1}}}]}]
        try:
            return _PROBE_TOOL in self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that chokes on tool_calls does not render them
            return False

    def _template_tools(self, tools: list[dict[str, Any]]) -> bool:
        from agentrl.trajectory.prompting import template_renders_tools

        key = json.dumps(tools, sort_keys=True)
        if key not in self._renders_tools:
            self._renders_tools[key] = template_renders_tools(self.tokenizer, tools)
        return self._renders_tools[key]

    def prepare(self, conversation: Conversation) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages as given to the template, and the ``tools`` argument (None when they went into the
        system prompt or there are none)."""
        from agentrl.trajectory.prompting import tool_instructions

        messages = []
        for message in conversation.messages:
            message = dict(message)
            calls = message.pop("tool_calls", None)
            if calls and TOOL_CALL_TAG not in message["content"]:
                if self.renders_tool_calls:
                    message["tool_calls"] = [
                        {"id": c["id"], "type": "function",
                         "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
                else:
                    text = "\n".join(_tool_call_text(c) for c in calls)
                    message["content"] = f"{message['content']}\n{text}" if message["content"] else text
            messages.append(message)
        tools = conversation.tools
        if tools and not self._template_tools(tools):
            instructions = tool_instructions(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}
            else:
                messages.insert(0, {"role": "system", "content": instructions})
            return messages, None
        return messages, tools

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               generation_prompt: bool, pictures: dict[str, LoadedImage] | None = None) -> list[int]:
        """The ids of ``messages`` rendered by the chat template, each picture's placeholder expanded to its image
        tokens (``pictures``: the conversation's)."""
        shown = message_images(messages)
        if shown and self.vision is None:
            raise ValueError(f"{len(shown)} picture(s), but the model is a text model: pictures need a "
                             "vision-language model (--model_name_or_path)")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as error:  # noqa: BLE001 - template errors become the line's error message
            raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not shown:
            return ids
        try:
            return self.vision.expand(ids, [self.vision.image_tokens(pictures[sha256]) for sha256 in shown])
        except VisionInputError as error:
            raise ValueError(f"the chat template does not render the pictures as image placeholders: {error}") \
                from None

    def tokenise(self, conversation: Conversation, *, max_length: int | None = None,
                 overlong: Overlong = "reject") -> TokenisedConversation:
        """Token ids and loss mask of ``conversation`` (see the module docstring); ``ValueError`` if impossible."""
        messages, tools = self.prepare(conversation)
        offset = len(messages) - len(conversation.messages)  # a system message added for the tools
        trained = [False] * offset + list(conversation.trained)
        pictures = conversation.pictures
        full = self.render(messages, tools, generation_prompt=False, pictures=pictures)
        mask = [0] * len(full)
        boundaries = [0]
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            where = f"message {index + 1 - offset} (assistant)"
            start = self._prefix_length(self.render(messages[:index], tools, generation_prompt=True,
                                                    pictures=pictures), full, where,
                                        "the messages before it, with the generation prompt")
            end = self._prefix_length(self.render(messages[:index + 1], tools, generation_prompt=False,
                                                  pictures=pictures), full, where, "the messages up to it")
            if end < start:
                raise ValueError(f"{where}: the chat template renders the messages up to it shorter than the "
                                 "generation prompt before it; cannot locate its tokens")
            stop = end
            while stop > start and full[stop - 1] not in self.end_ids:
                stop -= 1
            if stop == start:  # no end-of-turn token: the whole rendered message is trained
                stop = end
            if trained[index]:
                mask[start:stop] = [1] * (stop - start)
            if end < len(full):
                boundaries.append(end)
            if index == len(messages) - 1:  # a rollout ends at the end-of-turn token: so does the sample
                full, mask = full[:stop], mask[:stop]
        boundaries = sorted({b for b in boundaries if b < len(full)})
        truncated = False
        if max_length is not None and len(full) > max_length:
            if overlong == "reject":
                raise ValueError(f"{len(full)} tokens, longer than --max_length {max_length}")
            full, mask, truncated = full[:max_length], mask[:max_length], True
            boundaries = [b for b in boundaries if b < max_length]
        if not any(mask):
            raise ValueError(f"no trained token within the first {max_length} tokens" if truncated
                             else "the trained assistant messages render to no tokens")
        images = message_images(messages)
        if truncated and images:  # keep whole pictures only: cut before one the limit splits
            full, mask, kept = _whole_images(full, mask, self.vision)
            images, boundaries = images[:kept], [b for b in boundaries if b < len(full)]
            if not any(mask):
                raise ValueError(f"no trained token within the first {max_length} tokens before a picture they "
                                 "would split")
        return TokenisedConversation(full, mask, boundaries, truncated, images)

    @staticmethod
    def _prefix_length(prefix: list[int], full: list[int], where: str, what: str) -> int:
        if full[:len(prefix)] != prefix:
            diverge = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
            raise ValueError(
                f"{where}: the chat template's rendering of {what} is not a token prefix of the whole conversation "
                f"(they differ at token {diverge}); this template rewrites earlier turns, so its training sequence "
                "would not match what the model sees while generating")
        return len(prefix)


def _whole_images(ids: list[int], mask: list[int], vision: VisionProcessor) -> tuple[list[int], list[int], int]:
    """``ids`` and ``mask`` cut before a picture they end inside (its ``<|vision_start|>``), and how many whole
    pictures remain."""
    whole, start = 0, None
    for i, token in enumerate(ids):
        if token == vision.vision_start_id:
            start = i
        elif token == vision.vision_end_id and start is not None:
            whole, start = whole + 1, None
    if start is not None:
        return ids[:start], mask[:start], whole
    return ids, mask, whole


def sample_id(split: str, tokens: TokenisedConversation) -> str:
    canonical = json.dumps([split, tokens.input_ids, tokens.loss_mask, *([tokens.images] if tokens.images else [])],
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


def to_sample(tokens: TokenisedConversation, split: str, source_id: str | None) -> DBRecordData:
    """A queued DBRecordData for the trainer (no behaviour logprobs, no advantages: CrossEntropy data)."""
    digest = sample_id(split, tokens)
    record_id = f"sft:{split}:{digest}"
    n = len(tokens.input_ids)
    return DBRecordData(
        id=f"{record_id}#b0", record_id=record_id, task_id=f"sft:{split}:{source_id or digest}", split=split,
        branch=0, seq=0, input_ids=tokens.input_ids, loss_mask=tokens.loss_mask, logprobs=[0.0] * n,
        versions=[-1] * n, advantages=[0.0] * n, reward=None, turn_boundaries=tokens.turn_boundaries,
        images=tokens.images, num_tokens=n)


# ------------------------------------------------------------------------------------------------------ files


@dataclass
class ParsedSFTFile:
    samples: list[tuple[int, DBRecordData]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duplicates: int = 0
    truncated: int = 0
    images: dict[str, LoadedImage] = field(default_factory=dict)
    """The samples' pictures by sha256 (stored with them)."""

    @property
    def tokens(self) -> int:
        return sum(s.num_tokens for _, s in self.samples)

    @property
    def trained_tokens(self) -> int:
        return sum(sum(s.loss_mask) for _, s in self.samples)

    @property
    def longest(self) -> int:
        return max((s.num_tokens for _, s in self.samples), default=0)


def parse_sft_file(path: str | Path, tokenizer: Any, options: SFTOptions = SFTOptions(),
                   vision: VisionProcessor | None = None) -> ParsedSFTFile:
    """Validate and tokenise every line; problems are collected as ``FILE:LINE: message``. ``vision``: a
    vision-language model's image tokens (pictures are refused without)."""
    from agentrl.store.task_files import iter_entries

    path = Path(path)
    if not path.is_file():
        raise SFTFileError([f"{path}: no such file"])
    try:
        entries = list(iter_entries(path))
    except UnicodeDecodeError as error:
        raise SFTFileError([f"{path}: not UTF-8 text ({error})"]) from error
    try:
        chat = ChatTokeniser(tokenizer, vision)
    except ValueError as error:
        raise SFTFileError([f"{path}: {error}"]) from error
    parsed = ParsedSFTFile()
    seen: set[str] = set()
    for line, obj in entries:
        if isinstance(obj, json.JSONDecodeError):
            parsed.problems.append(f"{path}:{line}: invalid JSON: {obj.msg} (column {obj.colno})")
            continue
        try:
            conversation = normalise(obj, path.parent)
            tokens = chat.tokenise(conversation, max_length=options.max_length, overlong=options.overlong)
        except ValueError as error:
            parsed.problems.append(f"{path}:{line}: {error}")
            continue
        sample = to_sample(tokens, options.split, conversation.source_id)
        if sample.id in seen:
            parsed.duplicates += 1
            continue
        seen.add(sample.id)
        parsed.images.update((sha256, conversation.pictures[sha256]) for sha256 in sample.images)
        parsed.truncated += tokens.truncated
        parsed.samples.append((line, sample))
    if not parsed.samples and not parsed.problems:
        parsed.problems.append(f"{path}: no conversations found")
    return parsed


@dataclass(frozen=True)
class SFTUploadResult:
    parsed: ParsedSFTFile
    inserted: int
    already_present: int


async def upload_sft(store: Any, parsed: ParsedSFTFile, *, skip_invalid: bool = False,
                     chunk: int = 1000) -> SFTUploadResult:
    """Queue the parsed samples (``store`` is an :class:`agentrl.store.Store`), in file order.

    Raises ``SFTFileError`` (and queues nothing) if any line is invalid, unless ``skip_invalid``; samples already
    stored (same split and tokens) are left as they are.
    """
    if parsed.problems and (not skip_invalid or not parsed.samples):
        raise SFTFileError(parsed.problems)
    samples: Sequence[DBRecordData] = [sample for _, sample in parsed.samples]
    for image in parsed.images.values():  # before the samples that name them
        await store.images.put(image)
    inserted = 0
    for start in range(0, len(samples), chunk):
        inserted += await store.samples.enqueue(list(samples[start:start + chunk]))
    return SFTUploadResult(parsed=parsed, inserted=inserted, already_present=len(samples) - inserted)
