"""Between the model's text and an environment's text actions: the episode prompt, action parsing, action writing.

The same three functions serve rollouts (``agentrl.rollout.episode``), oracle demonstrations (``agentrl envs
demos``) and evaluation, so a demonstration renders to exactly the tokens a rollout that acted the same would.

Action formats (AgentGym's): ``react`` — the action is the text after the last ``Action:`` (its first line);
``last_line`` (TextCraft/ADaPT) — the last non-empty line that is not a thought (``think: ...``), a leading ``>``
removed, and an ``Action:`` prefix too; characters other than letters, digits, commas and spaces are
dropped and runs of spaces collapsed (TextCraft's commands use nothing else). Reasoning in ``<think>...</think>``
is never part of an action.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.envs.base import ActionFormat

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ACTION = re.compile(r"Action\s*:", re.IGNORECASE)
_NOT_COMMAND = re.compile(r"[^A-Za-z0-9, ]")
_SPACES = re.compile(r"\s+")

NO_ACTION_HINT = {
    "react": "No action found. End your reply with one line 'Action: <your action>'.",
    "last_line": "No action found. End your reply with one line holding only your next command.",
}


def episode_messages(instruction: str, observation: str) -> list[dict[str, Any]]:
    """The first messages of an episode: the environment's instruction (system) and its first observation (user)."""
    return [{"role": "system", "content": instruction}, {"role": "user", "content": observation}]


def observation_message(observation: str) -> dict[str, Any]:
    """An observation as the next user turn."""
    return {"role": "user", "content": observation}


def parse_action(text: str, action_format: ActionFormat) -> str | None:
    """The action in an assistant turn, or ``None`` when there is none."""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:  # an unclosed block opened by the template: everything before the last close is thought
        text = text.rsplit("</think>", 1)[1]
    if action_format == "react":
        return _after_action(text)
    line = _last_line(text)
    if line is None:
        return None
    if _ACTION.match(line):
        line = _ACTION.split(line, maxsplit=1)[1]
    command = _SPACES.sub(" ", _NOT_COMMAND.sub("", line)).strip()
    return command or None


def format_action(action: str, action_format: ActionFormat, thought: str | None = None) -> str:
    """An assistant turn that :func:`parse_action` reads back as ``action``."""
    if action_format == "react":
        return f"Thought: {thought}\nAction: {action}" if thought else f"Action: {action}"
    return f"think: {thought}\n{action}" if thought else action


def _after_action(text: str) -> str | None:
    parts = _ACTION.split(text)
    if len(parts) < 2:
        return None
    lines = [line.strip() for line in parts[-1].strip().splitlines() if line.strip()]
    return lines[0] if lines else None


def _last_line(text: str) -> str | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip().lstrip(">").strip()
        if line and not line.lower().startswith(("think:", "thought:")):
            return line
    return None
