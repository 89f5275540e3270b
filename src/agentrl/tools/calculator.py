"""A safe arithmetic evaluator (the ``calculator`` tool): Python's ``ast`` walked over a whitelist, never ``eval``.

Accepted: int and float literals, ``+ - * / // % **`` (``^`` is read as a power, as on calculators), unary
``+``/``-``, parentheses, the constants ``pi``, ``e``, ``tau`` and the functions in ``FUNCTIONS``. Anything
else (names, attributes, subscripts, strings, comprehensions, lambdas, keyword arguments) is refused with a
message. Integer results are bounded to ``MAX_INT_BITS`` bits, exponents to ``MAX_EXPONENT``, and the
expression to ``MAX_EXPRESSION_CHARS`` characters, so no input can exhaust memory or time.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 500
MAX_DEPTH = 60

Number = int | float


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why."""


def _factorial(n: Number) -> int:
    if isinstance(n, float):
        if not n.is_integer():
            raise CalculatorError("factorial() needs a whole number")
        n = int(n)
    if n < 0 or n > MAX_FACTORIAL:
        raise CalculatorError(f"factorial() is limited to 0..{MAX_FACTORIAL}")
    return math.factorial(n)


FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "ln": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "degrees": math.degrees,
    "radians": math.radians,
    "min": min,
    "max": max,
    "factorial": _factorial,
}

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_CALL = re.compile(r"[A-Za-z_]\w*\s*\(")


def _normalise(expression: str) -> str:
    text = expression.strip()
    for old, new in (("^", "**"), ("×", "*"), ("÷", "/"), ("−", "-"), ("\u00a0", " ")):
        text = text.replace(old, new)
    if not _CALL.search(text):  # "1,234 * 5": thousands separators, unless commas may separate arguments
        text = _THOUSANDS.sub("", text)
    return text


def _check(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    whole = isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1
    if whole and exponent * math.log2(abs(base)) > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    try:
        result = base**exponent
    except ZeroDivisionError:
        raise CalculatorError("zero cannot be raised to a negative power") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number (fractional power of a negative number)")
    return result


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression is nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; constants: {', '.join(CONSTANTS)}")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _eval(node.operand, depth + 1)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        big_product = isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and (
            left.bit_length() + right.bit_length() > MAX_INT_BITS + 1
        )
        if big_product:
            raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
        try:
            return _check(op(left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise CalculatorError(f"unknown function; available: {', '.join(FUNCTIONS)}")
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        args = [_eval(arg, depth + 1) for arg in node.args]
        if node.func.id == "round" and len(args) == 2 and not isinstance(args[1], int):
            raise CalculatorError("round(x, n) needs a whole number n")
        try:
            return _check(FUNCTIONS[node.func.id](*args))
        except CalculatorError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:
            raise CalculatorError(f"{node.func.id}(): {exc}") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed in a calculator expression")


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression; ``CalculatorError`` explains anything refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = _normalise(expression)
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not a valid expression: {getattr(exc, 'msg', None) or type(exc).__name__}") from None
    return _eval(tree.body, 0)


def format_number(value: Number) -> str:
    """Integers exactly; floats with 12 significant digits (whole floats without ``.0``)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"
