"""Multi-turn, tool-using rollouts: the environment protocol and its checks, the calculator, the
reference engine's prefix cache (SGLang's semantics: cached KV reused, routing recorded with it
returned, cached_tokens, /flush_cache), token ids end to end, routing across turns with the cache
hit and flushed, and `moe-rl train` with an environment (the agentic demo config, the two-turn
zero-mismatch invariant, a failing environment)."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.data.prompts import PromptRecord
from moe_rl.envs import EnvError, EnvStep, check_step, demonstration_segments, load_environment
from moe_rl.envs.calculator import CalculatorEnv, _evaluate
from moe_rl.families.shape import MoEShape
from moe_rl.engines.sglang.decode import ResponseError
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine, SGLangSession
from moe_rl.rollout.trajectories import (TrajectoryLimits, TrajectoryStats, rollout_trajectories,
                                       run_trajectory)
from moe_rl.engines.sglang.pool import ServerPool
from moe_rl.engines.reference.prefix_cache import PrefixCache
from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port
from tests.helpers import engine_base_port
from tests.helpers import TINY_QWEN, TwoTurnEnv, write_tiny_qwen

ROOT = pathlib.Path(__file__).resolve().parents[2]
AGENTIC = ROOT / "configs" / "tiny_agentic_cpu.yaml"
LAYERS, TOPK = TINY_QWEN["num_hidden_layers"], TINY_QWEN["num_experts_per_tok"]


# ---------------------------------------------------------------------- environment protocol

class _Tok:
    """A tokenizer stand-in: id i is the character chr(97 + i)."""
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 97 for c in text]}


def test_check_step_accepts_and_refuses():
    ok = check_step({"observation_ids": [3, 4], "done": False}, vocab_size=10)
    assert ok == EnvStep([3, 4], None, False, False)
    assert check_step(EnvStep(reward=1, done=True), 10).reward == 1.0
    for bad, msg in [({"observation_ids": [3, 10]}, "step.observation_ids: token ids must lie"),
                     ({"observation_ids": "ab"}, "step.observation_ids: expected a list"),
                     ({"reward": float("nan"), "done": True}, "step.reward: expected a finite"),
                     ({"done": True}, "step.reward: an episode that is done needs a reward"),
                     ({"done": 1}, "step.done: expected a boolean"),
                     ({"obs": [1]}, "step: unknown field(s) ['obs']"),
                     (None, "step: expected an EnvStep or a dict")]:
        with pytest.raises(EnvError, match=re.escape(msg)):
            check_step(bad, vocab_size=10)


def test_load_environment_names_the_key():
    assert load_environment("calculator") is CalculatorEnv
    assert load_environment("moe_rl.envs.calculator:CalculatorEnv") is CalculatorEnv
    for spec, msg in [("nope", "expected one of"), ("no_such_mod:Env", "cannot load"),
                      ("moe_rl.envs:EnvStep", "not an environment class")]:
        with pytest.raises(ValueError, match=f"data.environment: .*{msg}"):
            load_environment(spec)


def test_calculator_env():
    from moe_rl.models.tiny import build_tokenizer
    tok = build_tokenizer()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    assert [_evaluate(e) for e in ("12+29", "2*3+4", "10-2*3", "1+", "a")] == [41, 10, 4, None,
                                                                             None]
    rec = PromptRecord("12+29=", enc("12+29="), "41")
    env = CalculatorEnv(tok)
    env.reset(rec)
    assert env.stop_token_ids == tuple(enc("]"))
    call = env.step(enc("[12+29]"), {"type": "stop", "matched": enc("]")[0]})
    assert call == EnvStep(enc("(41)"), None, False, False)
    answer = env.step(enc("41") + [tok.eos_token_id], {"type": "stop"})
    assert answer.done and answer.reward == 1.0
    assert env.step(enc("40") + [tok.eos_token_id], {"type": "stop"}).reward == 0.2
    segs = demonstration_segments(env, rec, len(tok))
    assert segs == [enc("[12+29]"), enc("(41)"), enc("41") + [tok.eos_token_id]]


# ---------------------------------------------------------------------- prefix cache

def _kv(n, fill=0.0, layers=2):
    return [torch.full((2, n, 4), fill) for _ in range(layers)]


def test_prefix_cache_lookup_insert_evict():
    c = PrefixCache(capacity_tokens=10)
    c.insert([1, 2, 3, 4], _kv(4, 1.0), _kv(4, 1.0), torch.full((4, 1, 2), 1))
    assert c.match([9, 9]) is None
    hit = c.match([1, 2, 3, 4])           # the last input token is always computed
    assert hit.length == 3 and hit.layers()[0][0].shape == (1, 2, 3, 4)
    assert c.match([1, 2, 7, 8]).length == 2
    # radix semantics: the stored prefix keeps its KV and routing, the tail is the new one
    c.insert([1, 2, 3, 4, 5, 6], _kv(6, 2.0), _kv(6, 2.0), torch.full((6, 1, 2), 2))
    assert len(c.entries) == 1           # the shorter entry was absorbed
    e = c.entries[0]
    assert e.keys[0][:, :4].eq(1.0).all() and e.keys[0][:, 4:].eq(2.0).all()
    assert e.routing[:4].eq(1).all() and e.routing[4:].eq(2).all()
    c.insert([7, 7, 7, 7, 7], _kv(5), _kv(5), torch.zeros(5, 1, 2))   # 11 > 10: LRU evicted
    assert [len(x.ids) for x in c.entries] == [5]
    c.flush()
    assert c.entries == [] and c.tokens == 0
    off = PrefixCache(0)
    off.insert([1, 2], _kv(2), _kv(2), torch.zeros(2, 1, 2))
    assert off.entries == []


def _req(ids, n=4, start=0, seed=1, **kw):
    return Request(input_ids=ids, params=SamplingParams(max_new_tokens=n, sampling_seed=seed),
                   rid="r", return_logprob=True, return_routed_experts=True,
                   routed_experts_start_len=start, **kw)


def _routing(resp, rows):
    raw = base64.b64decode(resp["meta_info"]["routed_experts"])
    return np.frombuffer(raw, "<i4").reshape(rows, LAYERS, TOPK)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi_turn") / "model"
    write_tiny_qwen(path)
    return path


def test_engine_prefix_cache_reuses_kv_and_its_recorded_routing(tiny_model):
    eng = ReferenceEngine(str(tiny_model))
    cold = ReferenceEngine(str(tiny_model), prefix_cache_tokens=0)
    first = eng.run([_req([1, 2, 3, 4, 5])])[0]
    assert first["meta_info"]["cached_tokens"] == 0
    ids = [1, 2, 3, 4, 5] + first["output_ids"] + [7, 8]
    # mark the stored routing: a hit must return the record, not a recomputation
    entry = eng.prefix_cache.entries[0]
    assert len(entry.ids) == 8 and entry.routing.shape[0] == 8
    real = entry.routing.clone()
    entry.routing = (entry.routing + 1) % TINY_QWEN["num_experts"]
    hit = eng.run([_req(ids, start=0)])[0]
    assert hit["meta_info"]["cached_tokens"] == 8
    n_rows = len(ids) + 4 - 1
    rows = _routing(hit, n_rows)
    marked = entry.routing[:8].numpy()
    assert (rows[:8][:, [0, 2]] == marked).all()          # layers 0 and 2 are MoE
    entry.routing = real
    miss = cold.run([_req(ids, start=0)])[0]
    assert miss["meta_info"]["cached_tokens"] == 0
    assert hit["output_ids"] == miss["output_ids"]
    lp = lambda r: torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]])  # noqa
    assert torch.allclose(lp(hit), lp(miss), atol=1e-5)
    assert (_routing(miss, n_rows)[8:] == rows[8:]).all()
    assert eng.flush_cache() and eng.prefix_cache.entries == []
    again = eng.run([_req(ids, start=0)])[0]
    assert again["meta_info"]["cached_tokens"] == 0
    eng.load(str(tiny_model))                              # a weight update empties it too
    assert eng.prefix_cache.entries == []


# ---------------------------------------------------------------------- trajectories over HTTP


class _Recording(ServerPool):
    """A pool that keeps every /generate request and response."""
    log: list = []

    async def request(self, path, body, **kw):
        resp = await super().request(path, body, **kw)
        self.log.append((body, resp))
        return resp


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = ReferenceServer(str(tiny_model), free_port(), return_routed_experts=True)
    proc.start(120)
    yield proc
    proc.stop()


def _engine(server, need_mask=False):
    shape = MoEShape.from_hf(json.loads((pathlib.Path(server.model) / "config.json")
                                        .read_text()))
    return SGLangEngine(lambda: _Recording([server.url]), shape, need_routing=True,
                        need_mask=need_mask)


@pytest.mark.parametrize("flush", [False, True], ids=["cache_hit", "flushed_between_turns"])
def test_routing_across_turns(server, tiny_model, flush):
    """Token ids end to end; each turn transfers only new routing rows; the recorded routing of
    every position is that of the KV the later tokens attended to (with the flush: the turn-2
    recomputation, fetched by the follow-up); it equals a from-scratch computation of the whole
    trajectory (float32, confident routers)."""
    _Recording.log, TwoTurnEnv.seen = [], []
    TwoTurnEnv.flush_url = server.url if flush else None
    eng = _engine(server, need_mask=True)
    rec = PromptRecord("", [5, 6, 7, 8], None)
    samples, stats = rollout_trajectories(
        eng, TwoTurnEnv, [rec], 1, SamplingConfig(top_k=8, max_new_tokens=4),
        TrajectoryLimits(4, 30), 48, group_ids=[0], seed=3)
    (s,) = samples
    t1, t2 = TwoTurnEnv.seen
    assert s.response_ids.tolist() == t1 + [10, 11, 12] + t2
    assert s.loss_mask.tolist() == [True] * len(t1) + [False] * 3 + [True] * len(t2)
    assert s.rollout_logprobs[len(t1):len(t1) + 3].eq(0).all()
    assert [s.kept_set(len(t1) + j).tolist() for j in range(3)] == [[10], [11], [12]]
    gens = [(b, r) for b, r in _Recording.log if b["sampling_params"].get("max_new_tokens")]
    (b1, r1), (b2, r2) = gens
    assert b1["input_ids"] == [5, 6, 7, 8] and b1["routed_experts_start_len"] == 0
    assert b2["input_ids"] == [5, 6, 7, 8] + t1 + [10, 11, 12]      # the ids, as generated
    assert b2["routed_experts_start_len"] == 4 + len(t1) - 1          # only new positions
    assert r2["meta_info"]["cached_tokens"] == (0 if flush else 4 + len(t1) - 1)
    assert stats.routing_refetches == int(flush) == s.metadata["routing_refetches"]
    assert stats.turns == 2 and stats.observation_tokens == 3 and stats.env_errors == 0
    cold = ReferenceEngine(str(tiny_model), prefix_cache_tokens=0)
    full = s.prompt_ids.tolist() + s.response_ids.tolist()
    ref = cold.run([Request(input_ids=full, params=SamplingParams(max_new_tokens=0), rid="x",
                            return_routed_experts=True)])[0]
    expect = _routing(ref, len(full) - 1)[:, [0, 2]]
    assert s.routing.shape[0] == len(full) - 1
    assert (s.routing.numpy() == expect).all()


def test_no_retokenisation(server):
    """A tokenizer whose decode -> encode round trip changes the trajectory's ids: the
    trajectory still carries exactly the engine's and the environment's ids."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {chr(97 + i): i for i in range(26)} | {"kl": 40}   # "k" = 10, "l" = 11
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("k", "l")]))
    tok.decoder = decoders.Fuse()
    assert tok.encode(tok.decode([10, 11, 12])).ids == [40, 12]
    _Recording.log, TwoTurnEnv.seen, TwoTurnEnv.flush_url = [], [], None
    samples, _ = rollout_trajectories(_engine(server), TwoTurnEnv, [PromptRecord("", [1, 2],
                                                                                  None)],
                                      2, SamplingConfig(max_new_tokens=3),
                                      TrajectoryLimits(2, 20), 48, group_ids=[0], seed=5)
    for s in samples:
        ids = s.response_ids.tolist()
        assert [10, 11, 12] == ids[s.loss_mask.tolist().index(False):][:3]
        assert tok.encode(tok.decode([i for i in ids if i < 26])).ids != \
            [i for i in ids if i < 26]   # a re-tokenising pipeline would have changed them
    outs = [r["output_ids"] for b, r in _Recording.log]
    assert sorted(map(tuple, TwoTurnEnv.seen)) == sorted(map(tuple, outs))


