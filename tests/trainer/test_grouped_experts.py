"""The experts in grouped GEMMs (moe_rl/trainer/grouped_experts.py) against megatron-core's loop
over them: bit for bit on CPU, forward and backward (every parameter's gradient, the routers'
included), in float32 and bfloat16, for every family's expert form (SiLU GLU; gpt-oss's clamped
SwiGLU with expert biases, whose gradients are summed over the rows in another order: equal
within rounding), own routing and replayed routing, experts that get no token; the same
parameter names and checkpoint keys, so a checkpoint crosses between the paths."""
import pytest
import torch

from moe_rl.trainer.expert_path import choose_expert_path, model_expert_path
from moe_rl.trainer.grouped_experts import GroupedExperts, GroupedLinear, deposit_grads
from moe_rl.trainer.model_builder import build_model, load_hf_config
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.weights.hf import load_hf_into_megatron
from tests.trainer_runs import FAMILIES, logprobs_and_grads as _run, three_samples as _batch
from tests.trainer_runs import write_family as _write


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def _built(path, experts, dtype):
    model, spec = build_model(path, dtype=dtype, experts=experts)
    load_hf_into_megatron(model, spec, path)
    return model, spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_grouped_experts_equal_the_loop_bit_for_bit(tmp_path, kind, dtype):
    path = _write(kind, tmp_path)
    loop, spec = _built(path, "sequential", dtype)
    grouped, _ = _built(path, "grouped", dtype)
    assert loop.expert_path[0] == "sequential" and grouped.expert_path[0] == "grouped"
    assert any(isinstance(m, GroupedExperts) for m in grouped.modules())
    assert not any(isinstance(m, GroupedExperts) for m in loop.modules())
    # the same parameters under the same names: checkpoints, export and sync see no difference
    assert [n for n, _ in loop.named_parameters()] == [n for n, _ in grouped.named_parameters()]
    assert set(loop.sharded_state_dict()) == set(grouped.sharded_state_dict())
    # what the driver predicts from config.json is what the trainer built
    assert model_expert_path("auto", load_hf_config(path), 1, dtype)[0] == "grouped"
    mb = _batch(spec)
    want_lp, want = _run(loop, spec, mb)
    got_lp, got = _run(grouped, spec, mb)
    assert torch.equal(want_lp, got_lp)
    assert set(want) == set(got) and any(".local_experts." in n for n in got)
    for name in want:
        if ".local_experts." in name and name.endswith(".bias"):   # gpt-oss: summed over rows
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7       # in another order
            assert torch.allclose(want[name], got[name], rtol=tol, atol=tol), name
        else:
            assert torch.equal(want[name], got[name]), name


def test_replayed_routing_and_experts_without_tokens_are_equal_too(tmp_path):
    """Every token replayed onto experts 0 and 1 of 8: six experts get no token (their
    gradients exactly zero on both paths)."""
    path = _write("qwen3_moe", tmp_path)
    loop, spec = _built(path, "sequential", torch.float32)
    grouped, _ = _built(path, "grouped", torch.float32)
    mb = _batch(spec, seed=3, pinned=[0, 1])
    ids = mb.replay_indices()
    want_lp, want = _run(loop, spec, mb, ids)
    got_lp, got = _run(grouped, spec, mb, ids)
    assert torch.equal(want_lp, got_lp)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    idle = [n for n in got if ".local_experts.5." in n]
    assert idle and all(not got[n].any() for n in idle)


