"""The calculator tool environment of the agentic CPU demo, on the arithmetic task.

The model may call the tool by writing ``[expression]`` (digits and ``+ - *``); the turn ends at
``]``. The environment appends ``(result)`` and the model continues; any other turn is its answer,
scored by the toy reward (1 for exactly the answer then end of text). Example, prompt ``12+29=``:
model ``[12+29]``, observation ``(41)``, model ``41<|endoftext|>``.
"""
from __future__ import annotations

import re

from moe_rl.envs import EnvStep, Environment
from moe_rl.rewards.functions import toy_reward

_CALL = re.compile(r"\[([0-9+\-* ]{1,32})\]")


def _evaluate(expr: str) -> int | None:
    """Integer value of digits joined by + - * (left to right with * first); None if malformed."""
    if not re.fullmatch(r"\s*\d+(\s*[+\-*]\s*\d+)*\s*", expr):
        return None
    terms = re.findall(r"[+\-]?\s*[^+\-]+", expr.replace(" ", ""))
    total = 0
    for term in terms:
        sign = -1 if term.startswith("-") else 1
        value = 1
        for factor in term.lstrip("+-").split("*"):
            value *= int(factor)
        total += sign * value
    return total


class CalculatorEnv(Environment):
    """Answers ``[expr]`` tool calls with ``(value)``; the first other turn ends the episode."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stop_token_ids = (self._encode("]")[0],)
        self.prompt = None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reset(self, prompt) -> None:
        self.prompt = prompt

    def step(self, action_ids: list[int], finish_reason: dict) -> EnvStep:
        text = self.tokenizer.decode(action_ids, skip_special_tokens=True)
        call = _CALL.fullmatch(text.strip())
        if call is not None:
            value = _evaluate(call.group(1))
            result = "error" if value is None else str(value)
            return EnvStep(observation_ids=self._encode(f"({result})"))
        stopped = action_ids[-1] == self.tokenizer.eos_token_id
        return EnvStep(reward=toy_reward(self.prompt.text, text, self.prompt.answer,
                                         {"stopped": stopped}), done=True)

    def demonstration(self, prompt) -> list[list[int]]:
        """The call, its result, the answer: what the warm start teaches."""
        expr = prompt.text.rstrip("=")
        return [self._encode(f"[{expr}]"), self._encode(f"({_evaluate(expr)})"),
                self._encode(prompt.answer) + [self.tokenizer.eos_token_id]]