class _FakePool:
    servers = ["s"]

    def __init__(self, responses):
        self.responses = list(responses)

    async def request(self, path, body, server=None):
        return self.responses.pop(0)


def _resp(out, rows, cached=0):
    return {"output_ids": out, "meta_info": {
        "output_token_logprobs": [[-0.5, t, None] for t in out], "cached_tokens": cached,
        "weight_version": "0", "finish_reason": {"type": "stop"},
        "routed_experts": base64.b64encode(np.asarray(rows, "<i4").tobytes()).decode()}}


def _rows(n, value):
    """``n`` routing rows whose MoE layers (0 and 2) pick experts ``value``, ``value`` + 1, ...
    (a token's top-k are distinct ids, as SGLang's are)."""
    r = np.zeros((n, LAYERS, TOPK), np.int32)
    r[:, [0, 2]] = value + np.arange(TOPK)
    return r


def test_recomputed_positions_are_refetched_and_overlaps_checked(tiny_model):
    shape = MoEShape.from_hf(json.loads((tiny_model / "config.json").read_text()))
    eng = SGLangEngine(None, shape, need_routing=True, need_mask=False)
    rec = PromptRecord("", [1, 2, 3], None)
    # turn 1: 3 prompt + 2 out -> 4 rows (value 1); turn 2 on 3+2+3 = 8 ids, cached 0 < 4:
    # its 8+2-1-4 = 5 new rows (value 2); the follow-up returns all 9 rows from 0
    turn1, turn2 = _resp([4, 5], _rows(4, 1)), _resp([6, 7], _rows(5, 2), cached=0)
    good = _resp([], np.concatenate([_rows(4, 3), _rows(5, 2)]), cached=9)
    env = TwoTurnEnv()
    TwoTurnEnv.flush_url = None
    s = asyncio.run(run_trajectory(eng, SGLangSession(eng, _FakePool([turn1, turn2, good])), 0, env, rec,
                                   SamplingConfig(max_new_tokens=2), TrajectoryLimits(3, 20),
                                   None, 48, TrajectoryStats()))
    assert s.routing[:4, :, 0].eq(3).all() and s.routing[4:, :, 0].eq(2).all()   # recomputed
    bad = _resp([], np.concatenate([_rows(4, 3), _rows(5, 4)]), cached=0)
    with pytest.raises(ResponseError, match="received twice disagree"):
        asyncio.run(run_trajectory(eng, SGLangSession(eng, _FakePool([turn1, turn2, bad])), 0, TwoTurnEnv(), rec,
                                   SamplingConfig(max_new_tokens=2), TrajectoryLimits(3, 20),
                                   None, 48, TrajectoryStats()))


