"""Several engine servers behind one dispatcher: async HTTP (httpx) with a connection pool,
bounded concurrency per server, timeouts, retries with backoff, least-loaded dispatch, and
restart of a server that dies: its requests go to another server, or (pinned requests: scoring
passes, weight updates, health) wait for its restart and are sent again.

A slow answer is not death: SGLang's non-streaming ``/generate`` sends nothing until the whole
generation is done, so a server silent for ``timeout`` seconds is asked ``GET /health`` (answered
within ``health_timeout``); while it answers, the wait goes on. Only a server that refuses
connections or leaves its health check unanswered, or answers it with a server error, is taken
for dead (and restarted)."""
from __future__ import annotations

import asyncio
import functools
import random
import ssl
from dataclasses import dataclass, field
from typing import Callable

import certifi
import httpx

from moe_rl.engines.base import EngineError


# SGLang's weight-update calls: while one runs, the server's /health (a generation behind the
# update lock, http_server.py, tokenizer_manager.py) cannot answer, so it is not asked
WEIGHT_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_distributed",
                          "/update_weights_from_tensor", "/init_weights_update_group",
                          "/destroy_weights_update_group", "/begin_weight_update",
                          "/end_weight_update"})


# joining or leaving the trainer's group: a rendezvous of seconds once every rank has arrived;
# a server stuck in it would hold the sync for SGLang's 30-minute group timeout, so each call is
# bounded by a request's timeout (rollout.servers.request_timeout_s), not a weight load's
GROUP_PATHS = frozenset({"/init_weights_update_group", "/destroy_weights_update_group"})


class EngineHTTPError(EngineError):
    """A request every server refused or that kept failing after its retries; ``reached``:
    whether any attempt may have reached a server (False when no connection ever opened)."""

    def __init__(self, message: str, reached: bool = True):
        super().__init__(message)
        self.reached = reached


def response_body(resp: httpx.Response):
    """A success body as SGLang sends it: JSON, plain text (``/flush_cache``) or empty
    (``/health``: None)."""
    if not resp.content:
        return None
    if "json" in resp.headers.get("content-type", ""):
        return resp.json()
    return {"text": resp.text}


def error_message(resp: httpx.Response) -> str:
    """The message of an error body: SGLang's ``{"error": {"message": ...}}``, a plain
    ``{"error": "..."}`` / ``{"message": ...}`` or the text itself (first 500 characters)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            err = err.get("message", err)
        if isinstance(err, str):
            return err[:500]
    return resp.text[:500]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every pool (httpx builds a new one per client otherwise,
    loading the CA bundle: ~20 ms per rollout call)."""
    return ssl.create_default_context(cafile=certifi.where())


@dataclass
class Server:
    url: str
    restart: Callable[[], None] | None = None   # blocking restart (e.g. ReferenceServer.restart)
    in_flight: int = 0
    alive: bool = True
    failures: int = 0
    semaphore: asyncio.Semaphore | None = None
    restarting: asyncio.Task | None = field(default=None, repr=False)


