"""Command-line flags generated from pydantic models: one ``--FIELD`` per field, the field's description as help.

Used by ``agentrl train``, ``agentrl sample``, ``agentrl eval`` and ``agentrl run`` so that a configuration is
declared once, in its model. The flag of a field follows from its type: booleans take ``true``/``false`` (a bare
``--flag`` means true), optional values take ``none``, a ``Literal`` is a choice, a dict is a JSON object, a list
takes several values (``--report_to a b``). The fields of a nested model are flags under their own names, listed
in a help section of their own (the nested field's ``title``). A field's annotation may carry a :class:`Flag` (in
``Annotated[...]``) to name its flag differently, parse its text otherwise (``--inference_urls a,b``), repeat it
(``--scorer_module a.py --scorer_module b.py``) or add a short alias; :data:`NO_FLAG` keeps a field off the command
line. A flag not given is absent from the namespace, so the model's default applies: a nested model whose
defaults differ per parent is a subclass overriding them (e.g. greedy sampling in ``agentrl eval``).

The inverse: :func:`given_flags` reads the flags a model instance was given back out of it, and :func:`to_argv`
writes flags as the command line that gives them, so a process can start another with a configuration it holds.

This module imports only pydantic and the standard library: any package may build flags with it.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

NONE_WORDS = ("none", "null")
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class Flag:
    """How a field's flag differs from the one its type gives (put it in the field's ``Annotated[...]``).

    ``name``: the flag's name when it is not the field's; ``parse``: turns the flag's text into the field's value
    (e.g. a comma-separated list) and ``unparse`` the value back into that text; ``repeat``: a list field whose
    flag is given once per item; ``metavar``: the value's name in the help; ``aliases``: other option strings
    (``-k``).
    """

    name: str | None = None
    parse: Callable[[str], Any] | None = None
    unparse: Callable[[Any], str] | None = None
    repeat: bool = False
    metavar: str | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class NoFlag:
    """Marks a field that has no flag (set by code, or derived from other fields)."""


NO_FLAG = NoFlag()


def comma_list(value: str) -> list[str]:
    """``a, b,,c`` → ``["a", "b", "c"]`` (empty items dropped)."""
    return [item.strip() for item in value.split(",") if item.strip()]


def parse_bool(value: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``), as an argparse type."""
    try:
        return TypeAdapter(bool).validate_python(value.strip().lower())
    except ValidationError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}") from None


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        return None if value.strip().lower() in NONE_WORDS else convert(value)
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _flag_of(info: FieldInfo) -> Flag | NoFlag | None:
    return next((item for item in info.metadata if isinstance(item, Flag | NoFlag)), None)


def flag_name(name: str, info: FieldInfo) -> str:
    """The flag (without ``--``) of field ``name``."""
    flag = _flag_of(info)
    return flag.name if isinstance(flag, Flag) and flag.name else name


