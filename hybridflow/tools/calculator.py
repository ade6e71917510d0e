"""The built-in calculator: exact arithmetic on an expression, evaluated from its syntax tree (never eval).

Integers stay exact (Python's big integers); ``/`` divides exactly when it can and gives a decimal
otherwise. Every input gives a value or a CalculatorError, in bounded time and memory: the expression's length
and nesting are bounded, every number (literals, intermediate results) has at most MAX_DIGITS digits in its
numerator and denominator, and a power is refused before it is computed if its result would be longer.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any

from hybridflow.tools.base import Tool, ToolResponse

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 100
MAX_DIGITS = 200
MAX_DEPTH = 250  # nested operations: any chain of binary operations that fits, far below Python's recursion limit
BITS_PER_DIGIT = 3.33  # a little less than log2(10): a number of more than 3.33 * d + 4 bits has more than d digits

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    pass


def _evaluate(node: ast.AST, depth: int = 0) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise CalculatorError(f"{ast.unparse(node)} is not a finite number")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if (bits - 1) * abs(exponent) + 1 > _MAX_BITS:  # the fewest bits the result can have: surely too long
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return _bounded(base ** int(exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"unsupported: {ast.unparse(node)!r} (use numbers, + - * / // % ** and parentheses)")


_MAX_BITS = int(MAX_DIGITS * BITS_PER_DIGIT) + 4  # more bits than this: surely more than MAX_DIGITS digits


def _digits(n: int) -> int:
    """Decimal digits of ``n``, or MAX_DIGITS + 1 if it surely has more (never converts a huge number)."""
    return len(str(abs(n))) if n.bit_length() <= _MAX_BITS else MAX_DIGITS + 1


def _bounded(value: Fraction) -> Fraction:
    if max(_digits(value.numerator), _digits(value.denominator)) > MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, e.g. "3 * (4 + 5)" -> "27"; CalculatorError if it is not one.
    Raises nothing else, whatever the input."""
    expression = expression.replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:  # ValueError: a NUL byte
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from error
    try:
        return _format(_evaluate(tree))
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError, RecursionError, MemoryError) as error:  # none expected: bounded above
        raise CalculatorError(f"cannot compute {expression!r}: {type(error).__name__}") from error


def _number_text(number: int | float) -> str:
    if isinstance(number, int) and _digits(number) > MAX_DIGITS:  # str() of a huge int is slow, then refused
        raise CalculatorError(f"the number has more than {MAX_DIGITS} digits")
    return str(number)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. '482 * 37 + 5'."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "numbers, + - * / // % ** and parentheses"}},
        "required": ["expression"],
    }

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        expression = arguments.get("expression")
        if not isinstance(expression, (str, int, float)) or isinstance(expression, bool):
            return ToolResponse(text='Error: give the expression as {"expression": "..."}', error=True)
        try:
            return ToolResponse(text=calculate(expression if isinstance(expression, str) else _number_text(expression)))
        except CalculatorError as error:
            return ToolResponse(text=f"Error: {error}", error=True)
