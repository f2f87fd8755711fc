"""Reward functions: the toy task's, math answers (:mod:`moe_rl.rewards.math_answers`), and a user
function given as ``module:function`` whose failures score 0 and are counted instead of crashing
the run."""
from __future__ import annotations

import logging
import math
from typing import Callable

from moe_rl.plugins import PluginTimeout, call_bounded, load_named
from moe_rl.rewards.math_answers import math_reward

log = logging.getLogger(__name__)


def toy_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """The demo task's reward: 1 for exactly the answer then end of text; 0.5 for the right
    number followed by more text (or cut off); 0.2 for a wrong number then end of text; 0.1 when
    the response at least starts with a digit; 0 otherwise. ``metadata["stopped"]``: the engine
    stopped on end of text."""
    text = response.strip()
    if answer is None:
        return 0.0
    stopped = metadata.get("stopped", True)
    if text == answer and stopped:
        return 1.0
    if text.startswith(answer) and (len(text) == len(answer) or not text[len(answer)].isdigit()):
        return 0.5
    if text.isdigit() and stopped:
        return 0.2
    return 0.1 if text[:1].isdigit() else 0.0


BUILTIN = {"toy": toy_reward, "math": math_reward}


class RewardFunction:
    """Calls the reward, at most ``timeout_s`` seconds each: exceptions and non-finite or
    non-numeric values score 0 and are counted (``errors``, metric ``reward/errors``); a call
    past its time gives None, the sample is dropped and counted (``timeouts``, metric
    ``reward/timeouts``); the first message of each kind is logged."""

    def __init__(self, spec: str, timeout_s: float = 60.0):
        self.spec, self.timeout_s = spec, timeout_s
        self.fn: Callable = load_reward(spec)
        self.errors = self.timeouts = 0
        self.first_error: str | None = None

    def __call__(self, prompt: str, response: str, answer: str | None,
                 metadata: dict) -> float | None:
        try:
            value = call_bounded(self.fn, prompt, response, answer, metadata,
                                 timeout_s=self.timeout_s)
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
            return value
        except PluginTimeout as exc:
            self.timeouts += 1
            if self.timeouts == 1:
                log.warning("reward %s %s (data.reward_timeout_s): sample dropped", self.spec,
                            exc)
            if self.first_error is None:
                self.first_error = f"timed out: {exc} (data.reward_timeout_s)"
            return None
        except Exception as exc:   # the user's code must never stop the run
            self.errors += 1
            if self.first_error is None:
                self.first_error = f"{type(exc).__name__}: {exc}"
                log.warning("reward %s failed (scored 0): %s", self.spec, self.first_error)
            return 0.0


SIGNATURE = "reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float"


def load_reward(spec: str) -> Callable:
    """A built-in reward name, or ``module:function`` taking the four arguments of
    :data:`SIGNATURE` (ValueError naming data.reward and the expected signature otherwise)."""
    import inspect
    fn = load_named(spec, "data.reward", BUILTIN, "module:function")
    if not callable(fn):
        raise ValueError(f"data.reward: {spec!r} is not callable; expected a function {SIGNATURE}")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)):
        raise ValueError(f"data.reward: {spec!r} is a coroutine function (async def); expected a "
                         f"plain function {SIGNATURE}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # a callable without a readable signature (C code)
        return fn
    try:
        sig.bind("prompt", "response", "answer", {})
    except TypeError as exc:
        raise ValueError(f"data.reward: {spec!r} takes {sig}, which cannot be called as "
                         f"{SIGNATURE} ({exc}); moe_rl calls it with these four positional "
                         f"arguments") from None
    return fn


def score_rewards(samples: list, tokenizer, prompts, reward_fn: RewardFunction) -> list:
    """Decode each response and fill its reward; returns the samples scored (those whose reward
    call timed out are left out)."""
    eos = tokenizer.eos_token_id
    kept = []
    for s in samples:
        rec = prompts[s.metadata["prompt_index"]] if "prompt_index" in s.metadata else None
        ids = s.response_ids.tolist()
        stopped = bool(ids) and ids[-1] == eos
        text = tokenizer.decode(ids, skip_special_tokens=True)
        reward = reward_fn(rec.text if rec else "", text, rec.answer if rec else None,
                           {**(rec.metadata if rec else {}), **s.metadata, "stopped": stopped})
        if reward is not None:
            s.reward = reward
            kept.append(s)
    return kept