class ServerPool:
    """Dispatch JSON requests to the least-loaded live server."""

    def __init__(self, urls: list[str], *, api_key: str | None = None, timeout: float = 300.0,
                 max_retries: int = 3, concurrency: int = 64,
                 restarters: list[Callable[[], None] | None] | None = None,
                 backoff: float = 0.5, health_timeout: float | None = None,
                 weight_timeout: float = 3600.0, answer_limit_mb: float = 1024.0):
        if not urls:
            raise ValueError("rollout.num_servers: the pool needs at least one server")
        restarters = restarters or [None] * len(urls)
        self.servers = [Server(u.rstrip("/"), r) for u, r in zip(urls, restarters)]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.max_retries = timeout, max_retries
        # the longest a silent server's /health may take (a CPU-bound server answers late)
        self.health_timeout = timeout if health_timeout is None else health_timeout
        self.concurrency, self.backoff = concurrency, backoff
        self.weight_timeout = weight_timeout   # the longest one weight-update call may take
        # the largest answer read (rollout.servers.max_answer_mb)
        self.answer_limit_mb = answer_limit_mb
        self.restarts = 0
        self.health_probes = 0   # /health asked of a server silent for `timeout` seconds
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "ServerPool":
        limits = httpx.Limits(max_connections=self.concurrency * len(self.servers))
        self._client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers,
                                         limits=limits, verify=_tls_context())
        for s in self.servers:
            s.semaphore = asyncio.Semaphore(self.concurrency)
        return self

    async def __aexit__(self, *exc) -> None:
        for s in self.servers:
            if s.restarting is not None:
                await s.restarting
        await self._client.aclose()
        self._client = None

    async def _pick(self, avoid: set[str]) -> Server:
        """The least-loaded live server (outside ``avoid`` when one is); when every server is
        dead, the first to come back from a restart under way."""
        if not any(s.alive for s in self.servers):
            pending = [s.restarting for s in self.servers if s.restarting is not None]
            if pending:
                await asyncio.wait([asyncio.shield(t) for t in pending],
                                   return_when=asyncio.FIRST_COMPLETED)
        live = ([s for s in self.servers if s.alive and s.url not in avoid] or
               [s for s in self.servers if s.alive])
        if not live:
            raise EngineHTTPError("no live engine server (all marked dead)")
        return min(live, key=lambda s: (s.in_flight, random.random()))

    def _mark_dead(self, server: Server) -> None:
        """Take ``server`` for dead and restart it; one without a restarter stays live (nothing
        would bring it back: the retries that ``max_retries`` promises try it again)."""
        if not server.alive or server.restart is None:
            return
        server.alive = False
        if server.restart is not None:
            async def restart():
                await asyncio.get_running_loop().run_in_executor(None, server.restart)
                server.alive, server.failures = True, 0
                self.restarts += 1
            server.restarting = asyncio.create_task(restart())

    async def _restarted(self, server: Server) -> bool:
        """Restart a dead ``server`` (or wait for its restart under way); False when it has no
        restarter or the restart failed."""
        self._mark_dead(server)
        task = server.restarting
        if task is None:
            return False
        try:
            await asyncio.shield(task)
        except Exception:
            return False
        return server.alive

    async def _healthy(self, server: Server) -> bool:
        """Whether ``server`` answers ``GET /health`` whole within ``health_timeout`` (an
        answer that drips in is cut off too)."""
        self.health_probes += 1
        try:
            resp = await asyncio.wait_for(self._client.get(server.url + "/health",
                                                           timeout=self.health_timeout),
                                          self.health_timeout)
        except (httpx.TransportError, httpx.TimeoutException, TimeoutError):
            return False
        return resp.status_code < 400

    async def _answer(self, server: Server, method: str, path: str,
                      body: dict | None) -> httpx.Response:
        """The response of one request. No read timeout on the request itself: after each
        ``timeout`` seconds without an answer the server's health is checked, and the wait goes
        on while it is healthy; an unhealthy server raises :class:`httpx.ReadTimeout`. A
        weight-update call (:data:`WEIGHT_PATHS`) is waited for ``weight_timeout`` seconds
        without asking ``/health``, which the server answers only once the update is done (a
        dead server still shows: its connection breaks); joining or leaving the group
        (:data:`GROUP_PATHS`) for ``timeout`` seconds."""
        send = asyncio.ensure_future(self._bounded(method, server.url + path, body))
        try:
            if path in WEIGHT_PATHS:
                bound, key = ((self.timeout, "rollout.servers.request_timeout_s")
                              if path in GROUP_PATHS else
                              (self.weight_timeout, "rollout.servers.weight_load_timeout_s"))
                done, _ = await asyncio.wait({send}, timeout=bound)
                if not done:
                    raise httpx.ReadTimeout(f"{server.url}{path}: no answer in {bound} s "
                                            f"({key})")
                return send.result()
            while True:
                done, _ = await asyncio.wait({send}, timeout=self.timeout)
                if done:
                    return send.result()
                if not await self._healthy(server):
                    raise httpx.ReadTimeout(f"{server.url}{path}: no answer in {self.timeout} s "
                                            f"and GET /health failed")
        finally:
            if not send.done():
                send.cancel()

    async def _bounded(self, method: str, url: str, body: dict | None) -> httpx.Response:
        """The response to one request, read whole but never past ``answer_limit_mb`` (a larger
        answer raises EngineHTTPError at once, not retried: a broken or hostile server cannot
        fill this process's memory)."""
        limit = int(self.answer_limit_mb * (1 << 20))
        too_large = (f"{url}: the answer is larger than rollout.servers.max_answer_mb="
                     f"{self.answer_limit_mb:g} MB")
        no_read_limit = httpx.Timeout(self.timeout, read=None)
        async with self._client.stream(method, url, json=body, timeout=no_read_limit) as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise EngineHTTPError(too_large)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():   # decoded: a compressed bomb counts whole
                size += len(chunk)
                if size > limit:
                    raise EngineHTTPError(too_large)
                chunks.append(chunk)
            headers = httpx.Headers({k: v for k, v in resp.headers.items() if k.lower() not in
                                     ("content-encoding", "content-length", "transfer-encoding")})
            return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks),
                                  request=resp.request)

    async def request(self, path: str, body: dict | None = None, *, server: Server | None = None,
                      method: str = "POST", resend: bool = True) -> dict:
        """Send to ``server`` (pinned) or else to the least-loaded live one. Connection errors
        and 5xx: an unpinned request goes to another server (a dead one is restarted); a pinned
        one waits for its server's restart and is sent to it again. 4xx raise at once; so does
        every failure after ``max_retries`` retries. ``resend=False`` (a request whose effect
        must not happen twice, e.g. a weight broadcast the server joins as a collective): only
        a connection that never opened is tried again; once the request may have reached the
        server, a failure raises at once (a second announcement would wait in the collective
        until the group's timeout)."""
        pinned = server is not None
        avoid: set[str] = set()
        last: Exception | None = None
        reached = False
        for attempt in range(self.max_retries + 1):
            target = server if pinned else await self._pick(avoid)
            if pinned and not target.alive and not await self._restarted(target):
                raise EngineHTTPError(f"{target.url}{path}: server is down and could not be "
                                      f"restarted ({last})", reached=reached)
            target.in_flight += 1
            dead = False
            try:
                async with target.semaphore:
                    resp = await self._answer(target, method, path, body)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last, dead = exc, True
                reached = reached or not isinstance(exc, httpx.ConnectError)
                if not resend and not isinstance(exc, httpx.ConnectError):
                    self._mark_dead(target)
                    raise EngineHTTPError(f"{target.url}{path}: not sent again, the server may "
                                          f"have started it: {exc!r}") from exc
            else:
                reached = True
                if resp.status_code < 400:
                    return response_body(resp)
                if resp.status_code < 500:
                    raise EngineHTTPError(f"{target.url}{path}: HTTP {resp.status_code}: "
                                          f"{error_message(resp)}")
                last = EngineHTTPError(f"{target.url}{path}: HTTP {resp.status_code}: "
                                       f"{error_message(resp)}")
                target.failures += 1
                if not resend:
                    raise last
                # SGLang answers /health 503 while its scheduler is stuck (e.g. in the
                # collective of a weight broadcast another server refused): taken for dead
                dead = path == "/health"
            finally:
                target.in_flight -= 1
            if dead:
                self._mark_dead(target)
            if not pinned:
                avoid.add(target.url)
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff * (2 ** attempt) * (0.5 + random.random() / 2))
        raise EngineHTTPError(f"{path}: failed after {self.max_retries + 1} attempts: {last}",
                              reached=reached)

    async def broadcast(self, path: str, body: dict | None = None, method: str = "POST",
                        resend: bool = True) -> list[dict]:
        """Send to every server (weight updates, health), each pinned; waits for restarting
        servers first (``resend``: as :meth:`request`'s)."""
        for s in self.servers:
            if s.restarting is not None:
                await s.restarting
                s.restarting = None
        return list(await asyncio.gather(*(self.request(path, body, server=s, method=method,
                                                        resend=resend)
                                           for s in self.servers)))
