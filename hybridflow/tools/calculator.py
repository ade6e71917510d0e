"""The built-in calculator: exact arithmetic on an expression, evaluated from its syntax tree (never eval).

Integers stay exact (Python's big integers); ``/`` divides exactly when it can and gives a decimal
otherwise. Powers and results are bounded so that a call cannot make the process compute for long.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from hybridflow.tools.base import Tool, ToolResponse

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 100
MAX_DIGITS = 200

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


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _evaluate(node.left), _evaluate(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        return _bounded(base ** int(exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"unsupported: {ast.unparse(node)!r} (use numbers, + - * / // % ** and parentheses)")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, e.g. "3 * (4 + 5)" -> "27"; CalculatorError if it is not one."""
    expression = expression.replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from error
    return _format(_evaluate(tree))


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
            return ToolResponse(text=calculate(str(expression)))
        except CalculatorError as error:
            return ToolResponse(text=f"Error: {error}", error=True)
