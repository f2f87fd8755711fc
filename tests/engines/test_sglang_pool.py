"""Two reference servers behind the pool; one is killed mid-rollout (multiproc)."""
import json
import os
import signal
import threading
import time

import pytest

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.families.shape import MoEShape
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine
from moe_rl.rollout.trajectories import generate_samples
from moe_rl.engines.sglang.pool import ServerPool
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
@pytest.mark.multiproc
def test_killed_server_loses_and_duplicates_nothing_and_restarts(tmp_path):
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=1), model)
    facts = MoEShape.from_hf(json.load(open(f"{model}/config.json")))
    layout = facts
    procs = [ReferenceServer(model, free_port(), log_path=str(tmp_path / f"s{i}.log")).start()
             for i in range(2)]
    try:
        engine = SGLangEngine(
            lambda: ServerPool([p.url for p in procs], restarters=[p.restart for p in procs],
                               max_retries=4, backoff=0.05, concurrency=4),
            layout, need_routing=True, need_mask=False)
        done = []
        killed = threading.Event()

        def progress(n):
            done.append(n)
            if len(done) == 6 and not killed.is_set():   # mid-rollout
                os.kill(procs[0].proc.pid, signal.SIGKILL)
                killed.set()

        prompts = [[6, 7, 68, 12 + (i % 10), 72] for i in range(24)]
        samples = generate_samples(engine, prompts, 2, SamplingConfig(max_new_tokens=24),
                                   seed=0, progress=progress)
        assert killed.is_set()
        # every (prompt, sample) exactly once, in order, each a valid record
        assert [s.sample_id for s in samples] == list(range(48))
        assert [s.group_id for s in samples] == [i // 2 for i in range(48)]
        for s, want in zip(samples, [p for p in prompts for _ in range(2)]):
            assert s.prompt_ids.tolist() == want and s.routing is not None
        # the dead server was restarted and answers again
        assert procs[0].restarts == 1 and procs[0].alive()
        engine.check_health()
    finally:
        for p in procs:
            p.stop()


@pytest.mark.multiproc
def test_requests_wait_for_the_restart_of_the_only_server(tmp_path):
    """One server, killed mid-rollout: the requests sent while it restarts wait for it instead
    of failing with "no live engine server"."""
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=2), model)
    layout = MoEShape.from_hf(json.load(open(f"{model}/config.json")))
    proc = ReferenceServer(model, free_port(), log_path=str(tmp_path / "s.log")).start()
    try:
        engine = SGLangEngine(lambda: ServerPool([proc.url], restarters=[proc.restart],
                                                 max_retries=3, backoff=0.05, concurrency=8),
                              layout, need_routing=False, need_mask=False)
        done = []

        def progress(n):
            done.append(n)
            if len(done) == 4:
                os.kill(proc.proc.pid, signal.SIGKILL)
        prompts = [[6, 7, 68, 12 + (i % 10), 72] for i in range(16)]
        samples = generate_samples(engine, prompts, 2, SamplingConfig(max_new_tokens=16),
                                   seed=0, progress=progress)
        assert [s.sample_id for s in samples] == list(range(32))
        assert proc.restarts == 1 and proc.alive()
    finally:
        proc.stop()


class _StubServer:
    """An HTTP server on 127.0.0.1 whose ``/generate`` answers after ``delay`` seconds (as
    SGLang's non-streaming generate: nothing until done) and whose ``/health`` answers at once,
    or never while ``hung``, or a byte every 0.1 s while ``dripping``."""

    def __init__(self, delay: float, port: int = 0):
        import http.server
        import time
        stub = self
        self.delay, self.hung, self.generated, self.status = delay, False, 0, 200
        self.dripping = False
        self.health_status = 200

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: bytes, status: int = 200):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                while stub.hung:
                    time.sleep(0.05)
                if stub.dripping:   # headers at once, then the body a byte at a time
                    self.send_response(200)
                    self.send_header("content-length", "600")
                    self.end_headers()
                    for _ in range(600):
                        if not stub.dripping:
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.1)
                self._reply(b"{}", stub.health_status)

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                time.sleep(stub.delay)
                stub.generated += 1
                self._reply(b'{"text": "done"}', stub.status)

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def _one_request(url: str, restarts: list, pinned: bool):
    import asyncio

    async def main():
        async with ServerPool([url], timeout=0.3, max_retries=2, backoff=0.01,
                              restarters=[lambda: restarts.append(1)]) as pool:
            server = pool.servers[0] if pinned else None
            return await pool.request("/generate", {"text": "x"}, server=server), pool
    return asyncio.run(main())


