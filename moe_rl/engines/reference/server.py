"""HTTP server (FastAPI + uvicorn) for the CPU reference engine, with SGLang's endpoints, field
names and encodings, and SGLang's continuous batching (see :func:`build_app`)."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
import itertools
import json
import secrets
import socket
import sys
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from moe_rl.errors import UserError
from moe_rl.engines.reference.admission_limits import Limits
from moe_rl.engines.reference.engine import (ReferenceEngine, Request, RequestError,
                                             parse_sampling_params)

def _error(message: str) -> dict:
    """SGLang's error body."""
    return {"error": {"message": message}}


def _unreadable_body(message: str) -> JSONResponse:
    """SGLang's (FastAPI's) 400 for a body that is not JSON or is nested past the parser's
    depth: its ``ErrorResponse`` shape, on every endpoint."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request",
                         "param": None, "code": 400}, status_code=400)


class UnreadableBody(RequestError):
    """The body is not JSON, or nested too deeply to read."""


def _read_json(raw: bytes):
    """The body's JSON value (UnreadableBody when it cannot be read)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise UnreadableBody("body: JSON nested too deeply to read") from None
    except ValueError:
        raise UnreadableBody("body: not valid JSON") from None


class _BearerAuth:
    """Require ``Authorization: Bearer KEY`` (a plain ASGI middleware: it leaves the request's
    receive channel alone, so a handler still sees its client hang up)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):   # bytes: any byte is fine
                await JSONResponse(_error("unauthorized: send Authorization: Bearer <key>"),
                                   status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ModelUpdateLock:
    """SGLang's model-update lock: every /generate call holds it shared for its whole life; a
    weight update or a session change holds it alone, so it waits for the running requests
    and holds new ones until it is done (no answer mixes two weight versions)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self.readers, self.writing, self.writers_waiting = 0, False, 0

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writing and not self.writers_waiting)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            self.writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self.writing and not self.readers)
            finally:
                self.writers_waiting -= 1
            self.writing = True
        try:
            yield
        finally:
            async with self._cond:
                self.writing = False
                self._cond.notify_all()


_BOOL_FIELDS = ("return_logprob", "return_routed_experts", "return_sampling_mask", "stream")


def _token_list(value, name: str) -> None:
    """RequestError unless ``value`` is a list of integer token ids."""
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool)
                                          for t in value):
        raise RequestError(f"{name}: expected a list of integer token ids")


def _inputs(body, limits: Limits) -> tuple[list, bool]:
    """The body's input sequences and whether it is a batch (a list of lists)."""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    if "text" in body and "input_ids" not in body:
        raise RequestError("text: the reference engine takes input_ids only (tokenize first)")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids: expected a non-empty list of token ids (or of lists)")
    batch = isinstance(ids[0], list)
    seqs = ids if batch else [ids]
    if batch and not all(isinstance(seq, list) for seq in seqs):
        raise RequestError("input_ids: a batch must be a list of lists of token ids, not a mix "
                           "of ids and lists")
    if len(seqs) > limits.max_batch_requests:
        raise RequestError(f"input_ids: {len(seqs)} inputs in one call, over the server's limit "
                           f"{limits.max_batch_requests} (--max-batch-requests)")
    for name in _BOOL_FIELDS:
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name}: expected a boolean")
    if body.get("stream"):
        raise RequestError("stream: the reference engine does not stream")
    return seqs, batch


def _per_input(body: dict, seqs: list, batch: bool) -> tuple[list, list, list]:
    """The sampling parameters, request ids and log-prob starts of each input (one value
    given for all, or one per input)."""
    n = len(seqs)
    params = body.get("sampling_params") or {}
    plist = params if isinstance(params, list) else [params] * n
    if len(plist) != n:
        raise RequestError("sampling_params: a list must have one entry per input")
    rids = _request_ids(body, batch, n)
    start = body.get("logprob_start_len", -1)
    starts = start if isinstance(start, list) else [start] * n
    if len(starts) != n or (isinstance(start, list) and not batch):
        raise RequestError("logprob_start_len: a list needs a batch input, one entry per input")
    if any(not isinstance(x, int) or isinstance(x, bool) or x < -1 for x in starts):
        raise RequestError("logprob_start_len: expected an integer >= -1 (or one per input)")
    return plist, rids, starts


