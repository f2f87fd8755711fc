"""Test helpers: a tiny random Qwen3-MoE written as a HF checkpoint and rollout samples scored by
transformers itself (log-probs and routing), as an engine would return them."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from moe_rl.envs import EnvStep
from moe_rl.rollout_record import Sample, compact_routing

TINY_QWEN = dict(vocab_size=48, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, intermediate_size=48,
                 moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                 max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)


def start_ranks(worker, args: tuple, nprocs: int) -> None:
    """``worker(rank, *args)`` in ``nprocs`` processes, joined (a rank's exception fails the
    caller), as torch.multiprocessing.spawn does, but each rank forked from one process per test
    process that imported megatron.core once (multiprocessing's forkserver, preloaded): a spawned
    rank imports it again, 4-9 s of CPU each on 2 cores. Each rank gets the caller's environment
    (a forkserver's children would otherwise inherit the environment it started with)."""
    import torch.multiprocessing as mp
    mp.get_context("forkserver").set_forkserver_preload(["megatron.core"])
    mp.start_processes(_rank_in_environment, args=(worker, dict(os.environ), args),
                       nprocs=nprocs, start_method="forkserver")


def _rank_in_environment(rank: int, worker, environ: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    measure_as(environ.get("MOE_RL_TEST_CONTEXT"))
    worker(rank, *args)


def measure_as(context: str | None) -> None:
    """Record this process's further lines under a test's id when coverage.py measures it
    (`make coverage`); nothing otherwise."""
    if context and "coverage" in sys.modules:
        import coverage
        running = coverage.Coverage.current()
        if running is not None:
            running.switch_context(context)


def engine_base_port() -> int:
    """A free port for ``rollout.servers.base_port``, below this machine's ephemeral port range (where
    ``bind(0)`` and outgoing connections never land) and above SGLang's own picks for its NCCL
    port (22000-29999): a server that binds its port itself (SGLang) leaves it unheld for its
    start-up, ~25 s here, and a port from ``free_port()`` was taken meanwhile (once, 2026-11-28:
    uvicorn's bind failed and the run waited out its health timeout)."""
    import random
    from moe_rl.engines.process import bind_port
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(30000, max(low - 8, 30001)), 64):
        try:
            bind_port("127.0.0.1", port).close()
            return port
        except OSError:
            continue
    raise RuntimeError("no free port between 30000 and the ephemeral range")

def sharpen(model) -> None:
    """Non-trivial norms (a mapping mix-up shows) and confident routers (no near-ties)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in n:
                p.mul_(20.0)


def sglang_cpu_python() -> str:
    """The interpreter of the SGLang CPU environment (``make test-sglang`` sets
    ``MOE_RL_SGLANG_PYTHON``); the test fails without one."""
    import os
    python = os.environ.get("MOE_RL_SGLANG_PYTHON")
    if not python:
        pytest.fail("MOE_RL_SGLANG_PYTHON is not set: the real-engine tests need the SGLang CPU "
                    "environment; run them with `make test-sglang`")
    return python


def write_tiny_qwen(path, seed: int = 0, **overrides):
    """Save a random tiny Qwen3-MoE (confident routers) to ``path``; returns the model."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN, **overrides})
    model = transformers.Qwen3MoeForCausalLM(cfg)
    sharpen(model)
    model.eval()
    model.save_pretrained(path)
    return model


def engine_samples(model, n_groups: int = 2, group_size: int = 2, seed: int = 0,
                   prompt_len: int = 4, max_resp: int = 5, noise: float = 0.0):
    """Samples with responses drawn from ``model``; rollout log-probs and routing recorded from
    a transformers forward (plus optional Gaussian ``noise`` on the log-probs, clamped <= 0)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    k = model.config.num_experts_per_tok
    # DeepSeek-V3's router (GLM-4.5's too): its biased, group-limited choice, read at the gates
    sigmoid_router = hasattr(model.config, "n_routed_experts")
    n_exp = model.config.n_routed_experts if sigmoid_router else model.config.num_experts
    samples = []
    sid = 0
    for grp in range(n_groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        for _ in range(group_size):
            r = int(torch.randint(2, max_resp + 1, (1,), generator=g))
            resp = torch.randint(0, vocab, (r,), generator=g)
            ids = torch.cat([prompt, resp])[None]
            with torch.no_grad():
                out = model(input_ids=ids, output_router_logits=True)
            logp = torch.log_softmax(out.logits.float()[0], -1)
            lp = logp[prompt_len - 1:-1].gather(1, resp[:, None]).squeeze(1)
            if noise:
                lp = (lp + noise * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
            if sigmoid_router:
                from tests.hf_models import hf_forward
                routing = hf_forward(model, ids[0])[1]
            else:
                routing = torch.stack([rl.topk(k, dim=-1).indices for rl in out.router_logits], 1)
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=lp,
                                  routing=compact_routing(routing[:-1], n_exp),
                                  reward=float(torch.rand((), generator=g)), group_id=grp,
                                  sample_id=sid))
            sid += 1
    return samples


def kernel_on_logits(logits, targets, offsets, ids, temperature=1.0):
    """The log-prob kernel on logits themselves (hidden = logits, output weight = identity)."""
    from moe_rl_kernels.logprob import logprob_entropy
    eye = torch.eye(logits.shape[1], dtype=logits.dtype)
    return logprob_entropy(logits, eye, targets, temperature=temperature, kept_offsets=offsets,
                           kept_ids=ids, backend="torch")


def assert_serves_like(eng, ref_url: str, layout, prompt: list[list[int]]):
    """``eng`` generates exactly what the server at ``ref_url`` generates for ``prompt`` (same
    seed): token ids and log-probs bit for bit. Returns (eng's sample, the reference's)."""
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.rollout.trajectories import generate_samples
    sampling = SamplingConfig(max_new_tokens=4)
    got = generate_samples(eng, prompt, 1, sampling, seed=3)[0]
    want = generate_samples(SGLangEngine(lambda: ServerPool([ref_url]), layout,
                                         need_routing=True, need_mask=False),
                            prompt, 1, sampling, seed=3)[0]
    assert got.response_ids.tolist() == want.response_ids.tolist()
    assert torch.equal(got.rollout_logprobs, want.rollout_logprobs)
    return got, want


def sample_from_response(resp: dict, prompt: list[int], layout, *, need_routing: bool,
                         need_mask: bool, group_id: int, sample_id: int):
    """One ``/generate`` response through the rollout's single-turn path: decoded into a turn
    (the SGLang client's decoder), then made a sample (the one-turn trajectory)."""
    from moe_rl.engines.sglang.decode import decode_turn
    from moe_rl.rollout.trajectories import sample_of_turn
    turn = decode_turn(resp, len(prompt), layout, need_routing=need_routing,
                       need_mask=need_mask)
    return sample_of_turn(prompt, turn, group_id=group_id, sample_id=sample_id)


ROOT = pathlib.Path(__file__).resolve().parents[1]


# the tiny GLM-4.5 of `moe-rl init-model`: tiny_cpu.yaml's shape with GLM's attention (biases,
# q/k norm, half the head rotary) and model.init.deepseek's router (4 groups, 2 per token, top-4)
GLM_INIT = ("model.init.architecture=glm4_moe", "model.init.num_experts_per_tok=4")
# the tiny gpt-oss: windows of 4 keys and YaRN from 8 positions, so that both act on the
# loop's short sequences
GPT_OSS_INIT = ("model.init.architecture=gpt_oss", "model.init.gpt_oss.sliding_window=4",
                "model.init.gpt_oss.yarn_original_max_position_embeddings=8")


def parse_python(source: str) -> ast.Module:
    """``ast.parse(source)``, tried again when CPython 3.11's shared AST recursion counter makes
    it fail spuriously (python/cpython#106905: another thread parsing at the same moment, e.g.
    one printing a traceback, whose carets 3.11 locates with ``ast``)."""
    for attempt in range(5):
        try:
            return ast.parse(source)
        except SystemError as err:
            if "recursion depth mismatch" not in str(err) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def setup_lists() -> dict:
    """install_requires and extras_require of setup.py, read without running it."""
    tree = parse_python((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords
            if k.arg in ("install_requires", "extras_require")}


def init_tiny_model(out, config="tiny_cpu.yaml", *overrides) -> pathlib.Path:
    """What `moe-rl init-model --config CONFIG --out OUT` writes, written in this process: a
    new process takes ~9 s of CPU to import what the model's writing needs, a test worker that
    wrote one before ~0.05 s. (``config``: a path or a shipped config's name; the command's own
    path is run by the session's ``trained_run``.)"""
    from moe_rl.config import load_config
    from moe_rl.models.tiny import write_tiny_model
    if isinstance(config, str) and config.endswith(".yaml") and "/" not in config:
        config = ROOT / "configs" / config
    write_tiny_model(load_config(str(config), list(overrides)).model.init, str(out))
    return pathlib.Path(out)


# metric names of wall-clock figures (phase times, throughput): they differ between two runs
# that are otherwise identical, and between a run and its resume
WALL_CLOCK = ("timing/", "throughput/")


def train_cli(workdir, steps, *extra, resume=False, config="tiny_cpu.yaml"):
    """`moe-rl train` of the tiny CPU config (or ``config`` of configs/) in ``workdir`` (model in workdir/model, run in
    workdir/run): SFT warm start, checkpoints every 2 steps; returns the finished process.
    ``rollout.servers.base_port`` is held busy by another socket all along: the engine must skip it."""
    from moe_rl.engines.process import bind_port
    from moe_rl.trainer.parallel import free_port
    with bind_port("127.0.0.1", free_port()) as busy:
        cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
               str(ROOT / "configs" / config), f"model.path={workdir / 'model'}",
               f"logging.dir={workdir / 'run'}", f"trainer.steps={steps}",
               "trainer.warmup.steps=2", "trainer.checkpoint.interval=2", "logging.progress=false",
               f"rollout.servers.base_port={busy.getsockname()[1]}", "rollout.prompts_per_step=4",
               "rollout.n_samples_per_prompt=4", *extra]
        if resume:
            cmd.append("--resume")
        res = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


class FakeTrainers:
    """Writes the trainer directory's shape: shards in dist/, one small file per rank."""
    def __init__(self, ranks=2, fail=False):
        self.ranks, self.fail = ranks, fail

    def save(self, path):
        os.makedirs(os.path.join(path, "dist"))
        for r in range(self.ranks):
            with open(os.path.join(path, "dist", f"__{r}_0.distcp"), "wb") as fh:
                fh.write(os.urandom(5000 + r))
            with open(os.path.join(path, f"rank{r}.pt"), "wb") as fh:
                fh.write(os.urandom(1000 + r))
        if self.fail:
            raise OSError(28, "No space left on device")


class RewardServer:
    """A reward service on 127.0.0.1 whose answer ``behave(body, call) -> (status, bytes)``
    the test chooses; it records every request body and its headers."""

    def __init__(self, behave):
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.headers.append(dict(self.headers))
                status, payload = behave(body, len(outer.requests))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # the client gave up first (the timeout a test asks for)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def train_tiny(tmp_path, steps: int, samples: int, *overrides, exit_code: int = 0):
    """`moe-rl train` of a fresh tiny model in ``tmp_path`` (its modules importable) with
    ``overrides``, ending with ``exit_code``; returns the finished process and the metrics
    rows."""
    import os
    import subprocess
    import sys
    init_tiny_model(str(tmp_path / "model"))
    res = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
         f"logging.dir={tmp_path / 'run'}", f"trainer.steps={steps}",
         "trainer.warmup.steps=0", "logging.progress=false",
         f"rollout.servers.base_port={engine_base_port()}", "rollout.prompts_per_step=4",
         f"rollout.n_samples_per_prompt={samples}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"))
    assert res.returncode == exit_code, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return res, rows


class TwoTurnEnv:
    """Answers the first turn with a fixed observation, ends after the second (reward 1);
    optionally flushes the server's prefix cache between the turns."""
    stop_token_ids = ()
    flush_url: str | None = None
    seen: list = []

    def __init__(self, tokenizer=None):
        self.turn = 0

    def reset(self, prompt):
        self.turn = 0

    def step(self, action_ids, finish_reason):
        self.seen.append(list(action_ids))
        self.turn += 1
        if self.turn == 1:
            if self.flush_url:
                httpx.post(self.flush_url + "/flush_cache").raise_for_status()
            return EnvStep(observation_ids=[10, 11, 12])
        return EnvStep(reward=1.0, done=True)


def fake_cuda_ipc(monkeypatch):
    """No GPU here: tensors count as CUDA ones and torch's CUDA reduction is replaced by one
    returning the argument layout torch gives a CUDA tensor (device index 0; each share its
    own reference-counter slot)."""
    import itertools
    import torch.multiprocessing.reductions as reductions
    import moe_rl.weights.serialize as ws
    slots = itertools.count()

    def reduce(t):
        return reductions.rebuild_cuda_tensor, (
            torch.Tensor, t.size(), t.stride(), 0, torch.UntypedStorage, t.dtype, 0,
            b"ipc-handle", t.numel() * t.element_size(), 0, False, b"ref-handle", next(slots),
            b"event-handle", True)
    monkeypatch.setattr(ws, "is_ipc_tensor", lambda t: True)
    monkeypatch.setattr(ws, "_torch_reduce_tensor", lambda: reduce)
    monkeypatch.setattr(ws, "_device_uuid", lambda i: f"GPU-uuid-{i}")


def on_sglang() -> tuple[str, ...]:
    """The overrides that put a run on the real SGLang on CPU."""
    return ("rollout.engine=sglang", "rollout.sglang.device=cpu",
            f"rollout.sglang.python={sglang_cpu_python()}")


# a reward module (written beside a run, on its PYTHONPATH): the toy reward, whose call number
# KILL_AT first SIGKILLs one engine server: the first process whose argv holds KILL_ARGV and the
# model path KILL_MATCH (SGLang's scheduler and detokenizer die with it: PR_SET_PDEATHSIG)
KILLER_REWARD = '''
import itertools, os, signal
from moe_rl.rewards.functions import toy_reward
_calls = itertools.count()


def score(prompt, response, answer, metadata):
    if next(_calls) == int(os.environ["KILL_AT"]):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
            except OSError:
                continue
            if (os.environ["KILL_ARGV"].encode() in argv
                    and os.environ["KILL_MATCH"].encode() in argv):
                os.kill(int(pid), signal.SIGKILL)
                break
    return toy_reward(prompt, response, answer, metadata)
'''


def token_draw(seed: int, spread: float, n: int = 64):
    """float64 per-token inputs of a policy loss: (lp requiring grad, lp_old, advantages), one
    row of ``n`` tokens; lp moves from lp_old by ``spread`` standard deviations in log space."""
    g = torch.Generator().manual_seed(seed)
    lp_old = torch.log(torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    lp = (lp_old + torch.randn(n, generator=g, dtype=torch.float64) * spread).clamp(max=-1e-3)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return lp.requires_grad_(), lp_old, adv


def random_sample(P=3, R=4, sid=0, group=0, seed=0, routing=True, mask=True, passes=0, vocab=20):
    """A sample of random ids with routes, kept sets and engine passes as asked."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    resp = torch.randint(0, vocab, (R,), generator=g)
    kw = {}
    if routing:
        kw["routing"] = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(
            (P + R - 1) * 2)]).reshape(P + R - 1, 2, 2).to(torch.uint8)
    if mask:
        sets = []
        for tok in resp.tolist():
            extra = torch.randperm(vocab, generator=g)[:3].tolist()
            sets.append(sorted(set(extra) | {tok}))
        off = [0]
        for s_ in sets:
            off.append(off[-1] + len(s_))
        kw["sampling_mask_offsets"] = torch.tensor(off)
        kw["sampling_mask_ids"] = torch.tensor([i for s_ in sets for i in s_], dtype=torch.int32)
    if passes:
        kw["pass_logprobs"] = -torch.rand(passes, R, generator=g)
    return Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=-torch.rand(R, generator=g),
                  loss_mask=torch.tensor([True] * (R - 1) + [False]), reward=0.5 * sid,
                  group_id=group, weight_version=3, sample_id=sid, metadata={"answer": "42"}, **kw)
