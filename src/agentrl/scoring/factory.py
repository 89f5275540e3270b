"""``MCPScorerFactory``: the per-process registry of scorers, and scoring that records failures.

A scorer is ``fn(model_answer, ground_truth, config) -> float`` (a two-argument ``fn(model_answer,
ground_truth)`` is accepted too), plain or ``async``; it may also return ``(score, details)`` with a dict worth
keeping next to the score (the LLM judge records its model and reply there). Plain functions run in a worker
thread so they never block the sampler's event loop. ``ground_truth`` is the reference answer or a mapping with
``answer`` (plus e.g. ``query``); ``config`` is a mapping, of which the built-ins read ``scorer_agent`` (judge
settings, ``agentcpm``), ``query`` (``agentcpm``, when the ground truth has none), ``env_reward``
(``env_reward``, also looked up in the ground truth) and ``rel_tol`` (``math``).

``score`` never raises for a scorer problem: an exception, a timeout, a judge that cannot answer or a result
that is not a finite number becomes ``ScoreResult.error`` (with ``score`` None), so the caller records it
instead of mistaking it for a reward of 0. A scorer whose backend cannot be reached raises
:class:`ScorerUnavailable` (the LLM judge does when every model fails with connection errors, timeouts or 5xx):
the result is then ``unavailable``, an infrastructure failure rather than a verdict, and with
``retry_unavailable`` ``score`` retries it with backoff for the exception's ``retry_for_s`` first.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from agentrl.log import redact
from agentrl.scoring.builtin import BUILTIN_SCORERS
from agentrl.scoring.errors import ScorerUnavailable

logger = logging.getLogger(__name__)

ScorerFn = Callable[..., Any]

DEFAULT_TIMEOUT_S = 300.0
UNAVAILABLE_BACKOFF_S = (1.0, 30.0)  # first and longest wait between retries of an unavailable scorer


class ScorerError(ValueError):
    """A scorer cannot be registered or loaded."""


class ScoreResult(BaseModel):
    """Outcome of scoring one answer: a score, or the error that prevented one."""

    scorer: str
    score: float | None = None
    error: str | None = None
    unavailable: bool = Field(False, description="the error is the scorer's backend being unreachable")
    details: dict[str, Any] = Field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def _wants_config(fn: ScorerFn) -> bool:
    """True for ``fn(answer, truth, config)``, False for ``fn(answer, truth)``; ``ScorerError`` otherwise."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ScorerError(f"cannot inspect scorer {fn!r}: {exc}") from exc
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return True
    positional = [
        p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    if len(positional) < 2 or len(required) > 3:
        raise ScorerError(
            f"scorer {getattr(fn, '__name__', fn)!r} must take (model_answer, ground_truth[, config]); "
            f"its signature is {inspect.signature(fn)}"
        )
    return len(positional) >= 3


class MCPScorerFactory:
    """Registry of scorers by name (per process; built-ins: ``math``, ``exact``, ``agentcpm``, ``env_reward``)."""

    _scorers: ClassVar[dict[str, tuple[ScorerFn, bool]]] = {}
    _recording: ClassVar[list[str] | None] = None

    @classmethod
    def register_scorer(cls, name: str, scorer_func: ScorerFn) -> None:
        """Register (or replace) ``scorer_func`` under ``name``."""
        if not isinstance(name, str) or not name.strip():
            raise ScorerError(f"a scorer name must be a non-empty string, got {name!r}")
        if not callable(scorer_func):
            raise ScorerError(f"scorer {name!r} is not callable: {scorer_func!r}")
        cls._scorers[name] = (scorer_func, _wants_config(scorer_func))
        if cls._recording is not None:
            cls._recording.append(name)

    @classmethod
    def get_scorer(cls, name: str) -> ScorerFn:
        """The function registered as ``name``; ``KeyError`` lists the registered names."""
        try:
            return cls._scorers[name][0]
        except KeyError:
            raise KeyError(f"unknown scorer {name!r}; registered: {', '.join(cls.names())}") from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._scorers)

    @classmethod
    def load_module(cls, path: str | Path) -> list[str]:
        """Import a Python file (``--scorer_module``) that registers scorers; returns the names it registered."""
        path = Path(path).resolve()
        if not path.is_file():
            raise ScorerError(f"scorer module {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"agentrl_scorer_module_{abs(hash(str(path)))}", path)
        if spec is None or spec.loader is None:
            raise ScorerError(f"cannot import scorer module {path}")
        module = importlib.util.module_from_spec(spec)
        cls._recording = registered = []
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ScorerError(f"scorer module {path} failed to import: {type(exc).__name__}: {exc}") from exc
        finally:
            cls._recording = None
        if not registered:
            raise ScorerError(
                f"scorer module {path} registered no scorer; call MCPScorerFactory.register_scorer(name, fn) in it"
            )
        logger.info("scorers registered from %s: %s", path, ", ".join(registered))
        return registered

    @classmethod
    async def score(
        cls,
        name: str,
        model_answer: str,
        ground_truth: Any,
        config: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        retry_unavailable: bool = False,
    ) -> ScoreResult:
        """Score one answer with scorer ``name``; failures are returned in ``ScoreResult.error``.

        With ``retry_unavailable``, a scorer that raises :class:`ScorerUnavailable` is tried again with growing
        waits until it answers or its ``retry_for_s`` have passed (the result then stays ``unavailable``).
        """
        started = time.perf_counter()
        delay, longest = UNAVAILABLE_BACKOFF_S
        while True:
            result, retry_for_s = await cls._score_once(name, model_answer, ground_truth, config, timeout)
            waited = time.perf_counter() - started
            if not (result.unavailable and retry_unavailable and waited + delay <= retry_for_s):
                result.elapsed_s = waited
                return result
            logger.warning("scorer %r unavailable; retrying in %.0f s (for up to %.0f s more)", name, delay,
                           retry_for_s - waited)
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)

    @classmethod
    async def _score_once(cls, name: str, model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None,
                          timeout: float | None) -> tuple[ScoreResult, float]:
        """One try, and the ``retry_for_s`` of a :class:`ScorerUnavailable` it raised (else 0)."""
        entry = cls._scorers.get(name)
        if entry is None:
            return ScoreResult(scorer=name, error=f"unknown scorer {name!r}; registered: {', '.join(cls.names())}"), 0.0
        fn, wants_config = entry
        args = (model_answer, ground_truth, dict(config or {})) if wants_config else (model_answer, ground_truth)
        try:
            async with asyncio.timeout(timeout):
                if inspect.iscoroutinefunction(fn):
                    value = await fn(*args)
                else:
                    value = await asyncio.to_thread(fn, *args)
                    if inspect.isawaitable(value):
                        value = await value
            score, details = _as_score(value)
        except TimeoutError:
            error = f"scorer {name!r} did not finish within {timeout:g} s"
        except ScorerUnavailable as exc:
            error = redact(f"scorer {name!r} unavailable: {exc}")[:2000]
            logger.warning("%s", error)
            return ScoreResult(scorer=name, error=error, unavailable=True), exc.retry_for_s
        except Exception as exc:  # noqa: BLE001 - a user scorer's bug is the score's error
            error = redact(f"scorer {name!r} failed: {type(exc).__name__}: {exc}")[:2000]
        else:
            return ScoreResult(scorer=name, score=score, details=details), 0.0
        logger.warning("%s", error)
        return ScoreResult(scorer=name, error=error), 0.0


def _storable(value: Any) -> Any:
    """``value`` with every non-finite float as its name ("nan", "inf", "-inf"): a scorer's details go into the
    Record, and not every MongoDB-protocol server stores NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(item) for item in value]
    return value


def _as_score(value: Any) -> tuple[float, dict[str, Any]]:
    details: dict[str, Any] = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, details = value[0], _storable(value[1])
    if value is None or isinstance(value, str):
        raise TypeError(f"a scorer must return a number, got {value!r}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"a scorer must return a finite number, got {value!r}")
    return score, details


for _name, _fn in BUILTIN_SCORERS.items():
    MCPScorerFactory.register_scorer(_name, _fn)
