"""The dispatcher by sort (moe_rl/trainer/sort_dispatcher.py) against megatron-core's allgather
dispatcher: bit for bit on CPU, forward and backward (every parameter's gradient), in float32
and bfloat16, for every family, own and replayed routing, grouped experts and the loop; no
host synchronisation in a MoE layer with the grouped experts; megatron's dispatcher wherever
an expert lives on another rank."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
from moe_rl.trainer.sort_dispatcher import SortTokenDispatcher
from moe_rl.weights.hf import load_hf_into_megatron
from tests.trainer_runs import FAMILIES, logprobs_and_grads, three_samples, write_family

# ops whose output size depends on the data, or that read a value to the host: a GPU waits
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount")


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def _built(path, dtype, sort, experts="auto"):
    model, spec = build_model(path, dtype=dtype, sort_dispatch=sort, experts=experts)
    load_hf_into_megatron(model, spec, path)
    return model, spec


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_sort_dispatcher_equals_megatrons_bit_for_bit(tmp_path, kind, dtype, experts):
    path = write_family(kind, tmp_path)
    sort, spec = _built(path, dtype, True, experts)
    megatron, _ = _built(path, dtype, False, experts)
    assert sort.dispatch_path[0] == "sort" and megatron.dispatch_path[0] == "allgather"
    dispatchers = [m.token_dispatcher for m in sort.modules() if hasattr(m, "token_dispatcher")]
    assert dispatchers and all(isinstance(d, SortTokenDispatcher) for d in dispatchers)
    assert [n for n, _ in sort.named_parameters()] == [n for n, _ in megatron.named_parameters()]
    k = spec.moe_shape.topk
    for replay in (False, True):
        mb = three_samples(spec, seed=2, pinned=list(range(k)) if replay else None)
        ids = mb.replay_indices() if replay else None
        want_lp, want = logprobs_and_grads(megatron, spec, mb, ids)
        got_lp, got = logprobs_and_grads(sort, spec, mb, ids)
        assert torch.equal(want_lp, got_lp), (replay, (want_lp - got_lp).abs().max())
        assert set(want) == set(got)
        for name in want:
            assert torch.equal(want[name], got[name]), (replay, name)


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sort", [True, False])
def test_a_moe_layer_reads_nothing_back_to_the_host(tmp_path, sort):
    """With the grouped experts and the sort dispatcher, a MoE layer's forward and backward
    hold no op a GPU would wait on; megatron's dispatcher holds several (the test would see a
    regression)."""
    path = write_family("qwen3_moe", tmp_path)
    model, _ = _built(path, torch.float32, sort, "grouped")
    layer = next(m for m in model.modules() if type(m).__name__ == "MoELayer")
    x = torch.randn(6, 2, model.config.hidden_size, requires_grad=True)
    layer(x)[0].sum().backward()   # lazy initialisation outside the count
    reads = _HostReads()
    with reads:
        layer(x)[0].sum().backward()
    assert (reads.seen == []) == sort, reads.seen


def test_experts_on_another_rank_keep_megatrons_dispatcher(monkeypatch):
    """Decided from the parallel layout: expert parallelism or expert tensor parallelism > 1
    keeps megatron's dispatcher (its collectives)."""
    from moe_rl.trainer import model_builder
    import types
    for ep, etp, want in ((1, 1, "sort"), (2, 1, "allgather"), (1, 2, "allgather")):
        config = types.SimpleNamespace(expert_model_parallel_size=ep,
                                       expert_tensor_parallel_size=etp,
                                       moe_token_dispatcher_type="allgather")
        monkeypatch.setattr("moe_rl.trainer.sort_dispatcher.use_sort_dispatcher",
                            lambda model: 0)
        assert model_builder._dispatch(None, config, True)[0] == want
    assert ParallelSizes().expert == 1
