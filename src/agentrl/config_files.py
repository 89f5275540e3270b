"""TOML configuration files: reading one with errors that name it, and writing values back as TOML.

``agentrl run --config FILE`` and its presets (``configs/*.toml``) are such files; :mod:`agentrl.run.layers` says
how their keys and tables map onto the run's options.

This module imports only the standard library.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A configuration file that cannot be read or does not fit the options (the message names file and key)."""


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of TOML file ``path``; :class:`ConfigFileError` for a file that is missing or is not TOML."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigFileError(f"{path}: cannot read it: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"{path}: not valid TOML: {error}") from None


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (a path as its text, a set as a sorted list)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, set | frozenset):
        value = sorted(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))} = {toml_value(item)}" for key, item in value.items()) + "}"
    return json.dumps(str(value))