class _Endless:
    stop_token_ids = ()

    def __init__(self, tokenizer=None):
        pass

    def reset(self, prompt):
        pass

    def step(self, action_ids, finish_reason):
        return EnvStep(observation_ids=[9, 9])


def test_limits_truncate_on_a_model_turn(tiny_model):
    shape = MoEShape.from_hf(json.loads((tiny_model / "config.json").read_text()))
    eng = SGLangEngine(None, shape, need_routing=False, need_mask=False)
    rec = PromptRecord("", [1, 2, 3], None)
    turns = [_resp([4, 5], _rows(4, 1)) for _ in range(3)]
    stats = TrajectoryStats()
    s = asyncio.run(run_trajectory(eng, SGLangSession(eng, _FakePool(turns)), 0, _Endless(), rec,
                                   SamplingConfig(max_new_tokens=2), TrajectoryLimits(3, 50),
                                   None, 48, stats))
    assert s.response_ids.tolist() == [4, 5, 9, 9, 4, 5, 9, 9, 4, 5]   # ends on a model turn
    assert s.metadata["truncated"] and s.reward == 0.0 and s.metadata["turns"] == 3
    stats2 = TrajectoryStats()
    s = asyncio.run(run_trajectory(eng, SGLangSession(eng, _FakePool(turns)), 0, _Endless(), rec,
                                   SamplingConfig(max_new_tokens=2), TrajectoryLimits(9, 7),
                                   None, 48, stats2))
    assert s.response_ids.tolist() == [4, 5, 9, 9, 4, 5]   # 6 + 2 more would reach the cap 7
    assert stats.metrics()["rollout/truncated_frac"] == 1.0
    assert stats.metrics()["rollout/observation_token_frac"] == pytest.approx(4 / 10)
    assert stats.metrics()["rollout/turns_mean"] == 3.0


