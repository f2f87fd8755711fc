"""Dispatched ops per MoE layer, the CPU proxy of the trainer's GPU speed: the experts in
megatron-core's loop (``trainer.experts=sequential``) against two grouped GEMMs (``grouped``).

For each path and expert count E (8, 32, 128; top-8 of a Qwen3-MoE-shaped layer, hidden 64,
expert width 64): the aten ops a ``TorchDispatchMode`` sees in forward + backward of one MoE
layer (router, dispatch, experts, combine), the host synchronisations the experts make
(``tolist`` / ``item`` / ``cpu`` calls while the expert module runs), and for the tiny 2-layer
model at E = 128 the ops and host milliseconds of one forward + backward (median of 5, the two
paths interleaved). A GPU launches roughly one kernel per op, which is where the loop's time went on an
H200 (benchmarks/results/gpu_check.md). Usage: python benchmarks/trainer_ops.py
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
PATHS = ("sequential", "grouped")
SYNCS = ("tolist", "item", "cpu", "numpy")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Counts the tensor-to-host calls made while an expert module's forward runs."""

    def __init__(self):
        self.calls, self.inside, self.saved = 0, 0, {}

    def __enter__(self):
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def counted(t, *a, _original=original, **k):
                self.calls += bool(self.inside)
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)

    def watch(self, model) -> None:
        from megatron.core.transformer.moe.experts import SequentialMLP
        for m in model.modules():
            if isinstance(m, SequentialMLP):
                m.register_forward_pre_hook(lambda *_: setattr(self, "inside", self.inside + 1))
                m.register_forward_hook(lambda *_: setattr(self, "inside", self.inside - 1))


def hf_config(experts: int, layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": experts,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "max_position_embeddings": 256, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def build(path: str, experts: int, layers: int):
    from moe_rl.trainer.model_builder import build_model
    torch.manual_seed(0)
    model, _ = build_model(hf_config(experts, layers), experts=path)
    assert model.expert_path[0] == path, model.expert_path
    return model


def moe_layer_ops(path: str, experts: int) -> dict:
    """Ops and expert host syncs of one MoE layer (router, dispatch, experts, combine) in
    forward + backward, on hidden states of 4 x 64 tokens."""
    layer = build(path, experts, 1).decoder.layers[0].mlp
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step():
        out, _ = layer(x)
        out.float().sum().backward()
    step()   # first call: lazy initialisation
    counter, syncs = OpCounter(), SyncCounter()
    syncs.watch(layer)
    with syncs, counter:
        step()
    return {"ops": counter.ops, "syncs": syncs.calls}


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
    models = {path: build(path, 128, 2) for path in PATHS}

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
        for path in PATHS:
            got = moe_layer_ops(path, experts)
            rows.append({"experts": experts, "path": path, "ops_per_moe_layer": got["ops"],
                         "expert_syncs_per_layer": got["syncs"]})
            print(rows[-1], flush=True)
    step = tiny_steps()
    report = {"torch": torch.__version__, "per_layer": rows, "tiny_2_layer_step_e128": step,
              "bounds": {"ops_per_moe_layer": 150, "ops_per_tiny_step": 1000}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trainer_ops.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Dispatched ops per MoE layer: the experts' loop against grouped GEMMs", "",
             "`python benchmarks/trainer_ops.py` (CPU, torch " + torch.__version__ + "); "
             "forward + backward, top-8 of E experts, hidden 64, expert width 64. A GPU launches "
             "about one kernel per op.", "",
             "| E | path | ops per MoE layer | host syncs in the experts per layer |",
             "|---|---|---|---|"]
    lines += [f"| {r['experts']} | {r['path']} | {r['ops_per_moe_layer']:,} | "
              f"{r['expert_syncs_per_layer']} |" for r in rows]
    lines += ["", "The tiny 2-layer model at E = 128, one forward + backward:", "",
              "| path | ops | host ms (median of 5) |", "|---|---|---|"]
    lines += [f"| {p} | {s['ops']:,} | {s['host_ms']:.0f} |" for p, s in step.items()]
    ratio = step["sequential"]["host_ms"] / step["grouped"]["host_ms"]
    lines += ["", f"Host time, loop / grouped: {ratio:.1f}x (one run; a ratio, these machines "
              f"are shared). Bounds (issue 76): <= 150 ops per MoE layer at any E, <= 1,000 "
              f"per tiny step, no host sync inside the experts."]
    (RESULTS / "trainer_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