def test_the_grouped_linear_is_each_experts_matmul_and_its_gradients():
    """Float32 against an independent float64 per-expert loop (torch's grouped GEMM takes no
    float64), forward and both gradients, with an expert of no rows (its gradient zero)."""
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 4, 1]
    x64 = torch.randn(sum(counts), 8, generator=g, dtype=torch.float64, requires_grad=True)
    w64 = [torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
           for _ in counts]
    r = torch.randn(sum(counts), 12, generator=g, dtype=torch.float64)
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    ref = torch.cat([x64[a:b] @ w.T for w, a, b in zip(w64, bounds, bounds[1:])])
    (ref * r).sum().backward()
    x = x64.detach().float().requires_grad_()
    ws = [w.detach().float().requires_grad_() for w in w64]
    offs = torch.tensor(bounds[1:], dtype=torch.int32)
    y = GroupedLinear.apply(x, offs, ws)
    (y * r.float()).sum().backward()
    assert torch.allclose(y.double(), ref, atol=1e-5)
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-5)
    for w, w_ref in zip(ws, w64):
        assert torch.allclose(w.grad.double(), w_ref.grad, atol=1e-5)
    assert not ws[1].grad.any()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_under_megatron_ddp_the_main_grads_equal_the_loops(tmp_path, kind):
    """The trainer wraps the model in megatron's DDP (float32 gradient buffers): the grouped
    experts deposit their gradients straight into each expert's ``main_grad``, which must hold
    what DDP's per-parameter hook gives the loop's, over two micro-batches (accumulated), in
    bfloat16; no expert parameter keeps a ``.grad`` of its own."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    path = _write(kind, tmp_path)
    got = {}
    for experts in ("sequential", "grouped"):
        model, spec = _built(path, experts, torch.bfloat16)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True), model)
        ddp.zero_grad_buffer()
        for seed in (0, 1):
            _run(model, spec, _batch(spec, seed=seed))
        ddp.finish_grad_sync()
        got[experts] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        assert not any(p.grad is not None for n, p in model.named_parameters()
                       if ".local_experts." in n and experts == "grouped")
    want, have = got["sequential"], got["grouped"]
    assert set(want) == set(have) and any(".local_experts." in n for n in have)
    for name in want:
        if ".local_experts." in name and name.endswith(".bias"):   # summed in another order
            assert torch.allclose(want[name], have[name], rtol=2 ** -7, atol=2 ** -7), name
        else:
            assert torch.equal(want[name], have[name]), name
    assert any(have[n].any() for n in have if ".local_experts." in n)


def test_deposited_gradients_accumulate_like_autograds():
    """Into ``.grad`` without DDP: the first deposit sets it, the next adds (two micro-batches),
    a frozen parameter is left; into ``main_grad`` in its dtype where one exists."""
    w = [torch.zeros(2, 3, requires_grad=True) for _ in range(3)]
    w[2].requires_grad_(False)
    g = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3)
    deposit_grads(w, g.clone())   # a backward's gradient is its own tensor
    deposit_grads(w, g.clone())
    assert torch.equal(w[0].grad, 2 * g[0]) and torch.equal(w[1].grad, 2 * g[1])
    assert w[2].grad is None
    m = [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16)) for _ in range(2)]
    for p in m:
        p.main_grad = torch.ones(2, 3)
    deposit_grads(m, g[:2].bfloat16() / 7)
    for p, row in zip(m, g[:2]):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, 1 + (row / 7).bfloat16().float())


def test_a_deposit_costs_the_same_ops_for_any_number_of_experts():
    """Into bfloat16 parameters' float32 ``main_grad`` (the trainer's case): one conversion,
    one split, one foreach add, whatever the number of experts."""
    from benchmarks.trainer_ops import OpCounter

    def ops(experts: int) -> int:
        params = [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
                  for _ in range(experts)]
        for p in params:
            p.main_grad = torch.zeros(4, 4)
        grads = torch.ones(experts, 4, 4, dtype=torch.bfloat16)
        with OpCounter() as counter:
            deposit_grads(params, grads)
        assert all(p.main_grad.eq(1).all() for p in params)
        return counter.ops
    assert ops(8) == ops(128) <= 4


def test_the_path_is_chosen_from_sizes_and_refused_where_it_cannot_run():
    assert choose_expert_path("auto", 64, 64, torch.bfloat16)[0] == "grouped"
    assert choose_expert_path("sequential", 64, 64, torch.bfloat16)[0] == "sequential"
    path, why = choose_expert_path("auto", 64, 20, torch.bfloat16)   # 40-byte rows
    assert path == "sequential" and "expert width 20 is not a multiple of 8" in why
    assert choose_expert_path("auto", 64, 20, torch.float32)[0] == "grouped"   # 80-byte rows
    with pytest.raises(ValueError, match="trainer.experts: grouped cannot run here: the hidden "
                                         "size 36"):
        choose_expert_path("grouped", 36, 64, torch.bfloat16)


def test_with_transformer_engine_auto_builds_te_grouped_experts(tmp_path, monkeypatch):
    """Where TE and CUDA are (only a GPU shows it; here the decision and the configuration it
    hands megatron's TE spec): ``auto`` and ``te_grouped`` set ``moe_grouped_gemm`` (megatron
    then builds TEGroupedMLP) and the fused permutation where TE has it, never the router
    fusion (it skips routing replay); without TE, ``te_grouped`` is refused."""
    import moe_rl.trainer.model_builder as builder
    path = _write("qwen3_moe", tmp_path)
    seen = []

    class Built(Exception):
        pass

    def spec_of(config, sdpa=True):
        seen.append(config)
        raise Built
    monkeypatch.setattr(builder, "layer_spec", spec_of)
    monkeypatch.setattr(builder, "te_available", lambda: True)
    from megatron.core.transformer.moe import moe_utils   # TE's kernels megatron's check imports
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    for fused in (True, False):
        monkeypatch.setattr(builder, "te_permute_fusion", lambda: fused)
        for requested in ("auto", "te_grouped"):
            with pytest.raises(Built):
                build_model(path, experts=requested, dtype=torch.bfloat16)
            c = seen.pop()
            assert c.moe_grouped_gemm and c.moe_permute_fusion == fused
            assert not c.moe_router_fusion and c.moe_enable_routing_replay
    with pytest.raises(Built):
        build_model(path, experts="grouped", dtype=torch.bfloat16)
    assert not seen.pop().moe_grouped_gemm   # torch's grouped GEMM on TE's spec
    assert choose_expert_path("auto", 64, 64, torch.bfloat16, te=True)[0] == "te_grouped"
    with pytest.raises(ValueError, match="te_grouped needs Transformer Engine and a CUDA GPU"):
        choose_expert_path("te_grouped", 64, 64, torch.bfloat16, te=False)


def test_a_spec_without_the_loops_slot_is_said_not_claimed(tmp_path, monkeypatch):
    """A megatron-core whose layer spec moe_rl cannot edit: ``auto`` builds the loop and says
    why (the start-up line never claims grouped experts that were not built), ``grouped``
    refuses."""
    import moe_rl.trainer.grouped_experts as grouped
    path = _write("qwen3_moe", tmp_path)
    monkeypatch.setattr(grouped, "use_grouped_experts", lambda block: 0)
    model, _ = build_model(path, experts="auto")
    assert model.expert_path[0] == "sequential" and "no SequentialMLP slot" in model.expert_path[1]
    assert not any(isinstance(m, GroupedExperts) for m in model.modules())
    with pytest.raises(ValueError, match="trainer.experts: grouped cannot run here"):
        build_model(path, experts="grouped")


def _ep_worker(rank, port, model_dir, out_dir):
    """Expert parallel 2: each rank's half of the experts on both paths, replayed routing."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.trainer.parallel import ParallelSizes, destroy
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(expert=2))
    results = {}
    for experts in ("sequential", "grouped"):
        model, spec = build_model(model_dir, sizes=ParallelSizes(expert=2), experts=experts)
        load_hf_into_megatron(model, spec, model_dir)
        mb = _batch(spec, seed=rank, pinned=[rank, 5])   # tokens on both ranks' experts
        results[experts] = _run(model, spec, mb, mb.replay_indices())
        results[experts + "_allreduce"] = sorted(
            {getattr(p, "allreduce", True) for n, p in model.named_parameters()
             if ".local_experts." in n})
    (want_lp, want), (got_lp, got) = results["sequential"], results["grouped"]
    torch.save({"lp_equal": torch.equal(want_lp, got_lp),
                "unequal": [n for n in want if not torch.equal(want[n], got[n])],
                "local": sorted({n.split(".local_experts.")[1].split(".")[0]
                                 for n in got if ".local_experts." in n}),
                "allreduce": results["grouped_allreduce"] + results["sequential_allreduce"]},
               os.path.join(out_dir, f"ep{rank}.pt"))
    destroy()


@pytest.mark.multiproc
def test_expert_parallel_2_over_gloo_is_equal_on_both_paths(tmp_path):
    from moe_rl.trainer.parallel import free_port
    from tests.helpers import start_ranks
    path = _write("qwen3_moe", tmp_path)
    start_ranks(_ep_worker, (free_port(), str(path), str(tmp_path)), 2)
    for rank in range(2):
        out = torch.load(tmp_path / f"ep{rank}.pt")
        assert out["lp_equal"] and out["unequal"] == [], out
        assert out["local"] == ["0", "1", "2", "3"]    # 8 experts, 4 on each rank
        assert out["allreduce"] == [False, False]      # expert-data-parallel reduction only