# ---------------------------------------------------------------------- configuration

def test_config_refusals(agentic_model):
    with pytest.raises(ConfigError, match="rollout.max_response_tokens: .* leaves no room"):
        load_config(str(AGENTIC), [f"model.path={agentic_model}",
                                   "rollout.max_response_tokens=64"])
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config(str(AGENTIC), ["rollout.max_turns=0"])


def _cli(*args, cwd, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def agentic_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("agentic") / "model"
    res = _cli("init-model", "--config", str(AGENTIC), "--out", str(out), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def test_environment_refusals_through_moe_rl_config(agentic_model, tmp_path):
    res = _cli("config", "--config", str(AGENTIC), f"model.path={agentic_model}",
               "data.environment=no_such_module:Env", cwd=tmp_path)
    assert res.returncode == 2 and "data.environment: cannot load" in res.stderr
    (tmp_path / "plain_env.py").write_text(
        "class Env:\n    def reset(self, p): pass\n    def step(self, a, f): pass\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    res = _cli("config", "--config", str(AGENTIC), f"model.path={agentic_model}",
               "data.environment=plain_env:Env", cwd=tmp_path, env=env)
    assert res.returncode == 2 and "trainer.warmup.steps: " in res.stderr
    assert "no demonstration(prompt)" in res.stderr


def _train(model, run_dir, *overrides, env=None, steps=2):
    res = _cli("train", "--config", str(AGENTIC), f"model.path={model}",
               f"logging.dir={run_dir}", f"trainer.steps={steps}", "trainer.checkpoint.export_hf=false",
               "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
               f"rollout.servers.base_port={engine_base_port()}", "logging.progress=false", *overrides,
               cwd=run_dir.parent, env=env)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    return res, rows


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`; CI: the agentic config with partial rollouts (R3 too)
def test_agentic_config_trains_with_r3(agentic_model, tmp_path):
    """The demo config through `moe-rl train`: warm start on the calculator's demonstrations,
    then RL steps with R3 on multi-turn trajectories."""
    res, rows = _train(agentic_model, tmp_path / "run", "trainer.warmup.steps=60")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warm start: 60 supervised steps" in res.stdout
    for m in rows:
        assert m["rollout/turns_mean"] > 1.0 and m["rollout/observation_token_frac"] > 0
        assert m["rollout/env_errors"] == 0.0 and 0.0 <= m["rollout/truncated_frac"] <= 1.0
        assert m["routing/agreement"] == 1.0 and m["mismatch/k3"] < 1e-6
    assert rows[0]["rollout/turns_mean"] > 1.3    # the warm start taught the call format


@pytest.mark.loop
def test_agentic_config_trains_with_partial_rollouts(agentic_model, tmp_path):
    """Partial rollouts on multi-turn trajectories through `moe-rl train` (R3, k = 1, old tokens
    masked rather than restarted, only each response's newest version in the loss): a turn the
    step's abort cut continues under the next weights, the environment given the whole turn;
    every segment compares with the trainer at its own version."""
    # k = 1: nothing launched ahead, so every continuation runs under the next version; one
    # group of 2 a step among 7 in flight: the abort finds trajectories mid-way
    res, rows = _train(agentic_model, tmp_path / "run", "trainer.warmup.steps=60",
                       "rollout.partial.enabled=true", "rollout.max_staleness=1",
                       "rollout.partial.stale=mask", "rollout.partial.mask_offpolicy=true",
                       "rollout.prompts_per_step=1", "rollout.n_samples_per_prompt=2",
                       "rollout.partial.extra_groups=6", "rollout.max_new_tokens=24",
                       "rollout.max_response_tokens=44", steps=5)
    assert res.returncode == 0, res.stderr[-3000:]
    assert max(m["rollout/turns_mean"] for m in rows) > 1.0
    assert sum(m["rollout/partial_aborted"] for m in rows) > 0
    assert max(m["rollout/partial_frac"] for m in rows) > 0.0
    for m in rows:
        assert m["rollout/env_errors"] == 0.0 and m["rollout/partial_dropped"] == 0.0
        if "mismatch/k3" in m:   # absent where the bound masked every token (surplus groups)
            assert m["routing/agreement"] == 1.0 and abs(m["mismatch/k3"]) < 1e-6, m
        if m["rollout/partial_frac"] > 0:   # the older segments are out of the loss
            assert m["rollout/partial_masked_tokens"] > 0
    assert sum("mismatch/k3" in m for m in rows) >= 2


TWO_TURN_ENV = '''
from moe_rl.envs import EnvStep

class TwoTurns:
    """One observation after the first model turn, done after the second."""
    stop_token_ids = ()

    def __init__(self, tokenizer):
        self.obs = tokenizer("(7)", add_special_tokens=False)["input_ids"]

    def reset(self, prompt):
        self.turns = 0

    def step(self, action_ids, finish_reason):
        self.turns += 1
        if self.turns == 1:
            return EnvStep(observation_ids=self.obs)
        return EnvStep(reward=float(len(action_ids) % 3), done=True)


class Broken(TwoTurns):
    def step(self, action_ids, finish_reason):
        return {"observation_ids": [10 ** 6]}


class FailsOrHangs(TwoTurns):
    """Of every three environments built, the first fails in its first step and the third
    never returns from it."""
    built = 0

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        FailsOrHangs.built += 1
        self.fails, self.hangs = FailsOrHangs.built % 3 == 1, FailsOrHangs.built % 3 == 0

    def step(self, action_ids, finish_reason):
        if self.fails:
            raise RuntimeError("tool crashed")
        if self.hangs:
            import threading
            threading.Event().wait()
        return super().step(action_ids, finish_reason)
'''


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("envs")
    (d / "two_turn_envs.py").write_text(TWO_TURN_ENV)
    return dict(os.environ, PYTHONPATH=f"{d}:{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.loop
# `make test-slow`; CI: the agentic partial run asserts the same invariant on multi-turn
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mask-engine_avg", "full-trainer"])
def test_two_turn_zero_mismatch_invariant(agentic_model, tmp_path, env_module, mode):
    """Float32 engine and trainer, two-turn trajectories: every mismatch metric ~0, nothing
    corrected away, routing agreement 1 with R3."""
    extra = ["rollout.sampling.top_k=6", "algorithm.keep_sampling_mask=true", "algorithm.pi_old="
             "engine_avg", "algorithm.pi_old_passes=2"] if mode.startswith("mask") else \
        ["algorithm.pi_old=trainer"]
    res, rows = _train(agentic_model, tmp_path / "run", "data.environment=two_turn_envs:TwoTurns",
                       "trainer.warmup.steps=0", "rollout.sampling.temperature=0.8",
                       "algorithm.corrections=[seq_mis,icepop]", *extra, env=env_module,
                       steps=1)
    assert res.returncode == 0, res.stderr[-3000:]
    (m,) = rows
    assert m["rollout/turns_mean"] == 2.0 and m["rollout/truncated_frac"] == 0.0
    assert m["rollout/observation_token_frac"] > 0
    assert m["mismatch/k3"] < 1e-6 and abs(m["mismatch/k1"]) < 1e-5
    assert m["mismatch/extreme_frac"] == 0.0 and m["routing/agreement"] == 1.0
    for corr in ("seq_mis", "icepop"):
        assert m[f"correction/{corr}/masked_token_frac"] == 0.0
    assert m["ratio/first_minibatch_max_dev"] < 1e-5


@pytest.mark.loop   # a real run (`moe-rl train`): make test-loop
def test_failing_and_hanging_environments_lose_their_trajectories_and_the_run_goes_on(
        agentic_model, tmp_path, env_module):
    """An environment that raises, and one whose step() never returns (past
    data.environment_timeout_s): each loses its trajectory, counted (rollout/env_errors,
    rollout/env_timeouts) and named in the log; the run ends normally."""
    res, rows = _train(agentic_model, tmp_path / "run",
                       "data.environment=two_turn_envs:FailsOrHangs",
                       "trainer.warmup.steps=0", "data.environment_timeout_s=2",
                       env=env_module)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(rows) == 2
    assert sum(m["rollout/env_errors"] for m in rows) > 0
    assert sum(m["rollout/env_timeouts"] for m in rows) > 0
    assert "trajectories dropped on environment errors or timeouts; first: step: " in res.stdout
    assert "RuntimeError: tool crashed" in res.stdout or \
        "did not return within 2 s (data.environment_timeout_s)" in res.stdout


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: a Python reward failing on every sample stops a run alike
def test_an_environment_failing_on_every_trajectory_stops_the_run(agentic_model, tmp_path,
                                                                  env_module):
    res, rows = _train(agentic_model, tmp_path / "broken",
                       "data.environment=two_turn_envs:Broken", "trainer.warmup.steps=0",
                       env=env_module)
    assert res.returncode != 0
    assert "data.environment: two_turn_envs:Broken failed on every trajectory" in res.stderr
    assert "step.observation_ids: token ids must lie in" in res.stderr


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), 10 ** 400, True, "1"])
def test_an_environment_reward_that_is_not_a_finite_number_is_an_env_error(reward):
    """An integer past float's range included (math.isfinite raised OverflowError on it)."""
    from moe_rl.envs import EnvError, check_step
    with pytest.raises(EnvError, match="step.reward: expected a finite number or None"):
        check_step({"observation_ids": [], "reward": reward, "done": True}, vocab_size=10)
