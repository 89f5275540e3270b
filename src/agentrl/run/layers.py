"""How `agentrl run` resolves its options: layers, later ones winning — the components' defaults, a preset
(``--preset NAME``: ``configs/NAME.toml``), a file (``--config FILE``), the command line — and the resolved tree
printed with where each value came from (``--print_config``).

A file's top-level keys are the run's flags without ``--`` (run options, shared values, short names such as
``learning_rate``); a ``[sampler]``, ``[trainer]``, ``[warmup_trainer]``, ``[eval]`` or ``[engine]`` table holds
flags of that process. A table ``[with_env]``, ``[with_lora]`` or ``[with_model]`` applies only with ``--env``,
``--lora_r`` > 0 or ``--model`` (these taken from every layer), after the file's own keys and in the order written;
inside ``[with_env]`` a table named after an environment (``[with_env.sciworld]``) applies only to it, and tables
nest (``[with_env.with_lora]``). A relative path a preset gives (``tasks = "assets/tasks/pictures_rl.jsonl"``) is
relative to the repository the presets ship in; elsewhere, to the working directory. The printed view is itself
such a file: ``--print_config > my.toml`` then ``--config my.toml`` runs the same configuration.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentrl.config_files import ConfigFileError, read_toml, toml_value
from agentrl.config_flags import describe_errors, flag_fields, flag_items, flag_values
from agentrl.run.config import PRESETS, REPO, SECTIONS, SHARED, SHORT_NAMES, WIRED, RunConfig

CONDITIONS = ("env", "lora", "model")
PATH_OPTIONS = frozenset(name for name, info in RunConfig.model_fields.items() if "Path" in str(info.annotation))
"""The run's options that are paths (a preset's relative ones are relative to the repository)."""
Key = tuple[str | None, str]
"""(section or None for the run's own options, flag)."""


@dataclass
class Resolved:
    """A configuration and, for each key some layer set, that layer's name and how it named the key."""

    config: RunConfig
    origins: dict[Key, str]
    labels: dict[Key, str]


def preset_path(name: str) -> Path:
    """``configs/NAME.toml``; :class:`ConfigFileError` listing the presets for an unknown name."""
    path = PRESETS / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.toml"))) or "none"
        raise ConfigFileError(f"--preset {name}: no such preset (presets: {known}; in {PRESETS})")
    return path


def _command(section: str) -> str:
    """The `agentrl` command of ``section``'s process."""
    return {"sampler": "sample", "eval": "eval", "engine": "engine"}.get(section, "train")


def _run_option(key: str) -> bool:
    return key in RunConfig.model_fields and key not in SECTIONS


def _tables(table: dict[str, Any], where: str, conditions: dict[str, Any], env: bool = False
            ) -> list[tuple[str, dict[str, Any]]]:
    """``table``'s own keys, then the overlays among its ``with_*`` tables that apply, each with where it is."""
    own = {key: value for key, value in table.items()
           if not key.startswith("with_") and not (env and isinstance(value, dict) and key not in SECTIONS)}
    found = [(where, own)]
    for key, value in table.items():
        if env and isinstance(value, dict) and key not in SECTIONS and not key.startswith("with_"):
            if key == conditions["env"]:
                found += _tables(value, f"{where}[{key}] ", conditions)
        elif key.startswith("with_"):
            condition = key.removeprefix("with_")
            if condition not in CONDITIONS or not isinstance(value, dict):
                raise ConfigFileError(f"{where}{key}: expected a table [with_env], [with_lora] or [with_model]")
            if conditions[condition]:
                found += _tables(value, f"{where}[{key}] ", conditions, env=condition == "env")
    return found


def _keys(table: dict[str, Any], where: str) -> dict[Key, tuple[Any, str]]:
    """The (section, flag) keys of one table of a layer, each with its value and its name there."""
    found: dict[Key, tuple[Any, str]] = {}
    for key, value in table.items():
        if key in SECTIONS and isinstance(value, dict):
            flags = flag_fields(SECTIONS[key])
            for flag, item in value.items():
                if flag not in flags:
                    raise ConfigFileError(f"{where}[{key}] {flag}: not a flag of this process (`agentrl "
                                          f"{_command(key)} --help` lists them)")
                found[(key, flag)] = (item, f"{where}[{key}] {flag}")
        elif key in SHORT_NAMES:
            found[SHORT_NAMES[key]] = (value, f"{where}{key}")
        elif _run_option(key):
            found[(None, key)] = (value, f"{where}{key}")
        else:
            raise ConfigFileError(f"{where}{key}: no option named {key} (the keys are `agentrl run`'s flags without "
                                  "the leading --, and [sampler], [trainer], [warmup_trainer], [eval], [engine] "
                                  "tables)")
    return found


def resolve(flags: dict[str, Any], preset: str | None = None, config_file: Path | None = None) -> Resolved:
    """The configuration of ``flags`` (``{key: value}`` as in a file, a section as a table) over the file over the
    preset; :class:`ConfigFileError` naming the file and key, or the flag, of each invalid value."""
    layers: list[tuple[str, str, dict[str, Any]]] = []
    if preset:
        layers.append(("preset", f"{preset_path(preset)}: ", read_toml(preset_path(preset))))
    if config_file:
        layers.append(("file", f"{config_file}: ", read_toml(config_file)))
    layers.append(("flag", "--", flags))
    plain: dict[str, Any] = {}
    for _, _, data in layers:
        plain.update({key: value for key, value in data.items() if not key.startswith("with_")})
    conditions = {"env": plain.get("env"), "lora": bool(plain.get("lora_r")), "model": plain.get("model")}
    values: dict[Key, Any] = {}
    origins: dict[Key, str] = {}
    labels: dict[Key, str] = {}
    for origin, where, data in layers:
        for table_where, table in _tables(data, where if origin != "flag" else "", conditions):
            for key, (value, label) in _keys(table, table_where).items():
                if origin == "preset" and key[0] is None and key[1] in PATH_OPTIONS and isinstance(value, str) \
                        and not Path(value).is_absolute():
                    value = str(REPO / value)
                values[key], origins[key] = value, origin
                labels[key] = label if origin != "flag" else "--" + (
                    ".".join(filter(None, key)) if key[0] and label.startswith("[") else label)
    run = {flag: value for (section, flag), value in values.items() if section is None}
    sections = {name: flag_values(model, {flag: value for (section, flag), value in values.items()
                                          if section == name}) for name, model in SECTIONS.items()}
    try:
        return Resolved(RunConfig(**run, **sections), origins, labels)
    except ValidationError as error:
        def label(flag: str) -> str:
            section, _, name = flag.rpartition(".")
            return labels.get((section or None, name), f"--{flag}")
        raise ConfigFileError(describe_errors(RunConfig, error, label)) from None


def command_line_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags given on the command line (``--SECTION.FLAG`` as a table), as :func:`resolve` takes them."""
    given: dict[str, Any] = {}
    for key, value in vars(args).items():
        section, dot, flag = key.partition(".")
        if dot and section in SECTIONS:
            given.setdefault(section, {})[flag] = value
        elif _run_option(key) or key in SHORT_NAMES:
            given[key] = value
    return given


def _extra_flags(config: RunConfig) -> dict[str, tuple[dict[str, Any], str]]:
    """Per section, the flags its ``extra`` strings (``--loss_flags``, ``--extra_train_flags``, ...) give, parsed as
    that process parses them, with the option they came from: they go after the others, so they win."""
    from agentrl import train
    from agentrl.config_flags import add_model_arguments

    found: dict[str, tuple[dict[str, Any], str]] = {}
    for section, names in (("trainer", ("loss_flags", "extra_train_flags")), ("sampler", ("extra_sample_flags",)),
                           ("eval", ("extra_eval_flags",))):
        if section == "trainer":
            parser = train.build_parser()
        else:
            parser = argparse.ArgumentParser(add_help=False)
            add_model_arguments(parser, SECTIONS[section])
        flags = flag_fields(SECTIONS[section])
        for name in names:
            args, _ = parser.parse_known_args(shlex.split(getattr(config, name)))
            for flag, value in vars(args).items():
                if flag in flags:
                    found[f"{section}.{flag}"] = ({flag: value}, name)
    return found


def view(resolved: Resolved) -> str:
    """The configuration as a TOML file, each value's origin in a trailing comment: ``flag``, ``file``, ``preset``,
    ``default`` (declared on its component), ``derived`` (from other options) or the option of extra flags."""
    config, origins = resolved.config, resolved.origins
    short = {target: name for name, target in SHORT_NAMES.items()}
    lines = ["# agentrl run: the resolved options (after each, where its value came from); --config reads this"]
    shared = SHARED[config.mode]
    for name, info in RunConfig.model_fields.items():
        if name in SECTIONS:
            continue
        if name in shared:
            value, origin = config.value(name), origins.get((None, name), "default")
            where = ", ".join(f"{section}.{flag}" for section, flag in shared[name])
            origin = f"{origin} (to {where})"
        else:
            value = getattr(config, name)
            default = info.get_default(call_default_factory=True)
            origin = origins.get((None, name), "default" if value == default else "derived")
        lines.append(_line(name, value, origin))
    extra = _extra_flags(config)
    for section in SECTIONS:
        pushed = {flag for targets in shared.values() for at, flag in targets if at == section}
        lines += ["", f"[{section}]  # `agentrl {_command(section)}` flags"
                  f"{' of the warm-up' if section == 'warmup_trainer' else ''}"]
        for flag, value in flag_items(getattr(config, section)).items():
            if flag in WIRED[section] or flag in pushed:
                continue
            origin = origins.get((section, flag), "default")
            if (section, flag) in short:
                origin += f", --{short[(section, flag)]}"
            if f"{section}.{flag}" in extra:
                values, name = extra[f"{section}.{flag}"]
                value, origin = values[flag], f"--{name}"
            lines.append(_line(flag, value, origin))
    return "\n".join(lines)


def _line(key: str, value: Any, origin: str) -> str:
    if value is None:
        return f"# {key} = (unset)  # {origin}"
    return f"{key} = {toml_value(value)}  # {origin}"
