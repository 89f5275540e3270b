"""Configuration files and the resolved view of a configuration, for the models whose flags
:mod:`agentrl.config_flags` generates (``agentrl run --config FILE --print_config``).

A file is TOML with one key per option, named as the option's flag (``learning_rate = 2e-6``); flags given on the
command line win over it. :func:`resolved_view` prints the configuration a command would run with, one option a
line with where its value came from: ``flag``, ``file``, ``default`` (the option's declared default) or ``derived``
(filled from other options: see each option's help). The view is itself a valid file (unset options are comments),
so ``--print_config > my.toml`` then ``--config my.toml`` runs the same configuration.

This module imports only pydantic and the standard library.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from agentrl.config_flags import describe_errors, flag_name


class ConfigFileError(ValueError):
    """A configuration file that cannot be read or does not fit the options (the message names file and key)."""


def read_config_file(path: Path, model: type[BaseModel]) -> dict[str, Any]:
    """The options of TOML file ``path`` by field name (keys are flag names); :class:`ConfigFileError` for a file
    that is missing, is not TOML, or names an option ``model`` does not have."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigFileError(f"{path}: cannot read it: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigFileError(f"{path}: not valid TOML: {error}") from None
    fields = {flag_name(name, info): name for name, info in model.model_fields.items()}
    unknown = sorted(key for key in data if key not in fields)
    if unknown:
        raise ConfigFileError(f"{path}: no option named {', '.join(unknown)} (the keys are the command's flags "
                              "without the leading --; --help lists them)")
    return {fields[key]: value for key, value in data.items()}


def build(model: type[BaseModel], file_values: dict[str, Any], flag_values: dict[str, Any],
          path: Path | None = None) -> BaseModel:
    """``model`` from a file's values overridden by the flags'; :class:`ConfigFileError` naming the file and key,
    or the flag, of each invalid value."""
    from_file = {flag_name(name, model.model_fields[name]) for name in file_values.keys() - flag_values.keys()}
    try:
        return model(**{**file_values, **flag_values})
    except ValidationError as error:
        label = lambda flag: f"{path}: {flag}" if flag in from_file else f"--{flag}"  # noqa: E731
        raise ConfigFileError(describe_errors(model, error, label)) from None


def origins(config: BaseModel, file_values: dict[str, Any], flag_values: dict[str, Any]) -> dict[str, str]:
    """Where each field's value came from: ``flag``, ``file``, ``default`` or ``derived``."""
    found = {}
    for name, info in type(config).model_fields.items():
        if name in flag_values:
            found[name] = "flag"
        elif name in file_values:
            found[name] = "file"
        else:
            found[name] = "default" if getattr(config, name) == info.get_default(call_default_factory=True) \
                else "derived"
    return found


def resolved_view(config: BaseModel, file_values: dict[str, Any], flag_values: dict[str, Any]) -> str:
    """The configuration as a TOML file, each line's origin in a trailing comment (see the module doc)."""
    lines = []
    where = origins(config, file_values, flag_values)
    for name, info in type(config).model_fields.items():
        key, value = flag_name(name, info), getattr(config, name)
        if value is None:
            lines.append(f"# {key} = (unset)  # {where[name]}")
        else:
            lines.append(f"{key} = {_toml_value(value)}  # {where[name]}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value))
