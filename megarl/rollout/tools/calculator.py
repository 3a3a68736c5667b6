"""The ``calculator`` tool: evaluate an arithmetic expression safely (no ``eval``).

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary signs,
parentheses and a few functions (``abs round min max sqrt``) are evaluated; anything else is an
error observation. Exponents and results are bounded so that ``9**9**9`` fails fast instead of
hanging the event loop.
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from megarl.rollout.tools.tool_registry import register_tool

_BINARY: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
_MAX_EXPONENT = 1000
_MAX_MAGNITUDE = 10 ** 100


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is out of bounds."""


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} too large (max {_MAX_EXPONENT})")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > _MAX_MAGNITUDE:
            raise CalculatorError("result out of range")
        return result
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS and not node.keywords):
        return _FUNCTIONS[node.func.id](*[_evaluate(a) for a in node.args])
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:80]}")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression.

    Raises:
        CalculatorError: anything but plain arithmetic, or out-of-range values.
        ZeroDivisionError: division by zero.
    """
    if len(expression) > 1000:
        raise CalculatorError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid expression: {e.msg}") from None
    return _evaluate(tree)


def format_number(value: int | float) -> str:
    """``12.0 -> "12"``, ``0.1 + 0.2 -> "0.3"`` (12 significant digits), ints verbatim."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


@register_tool("calculator")
class CalculatorTool:
    """``{"expression": str}`` -> the value, or ``Error: ...``."""

    name = "calculator"

    def __init__(self) -> None:
        self.schema: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Evaluate an arithmetic expression (+ - * / // % ** and "
                               "abs, round, min, max, sqrt).",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "e.g. (3 + 4) * 2 / 7"}},
                    "required": ["expression"],
                },
            },
        }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Evaluate ``arguments["expression"]``; errors are returned as ``Error: ...`` text."""
        try:
            return format_number(calculate(arguments["expression"]))
        except (CalculatorError, ZeroDivisionError, OverflowError, TypeError, ValueError) as e:
            return f"Error: {e}"
