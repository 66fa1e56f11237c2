r"""Final answers of math completions and references, as the `math_verify` reward reads them.

A completion's final answer is, in this order of preference:

| form | example | format |
|---|---|---|
| `boxed` | `... so the total is \boxed{72}.` | strict |
| `hash` | GSM8K's `#### 72` | strict |
| `stated` | `The answer is 72 dollars.` / `Answer: 72` | lenient |
| `last_number` | the last number in the text, `1,234.5` / `-3/4` | lenient |

A *strict* format is what the prompt asked for (a box or `####`); a *lenient* one is any answer
that can be found. `reference_answer` reads a reference the same way, except that a short
reference with none of these marks (`"72"`, `"\frac{3}{4}"`, `"x^2+2x"`) is its own answer.

`latex_candidate` prepares an answer for math-verify: thousands separators dropped from a plain
number (`1,234` is one number, not the set {1, 234}), units after a number dropped (`18 km/h`,
`5 dollars`, `\text{ cm}`), and the whole wrapped in `$...$` so math-verify's LaTeX extraction
parses expressions as well as numbers. No math-verify here: this module is pure and fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from astraflow.data.columns import last_boxed

STRICT_FORMS = ("boxed", "hash")
LENIENT_FORMS = (*STRICT_FORMS, "stated", "last_number")
MAX_ANSWER_CHARS = 400  # longer "answers" are not verified (math-verify's cost grows with the input)
MAX_REFERENCE_CHARS = 200  # a reference without marks longer than this is a solution, not an answer

_HASH = re.compile(r"####\s*([^\n]+)")
_STATED = re.compile(r"(?:final\s+answer|the\s+answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?"
_LAST_NUMBER = re.compile(_NUMBER)
_PLAIN_NUMBER = re.compile(rf"^\s*\$?\s*({_NUMBER})\s*\$?\s*$")
_NUMBER_WITH_UNIT = re.compile(
    rf"^\s*\\?\$?\s*({_NUMBER})\s*(?:\\%|%)?\s*(?:\\(?:text|mathrm|mbox)\{{[^{{}}]*\}}|[A-Za-z][A-Za-z/. ]*)\s*\.?\s*$")


@dataclass(frozen=True, slots=True)
class FinalAnswer:
    """What was found as the final answer of a text, and in which form."""

    text: str  # the answer's text (not yet parsed)
    form: str  # boxed | hash | stated | last_number

    @property
    def strict(self) -> bool:
        return self.form in STRICT_FORMS


def final_answer(text: str | None) -> FinalAnswer | None:
    """The final answer of a completion (see the module doc), or None when it has none."""
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return FinalAnswer(boxed, "boxed")
    hashes = _HASH.findall(text)
    if hashes and hashes[-1].strip():
        return FinalAnswer(hashes[-1].strip(), "hash")
    stated = _STATED.findall(text)
    if stated and stated[-1].strip().rstrip(".").strip():
        return FinalAnswer(stated[-1].strip().rstrip(".").strip(), "stated")
    numbers = _LAST_NUMBER.findall(text)
    if numbers:
        return FinalAnswer(numbers[-1].strip(), "last_number")
    return None


def reference_answer(text: str) -> str | None:
    """The answer a reference holds: its box or `####` answer; else the reference itself when it is
    short (an answer, not a solution); else its stated answer; None when there is none."""
    text = text.strip()
    if not text:
        return None
    found = final_answer(text)
    if found is not None and found.strict:
        return found.text
    if len(text) <= MAX_REFERENCE_CHARS and "\n" not in text:
        return text
    return found.text if found is not None and found.form == "stated" else None


def latex_candidate(answer: str) -> str:
    """`answer` ready for math-verify's LaTeX extraction (see the module doc)."""
    s = answer.strip().rstrip(".").strip()
    if s.startswith("$") and s.endswith("$") and len(s) > 1:
        s = s.strip("$").strip()
    plain = _PLAIN_NUMBER.match(s)
    if plain is None:
        unit = _NUMBER_WITH_UNIT.match(s)
        if unit is not None and not _is_expression_tail(s[unit.end(1):]):
            s = unit.group(1) + ("\\%" if "%" in s[unit.end(1):] else "")
            plain = _PLAIN_NUMBER.match(s) if "%" not in s else None
    if plain is not None:
        s = plain.group(1).replace(",", "").replace(" ", "")
    return f"${s}$"


def _is_expression_tail(tail: str) -> bool:
    """A tail of one letter (`2x`, `3 y`, `5\\pi`) makes an expression, not a unit."""
    letters = re.sub(r"\\(?:text|mathrm|mbox)\{[^{}]*\}", "unit", tail).strip().rstrip(".")
    return bool(re.fullmatch(r"[A-Za-z]", letters))