@pytest.mark.parametrize("pinned", [False, True])
def test_a_slow_healthy_server_is_waited_for_not_restarted(pinned):
    """A generation longer than the pool's timeout on a server whose /health answers: the answer
    arrives, the request ran once, and no restart killed the server with its in-flight work."""
    stub, restarts = _StubServer(delay=1.5), []
    try:
        out, pool = _one_request(stub.url, restarts, pinned)
        assert out == {"text": "done"} and stub.generated == 1
        assert restarts == [] and pool.servers[0].alive and pool.restarts == 0
    finally:
        stub.close()


def test_a_hung_server_is_restarted_and_the_request_sent_again():
    """A server that answers neither the request nor /health is taken for dead: restarted, and
    the pinned request is sent to it again."""
    stub, restarts = _StubServer(delay=1.0), []
    stub.hung = True

    def restart():
        restarts.append(1)
        stub.delay, stub.hung = 0.0, False
    try:
        import asyncio

        async def main():
            async with ServerPool([stub.url], timeout=0.3, max_retries=2, backoff=0.01,
                                  restarters=[restart]) as pool:
                return await pool.request("/generate", {}, server=pool.servers[0]), pool
        out, pool = asyncio.run(main())
        assert out == {"text": "done"} and restarts == [1] and pool.restarts == 1
    finally:
        stub.close()


def test_a_health_check_that_drips_is_bounded_whole_and_counts_as_failed():
    """A hung request on a server whose /health sends its headers and then a byte every 0.1 s
    (each read well inside the bound): the check is cut at health_timeout for the whole answer,
    the server taken for dead and restarted, the request sent again."""
    import asyncio
    import time
    stub, restarts = _StubServer(delay=30.0), []
    stub.dripping = True

    def restart():
        restarts.append(1)
        stub.delay, stub.dripping = 0.0, False
    try:
        async def main():
            async with ServerPool([stub.url], timeout=0.3, max_retries=2, backoff=0.01,
                                  restarters=[restart], health_timeout=0.5) as pool:
                t0 = time.monotonic()
                out = await pool.request("/generate", {}, server=pool.servers[0])
                return out, time.monotonic() - t0
        out, took = asyncio.run(main())
        assert out == {"text": "done"} and restarts == [1]
        assert took < 5.0, took   # 0.3 s silent + 0.5 s health + the resend; not 60 s of drip
    finally:
        stub.close()


@pytest.mark.parametrize("failure", ["http_500", "hung"])
def test_a_weight_announcement_is_never_sent_twice(failure):
    """A request whose effect may have started (a weight broadcast the server joins as a
    collective) fails at once, sent once, when its server fails (5xx) or stays silent past the
    weight-call bound; a resend would wait in the collective until the group's timeout. An
    ordinary request is retried."""
    import asyncio
    from moe_rl.engines.sglang.pool import EngineHTTPError
    stub = _StubServer(delay=0.0)
    if failure == "http_500":
        stub.status = 500
    else:
        stub.delay, stub.hung = 1.0, True

    async def main(resend):
        async with ServerPool([stub.url], timeout=0.3, max_retries=2, backoff=0.01,
                              weight_timeout=0.3,
                              restarters=[lambda: setattr(stub, "hung", False)]) as pool:
            with pytest.raises(EngineHTTPError) as info:
                await pool.request("/update_weights_from_distributed", {}, resend=resend,
                                   server=pool.servers[0])
            return str(info.value)
    try:
        msg = asyncio.run(main(resend=False))
        time.sleep(1.2 if failure == "hung" else 0.0)   # the hung request's handler finishes
        assert stub.generated == 1, msg
        if failure == "http_500":
            stub.generated = 0
            asyncio.run(main(resend=True))   # an ordinary request: 1 + max_retries sends
            assert stub.generated == 3
        else:
            assert "not sent again" in msg
    finally:
        stub.close()


