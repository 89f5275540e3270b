"""The ``humaneval`` scorer: a model's program run against a HumanEval problem's tests in the sandbox.

The problem's fields (``prompt``, ``test``, ``entry_point``, as in OpenAI HumanEval rows) come from the Task's
metadata: ``ground_truth["metadata"]`` or the top level of ``ground_truth`` (where the sampler puts them). An answer
that defines ``def {entry_point}(`` is a whole function: it runs after the part of the prompt before that function
(imports and helpers the tests may call). Any other answer completes the prompt's body. The tests follow, then
``check({entry_point})``; the answer passes if the program exits with 0 within the limits.

Fails closed: where the code cannot be isolated, :class:`~agentrl.tools.sandbox.SandboxUnavailable` propagates and
the scoring is recorded as an error, never as a pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentrl.tools.sandbox import SandboxConfig, run_python

HUMANEVAL_FIELDS = ("prompt", "test", "entry_point")
HUMANEVAL_SANDBOX = SandboxConfig(timeout_s=10, cpu_seconds=10, memory_mb=1024)
STDERR_TAIL_CHARS = 500


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


def humaneval_program(answer: str, prompt: str, test: str, entry_point: str) -> str:
    """The program that checks ``answer``: a whole function after the prompt's preamble, or the prompt completed
    by a body; then the tests and ``check(entry_point)``."""
    definition = re.compile(rf"^def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    if definition.search(answer):
        in_prompt = definition.search(prompt)
        program = f"{prompt[: in_prompt.start()] if in_prompt else prompt}\n{answer}"
    else:
        program = prompt + answer
    return f"{program}\n\n{test}\n\ncheck({entry_point})\n"


async def humaneval_score(model_answer: str, ground_truth: Any,
                          config: Mapping[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """1.0 if the answer passes the problem's tests in the sandbox, else 0.0; details: ``passed``, ``exit_code``,
    ``timed_out`` and the end of ``stderr``."""
    problem = humaneval_problem(ground_truth)
    result = await run_python(humaneval_program(model_answer or "", **problem), HUMANEVAL_SANDBOX)
    passed = result.exit_code == 0 and not result.timed_out
    return (1.0 if passed else 0.0), {"passed": passed, "exit_code": result.exit_code,
                                      "timed_out": result.timed_out, "stderr": result.stderr[-STDERR_TAIL_CHARS:]}
