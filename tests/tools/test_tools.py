"""Tools: the calculator by hand, plain functions as tools, the tools YAML file, the Python tool in its sandbox."""

import asyncio
import time

import hypothesis
import pytest

from hybridflow.tools import FunctionTool, ToolResponse, ToolSet, load_tools
from hybridflow.tools.calculator import CalculatorError, CalculatorTool, calculate
from hybridflow.validation import UserError


@pytest.mark.parametrize(
    "expression, value",
    [
        ("482 * 37", "17834"),
        ("2 + 3 * (4 - 1)", "11"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("1 / 4", "0.25"),
        ("10 / 4 * 2", "5"),  # exact: 5, not 5.0
        ("2 ** 10", "1024"),
        ("3 ^ 2", "9"),  # "^" read as a power
        ("12 × 3", "36"),
        ("123456789 * 987654321", "121932631112635269"),  # exact big integers
    ],
)
def test_calculator_by_hand(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("__import__('os').system('ls')", "unsupported"),
        ("x + 1", "unsupported"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponents must be whole numbers up to 100"),
        ("9 ** 99 * 9 ** 99 * 9 ** 99", "more than 200 digits"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than 500"),
    ],
)
def test_calculator_refuses_what_is_not_small_arithmetic(expression, problem):
    with pytest.raises(CalculatorError, match=problem):
        calculate(expression)


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("9**9**9", "exponents must be whole numbers up to 100"),
        ("0**-1", "division by zero"),  # before: ZeroDivisionError
        ("1e309", "1e309 is not a finite number"),  # before: OverflowError
        ("(10**100)**100", "more than 200 digits"),  # before: ValueError (int-to-str digit limit)
        ("(2**100)**10", "more than 200 digits"),
        ("1e308 * 10 / 3", "more than 200 digits"),
        ("-" * 499 + "1", "nested more than 250 levels"),
        ("(" * 210 + "1" + ")" * 210, "not an arithmetic expression"),  # the parser's own nesting limit (200)
        ("1\x00", "not an arithmetic expression"),  # before: ValueError (a NUL byte)
        ("1" * 201, "more than 200 digits"),
    ],
)
def test_calculator_bounds_every_number_and_the_nesting(expression, problem):
    with pytest.raises(CalculatorError, match=problem):
        calculate(expression)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(2**66)**10", str(2**660)),  # 199 digits: at the bound, not refused by the estimate
        ("1" + "+1" * 249, "250"),  # a long chain of additions is not "nesting" to refuse
        ("(-2)**-3", "-0.125"),
        ("0**0", "1"),
    ],
)
def test_calculator_at_its_bounds(expression, value):
    assert calculate(expression) == value


@hypothesis.settings(max_examples=400, derandomize=True, deadline=None)
@hypothesis.given(hypothesis.strategies.text(alphabet="0123456789.e+-*/%^() ", max_size=600))
def test_any_text_gives_a_value_or_the_calculators_error_quickly(expression):
    start = time.perf_counter()
    try:
        assert isinstance(calculate(expression), str)
    except CalculatorError:
        pass
    assert time.perf_counter() - start < 0.5


def test_calculator_tool_answers_errors_as_text():
    tool = CalculatorTool()
    assert asyncio.run(tool.execute("0", {"expression": "6*7"})) == ToolResponse(text="42")
    answer = asyncio.run(tool.execute("0", {"expression": "6/0"}))
    assert answer.error and answer.text == "Error: division by zero"
    assert asyncio.run(tool.execute("0", {"expression": ["6"]})).error
    for nasty in ("0**-1", "1e309", "(10**100)**100", 10**5000, float("inf")):
        answer = asyncio.run(tool.execute("0", {"expression": nasty}))
        assert answer.error and answer.text.startswith("Error: "), nasty
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]


def word_count(text: str, minimum: int = 0) -> int:
    """Count the words of a text.

    Longer explanation that is not part of the description."""
    return max(minimum, len(text.split()))


async def shout(text: str) -> ToolResponse:
    return ToolResponse(text=text.upper(), reward=1.0)


def test_a_function_is_a_tool_with_a_schema_from_its_signature():
    tool = FunctionTool(word_count)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "word_count",
            "description": "Count the words of a text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "minimum": {"type": "integer"}},
                "required": ["text"],
            },
        },
    }
    assert asyncio.run(tool.execute("0", {"text": "a b c"})) == ToolResponse(text="3")
    bad = asyncio.run(tool.execute("0", {"txt": "a"}))
    assert bad.error and "bad arguments for word_count" in bad.text
    assert asyncio.run(FunctionTool(shout).execute("0", {"text": "hi"})) == ToolResponse(text="HI", reward=1.0)


def test_the_tools_file_declares_tools_by_name_class_and_function(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text(
        "from hybridflow.tools import Tool, ToolResponse\n"
        "class Greeter(Tool):\n"
        "    name = 'greet'\n"
        "    description = 'Say hello.'\n"
        "    parameters = {'type': 'object', 'properties': {}}\n"
        "    def __init__(self, greeting='hello'):\n"
        "        self.greeting = greeting\n"
        "    async def execute(self, instance_id, arguments):\n"
        "        return ToolResponse(text=self.greeting)\n"
        "def double(x: int) -> int:\n"
        "    'Twice x.'\n"
        "    return 2 * x\n"
    )
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - name: calculator\n"
        f"  - class: {module}:Greeter\n"
        "    config: {greeting: hi there}\n"
        f"  - function: {module}:double\n"
    )
    tools = load_tools(path)
    assert [s["function"]["name"] for s in tools.schemas] == ["calculator", "greet", "double"]
    assert asyncio.run(tools["greet"].execute("0", {})).text == "hi there"
    assert asyncio.run(tools["double"].execute("0", {"x": 21})).text == "42"


@pytest.mark.parametrize(
    "content, message",
    [
        ("tools: []\n", "at least one tool"),
        ("tools:\n  - name: nope\n", "no tool named 'nope'"),
        ("tools:\n  - name: calculator\n    class: x.py:Y\n", "exactly one of name, class, function"),
        ("tools:\n  - name: calculator\n  - name: calculator\n", "two tools are named 'calculator'"),
        ("tools:\n  - class: hybridflow.tools.calculator:calculate\n", "is not a subclass of hybridflow.tools.Tool"),
        ("tools:\n  - function: missing_file.py:f\n", "does not exist"),
        ("tools:\n  - name: calculator\n    config: {precision: 3}\n", "takes no config"),
    ],
)
def test_tools_file_mistakes_name_the_entry(tmp_path, content, message):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_tools(path)


def test_a_missing_tools_file_is_named():
    with pytest.raises(UserError, match="tool_config_path"):
        load_tools("no/such/tools.yaml")


def test_the_python_tool_runs_code_in_the_sandbox(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - name: python\n    config: {timeout_s: 5, memory_mb: 256}\n")
    python = load_tools(path)["python"]
    answer = asyncio.run(python.execute("0", {"code": "print(sum(i * i for i in range(10)))"}))
    assert answer == ToolResponse(text="285")
    escaped = asyncio.run(python.execute("0", {"code": "print(open('/etc/passwd').read())"}))
    assert escaped.error and "FileNotFoundError" in escaped.text
    assert asyncio.run(python.execute("0", {"program": "1"})).error
    assert isinstance(ToolSet([python]).schemas[0]["function"]["parameters"], dict)
