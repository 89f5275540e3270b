"""Math answer equivalence (the ``math`` scorer).

Both answers are normalised (LaTeX wrappers, ``\\text{}`` units, ``\\left``/``\\right``, degrees, ``$``,
thousands separators, ``x =`` prefixes), then compared as strings, as numbers (integers exactly, other values
with a relative tolerance; percentages also against their fraction), element-wise for tuples, and finally
symbolically with sympy. LaTeX (``\\frac``, ``\\sqrt``, ``\\cdot``, ``^``, implicit products) is translated to
an expression that Python's ``ast`` parses, and the tree is turned into sympy objects over a whitelist, so no
model output is ever evaluated as code (sympy's own string parser uses ``eval``).

Two plain numeric literals (``42``, ``-0.5``, ``1e3``: most answers) are compared as exact fractions with the same
values and rules sympy would give them, without sympy: it is imported at the first answer that needs it (~0.3 CPU-s
a sampler or evaluation process does not spend when its answers are numbers).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from functools import cache
from types import ModuleType
from typing import Any

from agentrl.scoring.answers import extract_boxed, extract_hashes, final_answer_text

REL_TOL = 1e-4
MAX_ANSWER_CHARS = 300
MAX_EXPONENT = 1000

_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|mathrm|mbox|textit|operatorname)\s*\{([^{}]*)\}")
_UNIT_WORDS = re.compile(r"^[A-Za-z ./^0-9]*$")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\$", "$", "~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_VARIABLE_PREFIX = re.compile(r"^[A-Za-z]\s*=\s*(?=[^=])")
_IMPLICIT_AFTER_DIGIT = re.compile(r"(?<![A-Za-z_\d.])(\d+(?:\.\d*)?)\s*(?=[A-Za-z(])")
_EXPONENT = re.compile(r"[eE][+\-]?\d")


@cache
def _sympy() -> ModuleType:
    import sympy

    return sympy


@cache
def _sympy_names() -> tuple[dict[str, Any], dict[str, Any]]:
    """The functions and constants an answer may name."""
    sp = _sympy()
    functions = {"sqrt": sp.sqrt, "log": sp.log, "ln": sp.log, "exp": sp.exp, "sin": sp.sin, "cos": sp.cos,
                 "tan": sp.tan, "abs": sp.Abs}
    constants = {"pi": sp.pi, "e": sp.E, "oo": sp.oo, "inf": sp.oo, "infty": sp.oo}
    return functions, constants


def _replace_command_groups(text: str, command: str, build: Any, groups: int) -> str:
    """Replace ``\\command{a}{b}`` (``groups`` brace groups, single-character shorthand allowed) by ``build(a, b)``."""
    out, position = [], 0
    while True:
        start = text.find(command, position)
        if start == -1:
            out.append(text[position:])
            return "".join(out)
        out.append(text[position:start])
        cursor, args = start + len(command), []
        for _ in range(groups):
            while cursor < len(text) and text[cursor] == " ":
                cursor += 1
            if cursor < len(text) and text[cursor] == "{":
                depth, end = 0, cursor
                for end in range(cursor, len(text)):
                    depth += {"{": 1, "}": -1}.get(text[end], 0)
                    if depth == 0:
                        break
                args.append(text[cursor + 1 : end])
                cursor = end + 1
            elif cursor < len(text):
                args.append(text[cursor])
                cursor += 1
        if len(args) < groups:
            out.append(text[start:])
            return "".join(out)
        out.append(build(*args))
        position = cursor


def _latex_commands(text: str) -> str:
    """``\\frac{a}{b}`` → ``((a)/(b))``, ``\\sqrt[n]{x}`` → ``((x)**(1/(n)))``, ``\\sqrt{x}`` → ``sqrt(x)``, nested."""
    text = _replace_command_groups(text, "\\frac", lambda a, b: f"(({_latex_commands(a)})/({_latex_commands(b)}))", 2)
    text = re.sub(r"\\sqrt\s*\[([^\]]*)\]\s*\{([^{}]*)\}", r"((\2)**(1/(\1)))", text)
    return _replace_command_groups(text, "\\sqrt", lambda a: f"sqrt({_latex_commands(a)})", 1)


def _drop_units(text: str) -> str:
    """``\\text{...}`` groups: dropped when they hold unit words next to a number (``5\\text{ cm}``), else unwrapped."""

    def replace(match: re.Match[str]) -> str:
        rest = text.replace(match.group(0), "")
        return "" if _UNIT_WORDS.match(match.group(1)) and re.search(r"\d", rest) else match.group(1)

    return _TEXT_COMMANDS.sub(replace, text)


def normalise(answer: str) -> tuple[str, bool]:
    """``(expression, had_percent)``: the answer as a Python-syntax expression (best effort)."""
    text = answer.strip()
    for wrapper in (("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(wrapper[0]) and text.endswith(wrapper[1]):
            text = text[2:-2]
    text = _drop_units(text)
    for token in _DROP:
        text = text.replace(token, "")
    text = _DEGREES.sub("", text)
    had_percent = "%" in text
    text = text.replace("\\%", "").replace("%", "")
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cdot", "*"), ("\\times", "*"),
                     ("\\div", "/"), ("\\pi", "pi"), ("\\infty", "oo"), ("\\ln", "ln"), ("\\log", "log"),
                     ("\\exp", "exp"), ("\\sin", "sin"), ("\\cos", "cos"), ("\\tan", "tan"), ("−", "-")):
        text = text.replace(old, new)
    text = _latex_commands(text)
    text = text.replace("{", "(").replace("}", ")").replace("^", "**")
    text = _THOUSANDS.sub("", text)
    text = _VARIABLE_PREFIX.sub("", text).strip().rstrip(".").strip()
    text = _IMPLICIT_AFTER_DIGIT.sub(lambda m: m.group(0) if _EXPONENT.match(text, m.end()) else m.group(1) + "*", text)
    text = re.sub(r"\)\s*(?=[A-Za-z0-9(])", ")*", text)
    return text, had_percent


def _is_number_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool)


def _to_sympy(node: ast.AST) -> Any:
    sympy = _sympy()
    functions, constants = _sympy_names()
    if isinstance(node, ast.Expression):
        return _to_sympy(node.body)
    if _is_number_literal(node):
        return sympy.Integer(node.value) if isinstance(node.value, int) else sympy.Rational(repr(node.value))
    if isinstance(node, ast.Name):
        if node.id in constants:
            return constants[node.id]
        if len(node.id) <= 3:
            return sympy.Symbol(node.id)
        raise ValueError(f"unknown name {node.id!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _to_sympy(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _to_sympy(node.left), _to_sympy(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            return left / right
        if isinstance(node.op, ast.Pow):
            if right.is_number and abs(right) > MAX_EXPONENT:
                raise ValueError("exponent too large")
            return left**right
        raise ValueError(f"operator {type(node.op).__name__} not supported")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        if node.keywords or len(node.args) != 1:
            raise ValueError("functions take one argument")
        return functions[node.func.id](_to_sympy(node.args[0]))
    raise ValueError(f"{type(node).__name__} not supported")


def to_sympy(expression: str) -> Any | None:
    """The sympy value of a normalised expression, or ``None`` if it is not a (safe) math expression."""
    if not expression or len(expression) > MAX_ANSWER_CHARS:
        return None
    try:
        return _to_sympy(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, ZeroDivisionError, OverflowError):
        return None


def plain_number(expression: str) -> Fraction | None:
    """The exact value of a plain (optionally signed) numeric literal, as :func:`to_sympy` would give it (an int
    exactly, a float as the decimal of its ``repr``), or ``None`` for anything else (sympy decides those)."""
    if not expression or len(expression) > MAX_ANSWER_CHARS:
        return None
    try:
        node = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        sign, node = (-1 if isinstance(node.op, ast.USub) else 1), node.operand
    if not _is_number_literal(node) or (isinstance(node.value, float) and not math.isfinite(node.value)):
        return None
    return sign * Fraction(node.value if isinstance(node.value, int) else repr(node.value))


def _split_top_level(expression: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in expression:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _unwrap_tuple(expression: str) -> str:
    if len(expression) >= 2 and expression[0] in "([" and expression[-1] in ")]":
        inner = expression[1:-1]
        if "," in inner and len(_split_top_level(inner)) > 1:
            return inner
    return expression


def _is_integer(value: Any) -> bool:
    return value.denominator == 1 if isinstance(value, Fraction) else bool(value.is_Integer)


def _numbers_equal(a: Any, b: Any, percent: bool, rel_tol: float) -> bool:
    """``a`` and ``b`` both sympy numbers or both Fractions (:func:`plain_number`): the same rules for either."""
    candidates = [b, b / 100, b * 100] if percent else [b]
    for candidate in candidates:
        if _is_integer(a) and _is_integer(candidate):
            if a == candidate:
                return True
            continue
        try:
            x, y = float(a), float(candidate)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isclose(x, y, rel_tol=rel_tol, abs_tol=1e-12):
            return True
    return False


def _expressions_equal(a: Any, b: Any) -> bool:
    try:
        difference = _sympy().simplify(a - b)
    except (TypeError, ValueError, AttributeError, RecursionError, NotImplementedError):
        return False
    return difference == 0


def math_equal(prediction: str, reference: str, rel_tol: float = REL_TOL) -> bool:
    """Whether two answers denote the same mathematical value (see the module docstring)."""
    pred_expr, pred_percent = normalise(prediction)
    ref_expr, ref_percent = normalise(reference)
    if not pred_expr or not ref_expr:
        return False
    if pred_expr.replace(" ", "").lower() == ref_expr.replace(" ", "").lower():
        return True
    pred_parts, ref_parts = _split_top_level(_unwrap_tuple(pred_expr)), _split_top_level(_unwrap_tuple(ref_expr))
    if len(pred_parts) > 1 or len(ref_parts) > 1:
        return len(pred_parts) == len(ref_parts) and all(
            math_equal(p, r, rel_tol) for p, r in zip(pred_parts, ref_parts, strict=True)
        )
    numbers = plain_number(pred_expr), plain_number(ref_expr)
    if None not in numbers:
        return _numbers_equal(*numbers, pred_percent or ref_percent, rel_tol)
    a = to_sympy(pred_expr)
    b = to_sympy(ref_expr) if a is not None else None
    if a is None or b is None:
        return False
    if a.is_number and b.is_number:
        return _numbers_equal(a, b, pred_percent or ref_percent, rel_tol)
    return _expressions_equal(a, b)


def _references(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("answer")
    if isinstance(ground_truth, list | tuple):
        return [r for item in ground_truth for r in _references(item)]
    if ground_truth is None:
        return []
    text = str(ground_truth)
    return [extract_boxed(text) or extract_hashes(text) or text.strip()]


def math_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any] | None = None) -> float:
    """1.0 if the answer matches any reference answer, else 0.0 (``config["rel_tol"]`` overrides the tolerance).

    ``ground_truth`` is a string (``\\boxed{}`` and ``#### x`` are unwrapped), a number, a list of accepted
    answers, or a mapping with an ``answer`` key.
    """
    references = _references(ground_truth)
    if not references:
        raise ValueError("the math scorer needs a reference answer")
    prediction = final_answer_text(model_answer or "")
    if not prediction:
        return 0.0
    rel_tol = float((config or {}).get("rel_tol", REL_TOL))
    return 1.0 if any(math_equal(prediction, reference, rel_tol) for reference in references) else 0.0
