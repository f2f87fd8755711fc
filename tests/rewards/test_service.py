"""Rewards beyond one Python call per sample: the HTTP reward service (against real servers on
127.0.0.1: slow, failing, garbage-answering), batched and async reward functions, and rewards
requested per group while the other groups still generate."""
from __future__ import annotations

import asyncio
import json
import math
import os
import textwrap
import threading
import time

import pytest
import torch

from moe_rl.config import ConfigError, RewardServiceConfig, load_config
from moe_rl.engines.base import SamplingConfig, Turn
from moe_rl.rewards.functions import RewardFunction, load_reward
from moe_rl.rewards.service import RewardService, reward_scorer
from moe_rl.rollout.trajectories import generate_samples
from tests.helpers import RewardServer


def items(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "response": "x" * i, "label": str(i), "metadata": {"i": i}}
            for i in range(n)]


def length_rewards(body, _call):
    """The reference service: reward = len(response) / 10."""
    return 200, json.dumps({"rewards": [len(s["response"]) / 10 for s in body["samples"]]}
                           ).encode()


@pytest.fixture
def serve():
    servers = []

    def start(behave):
        servers.append(RewardServer(behave))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def service(url: str, **kw) -> RewardService:
    return RewardService(RewardServiceConfig(url=url, **kw), backoff_s=0.01)


def test_the_protocol_batches_in_order_with_the_api_key(serve, monkeypatch):
    srv = serve(length_rewards)
    monkeypatch.setenv("MY_REWARD_KEY", "s3cret")
    svc = service(srv.url, batch_size=3, api_key_env="MY_REWARD_KEY")
    out = asyncio.run(svc.score(items(7)))
    assert out == [pytest.approx(i / 10) for i in range(7)]
    assert sorted(len(r["samples"]) for r in srv.requests) == [1, 3, 3]
    sent = sorted((s for r in srv.requests for s in r["samples"]), key=lambda s: s["prompt"])
    assert sent == items(7)   # each sample's prompt, response, label, metadata, as documented
    assert all(h["Authorization"] == "Bearer s3cret" for h in srv.headers)
    assert svc.errors == svc.timeouts == 0


def test_a_missing_api_key_variable_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match="data.reward_service.api_key_env: .*NOT_SET_ANYWHERE"):
        service("http://127.0.0.1:1/r", api_key_env="NOT_SET_ANYWHERE")


def test_5xx_is_retried_with_backoff_4xx_never(serve):
    flaky = serve(lambda body, call: (503, b"busy") if call <= 2 else length_rewards(body, call))
    svc = service(flaky.url, batch_size=8, max_retries=3)
    assert asyncio.run(svc.score(items(4))) == [pytest.approx(i / 10) for i in range(4)]
    assert len(flaky.requests) == 3 and svc.errors == 0          # two 503s, then the answer
    down = serve(lambda body, call: (500, b"always down"))
    svc = service(down.url, batch_size=8, max_retries=2)
    assert asyncio.run(svc.score(items(4))) == [0.0] * 4
    assert len(down.requests) == 3 and svc.errors == 4 and "HTTP 500" in svc.first_error
    refused = serve(lambda body, call: (400, b'{"error": "bad sample"}'))
    svc = service(refused.url, max_retries=5)
    assert asyncio.run(svc.score(items(3))) == [0.0] * 3
    assert len(refused.requests) == 1 and svc.errors == 3 and "HTTP 400" in svc.first_error


def test_garbage_answers_score_zero_and_are_counted(serve):
    answers = {1: b"not json at all", 2: b'{"scores": [1, 2]}', 3: b'{"rewards": [1.0]}',
               4: b'{"rewards": [1.0, NaN, null, "x"]}'}
    srv = serve(lambda body, call: (200, answers[call]))
    svc = service(srv.url, batch_size=4, max_concurrency=1, max_retries=0)
    results = [asyncio.run(svc.score(items(4 if k == 4 else 2 if k < 3 else 2)))
               for k in range(1, 5)]
    assert results[0] == [0.0, 0.0] and results[1] == [0.0, 0.0] and results[2] == [0.0, 0.0]
    assert results[3] == [1.0, 0.0, 0.0, 0.0]
    assert svc.errors == 2 + 2 + 2 + 3 and "unreadable answer" in svc.first_error
    assert len(srv.requests) == 4   # garbage is not retried