def _request_ids(body: dict, batch: bool, n: int) -> list:
    """``rid`` of each of the ``n`` inputs: one string (or none) for a single input, a list of
    ``n`` for a batch."""
    rids = body.get("rid")
    if batch and rids is not None and (not isinstance(rids, list) or len(rids) != n):
        raise RequestError(f"rid: a batch of {n} inputs needs a list of {n} request ids")
    if not batch and isinstance(rids, list):
        raise RequestError("rid: a single input takes one request id, not a list")
    rids = rids if isinstance(rids, list) else [rids] * n
    if any(r is not None and not isinstance(r, str) for r in rids):
        raise RequestError("rid: expected string request ids")
    return rids


def _listed_token_ids(body: dict, batch: bool, n: int) -> list:
    """``token_ids_logprob`` of each of the ``n`` inputs (checked)."""
    listed = body.get("token_ids_logprob")
    if listed is not None and not isinstance(listed, list):
        raise RequestError("token_ids_logprob: expected a list of token ids (or one per input)")
    listed_per = (listed if batch and listed and isinstance(listed[0], list)
                  else [listed] * n)
    if len(listed_per) != n:
        raise RequestError("token_ids_logprob: a list of lists must have one entry per input")
    for i, ids_lp in enumerate(listed_per):
        if ids_lp is not None:
            _token_list(ids_lp, f"token_ids_logprob[{i}]" if listed_per is listed
                        else "token_ids_logprob")
    return listed_per


def _parsed_params(plist: list, seqs: list, engine: ReferenceEngine, want_mask: bool,
                   limits: Limits) -> list:
    """Each input's sampling parameters, parsed, within the server's limits on samples,
    sub-requests and tokens per call."""
    parsed = []
    for p in plist:
        if not isinstance(p, dict):
            raise RequestError("sampling_params: expected an object")
        parsed.append(parse_sampling_params(p, engine.mask_cap, want_mask))
        if parsed[-1].n > limits.max_n:
            raise RequestError(f"sampling_params.n: {parsed[-1].n} is over the server's limit "
                               f"{limits.max_n} (--max-n)")
    subs = sum(p.n for p in parsed)
    if subs > limits.max_batch_requests:
        raise RequestError(f"input_ids x sampling_params.n: {subs} sub-requests in one call, over "
                           f"the server's limit {limits.max_batch_requests} "
                           f"(--max-batch-requests)")
    tokens = sum((len(seq) + p.max_new_tokens) * p.n for seq, p in zip(seqs, parsed))
    if tokens > limits.max_request_tokens:
        raise RequestError(f"input_ids + max_new_tokens: {tokens} tokens in one call, over the "
                           f"server's limit {limits.max_request_tokens} (--max-request-tokens)")
    return parsed


def _as_requests(body: dict, engine: ReferenceEngine, counter, limits: Limits = Limits()
                 ) -> tuple[list[Request], bool]:
    """Parse a /generate body into requests; returns (requests, whether it was a batch).
    ``limits`` are checked before any sub-request is built."""
    seqs, batch = _inputs(body, limits)
    plist, rids, starts = _per_input(body, seqs, batch)
    r_start = body.get("routed_experts_start_len", 0)
    if not isinstance(r_start, int) or isinstance(r_start, bool):
        raise RequestError("routed_experts_start_len: expected an integer")
    want_mask = bool(body.get("return_sampling_mask", False))
    mode = body.get("sampling_logprobs_mode", "selected")
    listed_per = _listed_token_ids(body, batch, len(seqs))
    parsed = _parsed_params(plist, seqs, engine, want_mask, limits)
    out = []
    for seq, params, rid, ids_lp, start in zip(seqs, parsed, rids, listed_per, starts):
        _token_list(seq, "input_ids")
        for copy in range(params.n):   # n > 1: n samples of this prompt, in a row
            seeded = (params if params.n == 1 or params.sampling_seed is None else
                dataclasses.replace(params, sampling_seed=params.sampling_seed + copy))
            req = Request(input_ids=seq, params=seeded,
                          rid=(f"{rid}-{copy}" if rid and params.n > 1 else rid)
                          or f"ref-{next(counter)}",
                          return_logprob=bool(body.get("return_logprob", False)),
                          logprob_start_len=start,
                          return_routed_experts=bool(body.get("return_routed_experts", False)),
                          routed_experts_start_len=r_start, return_sampling_mask=want_mask,
                          sampling_logprobs_mode=mode, token_ids_logprob=ids_lp)
            if copy == 0:   # the copies differ in their seed and rid only
                engine.validate(req)
            out.append(req)
        batch = batch or params.n > 1
    return out, batch


