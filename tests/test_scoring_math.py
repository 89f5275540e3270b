"""Answer extraction (schemas ``boxed`` and ``answer``) and the ``math`` scorer's notion of equal answers."""

from __future__ import annotations

import pytest

from agentrl.scoring import extract_answer, math_equal
from agentrl.scoring.answers import extract_hashes, final_answer_text
from agentrl.scoring.math_equiv import math_score


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("First \\boxed{1}, finally \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b}} + {c}}", "\\sqrt{\\frac{a}{b}} + {c}"),
        ("\\fbox{7}", "7"),
        ("\\fbox{7} then \\boxed{8}", "8"),
        ("so \\boxed 5", "5"),
        ("\\boxed{unclosed", ""),
        ("no box at all", ""),
        ("<think>maybe \\boxed{3}</think>It is \\boxed{4}", "4"),
        ("<think>maybe \\boxed{3}</think>I do not know", ""),
    ],
)
def test_boxed_schema(text: str, expected: str) -> None:
    assert extract_answer(text, "boxed") == expected


@pytest.mark.parametrize(
    ("text", "schema", "expected"),
    [
        ("<answer>Paris</answer>", "answer", "Paris"),
        ("<answer>a</answer> then <answer> b </answer>", "answer", "b"),
        ("<answer>no end", "answer", ""),
        ("no start</answer>", "answer", ""),
        ("<result>9</result>", "result", "9"),
    ],
)
def test_tag_schemas(text: str, schema: str, expected: str) -> None:
    assert extract_answer(text, schema) == expected


def test_final_answer_text_and_hashes() -> None:
    assert extract_hashes("Natalia sold 48 clips.\n#### 72") == "72"
    assert extract_hashes("no marker") is None
    assert final_answer_text("work... \\boxed{5}") == "5"
    assert final_answer_text("work...\n#### 1,234") == "1,234"
    assert final_answer_text("<answer>7</answer>") == "7"
    assert final_answer_text("  12  ") == "12"


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("72", "72"),
        ("72.0", "72"),
        ("1,234,567", "1234567"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{4}", "3/4"),
        ("\\frac12", "0.5"),
        ("\\frac{\\frac{1}{2}}{3}", "1/6"),
        ("50\\%", "0.5"),
        ("50%", "50"),
        ("0.5", "50\\%"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("x = 5", "5"),
        ("5\\text{ cm}", "5"),
        ("\\$12.50", "12.5"),
        ("$12.50$", "12.5"),
        ("90^\\circ", "90"),
        ("\\left(3\\right)", "3"),
        ("(1, 2)", "(1,2)"),
        ("2x+1", "1+2x"),
        ("(x+1)^2", "x^2 + 2x + 1"),
        ("2\\pi", "\\pi \\cdot 2"),
        ("0.33333", "1/3"),
        ("2e5", "200000"),
        ("-3", "-3"),
        ("\\text{yes}", "Yes"),
    ],
)
def test_equivalent_answers(prediction: str, reference: str) -> None:
    assert math_equal(prediction, reference)


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("1000001", "1000000"),  # integers compare exactly, not within a tolerance
        ("0.333", "1/3"),
        ("1,2", "(2,1)"),  # tuples are ordered
        ("(1, 2)", "(1, 2, 3)"),
        ("3.14", "\\pi"),
        ("x + 1", "x + 2"),
        ("", "5"),
        ("5", ""),
        ("__import__('os').system('true')", "0"),  # never evaluated as code
        ("2^{10000}", "1"),
    ],
)
def test_different_answers(prediction: str, reference: str) -> None:
    assert not math_equal(prediction, reference)