def test_a_pool_without_a_restarter_retries_a_refused_connection():
    """The trainer's side of a weight sync has no restarter: a connection refused while its
    server is briefly away is tried again with backoff, as max_retries promises (it gave up at
    the first error), and the request lands once the server is back."""
    import asyncio
    from moe_rl.trainer.parallel import free_port
    port, started = free_port(), []
    threading.Timer(0.4, lambda: started.append(_StubServer(delay=0.0, port=port))).start()

    async def main():
        async with ServerPool([f"http://127.0.0.1:{port}"], timeout=5, max_retries=4,
                              backoff=0.2) as pool:
            return await pool.request("/generate", {}, server=pool.servers[0])
    try:
        assert asyncio.run(main()) == {"text": "done"}
        assert started and started[0].generated == 1
    finally:
        for stub in started:
            stub.close()


def test_a_weight_load_longer_than_the_timeout_is_not_judged_by_health():
    """SGLang's /health cannot answer while /update_weights_from_disk holds the update lock: a
    load longer than the pool's timeout on such a server completes, once, with no /health asked
    and no restart (one that killed the server mid-load would do so again on every retry)."""
    import asyncio
    stub, restarts = _StubServer(delay=1.5), []
    stub.hung = True   # /health answers only after the load
    try:
        async def main():
            async with ServerPool([stub.url], timeout=0.3, health_timeout=0.3, max_retries=2,
                                  backoff=0.01, restarters=[lambda: restarts.append(1)]) as pool:
                out = await pool.request("/update_weights_from_disk", {"model_path": "m"},
                                         server=pool.servers[0])
                return out, pool
        out, pool = asyncio.run(main())
        assert out == {"text": "done"} and stub.generated == 1
        assert restarts == [] and pool.restarts == 0 and pool.health_probes == 0
    finally:
        stub.hung = False
        stub.close()


def test_a_weight_call_is_bounded_by_the_weight_load_timeout():
    """A weight call still unanswered after ``weight_timeout`` fails, naming the key."""
    import asyncio
    from moe_rl.engines.sglang.pool import EngineHTTPError
    import time
    stub = _StubServer(delay=1.5)
    try:
        async def main():
            async with ServerPool([stub.url], timeout=0.1, weight_timeout=0.5,
                                  max_retries=0) as pool:
                await pool.request("/update_weights_from_disk", {}, server=pool.servers[0])
        with pytest.raises(EngineHTTPError, match="rollout.servers.weight_load_timeout_s"):
            asyncio.run(main())
        time.sleep(1.1)   # the stub's handler done before the next test (no thread left over)
    finally:
        stub.close()


@pytest.mark.parametrize("path", ["/init_weights_update_group", "/destroy_weights_update_group"])
def test_joining_or_leaving_the_group_is_bounded_by_a_requests_timeout(path):
    """A server stuck in the group's rendezvous (it never answers) holds the sync for a
    request's timeout, not a weight load's hour (or SGLang's 30-minute group timeout)."""
    import asyncio
    import time
    from moe_rl.engines.sglang.pool import EngineHTTPError
    stub = _StubServer(delay=1.5)   # answers long after the bound (a weight load's would wait)
    try:
        async def main():
            async with ServerPool([stub.url], timeout=0.3, weight_timeout=3600.0,
                                  max_retries=0) as pool:
                await pool.request(path, {}, server=pool.servers[0], resend=False)
        start = time.monotonic()
        with pytest.raises(EngineHTTPError, match=r"no answer in 0.3 s "
                                                  r"\(rollout.servers.request_timeout_s\)"):
            asyncio.run(main())
        assert time.monotonic() - start < 1.5
        time.sleep(1.6)   # the stub's handler done before the next test (no thread left over)
    finally:
        stub.close()


def test_a_server_answering_health_with_503_is_restarted():
    """SGLang answers /health 503 while its scheduler is stuck (in the collective of a weight
    broadcast another server refused, until the group's timeout): the health check takes it for
    dead, restarts it and asks again (it failed the run after its retries)."""
    import asyncio
    stub, restarts = _StubServer(delay=0.0), []
    stub.health_status = 503

    def restart():
        restarts.append(1)
        stub.health_status = 200
    try:
        async def main():
            async with ServerPool([stub.url], timeout=1.0, max_retries=2, backoff=0.01,
                                  restarters=[restart]) as pool:
                return await pool.broadcast("/health", None, method="GET"), pool
        out, pool = asyncio.run(main())
        assert out == [{}] and restarts == [1] and pool.restarts == 1
    finally:
        stub.close()