class _Scheduler:
    """SGLang's continuous batching over ``engine``: between two decode iterations, waiting
    requests join the running batch (first come, first served) while at most
    ``max_running_requests`` run and the running ones reserve at most ``max_total_tokens``
    tokens (input + max_new_tokens each). A finished request leaves at once; a request whose
    client went away is dropped at the next iteration; an abort answers the requests it names
    with what they generated so far."""

    def __init__(self, engine: ReferenceEngine, max_running_requests: int,
                 max_total_tokens: int):
        self.engine = engine
        self.max_running, self.max_tokens = max_running_requests, max_total_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.waiting: collections.deque = collections.deque()
        self.aborts: list = []   # /abort_request calls not yet applied: a predicate each
        self.live: dict[int, Request] = {}   # the requests of the calls being answered, by id

    def pending(self) -> int:
        """Requests waiting to run."""
        return len(self.waiting) + self.queue.qsize()

    def admissions(self) -> list:
        """Waiting requests that fit, in arrival order (a cancelled one is skipped)."""
        admit, room = [], self.max_tokens - self.engine.tokens_in_flight()
        slots = self.max_running - len(self.engine.running)
        while self.waiting and len(admit) < slots:
            req, fut = self.waiting[0]
            if fut.done():
                self.waiting.popleft()
                continue
            need = len(req.input_ids) + req.params.max_new_tokens
            if need > room:
                break
            self.waiting.popleft()
            admit.append((req, fut))
            room -= need
        return admit

    def take_aborts(self):
        """The predicate of the aborts asked since the last iteration (None: none); waiting
        requests it names are answered now, with nothing generated."""
        if not self.aborts:
            return None
        asked = list(self.aborts)
        self.aborts.clear()
        match = lambda req: any(a(req) for a in asked)   # noqa: E731
        while not self.queue.empty():
            self.waiting.append(self.queue.get_nowait())
        for item in [w for w in self.waiting if match(w[0])]:
            self.waiting.remove(item)
            if not item[1].done():
                item[1].set_result(self.engine.aborted_response(item[0]))
        return match

    async def worker(self) -> None:
        """The decode loop: admit, step, answer; forever."""
        loop = asyncio.get_running_loop()
        engine, waiting = self.engine, self.waiting
        while True:
            if not engine.running and not waiting:
                waiting.append(await self.queue.get())
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            abort = self.take_aborts()
            admit = self.admissions()
            gone = {id(r.handle) for r in engine.running if r.handle.done()}
            if not admit and not engine.running:   # only cancelled requests were waiting
                continue
            finished = await loop.run_in_executor(None, engine.step, admit, gone, abort)
            for fut, result in finished:
                if fut.done():
                    continue
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    async def run(self, request: HTTPRequest, reqs: list[Request], batch: bool):
        """Queue ``reqs`` and answer them (a list when ``batch``), or 499 when the client goes
        away first (their work stops)."""
        loop = asyncio.get_running_loop()
        futures = []
        for r in reqs:
            fut = loop.create_future()
            self.live[id(r)] = r
            fut.add_done_callback(lambda _, key=id(r): self.live.pop(key, None))
            self.queue.put_nowait((r, fut))
            futures.append(fut)
        gathered = asyncio.gather(*futures)
        while not gathered.done():   # stop the work when the client goes away
            await asyncio.wait({gathered}, timeout=0.05)
            if not gathered.done() and await request.is_disconnected():
                gathered.cancel()
                return Response(status_code=499)
        try:
            results = gathered.result()
        except RequestError as exc:
            return JSONResponse(_error(str(exc)), status_code=400)
        except Exception as exc:
            return JSONResponse(_error(f"engine failure: {exc}"), status_code=500)
        return results if batch else results[0]

    def abort(self, rid: str, everything: bool) -> None:
        """SGLang's: every request whose id starts with ``rid`` (all with ``everything``)
        stops at the next iteration; an empty rid without ``everything`` names none."""
        if everything or rid:
            asked = {i for i, req in self.live.items()   # a request after this call stays
                     if everything or str(req.rid).startswith(rid)}
            self.aborts.append(lambda req: id(req) in asked)