def test_a_slow_service_times_out_and_its_samples_are_dropped(serve):
    srv = serve(lambda body, call: (time.sleep(10.0), length_rewards(body, call))[1])
    svc = service(srv.url, timeout_s=0.2, max_retries=1, batch_size=2)
    t0 = time.monotonic()
    assert asyncio.run(svc.score(items(2))) == [None, None]
    assert time.monotonic() - t0 < 5.0   # 2 tries of 0.2 s, not the service's 10 s
    assert svc.timeouts == 2 and svc.errors == 0 and "timed out" in svc.first_error
    assert len(srv.requests) == 2   # the first try and one retry


def test_an_unreachable_service_counts_errors_after_its_retries():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()   # nothing listens there
    svc = service(f"http://127.0.0.1:{port}/r", max_retries=2)
    assert asyncio.run(svc.score(items(3))) == [0.0] * 3
    assert svc.errors == 3 and "ConnectError" in svc.first_error


def test_max_concurrency_bounds_the_requests_in_flight(serve):
    active, peak, lock = [0], [0], threading.Lock()

    def slow(body, call):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.1)
        with lock:
            active[0] -= 1
        return length_rewards(body, call)
    srv = serve(slow)
    svc = service(srv.url, batch_size=1, max_concurrency=2)
    assert len(asyncio.run(svc.score(items(8)))) == 8
    assert peak[0] == 2 and len(srv.requests) == 8


def test_reward_service_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="data.reward_service.url: expected an http"):
        load_config("tiny_cpu.yaml", ["data.reward_service.url=localhost:9"])
    with pytest.raises(ConfigError, match="data.reward_service.url: with data.environment"):
        load_config("tiny_agentic_cpu.yaml", ["data.reward_service.url=http://127.0.0.1:9/r"])
    cfg = load_config("tiny_cpu.yaml", ["data.reward_service.url=http://127.0.0.1:9/r"])
    assert isinstance(reward_scorer(cfg.data), RewardService)
    assert isinstance(reward_scorer(cfg.data, "toy"), RewardFunction)   # eval.reward wins


KINDS = """
import asyncio

def batched(samples):
    return [len(s["response"]) + (s["label"] == "1") for s in samples]

async def async_one(prompt, response, answer, metadata):
    await asyncio.sleep(0.01)
    return metadata["i"] * 2

async def async_batched(samples):
    return [0.5] * len(samples)

def batched_wrong_length(samples):
    return [1.0]

def batched_slow(samples):
    import time
    time.sleep(5)

async def async_slow(prompt, response, answer, metadata):
    await asyncio.sleep(5)

def two_args(a, b):
    return 0.0
"""


