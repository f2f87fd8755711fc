"""Rewards from an HTTP service (``data.reward_service``): a reward-model server or a sandbox.

Protocol: ``POST <url>`` with the JSON body ``{"samples": [{"prompt", "response", "label",
"metadata"}, ...]}``; the answer is ``{"rewards": [number, ...]}``, one per sample, in the same
order. A connection error, a timeout or a 5xx answer is retried with exponential backoff (at
most ``max_retries`` times); a 4xx answer is not. A sample whose reward is missing, null, NaN or
not a number, and every sample of a request that failed or got an unreadable answer, scores 0
and counts in ``reward/errors``; the samples of a request that timed out on its last try are
dropped and count in ``reward/timeouts``."""
from __future__ import annotations

import asyncio
import json
import os

import httpx

from moe_rl.config import RewardServiceConfig
from moe_rl.rewards.functions import RewardCounts


class RewardService(RewardCounts):
    """The async client of a reward service: a finished group's samples go out in requests of
    at most ``batch_size``, at most ``max_concurrency`` requests in flight at once."""

    def __init__(self, cfg: RewardServiceConfig, backoff_s: float = 0.5):
        super().__init__(f"service {cfg.url}")
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

    async def _post(self, client: httpx.AsyncClient, body: bytes) -> httpx.Response:
        """The answer of the service (retried on connection errors, timeouts and 5xx)."""
        for attempt in range(self.cfg.max_retries + 1):
            last = attempt == self.cfg.max_retries
            try:
                async with self._semaphore():
                    resp = await client.post(self.cfg.url, content=body, headers=self.headers)
                if resp.status_code < 500 or last:
                    return resp
            except httpx.TransportError:
                if last:
                    raise
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")   # pragma: no cover

    async def _request(self, client: httpx.AsyncClient, items: list[dict]) -> list[float | None]:
        n = len(items)
        body = json.dumps({"samples": items}, default=str).encode()
        try:
            resp = await self._post(client, body)
        except httpx.TimeoutException as exc:
            self.timeout(f"timed out: no answer within {self.cfg.timeout_s:g} s after "
                         f"{self.cfg.max_retries} retries ({type(exc).__name__}; "
                         f"data.reward_service.timeout_s)", n)
            return [None] * n
        except httpx.TransportError as exc:
            return [self.error(f"{type(exc).__name__}: {exc} (after {self.cfg.max_retries} "
                               f"retries)", n)] * n
        if resp.status_code != 200:
            return [self.error(f"HTTP {resp.status_code}: {resp.text[:200]}", n)] * n
        try:
            rewards = resp.json()["rewards"]
            if not isinstance(rewards, list):
                raise TypeError(f"'rewards' is {type(rewards).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            return [self.error(f"unreadable answer ({type(exc).__name__}: {exc}): "
                               f"{resp.text[:200]!r}; expected {{\"rewards\": [number, ...]}}",
                               n)] * n
        if len(rewards) != n:
            return [self.error(f"{len(rewards)} rewards for {n} samples", n)] * n
        return [self.value(v) for v in rewards]

    async def score(self, items: list[dict]) -> list[float | None]:
        """The rewards of ``items``, in order (None: dropped on a timeout)."""
        size = self.cfg.batch_size
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as client:
            parts = await asyncio.gather(*(self._request(client, items[i:i + size])
                                           for i in range(0, len(items), size)))
        return [r for part in parts for r in part]


def reward_scorer(data_cfg, spec: str | None = None):
    """What scores a run's samples: the reward service when ``data.reward_service.url`` is set
    (and no ``spec`` is given), else the Python reward ``spec`` (default ``data.reward``)."""
    from moe_rl.rewards.functions import RewardFunction
    if spec is None and data_cfg.reward_service.url:
        return RewardService(data_cfg.reward_service)
    return RewardFunction(spec or data_cfg.reward, data_cfg.reward_timeout_s)
