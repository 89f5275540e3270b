"""Answer schemas: where a model's final answer sits in its output.

- ``boxed``: the content of the last ``\\boxed{...}`` (or, if there is none, the last ``\\fbox{...}``), nested
  braces included (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``);
- ``gsm8k``: the number after the last ``####``, else the last number (GSM8K, AutoRL-Bench), without commas or a
  ``$`` (``$1,000.`` → ``1000``); negative and decimal numbers included;
- ``code``: the content of the last fenced code block (```` ```python ```` or a bare fence), else the whole text if
  it looks like code (has ``def `` or ``return``); indentation is kept, so a function body stays one;
- ``answer``: the text between the last ``<answer>`` and ``</answer>``; any other schema name ``X`` uses the
  tags ``<X>...</X>`` the same way.

Only the visible part of the output is searched (after the last ``</think>``), so an answer merely considered
while thinking does not count.
"""

from __future__ import annotations

import re
from collections.abc import Callable

ANSWER_SCHEMAS: tuple[str, ...] = ("answer", "boxed", "gsm8k", "code")

_BARE_BOXED = re.compile(r"\\boxed\s+([^\s$]+)")
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?\d(?:[\d,]*\d)?(?:\.\d+)?")  # a minus after a word or ")" subtracts
_FENCED_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


def _visible(text: str) -> str:
    return text.rpartition("</think>")[2] if "</think>" in text else text


def _braced_after(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == '{'`` (``None`` if unbalanced)."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index]
    return None


def extract_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (else ``\\fbox{...}``) with nested braces; ``None`` if absent or unbalanced."""
    for command in ("\\boxed", "\\fbox"):
        position = text.rfind(command + "{")
        if position != -1:
            content = _braced_after(text, position + len(command))
            return content.strip() if content is not None else None
    bare = _BARE_BOXED.findall(text)  # "\boxed 5" is valid LaTeX too
    return bare[-1] if bare else None


def extract_tagged(text: str, tag: str) -> str | None:
    """Text between the last ``</tag>`` and the last ``<tag>`` before it; ``None`` if either is missing."""
    end = text.rfind(f"</{tag}>")
    if end == -1:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start == -1:
        return None
    return text[start + len(tag) + 2 : end].strip()


def extract_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K-style answers); ``None`` if absent."""
    position = text.rfind("####")
    if position == -1:
        return None
    return text[position + 4 :].strip().splitlines()[0].strip() if text[position + 4 :].strip() else None


def extract_gsm8k_number(text: str) -> str | None:
    """The number after the last ``####``, else the last number, without commas or ``$``; ``None`` if none."""
    marker, tail = text.rpartition("####")[1:]
    after_marker = _NUMBER.search(tail) if marker else None
    numbers = [after_marker.group()] if after_marker else _NUMBER.findall(text)
    return numbers[-1].replace(",", "").replace("$", "") if numbers else None


def extract_code(text: str) -> str | None:
    """The last fenced code block's content, else ``text`` if it has ``def `` or ``return``; ``None`` otherwise."""
    blocks = _FENCED_BLOCK.findall(text)
    code = blocks[-1] if blocks else text if "def " in text or "return" in text else ""
    return _LEADING_BLANK_LINES.sub("", code).rstrip() or None


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed, "gsm8k": extract_gsm8k_number, "code": extract_code}


def extract_answer(text: str, schema: str = "answer") -> str:
    """The final answer in ``text`` under ``schema`` (``""`` when there is none)."""
    visible = _visible(text)
    extractor = _EXTRACTORS.get(schema)
    found = extractor(visible) if extractor else extract_tagged(visible, schema)
    return found or ""


def final_answer_text(text: str) -> str:
    """Best guess of the answer in free text: ``\\boxed{}``, then ``####``, then ``<answer>``, else the text itself."""
    visible = _visible(text)
    for found in (extract_boxed(visible), extract_hashes(visible), extract_tagged(visible, "answer")):
        if found:
            return found
    return visible.strip()
