"""The engine contract (moe_rl.engines.base), run against every engine this machine can start:
the CPU reference engine always, SGLang where it is installed and a GPU is present. Each
implementation is started through the factory the run uses (its command line, its server
process, ``connect``), and judged on what the rollout and the weight sync rely on."""
import asyncio
import dataclasses
import importlib.util
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moe_rl.config import ModelInitConfig, config_from_dict
from moe_rl.engines.base import Engine, EngineSession, SamplingConfig
from moe_rl.engines.factory import engine_kind
from moe_rl.engines.sglang.pool import ServerPool
from moe_rl.engines.sglang.weights import broadcast_tensors, close_group, open_group
from moe_rl.models.tiny import write_tiny_model
from moe_rl.families.shape import MoEShape
from moe_rl.rollout.trajectories import generate_samples
from moe_rl.trainer.parallel import free_port
from tests.helpers import engine_base_port, sglang_cpu_python

pytestmark = pytest.mark.xdist_group("engine_contract")   # its fixture made once


def _available() -> list:
    """The reference engine; real SGLang on CPU (``make test-sglang``: its environment from
    ``moe-rl sglang-cpu-env``); SGLang on GPUs where it is installed and a GPU is present."""
    kinds = ["reference", pytest.param("sglang-cpu", marks=pytest.mark.sglang)]
    if importlib.util.find_spec("sglang") and shutil.which("nvidia-smi"):
        kinds.append("sglang")
    return kinds


SAMPLING = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=4)


class Started:
    """An engine of two servers, started as a run starts them."""

    def __init__(self, kind: str, model: str, logs):
        gpus = 1 if kind == "sglang" else 0
        engine = {"engine": kind.removesuffix("-cpu"), "num_servers": 2, "sampling": {"top_k": 8},
                  "return_routing": True}
        if kind == "sglang-cpu":
            engine["sglang"] = {"device": "cpu", "python": sglang_cpu_python()}
        self.kind = kind
        # seeded sampling: SGLang honours sampling_seed only in deterministic inference, which
        # no CPU attention backend supports
        self.seeded = kind != "sglang-cpu"
        self.cfg = config_from_dict({
            "model": {"path": model}, "cluster": {"gpus_per_node": gpus},
            "rollout": engine, "algorithm": {"replay": "r3", "keep_sampling_mask": True}})
        engine_type = engine_kind(self.cfg)
        procs = []
        for i in range(2):
            argv, env = engine_type.server_command("127.0.0.1", engine_base_port(),
                                                   [0] if gpus else [], i, model)
            port = int(argv[argv.index("--port") + 1])
            procs.append(engine_type.server_process(argv, env, "127.0.0.1", port,
                                                    str(logs / f"server{i}.log")))
        try:
            with ThreadPoolExecutor(len(procs)) as pool:   # side by side, as a run starts them
                self.procs = list(pool.map(lambda p: p.start(300), procs))
        except Exception:
            for p in procs:
                p.stop()
            raise
        shape = MoEShape.from_hf(json.loads(open(f"{model}/config.json").read()))
        self.engine: Engine = engine_type.connect([p.url for p in self.procs], shape,
                                                  [p.restart for p in self.procs])

    def stop(self):
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module", params=_available())
def started(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"contract_{request.param}")
    write_tiny_model(ModelInitConfig(seed=1), str(base / "a"))   # with its tokenizer, as SGLang's
    write_tiny_model(ModelInitConfig(seed=2), str(base / "b"))   # warm-up needs one
    eng = Started(request.param, str(base / "a"), base)
    eng.models = base
    yield eng
    eng.stop()