def test_batched_and_async_reward_functions(tmp_path, monkeypatch):
    (tmp_path / "kinds_rewards.py").write_text(textwrap.dedent(KINDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RewardFunction("kinds_rewards:batched")
    assert fn.batched and asyncio.run(fn.score(items(3))) == [0.0, 2.0, 2.0]
    fn = RewardFunction("kinds_rewards:async_one")
    assert not fn.batched and fn.is_async
    assert asyncio.run(fn.score(items(3))) == [0.0, 2.0, 4.0]
    assert asyncio.run(RewardFunction("kinds_rewards:async_batched").score(items(2))) == [0.5] * 2
    fn = RewardFunction("kinds_rewards:batched_wrong_length")
    assert asyncio.run(fn.score(items(3))) == [0.0] * 3 and fn.errors == 3
    assert "expected a list of 3 numbers" in fn.first_error
    for slow in ("batched_slow", "async_slow"):
        fn = RewardFunction(f"kinds_rewards:{slow}", timeout_s=0.2)
        assert asyncio.run(fn.score(items(2))) == [None, None] and fn.timeouts == 2
    with pytest.raises(ValueError, match=r"data.reward: .*two_args.* nor as reward\(samples"):
        load_reward("kinds_rewards:two_args")


class _Session:
    """An engine session whose turns for prompt p take ``delays[p]`` seconds."""

    def __init__(self, delays, log):
        self.delays, self.log = delays, log

    num_servers = 1

    async def generate_turn(self, input_ids, sampling, *, seed=None, routing_from=None,
                            server=None):
        await asyncio.sleep(self.delays[input_ids[0]])
        self.log.append(("generated", input_ids[0], time.monotonic()))
        return Turn([7, 1], torch.tensor([-0.5, -0.25]), None, None, None, None, 0,
                    {"type": "stop"}, 0)


class _Engine:
    def __init__(self, delays, log):
        self.delays, self.log = delays, log

    def run(self, fn):
        return asyncio.run(fn(_Session(self.delays, self.log)))


def test_a_group_is_scored_as_soon_as_it_is_generated():
    """Group 0 finishes fast, group 1 slowly: group 0's rewards are requested while group 1 is
    still generating, and the samples come back in prompt-major order."""
    log: list = []

    async def on_group(group):
        log.append(("scored", group[0].group_id, time.monotonic()))
        for s in group:
            s.reward = float(s.group_id)
        return group[:1] if group[0].group_id == 1 else group   # may drop samples
    samples = generate_samples(_Engine({0: 0.0, 1: 0.3}, log), [[0, 5], [1, 5]], 3,
                               SamplingConfig(), on_group=on_group)
    scored0 = next(t for kind, g, t in log if kind == "scored" and g == 0)
    last_generated = max(t for kind, g, t in log if kind == "generated")
    assert scored0 < last_generated - 0.2
    assert [(s.group_id, s.sample_id) for s in samples] == [(0, 0), (0, 1), (0, 2), (1, 3)]
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 1.0]
    assert not math.isnan(samples[0].rollout_logprobs.sum().item())


class _DripServer:
    """A service that sends its headers at once, then its answer one byte every ``every`` s (a
    socket read never waits long, so a per-read timeout never fires)."""

    def __init__(self, every: float):
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/reward"
        self.every, self.closed = every, False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        answer = b'{"rewards": [1.0, 1.0]}' + b" " * 1000
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(answer)).encode() + b"\r\n\r\n")
            for i in range(len(answer)):
                conn.sendall(answer[i:i + 1])
                time.sleep(self.every)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.closed = True
        self.sock.close()


def test_a_dripping_service_is_cut_off_at_its_timeout():
    """Headers at once, then a byte every 0.1 s: each read is quick, the request never ends.
    timeout_s bounds the request whole: 2 tries of 1 s, the samples dropped as timed out."""
    srv = _DripServer(every=0.1)
    try:
        svc = service(srv.url, timeout_s=1.0, max_retries=1, batch_size=2)
        t0 = time.monotonic()
        assert asyncio.run(svc.score(items(2))) == [None, None]
        assert time.monotonic() - t0 < 3.0   # 2 x 1 s + backoff, not ~100 s of dripping
        assert svc.timeouts == 2 and "no whole answer within 1 s" in svc.first_error
    finally:
        srv.close()


def test_hostile_answers_score_zero_and_are_counted(serve):
    """Numbers too large for a float, JSON nested past the parser's depth, strings and booleans
    where a number belongs: each such sample scores 0 and counts in reward/errors; the run's
    other samples keep their rewards."""
    answers = {1: b'{"rewards": [1' + b"0" * 400 + b', 0.5]}',
               2: b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
               3: b'{"rewards": ["0.5", true, 0.25, false]}'}
    srv = serve(lambda body, call: (200, answers[call]))
    svc = service(srv.url, batch_size=4, max_concurrency=1, max_retries=0)
    assert asyncio.run(svc.score(items(2))) == [0.0, 0.5]
    assert svc.errors == 1 and "too large for a float" in svc.first_error
    assert asyncio.run(svc.score(items(2))) == [0.0, 0.0]
    assert svc.errors == 3
    assert asyncio.run(svc.score(items(4))) == [0.0, 0.0, 0.25, 0.0]
    assert svc.errors == 6


