"""Environment kinds by name: the built-ins (imported lazily), specs registered at run time, and plugin references.

``get_spec(name)`` resolves, in this order: a spec registered with :func:`register` (tests, plugins that import
this module), a built-in (:data:`BUILTIN`: the module is imported on first use and its ``spec()`` called once, so
a missing third-party package only matters to the environment that needs it), and a plugin reference
``MODULE:FUNCTION`` (``FUNCTION()`` returns an :class:`EnvSpec`; this is how a separate process, such as
``agentrl envs serve``, reaches an environment defined outside the package). Resolved specs are cached.
"""

from __future__ import annotations

import importlib
import threading

from agentrl.envs.base import EnvError, EnvSpec

BUILTIN: dict[str, str] = {
    "textcraft": "agentrl.envs.textcraft",
    "babyai": "agentrl.envs.babyai",
    "sciworld": "agentrl.envs.sciworld",
}
"""Built-in environment name -> the module whose ``spec()`` describes it."""

PACKAGES: dict[str, str] = {"textcraft": "textcraft", "babyai": "minigrid", "sciworld": "scienceworld"}
"""Built-in environment name -> the third-party distribution it runs on."""

_registered: dict[str, EnvSpec] = {}
_resolved: dict[str, EnvSpec] = {}
_lock = threading.RLock()


def register(spec: EnvSpec) -> None:
    """Make ``spec`` known as ``spec.name`` in this process (replacing an earlier registration of that name).

    Built-in names cannot be taken: a registration that shadowed one would change what ``--env_server``-less runs
    and ``agentrl envs serve`` mean."""
    if spec.name in BUILTIN:
        raise ValueError(f"{spec.name!r} is a built-in environment; register the spec under another name")
    if ":" in spec.name:
        raise ValueError(f"environment name {spec.name!r} must not contain ':' (that marks MODULE:FUNCTION)")
    with _lock:
        _registered[spec.name] = spec
        _resolved.pop(spec.name, None)


def names() -> list[str]:
    """Built-in names, then registered ones (sorted)."""
    return sorted(BUILTIN) + sorted(_registered)


def get_spec(name: str) -> EnvSpec:
    """The :class:`EnvSpec` of ``name`` (see the module docstring); ``EnvError`` naming the known ones otherwise."""
    with _lock:
        if name in _registered:
            return _registered[name]
        if name not in _resolved:
            _resolved[name] = _load(name)
        return _resolved[name]


def _load(name: str) -> EnvSpec:
    if name in BUILTIN:
        module_name, function_name = BUILTIN[name], "spec"
    elif ":" in name:
        module_name, _, function_name = name.partition(":")
    else:
        raise EnvError(f"unknown environment {name!r}: expected one of {', '.join(names())} "
                       "or a plugin reference MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        needs = f" (it runs on the {PACKAGES[name]!r} package)" if name in PACKAGES else ""
        raise EnvError(f"environment {name!r}: cannot import {module_name}{needs}: {error}") from error
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise EnvError(f"environment {name!r}: {module_name} has no function {function_name}() returning an EnvSpec")
    spec = factory()
    if not isinstance(spec, EnvSpec):
        raise EnvError(f"environment {name!r}: {module_name}.{function_name}() returned "
                       f"{type(spec).__name__}, expected an EnvSpec")
    return spec
