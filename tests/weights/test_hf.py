"""moe_rl/weights/hf.py's view of a model's tensors: Transformer Engine's grouped experts
(megatron-core's ``TEGroupedMLP``, which only a GPU with TE builds) are named and ordered as
megatron's loop names its experts, so loads, exports and every weight sync see one layout. TE's
layout is the one megatron-core documents in ``TEGroupedLinear._sharded_state_dict_grouped``:
one ``GroupedLinear`` per projection holding ``weight<e>`` (then ``bias<e>``) for local expert
``e``; the stand-in below lays the loop model's own tensors out so."""
import pytest
import torch

from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.weights.hf import as_sequential_experts, hf_mapped_tensors, iter_hf_buckets
from moe_rl.weights.hf import load_hf_into_megatron
from tests.trainer_runs import write_family


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


class TEGroupedLinearLayout(torch.nn.Module):
    """TE's ``GroupedLinear`` parameter layout: every expert's weight, then every bias."""

    def __init__(self, linears):
        super().__init__()
        for e, lin in enumerate(linears):
            self.register_parameter(f"weight{e}", lin.weight)
        for e, lin in enumerate(linears):
            if getattr(lin, "bias", None) is not None:
                self.register_parameter(f"bias{e}", lin.bias)


class TEGroupedMLPLayout(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.linear_fc1 = TEGroupedLinearLayout([e.linear_fc1 for e in experts.local_experts])
        self.linear_fc2 = TEGroupedLinearLayout([e.linear_fc2 for e in experts.local_experts])


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_te_grouped_experts_export_load_and_sync_as_the_loops(tmp_path, kind):
    """The same names, tensors and order as the loop's (gpt-oss: with expert biases), the same
    export buckets, and a load fills TE's tensors."""
    path = write_family(kind, tmp_path)
    loop, spec = build_model(path, experts="sequential")
    load_hf_into_megatron(loop, spec, path)
    te, _ = build_model(path, experts="sequential")
    load_hf_into_megatron(te, spec, path)
    for layer, twin in zip(loop.decoder.layers, te.decoder.layers):
        if hasattr(layer.mlp, "experts"):
            twin.mlp.experts = TEGroupedMLPLayout(layer.mlp.experts)
    names = [n for n, _ in te.named_parameters()]
    assert any(n.endswith("experts.linear_fc1.weight1") for n in names)
    want, got = hf_mapped_tensors(loop), hf_mapped_tensors(te)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert all(a is b for (n, a), (_, b) in zip(got, want) if ".local_experts." in n)
    bucket = 1 << 14

    def buckets(model):
        return [[(n, t.clone()) for n, t in b] for b, _ in iter_hf_buckets(model, spec, bucket)]
    for a, b in zip(buckets(loop), buckets(te), strict=True):
        assert [n for n, _ in a] == [n for n, _ in b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    loop, _ = build_model(path, experts="sequential")   # a reference the zeroing leaves
    load_hf_into_megatron(loop, spec, path)
    with torch.no_grad():
        for _, t in got:
            t.zero_()
    load_hf_into_megatron(te, spec, path)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, hf_mapped_tensors(loop)))


def test_only_te_grouped_expert_names_are_renamed():
    t = torch.zeros(1)
    named = [("decoder.layers.0.mlp.linear_fc1.weight", t),
             ("decoder.layers.1.mlp.experts.linear_fc2.weight0", t),
             ("decoder.layers.1.mlp.experts.linear_fc1.bias1", t),
             ("decoder.layers.1.mlp.experts.linear_fc1.weight1", t),
             ("decoder.layers.1.mlp.experts.linear_fc1.weight0", t),
             ("decoder.layers.1.mlp.router.weight", t),
             ("decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight", t)]
    assert [n for n, _ in as_sequential_experts(named)] == [
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.bias",
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"]
