"""Rewards from an HTTP service (``data.reward_service``): a reward-model server or a sandbox.

Protocol: ``POST <url>`` with the JSON body ``{"samples": [{"prompt", "response", "label",
"metadata"}, ...]}``; the answer is ``{"rewards": [number, ...]}``, one per sample, in the same
order. ``timeout_s`` bounds each request whole (connection, upload and the full answer: a
service that drips its answer a byte at a time is cut off too); an answer larger than
``max_answer_mb`` is refused as it arrives. A connection error, a timeout or a 5xx answer is
retried with exponential backoff (at most ``max_retries`` times); a 4xx answer is not. A sample
whose reward is missing, null, NaN, infinite, too large for a float or not a JSON number (a
string such as "0.5" and true are not numbers), and every sample of a request that failed or got
an unreadable or oversized answer, scores 0 and counts in ``reward/errors``; the samples of a
request that timed out on its last try are dropped and count in ``reward/timeouts``."""
from __future__ import annotations

import asyncio
import json
import os

import httpx

from moe_rl.config import RewardServiceConfig
from moe_rl.rewards.functions import RewardCounts, RewardFunction


class AnswerTooLarge(ValueError):
    """The service's answer passed ``data.reward_service.max_answer_mb``."""


class RewardService(RewardCounts):
    """The async client of a reward service: a finished group's samples go out in requests of
    at most ``batch_size``, at most ``max_concurrency`` requests in flight at once."""

    def __init__(self, cfg: RewardServiceConfig, backoff_s: float = 0.5,
                 abs_max: float = 1e12):
        super().__init__(f"service {cfg.url}", abs_max)
        self.cfg, self.backoff_s = cfg, backoff_s
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"data.reward_service.api_key_env: the environment variable "
                                 f"{cfg.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self._limit: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        """The concurrency bound of the running event loop (each batch may run its own)."""
        loop = asyncio.get_running_loop()
        if self._limit is None or self._limit[0] is not loop:
            self._limit = (loop, asyncio.Semaphore(self.cfg.max_concurrency))
        return self._limit[1]

    async def _exchange(self, client: httpx.AsyncClient, body: bytes) -> tuple[int, bytes]:
        """One request: its status and whole answer, read as it streams in and refused once it
        passes ``max_answer_mb``."""
        cap = int(self.cfg.max_answer_mb * (1 << 20))
        async with client.stream("POST", self.cfg.url, content=body,
                                 headers=self.headers) as resp:
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > cap:
                    raise AnswerTooLarge(f"answer larger than {self.cfg.max_answer_mb:g} MB "
                                         f"(data.reward_service.max_answer_mb)")
                chunks.append(chunk)
            return resp.status_code, b"".join(chunks)

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> tuple[int, bytes]:
        """The service's answer (retried on connection errors, timeouts and 5xx); each try
        bounded whole by ``timeout_s``."""
        for attempt in range(self.cfg.max_retries + 1):
            last = attempt == self.cfg.max_retries
            try:
                async with self._semaphore():
                    status, content = await asyncio.wait_for(self._exchange(client, body),
                                                             self.cfg.timeout_s)
                if status < 500 or last:
                    return status, content
            except (httpx.TransportError, TimeoutError):
                if last:
                    raise
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")   # pragma: no cover

    def _number(self, value) -> float:
        """A reward from the answer's JSON: a finite JSON number, else an error (0)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return self.error(f"ValueError: reward {value!r:.60} is not a number")
        return self.value(value)

    async def _request(self, client: httpx.AsyncClient, items: list[dict]) -> list[float | None]:
        n = len(items)
        body = json.dumps({"samples": items}, default=str).encode()
        try:
            status, content = await self._post(client, body)
        except (httpx.TimeoutException, TimeoutError) as exc:
            self.timeout(f"timed out: no whole answer within {self.cfg.timeout_s:g} s after "
                         f"{self.cfg.max_retries} retries ({type(exc).__name__}; "
                         f"data.reward_service.timeout_s)", n)
            return [None] * n
        except httpx.TransportError as exc:
            return [self.error(f"{type(exc).__name__}: {exc} (after {self.cfg.max_retries} "
                               f"retries)", n)] * n
        except AnswerTooLarge as exc:
            return [self.error(str(exc), n)] * n
        text = content[:200].decode("utf-8", "replace")
        if status != 200:
            return [self.error(f"HTTP {status}: {text}", n)] * n
        try:
            rewards = json.loads(content)["rewards"]
            if not isinstance(rewards, list):
                raise TypeError(f"'rewards' is {type(rewards).__name__}")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            return [self.error(f"unreadable answer ({type(exc).__name__}: {str(exc)[:100]}): "
                               f"{text!r}; expected {{\"rewards\": [number, ...]}}", n)] * n
        if len(rewards) != n:
            return [self.error(f"{len(rewards)} rewards for {n} samples", n)] * n
        return [self._number(v) for v in rewards]

    async def score(self, items: list[dict]) -> list[float | None]:
        """The rewards of ``items``, in order (None: dropped on a timeout)."""
        size = self.cfg.batch_size
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as client:
            parts = await asyncio.gather(*(self._request(client, items[i:i + size])
                                           for i in range(0, len(items), size)))
        return [r for part in parts for r in part]


def reward_setting(data_cfg) -> tuple[str, str]:
    """The key and value that say what scores the run (``data.reward_service.url`` when a
    service is set, else ``data.reward``) and the key bounding one score's time, for messages."""
    if data_cfg.reward_service.url:
        return (f"data.reward_service.url: {data_cfg.reward_service.url}",
            f"data.reward_service.timeout_s={data_cfg.reward_service.timeout_s:g}")
    return f"data.reward: {data_cfg.reward}", f"data.reward_timeout_s={data_cfg.reward_timeout_s:g}"


def reward_scorer(data_cfg, spec: str | None = None):
    """What scores a run's samples: the reward service when ``data.reward_service.url`` is set
    (and no ``spec`` is given), else the Python reward ``spec`` (default ``data.reward``)."""
    if spec is None and data_cfg.reward_service.url:
        return RewardService(data_cfg.reward_service, abs_max=data_cfg.reward_abs_max)
    return RewardFunction(spec or data_cfg.reward, data_cfg.reward_timeout_s,
                          data_cfg.reward_abs_max)
