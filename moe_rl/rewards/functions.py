"""Reward functions: the toy task's, math answers (:mod:`moe_rl.rewards.math_answers`), and a user
function given as ``module:function`` (per sample or batched, plain or async) whose failures
score 0 and are counted instead of crashing the run."""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
from typing import Callable

from moe_rl.plugins import PluginTimeout, call_bounded_async, load_named
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


class RewardCounts:
    """What went wrong while scoring: ``errors`` (exceptions, non-finite or non-numeric values:
    scored 0, metric ``reward/errors``), ``timeouts`` (samples dropped, metric
    ``reward/timeouts``), ``clipped`` (rewards beyond +-``abs_max``, clipped to it: metric
    ``reward/clipped``), the first and the latest message; the first of each kind is logged."""

    def __init__(self, spec: str, abs_max: float = 1e12):
        self.spec, self.abs_max = spec, abs_max
        self.errors = self.timeouts = self.clipped = 0
        self.first_error: str | None = None
        self.last_error: str | None = None

    def error(self, message: str, n: int = 1) -> float:
        """``n`` samples failed with ``message``: each scores 0."""
        self.errors += n
        self.last_error = message
        if self.first_error is None:
            self.first_error = message
            log.warning("reward %s failed (scored 0): %s", self.spec, message)
        return 0.0

    def timeout(self, message: str, n: int = 1) -> None:
        """``n`` samples lost to a timeout: dropped (None)."""
        self.timeouts += n
        self.last_error = message
        if self.timeouts == n:
            log.warning("reward %s %s: sample dropped", self.spec, message)
        if self.first_error is None:
            self.first_error = message

    def value(self, value) -> float:
        """``value`` as a finite float, else an error (0)."""
        return self.judged(as_number(value))

    def judged(self, number: float | str) -> float:
        """A reward :func:`as_number` gave: its error message scores 0 (counted), a value
        beyond +-``abs_max`` is clipped to it (counted)."""
        if isinstance(number, str):
            return self.error(number)
        if abs(number) > self.abs_max:
            self.clipped += 1
            if self.clipped == 1:
                log.warning("reward %s returned %g, clipped to %g (data.reward_abs_max; counted "
                            "in reward/clipped)", self.spec, number, self.abs_max)
            return math.copysign(self.abs_max, number)
        return number


def as_number(value) -> float | str:
    """``value`` as a finite float, or the message of why it is not one (no counting: this
    runs inside the reward's bounded call, where the user's ``__float__`` may block or exit)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"ValueError: reward {value!r:.60} is not a number"
    except OverflowError:
        return f"OverflowError: reward {str(value)[:40]}... is too large for a float"
    if not math.isfinite(number):
        return f"ValueError: non-finite reward {number}"
    return number


def _batch_numbers(values, n: int) -> list[float | str] | str:
    """A batched reward's answer for ``n`` samples as :func:`as_number` gives each, or the
    message of why it is not a list of ``n``."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        return (f"ValueError: a batched reward returned {values!r:.60} for {n} samples; "
                f"expected a list of {n} numbers")
    return [as_number(v) for v in values]


