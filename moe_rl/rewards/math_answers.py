"""Math answers: ``data.reward: math`` judged by the math-verify library (parse and verify of
LaTeX and plain answers), with a regex rule as its documented fallback for answers math-verify
extracts nothing from."""
from __future__ import annotations

import logging
import re
from fractions import Fraction

# math-verify warns on every call that its own (signal-based) time limit is off: moe_rl bounds
# each reward call itself (data.reward_timeout_s), so that warning carries nothing
logging.getLogger("math_verify").setLevel(logging.ERROR)


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_IS = re.compile(r"answer(?: is|:)\s*\$?([^\s$]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last \\boxed{...}, else "answer is X", else the last
    number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    m = _ANSWER_IS.findall(text)
    if m:
        return m[-1]
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalise_answer(ans: str) -> Fraction | str:
    """A number as an exact Fraction when possible (3/4 == 0.75 == \\frac{3}{4}), else the
    cleaned string."""
    s = ans.strip().rstrip(".").strip("$ ").replace(",", "").replace("\\!", "")
    s = re.sub(r"\\(?:d|t)?frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "").replace(" ", "")
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return s.lower()


def regex_math_reward(response: str, answer: str) -> float:
    """The fallback: 1 when the extracted final answer (:func:`extract_answer`) equals the
    reference numerically (exact fractions) or textually (:func:`normalise_answer`)."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    return 1.0 if normalise_answer(got) == normalise_answer(answer) else 0.0


def _parsed(text: str) -> list:
    from math_verify import parse
    return parse(text, parsing_timeout=None)


def math_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """``data.reward: math``: 1 when the response's final answer is mathematically equal to the
    reference, as math-verify judges it (LaTeX or plain: ``\\boxed{\\frac{1}{2}}`` = ``0.5``
    = ``1/2``; sets and intervals; units and ``\\text`` stripped; several ``\\boxed`` answers
    form a set), else 0. When math-verify extracts no answer from the response or from the
    reference (a text answer), the regex rule decides (:func:`regex_math_reward`). No time limit
    inside (math-verify's is signal-based, main thread only): the caller bounds the call
    (``data.reward_timeout_s``)."""
    if answer is None:
        return 0.0
    from math_verify import verify
    gold = _parsed(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    got = _parsed(response)
    if gold and got:
        return 1.0 if verify(gold, got, timeout_seconds=None) else 0.0
    return regex_math_reward(response, answer)
