"""Scorer of MATH-style answers: the last \\boxed{...} of the response, normalised.

Normalisation makes LaTeX spellings of one answer equal: spaces, `\\left`/`\\right`, thin
spaces (`\\!`, `\\,`), `$`, `%` and degrees are dropped; `\\dfrac`/`\\tfrac` become `\\frac`;
`\\frac12` gets its braces; units in `\\text{...}` are dropped ("5\\text{ cm}" is "5");
"x = 5" is "5"; "5.0" is "5". Answers that are simple numbers (integers, decimals, a/b,
\\frac{a}{b}, signed) compare by exact value, so 0.5 = 1/2 = \\frac{1}{2}. Anything more
(expressions, intervals, matrices) compares as the normalised string: sound but not
complete, so an equal answer written in an unusual form may score 0.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from hybridflow.reward.registry import register_scorer

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed 5"); None if absent or unbalanced."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" "):  # "\boxed 5": up to the next space or "$"
        match = re.match(r" +([^\s$]+)", rest)
        return match.group(1) if match else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None  # the braces never close


def _drop_text_units(answer: str) -> str:
    """Drop \\text{...} units; keep the text when it is the whole answer ("\\text{(A)}")."""
    without = _TEXT.sub("", answer)
    return without if without.strip() else _TEXT.sub(r"\1", answer)


def normalize_answer(answer: str) -> str:
    """A canonical spelling of a final answer (see the module docstring)."""
    text = answer.strip()
    for dropped in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$", "\\%", "%", "\n"):
        text = text.replace(dropped, "")
    text = re.sub(r"\^\{?\\circ\}?", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _drop_text_units(text)
    text = text.replace(" ", "")
    text = re.sub(r"^[a-zA-Z]=", "", text)  # "x=5" -> "5"
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):  # 1,000 (but not a tuple like 1,2)
        text = text.replace(",", "")
    text = re.sub(r"^(-?\d+)\.0*$", r"\1", text)  # 5.0 / 5. -> 5
    text = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", text)  # .5 -> 0.5
    return text


def as_fraction(text: str) -> Fraction | None:
    """The value of a normalised simple number: 3, -0.25, 1/2, \\frac{1}{2}, -\\frac{3}{4}."""
    if len(text) > 64:
        return None
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return Fraction(text)
    match = re.fullmatch(r"(-?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+))", text)
    if not match:
        return None
    sign, numerator, denominator = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
    if int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if sign else value


def answers_equal(prediction: str, ground_truth: str) -> bool:
    """Equal after normalisation, or equal as simple numbers."""
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred == truth:
        return bool(pred)
    pred_value, truth_value = as_fraction(pred), as_fraction(truth)
    return pred_value is not None and pred_value == truth_value


@register_scorer("math", "lighteval/MATH")
def score_math(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict[str, Any]:
    """1.0 if the last boxed answer equals the ground truth (itself boxed or plain), else 0.0."""
    pred = last_boxed(solution_str)
    truth = last_boxed(ground_truth) or ground_truth
    correct = pred is not None and answers_equal(pred, truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