class RewardFunction(RewardCounts):
    """A Python reward (``data.reward``), per sample or batched, plain or ``async def``; every
    call bounded by ``timeout_s`` (a batched call covers the samples it is given). Failures are
    counted (:class:`RewardCounts`), never raised: the user's code must never stop the run."""

    def __init__(self, spec: str, timeout_s: float = 60.0, abs_max: float = 1e12):
        super().__init__(spec, abs_max)
        self.timeout_s = timeout_s
        self.fn, self.batched = load_reward(spec)
        self.is_async = _is_async(self.fn)

    async def _call(self, convert, *args):
        """``convert(reward(*args))`` on a thread of its own (an ``async def`` reward on its own
        event loop there), so that a reward blocking inside (``time.sleep``, a blocking HTTP
        call, a ``__float__`` of its value) holds neither the rollout's loop nor the bound."""
        fn = _run_coroutine(self.fn) if self.is_async else self.fn
        return await call_bounded_async(lambda *a: convert(fn(*a)), *args,
                                        timeout_s=self.timeout_s)

    async def _one(self, item: dict) -> float | None:
        try:
            number = await self._call(as_number, item["prompt"], item["response"],
                                      item["label"], item["metadata"])
        except PluginTimeout as exc:
            self.timeout(f"timed out: {exc} (data.reward_timeout_s)")
            return None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # noqa: BLE001 - the user's code (sys.exit included)
            return self.error(f"{type(exc).__name__}: {exc}")   # must never stop the run
        return self.judged(number)

    async def score(self, items: list[dict]) -> list[float | None]:
        """The rewards of ``items`` ({prompt, response, label, metadata} each), in order; None
        for a sample whose call timed out."""
        if not self.batched:
            return list(await asyncio.gather(*(self._one(item) for item in items)))
        try:
            numbers = await self._call(lambda v: _batch_numbers(v, len(items)), items)
        except PluginTimeout as exc:
            self.timeout(f"timed out: {exc} (data.reward_timeout_s)", len(items))
            return [None] * len(items)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # noqa: BLE001
            return [self.error(f"{type(exc).__name__}: {exc}", len(items))] * len(items)
        if isinstance(numbers, str):
            return [self.error(numbers, len(items))] * len(items)
        return [self.judged(v) for v in numbers]


SIGNATURE = "reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float"
BATCH_SIGNATURE = "reward(samples: list[dict]) -> list[float]"


def _run_coroutine(fn):
    """``fn`` (``async def``) as a plain function that runs it to the end on a new event loop
    of the calling thread."""
    def run(*args):
        return asyncio.run(fn(*args))
    return run


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def load_reward(spec: str) -> tuple[Callable, bool]:
    """(function, batched): a built-in reward name, or ``module:function`` taking the four
    arguments of :data:`SIGNATURE`, or one list of samples (:data:`BATCH_SIGNATURE`, each
    sample a dict {prompt, response, label, metadata}); either may be ``async def``.
    ValueError naming data.reward and the expected signatures otherwise."""
    fn = load_named(spec, "data.reward", BUILTIN, "module:function")
    if not callable(fn):
        raise ValueError(f"data.reward: {spec!r} is not callable; expected a function {SIGNATURE}"
                         f" or {BATCH_SIGNATURE}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # a callable without a readable signature (C code)
        return fn, False
    try:
        sig.bind("prompt", "response", "answer", {})
        return fn, False
    except TypeError as exc:
        per_sample_error = exc
    try:
        sig.bind([])
        return fn, True
    except TypeError:
        pass
    raise ValueError(f"data.reward: {spec!r} takes {sig}, which cannot be called as "
                     f"{SIGNATURE} ({per_sample_error}) nor as {BATCH_SIGNATURE}; moe_rl calls it "
                     f"with these positional arguments") from None


def reward_items(samples: list, tokenizer, prompts) -> list[dict]:
    """What a reward is given about each sample: {prompt, response (decoded), label (the
    reference answer), metadata (the row's ``data.metadata_keys``, the sample's own, and
    ``stopped``: the engine stopped on end of text)}."""
    eos = tokenizer.eos_token_id
    items = []
    for s in samples:
        rec = prompts[s.metadata["prompt_index"]] if "prompt_index" in s.metadata else None
        ids = s.response_ids.tolist()
        items.append({"prompt": rec.text if rec else "",
                      "response": tokenizer.decode(ids, skip_special_tokens=True),
                      "label": rec.answer if rec else None,
                      "metadata": {**(rec.metadata if rec else {}), **s.metadata,
                                   "stopped": bool(ids) and ids[-1] == eos}})
    return items


async def score_samples(samples: list, tokenizer, prompts, scorer) -> list:
    """Fill each sample's reward from ``scorer`` (a :class:`RewardFunction` or a reward
    service); returns the samples scored (those whose reward timed out are left out)."""
    rewards = await scorer.score(reward_items(samples, tokenizer, prompts))
    kept = []
    for s, reward in zip(samples, rewards):
        if reward is not None:
            s.reward = reward
            kept.append(s)
    return kept
