"""Dispatched ops per MoE layer, the CPU proxy of the trainer's GPU speed: megatron-core's loop over
the experts with its dispatcher (what ran until 2026-12-03), two grouped GEMMs with megatron's
dispatcher, and grouped GEMMs with the dispatcher by sort (the default where every expert is
local; moe_rl/trainer/sort_dispatcher.py).

For each configuration and expert count E (8, 32, 128; top-8 of a Qwen3-MoE-shaped layer, hidden
64, expert width 64): the aten ops a ``TorchDispatchMode`` sees in forward + backward of one MoE
layer (router, dispatch, experts, combine) and the host synchronisations anywhere in it (ops
whose output size depends on the data or that read a value to the host: ``nonzero``,
``masked_select``, ``_local_scalar_dense``, ...; and ``tolist`` / ``item`` / ``cpu`` calls),
and for the tiny 2-layer model at E = 128 the ops and host milliseconds of one forward +
backward (median of 5, the configurations interleaved). A GPU launches roughly one kernel per
op and waits at each synchronisation, which is where the loop's time went on an H200
(benchmarks/results/gpu_check.md). Usage: python benchmarks/trainer_ops.py
Writes benchmarks/results/trainer_ops.{json,md}.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXPERTS = (8, 32, 128)
# configuration -> (trainer.experts, dispatch by sort)
CONFIGS = {"loop": ("sequential", False), "grouped": ("grouped", False),
           "grouped+sort": ("grouped", True)}
SYNCS = ("tolist", "item", "cpu", "numpy")
HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, and those a GPU waits on."""

    def __init__(self):
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += func.__name__.split(".")[0] in HOST_READS
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Counts the tensor-to-host calls made while it is active."""

    def __init__(self):
        self.calls, self.saved = 0, {}

    def __enter__(self):
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def counted(t, *a, _original=original, **k):
                self.calls += 1
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def hf_config(experts: int, layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": experts,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "max_position_embeddings": 256, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def build(config: str, experts: int, layers: int):
    from moe_rl.trainer.model_builder import build_model
    path, sort = CONFIGS[config]
    torch.manual_seed(0)
    model, _ = build_model(hf_config(experts, layers), experts=path, sort_dispatch=sort)
    assert model.expert_path[0] == path, model.expert_path
    assert (model.dispatch_path[0] == "sort") == sort, model.dispatch_path
    return model


def moe_layer_ops(config: str, experts: int) -> dict:
    """Ops and host syncs of one MoE layer (router, dispatch, experts, combine) in forward +
    backward, on hidden states of 4 x 64 tokens."""
    layer = build(config, experts, 1).decoder.layers[0].mlp
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(0))
    x = x.to(next(layer.parameters()).device).requires_grad_()

    def step():
        out, _ = layer(x)
        out.float().sum().backward()
    step()   # first call: lazy initialisation
    counter, syncs = OpCounter(), SyncCounter()
    with syncs, counter:
        step()
    return {"ops": counter.ops, "syncs": counter.host_reads + syncs.calls}


def tiny_steps(repeats: int = 5) -> dict:
    """Ops and host ms of one forward + backward of the tiny 2-layer model at E = 128, each
    path's steps interleaved with the other's (a shared machine's load falls on both)."""
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.trainer.packing import pack_one
    from moe_rl.rollout_record import Sample
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(0, 128, (24,), generator=g).tolist(),
                      response_ids=torch.randint(0, 128, (40,), generator=g).tolist(),
                      rollout_logprobs=-torch.ones(40)) for _ in range(4)]
    mb = pack_one(samples, list(range(4)), pad_token_id=0, num_experts=128)
    models = {config: build(config, 128, 2) for config in CONFIGS}

    def step(model):
        model.zero_grad()
        lp, _ = forward_logprobs(model, mb)
        lp.sum().backward()
    out = {}
    for path, model in models.items():
        step(model)
        counter = OpCounter()
        with counter:
            step(model)
        out[path] = {"ops": counter.ops, "times_ms": []}
    for _ in range(repeats):
        for path, model in models.items():
            t = time.perf_counter()
            step(model)
            out[path]["times_ms"].append((time.perf_counter() - t) * 1e3)
    for row in out.values():
        row["host_ms"] = statistics.median(row["times_ms"])
    return out


def main() -> int:
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    rows = []
    for experts in EXPERTS:
        for config in CONFIGS:
            got = moe_layer_ops(config, experts)
            rows.append({"experts": experts, "config": config, "ops_per_moe_layer": got["ops"],
                         "host_syncs_per_layer": got["syncs"]})
            print(rows[-1], flush=True)
    step = tiny_steps()
    report = {"torch": torch.__version__, "per_layer": rows, "tiny_2_layer_step_e128": step,
              "bounds": {"ops_per_moe_layer": 150, "ops_per_tiny_step": 1000}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trainer_ops.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Dispatched ops per MoE layer: the experts' loop, grouped GEMMs, the dispatcher "
             "by sort", "",
             "`python benchmarks/trainer_ops.py` (CPU, torch " + torch.__version__ + "); "
             "forward + backward, top-8 of E experts, hidden 64, expert width 64. loop: "
             "megatron's SequentialMLP and dispatcher (before 2026-12-03); grouped: "
             "torch._grouped_mm, megatron's dispatcher; grouped+sort: the default where every "
             "expert is local. A GPU launches about one kernel per op and waits at each host "
             "sync.", "",
             "| E | configuration | ops per MoE layer | host syncs per layer |",
             "|---|---|---|---|"]
    lines += [f"| {r['experts']} | {r['config']} | {r['ops_per_moe_layer']:,} | "
              f"{r['host_syncs_per_layer']} |" for r in rows]
    lines += ["", "The tiny 2-layer model at E = 128, one forward + backward (attention through "
              "torch's SDPA in every configuration):", "",
              "| configuration | ops | host ms (median of 5) |", "|---|---|---|"]
    lines += [f"| {c} | {s['ops']:,} | {s['host_ms']:.0f} |" for c, s in step.items()]
    ratio = step["loop"]["host_ms"] / step["grouped+sort"]["host_ms"]
    lines += ["", f"Host time, loop / grouped+sort: {ratio:.1f}x (one run; a ratio, these "
              f"machines are shared). Bounds (issue 76): <= 150 ops per MoE layer at any E, "
              f"<= 1,000 per tiny step, no host sync in the experts and the EP=1 dispatch."]
    (RESULTS / "trainer_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