def test_a_turn_carries_what_the_rollout_needs(started):
    eng = started.engine
    assert eng.need_routing and eng.need_mask
    prompt = [5, 6, 7, 8]

    async def turn(session: EngineSession):
        assert session.num_servers == 2
        return await session.generate_turn(prompt, SAMPLING, seed=4)
    t = eng.run(turn)
    R = len(t.output_ids)
    assert 1 <= R <= SAMPLING.max_new_tokens and t.logprobs.shape == (R,)
    assert (t.logprobs <= 0).all() and torch.isfinite(t.logprobs).all()
    # routing of every position the model ran: the prompt and every generated token but the last
    moe_shape = eng.moe_shape
    assert t.routing.shape == (len(prompt) + R - 1, len(moe_shape.moe_layers), moe_shape.topk)
    # kept sets: the sampled token is in its set, at most top_k ids, log-mass <= 0
    assert t.kept_offsets.shape == (R + 1,) and int(t.kept_offsets[-1]) == t.kept_ids.numel()
    for j, y in enumerate(t.output_ids):
        kept = t.kept_ids[int(t.kept_offsets[j]):int(t.kept_offsets[j + 1])].tolist()
        assert y in kept and len(kept) <= SAMPLING.top_k
    assert (t.kept_logmass <= 0).all()
    assert isinstance(t.weight_version, int) and isinstance(t.finish_reason, dict)
    if started.seeded:   # the same seed draws the same turn (a prefix-cache hit: last bits)
        again = eng.run(turn)
        assert again.output_ids == t.output_ids
        assert torch.allclose(again.logprobs, t.logprobs, atol=1e-5)


def test_pinned_turns_share_their_servers_prefix_and_routing_can_be_fetched_again(started):
    eng = started.engine
    prompt = [9, 10, 11, 12, 13, 14]
    eng.flush_cache()

    async def two_turns(session: EngineSession):
        first = await session.generate_turn(prompt, SAMPLING, seed=1, routing_from=0, server=1)
        ids = prompt + first.output_ids
        received = first.routing.shape[0]
        second = await session.generate_turn(ids, SAMPLING, seed=2, routing_from=received,
                                             server=1)
        whole = ids + second.output_ids
        fetched = await session.routing(whole, 0, server=1)
        return first, second, fetched
    first, second, fetched = eng.run(two_turns)
    assert second.cached_tokens >= len(prompt)     # the same server kept the first turn's prefix
    n_ids = len(prompt) + len(first.output_ids) + len(second.output_ids)
    assert second.routing.shape[0] == n_ids - 1 - first.routing.shape[0]   # only new rows
    assert torch.equal(fetched, torch.cat([first.routing, second.routing]))
    eng.flush_cache()

    async def cold(session: EngineSession):
        return await session.generate_turn(prompt, SAMPLING, seed=1, server=1)
    assert eng.run(cold).cached_tokens == 0        # the flush dropped the prefix


def test_a_flush_asked_while_requests_run_waits_for_them(started):
    """A flush while a batch still runs on every server: the server waits for it to finish and
    then flushes (SGLang's ``timeout`` query), instead of refusing with HTTP 400; the batch
    comes back whole."""
    procs = started.procs
    n, length = (16, 32) if started.kind.startswith("sglang") else (64, 64)   # ~1-2 s each
    body = {"input_ids": [[5 + i % 7, 6, 7, 8] for i in range(n)],
            "sampling_params": {"max_new_tokens": length, "temperature": 1.0, "ignore_eos": True}}
    answers: list = []

    async def batches():
        async with ServerPool([p.url for p in procs], max_retries=0) as pool:
            answers.extend(await pool.broadcast("/generate", body))
    running = threading.Thread(target=lambda: asyncio.run(batches()))
    running.start()
    time.sleep(0.2)
    assert running.is_alive(), "the batch ended before the flush was asked: make it longer"
    started.engine.flush_cache()
    running.join()
    assert len(answers) == 2 and all(len(o["output_ids"]) == length for a in answers for o in a)