def _type_kwargs(name: str, annotation: Any, flag: Flag | None) -> dict[str, Any]:
    """``add_argument`` keywords that follow from the field's type (and its :class:`Flag`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    maybe: Callable[[Callable[[str], Any]], Callable[[str], Any]] = _optional if optional else (lambda f: f)
    if flag is not None and flag.parse is not None:
        return {"type": maybe(flag.parse), "metavar": flag.metavar or name.upper()}
    if origin is list:
        (item,) = args
        choices = typing.get_args(item) or None
        if flag is not None and flag.repeat:
            return {"action": "append", "choices": choices, "metavar": flag.metavar or name.upper()}
        return {"nargs": "+", "choices": choices, "metavar": name.upper()}
    if origin is typing.Literal:
        return {"choices": list(args) + ([None] if optional else []), "type": maybe(str),
                "metavar": "{" + ",".join(list(args) + (["none"] if optional else [])) + "}"}
    if origin is dict:
        return {"type": maybe(_json_object), "metavar": "JSON"}
    if annotation is bool:
        return {"type": maybe(parse_bool), "nargs": "?", "const": True, "metavar": "true|false"}
    kwargs: dict[str, Any] = {"type": maybe(annotation)}
    if flag is not None and flag.metavar:
        kwargs["metavar"] = flag.metavar
    return kwargs


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field holding a nested model (its fields are flags of their own), else None."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _help(info: FieldInfo) -> str:
    """The description, with the default unless the description says it (``default:``)."""
    description = info.description or ""
    if "default:" in description:
        return description
    return f"{description} (default: {info.get_default(call_default_factory=True)})".strip()


def add_model_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, model: type[BaseModel],
                        prefix: str = "", hidden: bool = False) -> None:
    """Register one flag per field of ``model`` (see the module docstring); a flag not given is absent from the
    namespace, so that the model's default applies. The fields of a nested model are flags under their own names,
    in a help section titled by the nested field's ``title`` (when ``parser`` is a parser, not a section).
    ``prefix`` goes before each flag and its namespace key (``--trainer.learning_rate``); ``hidden`` leaves the
    flags out of ``--help``."""
    for name, info in model.model_fields.items():
        flag = _flag_of(info)
        if isinstance(flag, NoFlag):
            continue
        if nested := _nested_model(info.annotation):
            titled = isinstance(parser, argparse.ArgumentParser) and info.title and not hidden
            add_model_arguments(parser.add_argument_group(info.title) if titled else parser, nested, prefix, hidden)
            continue
        add_flag(parser, prefix + flag_name(name, info), info, hidden=hidden, aliases=not prefix)


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, info: FieldInfo,
             help: str | None = None, hidden: bool = False, aliases: bool = True) -> None:
    """Register ``--flag`` for the field ``info`` (its type, its help or ``help``), absent from the namespace when
    not given."""
    meta = _flag_of(info)
    meta = meta if isinstance(meta, Flag) else None
    kwargs = _type_kwargs(flag.rsplit(".", 1)[-1], info.annotation, meta)
    strings = (meta.aliases if meta is not None and aliases else ())
    parser.add_argument(f"--{flag}", *strings, dest=flag, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS if hidden else help or _help(info), **kwargs)


def flag_values(model: type[BaseModel], given: dict[str, Any]) -> dict[str, Any]:
    """The ``given`` flags (by flag name) of ``model``'s fields, as its constructor takes them: those of a nested
    model under its field, left out when none of them is given so that its default applies."""
    values: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if isinstance(_flag_of(info), NoFlag):
            continue
        if nested := _nested_model(info.annotation):
            if inner := flag_values(nested, given):
                values[name] = inner
        elif (flag := flag_name(name, info)) in given:
            values[name] = given[flag]
    return values


def _flag_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The flag of a validation error's location (through nested models), or None for a whole model. A nested model
    without flags of its own (:data:`NO_FLAG`, e.g. a section of ``agentrl run``) prefixes its name: ``trainer.X``."""
    prefix = ""
    for part in loc:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        if info is None:
            return None
        nested = _nested_model(info.annotation)
        if nested is None:
            return prefix + flag_name(str(part), info)
        if isinstance(_flag_of(info), NoFlag):
            prefix += f"{part}."
        model = nested
    return None


def describe_errors(model: type[BaseModel], error: ValidationError,
                    label: Callable[[str], str] = lambda flag: f"--{flag}") -> str:
    """One line naming the flag of each problem (``label`` says how: ``--flag`` by default; a problem of several
    flags together: its message alone)."""
    problems = []
    for item in error.errors():
        name = _flag_at(model, item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{label(name)}: {message}" if name else message)
    return "; ".join(problems)


def model_from_namespace(model: type[ModelT], args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelT:
    """``model`` from the parsed flags of :func:`add_model_arguments`; an invalid value is a parser error (exit
    status 2) naming its flag."""
    try:
        return model(**flag_values(model, vars(args)))
    except ValidationError as error:
        parser.error(describe_errors(model, error))


def flag_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every flag of ``model`` (those of nested models included) and the field it sets."""
    found: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        if isinstance(_flag_of(info), NoFlag):
            continue
        if nested := _nested_model(info.annotation):
            found.update(flag_fields(nested))
        else:
            found[flag_name(name, info)] = info
    return found


def flag_items(config: BaseModel) -> dict[str, Any]:
    """Every flag of ``config`` (through nested models) and its value."""
    found: dict[str, Any] = {}
    for name, info in type(config).model_fields.items():
        if isinstance(_flag_of(info), NoFlag):
            continue
        value = getattr(config, name)
        found.update(flag_items(value) if _nested_model(info.annotation) else {flag_name(name, info): value})
    return found


def given_flags(config: BaseModel) -> dict[str, Any]:
    """The flags ``config`` was given (its fields set explicitly, through nested models) and their values."""
    found: dict[str, Any] = {}
    for name in config.model_fields_set:
        info = type(config).model_fields[name]
        if isinstance(_flag_of(info), NoFlag):
            continue
        value = getattr(config, name)
        if _nested_model(info.annotation):
            found.update(given_flags(value))
        else:
            found[flag_name(name, info)] = value
    return found


def to_argv(model: type[BaseModel], flags: dict[str, Any]) -> list[str]:
    """The command-line arguments that give ``model``'s ``flags`` these values (the inverse of its parser)."""
    fields, argv = flag_fields(model), []
    for flag, value in flags.items():
        info = fields[flag]
        meta = _flag_of(info)
        if value is None:
            argv += [f"--{flag}", NONE_WORDS[0]]
        elif isinstance(meta, Flag) and meta.unparse is not None:
            argv += [f"--{flag}", meta.unparse(value)]
        elif isinstance(meta, Flag) and meta.repeat:
            argv += [part for item in value for part in (f"--{flag}", str(item))]
        elif isinstance(value, bool):
            argv += [f"--{flag}", "true" if value else "false"]
        elif isinstance(value, list | tuple):
            argv += [f"--{flag}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            argv += [f"--{flag}", json.dumps(value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv
