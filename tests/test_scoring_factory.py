"""MCPScorerFactory: registration (sync, async, two-argument), loading scorers from a file, and failures that are
recorded as errors instead of becoming a score of 0."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from agentrl.scoring import MCPScorerFactory, ScorerError


@pytest.fixture(autouse=True)
def restore_registry():
    saved = dict(MCPScorerFactory._scorers)
    yield
    MCPScorerFactory._scorers.clear()
    MCPScorerFactory._scorers.update(saved)


async def test_builtins_are_registered() -> None:
    assert {"math", "exact", "agentcpm", "env_reward"} <= set(MCPScorerFactory.names())
    math = await MCPScorerFactory.score("math", "It is \\boxed{\\frac{1}{4}}", "0.25")
    assert (math.score, math.error, math.ok, math.scorer) == (1.0, None, True, "math")
    exact = await MCPScorerFactory.score("exact", "  The  Eiffel tower. ", {"answer": ["Big Ben", "the eiffel tower"]})
    assert exact.score == 1.0
    assert (await MCPScorerFactory.score("exact", "Paris", "London")).score == 0.0
    reward = await MCPScorerFactory.score("env_reward", "", None, {"env_reward": 0.25})
    assert reward.score == 0.25


async def test_math_format_gives_partial_credit_for_a_wrong_answer() -> None:
    assert (await MCPScorerFactory.score("math_format", "\\boxed{42}", "42")).score == 1.0
    assert (await MCPScorerFactory.score("math_format", "\\boxed{41}", "42")).score == 0.1
    assert (await MCPScorerFactory.score("math_format", "41", "42", {"format_credit": 0.3})).score == 0.3


async def test_sync_async_and_two_argument_scorers() -> None:
    seen: dict[str, object] = {}

    def three(model_answer, ground_truth, config):
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["config"] = config
        return len(model_answer) / 10

    async def three_async(model_answer, ground_truth, config):
        await asyncio.sleep(0)
        return 1.0 if model_answer == ground_truth else 0.0

    def two(model_answer, ground_truth):
        return 0.5

    def detailed(model_answer, ground_truth):
        return 1, {"matched": model_answer}

    for name, fn in (("t-three", three), ("t-async", three_async), ("t-two", two), ("t-detailed", detailed)):
        MCPScorerFactory.register_scorer(name, fn)
    assert (await MCPScorerFactory.score("t-three", "abcd", "x", {"k": 1})).score == 0.4
    assert seen == {"thread": True, "config": {"k": 1}}  # plain scorers run off the event loop
    assert (await MCPScorerFactory.score("t-async", "a", "a")).score == 1.0
    assert (await MCPScorerFactory.score("t-two", "a", "b", {"ignored": True})).score == 0.5
    assert MCPScorerFactory.get_scorer("t-two") is two
    result = await MCPScorerFactory.score("t-detailed", "x", "x")
    assert (result.score, result.details) == (1.0, {"matched": "x"})


def test_scorers_with_a_wrong_signature_are_refused() -> None:
    with pytest.raises(ScorerError, match=r"must take \(model_answer, ground_truth\[, config\]\)"):
        MCPScorerFactory.register_scorer("t-bad", lambda answer: 1.0)
    with pytest.raises(ScorerError, match="must take"):
        MCPScorerFactory.register_scorer("t-bad", lambda a, b, c, d: 1.0)
    with pytest.raises(ScorerError, match="not callable"):
        MCPScorerFactory.register_scorer("t-bad", 3)
    with pytest.raises(KeyError, match="unknown scorer 't-bad'; registered: agentcpm"):
        MCPScorerFactory.get_scorer("t-bad")


async def test_a_custom_scorer_from_a_file(tmp_path: Path) -> None:
    module = tmp_path / "my_scorers.py"
    module.write_text(
        "from agentrl.scoring import MCPScorerFactory\n"
        "\n"
        "async def length_scorer(model_answer, ground_truth, config):\n"
        "    return min(1.0, len(model_answer) / len(ground_truth))\n"
        "\n"
        "def contains(model_answer, ground_truth):\n"
        "    return ground_truth in model_answer\n"
        "\n"
        "MCPScorerFactory.register_scorer('t-length', length_scorer)\n"
        "MCPScorerFactory.register_scorer('t-contains', contains)\n"
    )
    assert MCPScorerFactory.load_module(module) == ["t-length", "t-contains"]
    assert (await MCPScorerFactory.score("t-length", "ab", "abcd")).score == 0.5
    assert (await MCPScorerFactory.score("t-contains", "it is 42", "42")).score == 1.0  # bool → 1.0


def test_bad_scorer_modules(tmp_path: Path) -> None:
    with pytest.raises(ScorerError, match="does not exist"):
        MCPScorerFactory.load_module(tmp_path / "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ScorerError, match="registered no scorer"):
        MCPScorerFactory.load_module(empty)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('cannot start')\n")
    with pytest.raises(ScorerError, match="failed to import: RuntimeError: cannot start"):
        MCPScorerFactory.load_module(broken)


async def test_scorer_failures_are_recorded_not_zero() -> None:
    def raises(model_answer, ground_truth, config):
        raise RuntimeError("database down")

    async def slow(model_answer, ground_truth, config):
        await asyncio.sleep(10)
        return 1.0

    MCPScorerFactory.register_scorer("t-raises", raises)
    MCPScorerFactory.register_scorer("t-slow", slow)
    MCPScorerFactory.register_scorer("t-nan", lambda a, b: float("nan"))
    MCPScorerFactory.register_scorer("t-none", lambda a, b: None)
    MCPScorerFactory.register_scorer("t-text", lambda a, b: "1.0")

    failed = await MCPScorerFactory.score("t-raises", "a", "b")
    assert (failed.score, failed.ok) == (None, False)
    assert failed.error == "scorer 't-raises' failed: RuntimeError: database down"
    timed_out = await MCPScorerFactory.score("t-slow", "a", "b", timeout=0.2)
    assert timed_out.score is None and "did not finish within 0.2 s" in timed_out.error
    for name, message in (("t-nan", "finite number"), ("t-none", "must return a number"), ("t-text", "must return")):
        result = await MCPScorerFactory.score(name, "a", "b")
        assert result.score is None and message in result.error
    # details are stored on the Record: non-finite numbers in them are kept by name (a server may refuse NaN)
    MCPScorerFactory.register_scorer("t-odd-details", lambda a, b: (1.0, {"x": float("nan"), "y": (float("inf"), 2.0),
                                                                         "z": {"w": float("-inf")}}))
    odd = await MCPScorerFactory.score("t-odd-details", "a", "b")
    assert odd.score == 1.0 and odd.details == {"x": "nan", "y": ["inf", 2.0], "z": {"w": "-inf"}}
    unknown = await MCPScorerFactory.score("t-missing", "a", "b")
    assert unknown.score is None and "unknown scorer 't-missing'" in unknown.error
    no_reward = await MCPScorerFactory.score("env_reward", "a", None, {})
    assert no_reward.score is None and "no environment reward" in no_reward.error
    no_reference = await MCPScorerFactory.score("math", "\\boxed{1}", None)
    assert no_reference.score is None and "needs a reference answer" in no_reference.error