def test_an_abort_returns_what_each_request_generated_and_a_continuation_finishes_it(started):
    """Partial rollouts' engine side (SGLang's /abort_request with abort_all): requests in flight
    answer at once with the tokens they generated, each with its log-prob, kept set and the
    routing of every position it ran; a request sent after the abort is not touched; the
    prefix sent again continues to the cap."""
    eng = started.engine
    long = SamplingConfig(temperature=1.0, top_k=8, max_new_tokens=200)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    async def interrupted(session: EngineSession):
        jobs = [asyncio.ensure_future(session.generate_turn(p, long, seed=i, server=i))
                for i, p in enumerate(prompts)]
        await asyncio.sleep(0.2)   # some tokens generated, far from the cap
        while not all(j.done() for j in jobs):
            await session.abort_all()
            await asyncio.wait(jobs, timeout=0.2)
        after = await session.generate_turn(prompts[0], SAMPLING, seed=9)
        return [j.result() for j in jobs], after
    turns, after = eng.run(interrupted)
    assert not after.aborted and len(after.output_ids) >= 1   # the abort did not outlive itself
    assert any(t.aborted and t.output_ids for t in turns), [t.finish_reason for t in turns]
    moe_shape = eng.moe_shape
    for prompt, t in zip(prompts, turns):
        R = len(t.output_ids)
        assert R < long.max_new_tokens or not t.aborted
        if not R:
            continue
        assert t.logprobs.shape == (R,) and (t.logprobs <= 0).all()
        assert t.routing.shape == (len(prompt) + R - 1, len(moe_shape.moe_layers), moe_shape.topk)
        assert t.kept_offsets.shape == (R + 1,) and t.token_versions is None
    prompt, t = next((p, t) for p, t in zip(prompts, turns) if t.aborted and t.output_ids)
    prefix = prompt + t.output_ids
    rest = dataclasses.replace(long, max_new_tokens=long.max_new_tokens - len(t.output_ids))

    async def continued(session: EngineSession):
        return await session.generate_turn(prefix, rest, seed=11)
    more = eng.run(continued)
    assert not more.aborted and len(t.output_ids) + len(more.output_ids) <= long.max_new_tokens
    assert more.routing.shape[0] == len(prefix) + len(more.output_ids) - 1


def test_scoring_passes_give_the_rollout_distribution(started):
    eng = started.engine
    samples = generate_samples(eng, [[5, 6, 7], [8, 9]], 2, SAMPLING, seed=3)
    eng.score(samples, 3, temperature=1.0, window=2)
    for s in samples:
        assert s.pass_logprobs.shape == (3, s.response_len)
        # a float32 engine scores on the kept set what it sampled from (split-KV last bits)
        assert torch.allclose(s.pass_logprobs, s.rollout_logprobs.expand(3, -1), atol=1e-4)


def _comparable(started) -> SamplingConfig:
    """Sampling whose turns two runs can compare: seeded, or greedy where seeds are ignored."""
    return SAMPLING if started.seeded else SamplingConfig(temperature=0.0, top_k=8,
                                                          max_new_tokens=8)


def test_check_model_finds_each_server_aligned_with_transformers(started, capsys):
    """`moe-rl check-model` against both servers (before any weight update: they serve model
    a): their routing and scoring agree with transformers and the trainer."""
    from moe_rl.cli import main
    urls = [p.url for p in started.procs]
    code = main(["check-model", str(started.models / "a"), "--max-prompts", "2",
                 *[x for url in urls for x in ("--engine", url)]])
    out = capsys.readouterr().out
    assert code == 0, out
    assert all(f"engine at {url}" in out for url in urls)
    assert out.splitlines()[-1].startswith("aligned: routing agreement >= 1.0000"), out


