"""Finding and comparing numbers in model text, shared by the numeric scorers.

Numbers compare exactly as fractions, so "12" equals "12.0" and "1,234" equals "1234" with no float rounding;
thousands separators ("1,234"), a leading "$" and the Unicode minus are accepted.
"""

from __future__ import annotations

import re
from fractions import Fraction

# 1,234,567 | 1234 | 12.5 | .5 ; a sign is decided separately (see find_numbers)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_MAX_DIGITS = 64  # longer runs are not answers; refusing them keeps Fraction() cheap


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, in order, as written minus commas and "$".

    A "-" counts as a sign only where it cannot be a binary minus: "5-4" gives ["5", "4"],
    "is -4" gives ["-4"].
    """
    text = text.replace("\u2212", "-").replace("$", "")
    found = []
    for match in _NUMBER.finditer(text):
        number = match.group().replace(",", "")
        start = match.start()
        if number.startswith("-") and start > 0 and (text[start - 1].isalnum() or text[start - 1] in ")]}"):
            number = number[1:]
        found.append(number)
    return found


def parse_number(text: str) -> Fraction | None:
    """The exact value of a plain number ("-1,234.50", "$5", "7."), or None if it is not one."""
    cleaned = text.strip().replace("\u2212", "-").replace("$", "").replace(",", "").rstrip(".")
    if not cleaned or len(cleaned) > _MAX_DIGITS or not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", cleaned):
        return None
    return Fraction(cleaned)


def same_number(prediction: str | None, ground_truth: str) -> bool:
    """Whether both parse as numbers with equal values."""
    if prediction is None:
        return False
    pred, truth = parse_number(prediction), parse_number(str(ground_truth))
    return pred is not None and truth is not None and pred == truth