async def _read_body(request: HTTPRequest, limits: Limits) -> bytes:
    """The body, refused (RequestError) past ``limits.max_request_bytes``."""
    too_big = RequestError(f"body: over the server's limit of {limits.max_request_bytes} "
                           f"bytes (--max-request-bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_request_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_object(request: HTTPRequest, limits: Limits):
    """The body as a JSON object, or the 400 answer naming what is wrong."""
    try:
        body = _read_json(await _read_body(request, limits))
    except UnreadableBody as exc:
        return _unreadable_body(str(exc))
    except RequestError as exc:
        return _refusal(str(exc))
    if not isinstance(body, dict):
        return _refusal("body: expected a JSON object")
    return body


def _refusal(message: str) -> JSONResponse:
    """SGLang's 400 answer of a control endpoint."""
    return JSONResponse({"success": False, "message": message}, status_code=400)


def build_app(engine: ReferenceEngine, api_key: str | None = None,
              max_running_requests: int = 64, max_total_tokens: int = 1 << 18,
              limits: Limits = Limits()) -> FastAPI:
    """The FastAPI application serving ``engine``, scheduled by :class:`_Scheduler`; a request
    that alone needs more than ``max_total_tokens`` is refused with 400. A call's body is read,
    parsed and expanded off the event loop within ``limits``; weight updates and session
    changes hold :class:`ModelUpdateLock` alone, as SGLang's."""
    if max_running_requests < 1 or max_total_tokens < 1:
        raise ValueError("max_running_requests and max_total_tokens: expected >= 1")
    app = FastAPI(title="moe_rl reference engine")
    sched = _Scheduler(engine, max_running_requests, max_total_tokens)
    app.state.limits = {"max_running_requests": max_running_requests,
                        "max_total_num_tokens": max_total_tokens, **dataclasses.asdict(limits)}
    model_update = ModelUpdateLock()
    control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")

    @app.on_event("startup")
    async def _start():
        app.state.worker = asyncio.create_task(sched.worker())

    @app.on_event("shutdown")
    async def _stop():   # uvicorn re-raises SIGTERM after this: atexit handlers never run
        engine.close()

    if api_key is not None:
        app.add_middleware(_BearerAuth, key=api_key)
    _info_routes(app, engine, sched)
    _generate_route(app, engine, sched, model_update, limits)
    _session_routes(app, engine, sched, model_update, control, limits)
    _weight_routes(app, engine, model_update, control, limits)
    return app


def _info_routes(app: FastAPI, engine: ReferenceEngine, sched: _Scheduler) -> None:
    """/health, /model_info and /get_server_info, as SGLang answers them."""
    @app.get("/health")
    async def health():
        return Response(status_code=200)   # SGLang: an empty 200

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path,
                "is_generation": True, "weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def server_info():
        return {**app.state.limits, "model_path": engine.model_path,
                "weight_version": engine.weight_version,
                "internal_states": [{"num_running_reqs": len(engine.running),
                                     "num_waiting_reqs": sched.pending(),
                                     "tokens_in_flight": engine.tokens_in_flight()}]}


def _generate_route(app: FastAPI, engine: ReferenceEngine, sched: _Scheduler,
                    model_update: ModelUpdateLock, limits: Limits) -> None:
    """/generate: its body parsed and expanded on a thread, its requests scheduled."""
    counter = itertools.count()

    def parse(raw: bytes) -> tuple[list[Request], bool]:
        reqs, batch = _as_requests(_read_json(raw), engine, counter, limits)
        for r in reqs:
            need = len(r.input_ids) + r.params.max_new_tokens
            if need > sched.max_tokens:
                raise RequestError(
                    f"input_ids: {len(r.input_ids)} tokens + sampling_params.max_new_tokens "
                    f"{r.params.max_new_tokens} exceed the server's token budget "
                    f"(--max-total-tokens {sched.max_tokens})")
        return reqs, batch

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        try:   # parsed on a thread: a large call never holds the event loop (/health answers)
            reqs, batch = await asyncio.to_thread(parse, await _read_body(request, limits))
        except UnreadableBody as exc:
            return _unreadable_body(str(exc))
        except RequestError as exc:
            return JSONResponse(_error(str(exc)), status_code=400)
        async with model_update.shared():   # a weight update waits for these requests
            return await sched.run(request, reqs, batch)


async def _on_control_threads(control: ThreadPoolExecutor, fn, *args):
    """Control work on its own threads, so it can never starve /generate's: None, or the 400
    answer of its refusal."""
    try:
        await asyncio.get_running_loop().run_in_executor(control, fn, *args)
    except (RequestError, ValueError, KeyError, TypeError) as exc:
        return _refusal(str(exc))
    return None


def _session_routes(app: FastAPI, engine: ReferenceEngine, sched: _Scheduler,
                    model_update: ModelUpdateLock, control: ThreadPoolExecutor,
                    limits: Limits) -> None:
    """Memory release and resume, weight-update sessions, /abort_request, /flush_cache."""
    def control_endpoint(path: str, action, done: str, exclusive: bool) -> None:
        """A body-less control endpoint: run ``action`` on the control threads (holding the
        model-update lock alone when ``exclusive``)."""
        async def endpoint(request: HTTPRequest):
            async with (model_update.exclusive() if exclusive else contextlib.nullcontext()):
                failed = await _on_control_threads(control, action)
                return failed or (None if done is None else {"success": True, "message": done})
        app.post(path)(endpoint)

    for path, action, done, exclusive in (   # SGLang answers release/resume with null
            ("/release_memory_occupation", engine.release_memory, None, False),
            ("/resume_memory_occupation", engine.resume_memory, None, False),
            ("/begin_weight_update", engine.begin_weight_update, "session open", True),
            ("/end_weight_update", engine.end_weight_update, "session closed", True)):
        control_endpoint(path, action, done, exclusive)

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest):
        """SGLang's: every request whose id starts with ``rid`` (all with ``abort_all``) stops
        and answers with what it generated so far, finish_reason ``abort``."""
        b = await _json_object(request, limits)
        if not isinstance(b, dict):
            return b
        rid, everything = b.get("rid") or "", b.get("abort_all", False)
        if not isinstance(everything, bool) or not isinstance(rid, str):
            return _refusal("abort_all: expected a boolean and rid a string")
        sched.abort(rid, everything)
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache(timeout: float = 0.0):
        # SGLang answers in plain text and refuses while busy; with `timeout` > 0 it first
        # waits up to that long for no request to be queued or running
        deadline = time.monotonic() + max(timeout, 0.0)
        while sched.waiting or not engine.flush_cache():
            if time.monotonic() >= deadline:
                return PlainTextResponse("Cache not flushed: there are running or waiting "
                                         "requests.\n", status_code=400)
            await asyncio.sleep(0.02)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)\n")