def test_weights_from_disk_and_from_a_group_land_everywhere(started):
    eng, w = started.engine, started.engine.weights
    b = str(started.models / "b")
    prompt = [[6, 7, 20, 12, 30]]
    sampling = _comparable(started)
    before = generate_samples(eng, prompt, 1, sampling, seed=5)[0]
    w.load_from_disk(b, 3)
    assert eng.weight_versions() == ["3", "3"]
    on_b = generate_samples(eng, prompt, 1, sampling, seed=5)[0]
    assert on_b.response_ids.tolist() != before.response_ids.tolist()
    # back to a's weights through the group: the trainer broadcasts, the receiver announces
    from safetensors.torch import load_file
    named = sorted(load_file(str(started.models / "a" / "model.safetensors")).items())
    port, joined = free_port(), {}
    world = 1 + 2 * w.ranks_per_server
    backend = "nccl" if started.cfg.cluster.gpus_per_node else "gloo"
    t = threading.Thread(target=lambda: joined.update(
        group=open_group(backend, "127.0.0.1", port, 0, world, "contract_w")))
    t.start()
    w.join_group("127.0.0.1", port, "contract_w", backend)
    t.join(120)
    try:
        w.begin()
        sender = threading.Thread(target=broadcast_tensors, args=(joined["group"], named))
        sender.start()
        w.announce_bucket(named, 4, "contract_w", last=True)
        sender.join(120)
        w.end()
        assert eng.weight_versions() == ["4", "4"]
        back = generate_samples(eng, prompt, 1, sampling, seed=5)[0]
        assert back.response_ids.tolist() == before.response_ids.tolist()
        assert torch.allclose(back.rollout_logprobs, before.rollout_logprobs, atol=1e-5)
        w.end(missing_ok=True)   # no session open: tolerated when asked
    finally:
        if "group" in joined:
            close_group(joined["group"])


def test_memory_release_and_resume_keep_the_weights(started):
    eng = started.engine
    prompt = [[6, 7, 20]]
    want = generate_samples(eng, prompt, 1, _comparable(started), seed=2)[0]
    eng.release_memory()
    eng.resume_memory()
    got = generate_samples(eng, prompt, 1, _comparable(started), seed=2)[0]
    assert got.response_ids.tolist() == want.response_ids.tolist()


def test_a_slow_batch_outlasting_the_timeout_is_waited_for(started):
    """A batch that takes longer than the pool's timeout on a healthy server: the pool asks
    /health, waits, and gets every answer; no server is restarted (SGLang's non-streaming
    /generate sends nothing until it is done)."""
    procs = started.procs
    restarts = [p.restarts for p in procs]
    body = {"input_ids": [[5 + i % 7, 6, 7, 8] for i in range(128)],
            "sampling_params": {"max_new_tokens": 56, "temperature": 1.0, "ignore_eos": True}}

    async def run():   # 7168 tokens: well past 0.5 s here; a CPU-bound server's /health is late
        async with ServerPool([p.url for p in procs], timeout=0.5, max_retries=0,
                              health_timeout=60,
                              restarters=[p.restart for p in procs]) as pool:
            out = await pool.request("/generate", body, server=pool.servers[0])
            return out, pool
    out, pool = asyncio.run(run())
    assert len(out) == 128 and all(len(o["output_ids"]) == 56 for o in out)
    assert pool.health_probes >= 1, "the batch ended within the timeout: make it longer"
    assert pool.restarts == 0 and [p.restarts for p in procs] == restarts
    assert all(p.alive() for p in procs)


def test_a_server_killed_mid_rollout_loses_and_duplicates_nothing(started):
    """Server 0 is killed while a rollout runs: its requests go to server 1, the pool restarts
    it, and every (prompt, sample) comes back exactly once, in order."""
    proc, restarts = started.procs[0], started.procs[0].restarts
    done, killed = [], []

    def progress(n):
        done.append(n)
        if len(done) == 4:   # mid-rollout
            proc.proc.kill()
            killed.append(len(done))
    prompts = [[6, 7, 20 + i % 9, 12] for i in range(12)]
    samples = generate_samples(started.engine, prompts, 2, SAMPLING, seed=0, progress=progress)
    assert killed
    assert [s.sample_id for s in samples] == list(range(24))
    assert [s.prompt_ids.tolist() for s in samples] == [p for p in prompts for _ in range(2)]
    assert all(s.routing is not None and s.sampling_mask_ids is not None for s in samples)
    started.engine.check_health()
    assert proc.restarts == restarts + 1 and proc.alive()


def test_health_brings_a_dead_server_back(started):
    proc = started.procs[0]
    restarts = proc.restarts
    proc.proc.kill()
    proc.proc.wait()
    started.engine.check_health()
    assert proc.restarts == restarts + 1 and proc.alive()
    assert len(started.engine.weight_versions()) == 2