def test_math_scorer_reference_forms() -> None:
    assert math_score("So \\boxed{\\frac{3}{4}}.", "0.75") == 1.0
    assert math_score("#### 1,234", "Work: 1000 + 234\n#### 1234") == 1.0
    assert math_score("\\boxed{8}", {"answer": ["7", "8"]}) == 1.0
    assert math_score("\\boxed{9}", ["7", "8"]) == 0.0
    assert math_score("\\boxed{12}", 12) == 1.0
    assert math_score("", "5") == 0.0
    assert math_score("\\boxed{1.00001}", "1", {"rel_tol": 1e-3}) == 1.0
    assert math_score("\\boxed{1.01}", "1", {"rel_tol": 1e-3}) == 0.0
    with pytest.raises(ValueError, match="needs a reference answer"):
        math_score("\\boxed{1}", None)


NUMBERS = ["0", "-0", "0.0", "-0.0", "42", "+42", "-42", "42.0", "41.99999", "42.00001", "4200", "0.42", ".5", "5.",
           "1e3", "1000", "1E-3", "0.001", "3.141592653589793238", "3.141592653589793", "0.1", "0.30000000000000004",
           "9" * 40, "9" * 39 + "8", "1" + "0" * 400, "1e400", "1e308", "007", "00", "1_000", "2.5e-320", "-2.5",
           "(42)", "4.2e1", "1e-400", "--42", "nan", "inf", "oo", "42 or 43", "[42]", "42, 43", "42 == 42", "x"]


@pytest.mark.parametrize("percent", [False, True])
def test_plain_numbers_compare_as_sympy_compares_them(percent: bool) -> None:
    """Plain literals skip sympy; every pair (and sign, exponent, overflow, leading-zero and underscore edge case)
    gets the answer the sympy path gives."""
    from agentrl.scoring.math_equiv import REL_TOL, _numbers_equal, plain_number, to_sympy

    checked = 0
    for a in NUMBERS:
        for b in NUMBERS:
            fast_a, fast_b = plain_number(a), plain_number(b)
            slow_a, slow_b = to_sympy(a), to_sympy(b)
            if fast_a is None or fast_b is None:  # not taken: sympy decides, as before
                continue
            assert slow_a is not None and slow_b is not None and slow_a.is_number and slow_b.is_number, (a, b)
            assert fast_a == slow_a and fast_b == slow_b, (a, b)
            assert _numbers_equal(fast_a, fast_b, percent, REL_TOL) == _numbers_equal(slow_a, slow_b, percent,
                                                                                      REL_TOL), (a, b)
            checked += 1
    assert checked > 500
    assert plain_number("1e400") is None and plain_number("007") is None and plain_number("2*3") is None


@pytest.mark.parametrize("answer", ["\\boxed{42 or 43}", "\\boxed{[42]}", "\\boxed{42 == 42}", "\\boxed{inf}",
                                    "\\boxed{nan}", "\\boxed{1e400}", "\\boxed{4200}", "\\boxed{41.9}",
                                    "\\boxed{42.01}", "\\boxed{" + "4" * 400 + "}", "\\boxed{42}\\boxed{43}"])
def test_the_numeric_path_accepts_no_answer_that_is_not_the_number(answer: str) -> None:
    """What a policy might try against a numeric reference: alternatives, containers, comparisons, infinities, the
    reference ×100 without a percent sign, near misses beyond the tolerance, an over-long answer, a second box."""
    assert math_score(answer, "42") == 0.0, answer
    assert math_score("\\boxed{42}", "42") == 1.0 and math_score("\\boxed{4.2e1}", "42") == 1.0


def test_numeric_answers_are_scored_without_importing_sympy() -> None:
    import subprocess
    import sys

    code = ("import sys; from agentrl.scoring.math_equiv import math_score; "
            "assert math_score('\\\\boxed{42}', '42') == 1.0 and math_score('it is \\\\boxed{41.5}', '42') == 0.0; "
            "assert math_score('\\\\boxed{50\\\\%}', '0.5') == 1.0; "
            "assert 'sympy' not in sys.modules; "
            "assert math_score('\\\\boxed{\\\\frac{1}{2}}', '0.5') == 1.0 and 'sympy' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
