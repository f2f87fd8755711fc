"""Multi-turn environments: the protocol an environment implements, its loader
(``data.environment``), and the checks on what it returns.

An environment is a class built once per trajectory as ``Class(tokenizer)``. The rollout calls
``reset(prompt)`` with the prompt record, then, after every model turn, ``step(action_ids,
finish_reason)`` with the turn's token ids exactly as the engine generated them (never decoded
and re-encoded) and SGLang's ``finish_reason`` of the turn; ``step`` answers an
:class:`EnvStep`: the observation's token ids to append (tokenised once, by the environment),
and, when the episode is over, ``done`` with its ``reward``. ``stop_token_ids`` (class
attribute) are the ids that end a model turn besides end of text (e.g. the closing token of a
tool call). An optional ``demonstration(prompt)`` returns the segments of one correct trajectory,
model turn first, alternating model and observation ids; the supervised warm start
(``trainer.warmup.steps``) trains on the model segments of these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_rl.plugins import load_named


@dataclass
class EnvStep:
    """What an environment answers to one model turn."""
    observation_ids: list[int] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    truncated: bool = False


class Environment:
    """Base class of an environment (subclassing it is optional; see the module docstring)."""
    stop_token_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def reset(self, prompt) -> None:
        """Start an episode from ``prompt`` (a PromptRecord: text, ids, answer)."""

    def step(self, action_ids: list[int], finish_reason: dict) -> EnvStep:
        """React to the model's turn ``action_ids``."""
        raise NotImplementedError


class EnvError(Exception):
    """An environment failed or answered something unusable; the trajectory is dropped."""


BUILTIN = {"calculator": "moe_rl.envs.calculator:CalculatorEnv"}


def load_environment(spec: str) -> type:
    """A built-in environment name or ``module:Class`` (ValueError naming data.environment)."""
    cls = load_named(spec, "data.environment", BUILTIN, "module:Class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        lacking = f"; missing {', '.join(missing)}" if missing else ""
        raise ValueError(f"data.environment: {spec!r} is not an environment class (needs "
                         f"reset and step methods{lacking})")
    stop = getattr(cls, "stop_token_ids", ())
    if not isinstance(stop, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stop):
        raise ValueError(f"data.environment: {spec!r}.stop_token_ids: expected a list of token "
                         f"ids, got {stop!r}")
    return cls


def _ids(value, what: str, vocab_size: int) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise EnvError(f"{what}: expected a list of token ids, got {type(value).__name__}")
    if any(i < 0 or i >= vocab_size for i in value):
        raise EnvError(f"{what}: token ids must lie in [0, {vocab_size})")
    return list(value)


def check_step(result, vocab_size: int) -> EnvStep:
    """An environment's answer (an :class:`EnvStep` or a dict of its fields), checked: ids in
    the vocabulary, a finite reward when done, booleans; EnvError names what is wrong."""
    if isinstance(result, dict):
        unknown = set(result) - set(EnvStep.__dataclass_fields__)
        if unknown:
            raise EnvError(f"step: unknown field(s) {sorted(unknown)}")
        result = EnvStep(**result)
    if not isinstance(result, EnvStep):
        raise EnvError(f"step: expected an EnvStep or a dict, got {type(result).__name__}")
    for name in ("done", "truncated"):
        if not isinstance(getattr(result, name), bool):
            raise EnvError(f"step.{name}: expected a boolean, got {getattr(result, name)!r}")
    obs = _ids(result.observation_ids, "step.observation_ids", vocab_size)
    reward = result.reward
    if reward is not None:
        if (isinstance(reward, bool) or not isinstance(reward, (int, float))
                or not _finite(reward)):
            raise EnvError(f"step.reward: expected a finite number or None, got {reward!r}")
        reward = float(reward)
    if result.done and reward is None:
        raise EnvError("step.reward: an episode that is done needs a reward")
    return EnvStep(obs, reward, result.done, result.truncated)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:   # an integer past float's range
        return False


def demonstration_segments(env, prompt, vocab_size: int) -> list[list[int]]:
    """``env.demonstration(prompt)`` checked: non-empty segments of token ids, model first and
    last, alternating with observations."""
    segs = env.demonstration(prompt)
    if not isinstance(segs, (list, tuple)) or len(segs) % 2 == 0:
        raise EnvError("demonstration: expected an odd number of segments (model, observation, "
                       "..., model)")
    out = [_ids(s, f"demonstration[{i}]", vocab_size) for i, s in enumerate(segs)]
    if any(not s for s in out[::2]):
        raise EnvError("demonstration: a model segment is empty")
    return out