def test_an_oversized_answer_is_refused_as_it_arrives(serve):
    """An answer past data.reward_service.max_answer_mb is refused (its samples score 0 and
    count) without being held whole."""
    big = b'{"rewards": [1.0], "pad": "' + b"x" * (3 << 20) + b'"}'
    srv = serve(lambda body, call: (200, big))
    svc = service(srv.url, max_answer_mb=1.0, max_retries=0)
    assert asyncio.run(svc.score(items(1))) == [0.0]
    assert svc.errors == 1 and "larger than 1 MB (data.reward_service.max_answer_mb)" in \
        svc.first_error
    ok = service(srv.url, max_answer_mb=8.0, max_retries=0)
    assert asyncio.run(ok.score(items(1))) == [1.0]


def test_extreme_finite_rewards_are_clipped_and_counted(tmp_path, monkeypatch):
    (tmp_path / "extreme_rewards.py").write_text(
        "def huge(prompt, response, answer, metadata):\n    return metadata['r']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RewardFunction("extreme_rewards:huge", abs_max=1e12)
    got = asyncio.run(fn.score([{"prompt": "", "response": "", "label": None,
                                 "metadata": {"r": r}} for r in (1.7e308, -1.7e308, 5.0, 10**400)]))
    assert got == [1e12, -1e12, 5.0, 0.0] and fn.clipped == 2 and fn.errors == 1


def test_a_rewards_value_is_read_within_its_timeout(tmp_path, monkeypatch):
    """The value a reward returns is turned into a number inside the bounded call: a
    ``__float__`` that blocks times out (it hung scoring), one that calls ``sys.exit`` is an
    error (it escaped), per sample and batched."""
    import time
    (tmp_path / "odd_values.py").write_text(
        "import sys, time\n"
        "class Slow:\n    def __float__(self):\n        time.sleep(30)\n        return 1.0\n"
        "class Exits:\n    def __float__(self):\n        sys.exit(3)\n"
        "def one(prompt, response, answer, metadata):\n"
        "    return {'slow': Slow(), 'exits': Exits(), 'ok': 2}[metadata['v']]\n"
        "def batch(samples):\n    return [Slow() if s['metadata']['v'] == 'slow' else 1.0\n"
        "            for s in samples]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    items = [{"prompt": "", "response": "", "label": None, "metadata": {"v": v}}
             for v in ("slow", "exits", "ok")]
    fn = RewardFunction("odd_values:one", timeout_s=1.0)
    start = time.monotonic()
    got = asyncio.run(fn.score(items))
    assert got == [None, 0.0, 2.0] and fn.timeouts == 1 and fn.errors == 1, fn.last_error
    batched = RewardFunction("odd_values:batch", timeout_s=1.0)
    batched.batched = True
    assert asyncio.run(batched.score(items)) == [None] * 3 and batched.timeouts == 3
    assert time.monotonic() - start < 10


def test_a_reward_that_closes_stdout_and_stderr_ends_nothing(tmp_path):
    """The process prints on after a reward closed ``sys.stdout`` and ``sys.stderr`` (its next
    line raised 'I/O operation on closed file' and the run died)."""
    import subprocess
    import sys
    (tmp_path / "closing.py").write_text(
        "import sys\ndef reward(prompt, response, answer, metadata):\n"
        "    sys.stdout.close()\n    sys.stderr.close()\n    return 1.0\n")
    script = (
        "import asyncio, sys\n"
        "from moe_rl.rewards.functions import RewardFunction\n"
        "fn = RewardFunction('closing:reward')\n"
        "got = asyncio.run(fn.score([{'prompt': '', 'response': '', 'label': None, "
        "'metadata': {}}]))\n"
        "print('scored', got, flush=True)\n"
        "print('and on stderr', file=sys.stderr, flush=True)\n")
    path = f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "scored [1.0]" in res.stdout and "and on stderr" in res.stderr