def _weight_routes(app: FastAPI, engine: ReferenceEngine, model_update: ModelUpdateLock,
                   control: ThreadPoolExecutor, limits: Limits) -> None:
    """The weight-update group (join, leave, broadcast) and /update_weights_from_disk."""
    group_setup = asyncio.Lock()

    @app.post("/init_weights_update_group")
    async def init_group(request: HTTPRequest):
        b = await _json_object(request, limits)
        if isinstance(b, JSONResponse):
            return b
        try:
            args = _group_fields(b)
        except RequestError as exc:
            return _refusal(str(exc))
        if group_setup.locked():
            return _refusal("init_weights_update_group: a group setup is already in progress")
        async with group_setup:   # one at a time, each bounded by the engine's group timeout
            return await _on_control_threads(control, engine.init_update_group, *args) or {
                "success": True, "message": "joined"}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: HTTPRequest):
        b = await _json_object(request, limits)
        if isinstance(b, JSONResponse):
            return b
        return await _on_control_threads(control, engine.destroy_update_group,
                                          b.get("group_name", "weight_update_group")) or {
            "success": True, "message": "left the group"}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(request: HTTPRequest):
        b = await _json_object(request, limits)
        if isinstance(b, JSONResponse):
            return b
        refused = _distributed_fields_refusal(b)
        if refused:
            return _refusal(refused)
        committed = []
        async with model_update.exclusive():
            err = await _on_control_threads(
                control, lambda *a: committed.append(engine.update_from_distributed(*a)),
                b["names"], b["dtypes"], b["shapes"], b.get("group_name", "weight_update_group"),
                b.get("flush_cache", True))
        if err is not None:
            return err
        if committed[0] and b.get("weight_version") is not None:
            engine.weight_version = str(b["weight_version"])
        return {"success": True, "message": f"received {len(b['names'])} tensors",
                "weight_version": engine.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights(request: HTTPRequest):
        body = await _json_object(request, limits)
        if isinstance(body, JSONResponse):
            return body
        path = body.get("model_path")
        if not isinstance(path, str):
            return _refusal("model_path: expected a string")
        loop = asyncio.get_running_loop()
        async with model_update.exclusive():   # running requests finish on the old weights
            try:
                await loop.run_in_executor(control, engine.load, path)
            except Exception as exc:
                return _refusal(f"{path}: {exc}")
        version = body.get("weight_version")
        engine.weight_version = str(version) if version is not None else str(
            int(engine.weight_version) + 1 if engine.weight_version.isdigit() else 1)
        return {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}


def _distributed_fields_refusal(b: dict) -> str | None:
    """What is wrong with an /update_weights_from_distributed body's fields (None: nothing)."""
    if not all(isinstance(b.get(k), list) for k in ("names", "dtypes", "shapes")):
        return "names, dtypes, shapes: expected lists"
    if not isinstance(b.get("flush_cache", True), bool):
        return "flush_cache: expected a boolean"
    if not isinstance(b.get("group_name", ""), str):
        return "group_name: expected a string"
    return None


def _group_fields(b: dict) -> tuple:
    """The arguments of ``engine.init_update_group`` from an /init_weights_update_group body;
    RequestError names a missing or mistyped field."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size")
               if k not in b]
    if missing:
        raise RequestError(f"missing fields {missing}")
    for key in ("master_port", "rank_offset", "world_size"):
        if not isinstance(b[key], int) or isinstance(b[key], bool):
            raise RequestError(f"{key}: expected an integer, got {b[key]!r}")
    if not 0 < b["master_port"] < 65536:
        raise RequestError(f"master_port: expected 1..65535, got {b['master_port']}")
    for key in ("master_address", "group_name", "backend"):
        if key in b and not isinstance(b[key], str):
            raise RequestError(f"{key}: expected a string, got {b[key]!r}")
    return (b["master_address"], b["master_port"], b["rank_offset"], b["world_size"],
            b.get("group_name", "weight_update_group"), b.get("backend", "nccl"))


def serve(model_path: str, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32",
          api_key: str | None = None, seed: int = 0, max_running_requests: int = 64,
          max_total_tokens: int = 1 << 18,
          return_routed_experts: bool = False, sampling_mask_max_tokens: int = 4096,
          sampling_backend: str = "flashinfer", deterministic_inference: bool = False,
          prefix_cache_tokens: int = 1 << 16, quantization: str = "none",
          fp32_lm_head: bool = False, fd: int | None = None, limits: Limits = Limits(),
          weight_group_timeout_s: float = 120.0) -> None:
    """Load the model and serve until interrupted (on the inherited bound socket ``fd`` when
    given, else on host:port)."""
    import uvicorn
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host} without --api-key: anyone who reaches the port can "
              f"generate, replace the weights and join the weight-update group",
              file=sys.stderr)
    try:
        engine = ReferenceEngine(model_path, dtype=dtype, seed=seed,
                                 group_timeout_s=weight_group_timeout_s,
                                 sampling_mask_max_tokens=sampling_mask_max_tokens,
                                 return_routed_experts=return_routed_experts,
                                 sampling_backend=sampling_backend,
                                 deterministic_inference=deterministic_inference,
                                 prefix_cache_tokens=prefix_cache_tokens,
                                 quantization=quantization, fp32_lm_head=fp32_lm_head)
    except ValueError as exc:   # the model or a flag refused: one line (moe-rl's UserError)
        raise UserError(str(exc)) from None
    app = build_app(engine, api_key, max_running_requests, max_total_tokens, limits)
    if fd is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
    else:
        sock = socket.socket(fileno=fd)   # family and type read from the descriptor
    address, bound_port = sock.getsockname()[:2]
    shown = f"[{address}]" if sock.family == socket.AF_INET6 else address
    print(f"listening on http://{shown}:{bound_port}", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
