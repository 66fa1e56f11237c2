"""The plain-text protocol spoken by AstraFlow's tiny local models.

One place defines the special tokens, the tool tags and the prompt format, so that the tokenizer
trainer, the SFT demonstrations, the evaluator and the RaaS workflows all agree byte for byte.

A conversation is plain text, no chat template::

    <bos>Q: What is 37*12+5?
    A:<calc>37*12+5</calc><result>449</result>Answer: 449<eos>

- ``format_prompt(question)`` gives ``"Q: {question}\\nA:"``; the tokenizer prepends ``<bos>``.
- The model may call the calculator with ``<calc>EXPR</calc>``; generation stops at ``</calc>``.
- The tool (never the model) appends ``<result>VALUE</result>``; those tokens are not trained.
- The model then writes ``Answer: N`` and ``<eos>``.

A verifier reads the question and a proposed answer, ``verification_prompt(prompt, proposed)``
= ``"Q: {question}\nProposed: {answer}\nA:"``, may call the calculator the same way, and
ends with ``Answer: yes`` or ``Answer: no`` (`parse_verdict`).

Every tag is one token in the tokenizer, so stopping at ``</calc>`` is a token-id check and
tokenizing the pieces one by one gives the same ids as tokenizing their concatenation.
"""

from __future__ import annotations

BOS = "<bos>"
EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"  # never produced by byte-level BPE; declared so loaders do not invent one
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order

CALC_OPEN = "<calc>"
CALC_CLOSE = "</calc>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
TOOL_TAGS: tuple[str, ...] = (CALC_OPEN, CALC_CLOSE, RESULT_OPEN, RESULT_CLOSE)

ANSWER_PREFIX = "Answer:"


def format_prompt(question: str) -> str:
    """Wraps a user question in the prompt format: ``"Q: {question}\\nA:"``."""
    return f"Q: {question.strip()}\nA:"


def calc_call(expression: str) -> str:
    """The model's calculator call for `expression`: ``"<calc>EXPR</calc>"``."""
    return f"{CALC_OPEN}{expression}{CALC_CLOSE}"


def tool_result(value: str) -> str:
    """The text the calculator tool appends after a call: ``"<result>VALUE</result>"``."""
    return f"{RESULT_OPEN}{value}{RESULT_CLOSE}"


def final_answer(value: str) -> str:
    """The model's closing line: ``"Answer: VALUE"`` (the end-of-sequence token follows)."""
    return f"{ANSWER_PREFIX} {value}"


VERDICTS = ("yes", "no")


def verification_prompt(prompt: str, proposed: str) -> str:
    """What a verifier reads: the task's prompt (its trailing ``A:`` removed) and the proposed answer
    on one line of at most 200 characters, then ``A:``."""
    question = prompt.rstrip()
    question = question[: -len("A:")].rstrip() if question.endswith("A:") else question
    return f"{question}\nProposed: {' '.join(proposed.split())[:200]}\nA:"


def parse_verdict(text: str | None) -> str:
    """The verdict after the last ``Answer:`` of `text`: ``yes``, ``no``, or ``unclear`` for anything else."""
    if not text:
        return "unclear"
    idx = text.rfind(ANSWER_PREFIX)
    words = text[idx + len(ANSWER_PREFIX):].split() if idx >= 0 else []
    word = words[0].lower().rstrip(".!,") if words else ""
    return word if word in VERDICTS else "unclear"
