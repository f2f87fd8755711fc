"""Rollout payload sizes and speeds: routing bytes per token (compact record vs the peers' int32
for all layers, + base64), sampling-mask bytes per token (ragged vs dense [T, V] boolean),
routing decode throughput, and reference-engine generation tokens/s.

Usage: python benchmarks/rollout_payload.py
"""
from __future__ import annotations

import base64
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
V_QWEN = 151_936


def routing_bytes(name: str, layers: int, moe_layers: int, topk: int, experts: int) -> dict:
    """Bytes per token of the routing payload, ours vs int32 over all layers."""
    ours = moe_layers * topk * (1 if experts <= 256 else 2)
    peers = layers * topk * 4
    return {"model": name, "layers": layers, "moe_layers": moe_layers, "topk": topk,
            "experts": experts, "ours_bytes_per_token": ours,
            "peers_int32_bytes_per_token": peers,
            "peers_base64_bytes_per_token": peers * 4 / 3, "ratio_peers_over_ours": peers / ours}


def mask_bytes(kept: int) -> dict:
    """Bytes per token of the kept-id set (int32 ids + one int64 offset) vs a dense bool row."""
    ours = kept * 4 + 8
    return {"kept_per_token": kept, "ours_bytes_per_token": ours,
            "dense_bool_bytes_per_token": V_QWEN, "ratio_dense_over_ours": V_QWEN / ours}


def decode_throughput(positions: int = 4096, repeats: int = 5) -> dict:
    """MB/s of base64 int32 -> compact routing for a Qwen3-30B-A3B-shaped response."""
    from moe_rl.engines.sglang.decode import decode_routing
    from moe_rl.families.shape import MoEShape
    layout = MoEShape(48, tuple(range(48)), 8, 128)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 128, (positions, 48, 8), dtype=np.int32)
    payload = base64.b64encode(arr.astype("<i4").tobytes()).decode()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = decode_routing(payload, positions, layout)
        best = min(best, time.perf_counter() - t)
    assert out.shape == (positions, 48, 8)
    mb = len(payload) / 1e6
    return {"payload_mb": mb, "seconds": best, "mb_per_s": mb / best}


def engine_tokens_per_second(n_prompts: int = 32, new_tokens: int = 32) -> dict:
    """Generation throughput of the CPU reference engine on the tiny demo model over HTTP."""
    from moe_rl.config import ModelInitConfig
    from moe_rl.families.shape import MoEShape
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.rollout.trajectories import generate_samples
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.engines.reference.launcher import ReferenceServer
    from moe_rl.trainer.parallel import free_port
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model(ModelInitConfig(), d)
        facts = MoEShape.from_hf(json.load(open(f"{d}/config.json")))
        layout = facts
        proc = ReferenceServer(d, free_port()).start()
        try:
            eng = SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                               need_mask=True)
            sampling = SamplingConfig(top_k=20, max_new_tokens=new_tokens)
            generate_samples(eng, [[6, 7, 68]] * 4, 1, sampling, seed=0)   # warm-up
            t = time.perf_counter()
            samples = generate_samples(eng, [[6, 7, 68, 12 + i % 9] for i in range(n_prompts)],
                                       1, sampling, seed=1)
            dt = time.perf_counter() - t
        finally:
            proc.stop()
    tokens = sum(s.response_len for s in samples)
    return {"prompts": n_prompts, "generated_tokens": tokens, "seconds": dt,
            "tokens_per_s": tokens / dt, "with": "routing + sampling masks, top_k 20"}


def routing_consistency(dtype: str, n_prompts: int = 32, new_tokens: int = 24) -> dict:
    """Agreement of the routing returned when scoring a generated sequence with the routing of
    its generation (same weights), per (position, MoE layer), for an engine in ``dtype``."""
    import httpx
    import torch
    from moe_rl.algo.metrics import routing_agreement
    from moe_rl.config import ModelInitConfig
    from moe_rl.families.shape import MoEShape
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.engines.sglang.decode import decode_routing
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.rollout.trajectories import generate_samples
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.engines.reference.launcher import ReferenceServer
    from moe_rl.trainer.parallel import free_port
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model(ModelInitConfig(), d)
        facts = MoEShape.from_hf(json.load(open(f"{d}/config.json")))
        layout = facts
        proc = ReferenceServer(d, free_port(), dtype=dtype).start()
        try:
            eng = SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                               need_mask=False)
            samples = generate_samples(eng, [[6, 7, 68, 12 + i % 9] for i in range(n_prompts)],
                                       1, SamplingConfig(max_new_tokens=new_tokens), seed=2)
            gen, scored = [], []
            for s in samples:
                ids = s.prompt_ids.tolist() + s.response_ids.tolist()
                r = httpx.post(proc.url + "/generate", timeout=120, json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                    "return_routed_experts": True}).json()
                scored.append(decode_routing(r["meta_info"]["routed_experts"], len(ids) - 1,
                                             layout))
                gen.append(s.routing)
        finally:
            proc.stop()
    m = routing_agreement(torch.cat(scored).long(), torch.cat(gen).long())
    return {"dtype": dtype, "positions": int(sum(g.shape[0] for g in gen)), **m}


def main() -> int:
    """Measure and write benchmarks/results/rollout_payload.{json,md}."""
    res = {
        "routing": [routing_bytes("tiny demo (Qwen3-MoE)", 2, 2, 2, 8),
                    routing_bytes("Qwen3-30B-A3B", 48, 48, 8, 128),
                    routing_bytes("DeepSeek-V3-shaped (3 dense + 58 MoE, 256 experts)", 61, 58,
                                  8, 256)],
        "sampling_mask": [mask_bytes(k) for k in (1, 20, 50, 200)],
        "decode": decode_throughput(),
        "engine": engine_tokens_per_second(),
        "routing_consistency": [routing_consistency("float32"), routing_consistency("bfloat16")],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout_payload.json").write_text(json.dumps(res, indent=2))
    md = ["# rollout_payload", "", "## Routing bytes per token", "",
          "| model | ours | peers int32 | peers base64 | peers/ours |", "|---|---|---|---|---|"]
    for r in res["routing"]:
        md.append(f"| {r['model']} | {r['ours_bytes_per_token']} | "
                  f"{r['peers_int32_bytes_per_token']} | {r['peers_base64_bytes_per_token']:.0f}"
                  f" | {r['ratio_peers_over_ours']:.1f}x |")
    md += ["", f"## Sampling-mask bytes per token (V = {V_QWEN})", "",
           "| kept ids | ours (ragged) | dense bool | dense/ours |", "|---|---|---|---|"]
    for r in res["sampling_mask"]:
        md.append(f"| {r['kept_per_token']} | {r['ours_bytes_per_token']} | "
                  f"{r['dense_bool_bytes_per_token']} | {r['ratio_dense_over_ours']:.0f}x |")
    d, e = res["decode"], res["engine"]
    md += ["", f"Routing decode (base64 int32 -> uint8, 4096 positions x 48 layers x top-8): "
           f"{d['mb_per_s']:.0f} MB/s of payload.", "",
           f"Reference engine (tiny model, CPU, {e['prompts']} concurrent requests, "
           f"{e['with']}): {e['tokens_per_s']:.0f} generated tokens/s."]
    md += ["", "## Routing of a scored sequence vs its generation (same weights)", "",
           "| engine dtype | positions | agreement | per MoE layer |", "|---|---|---|---|"]
    for r in res["routing_consistency"]:
        layers = ", ".join(f"{r[k]:.4f}" for k in sorted(r) if k.startswith("routing/agreement_"))
        md.append(f"| {r['dtype']} | {r['positions']} | {r['routing/agreement']:.4f} | {layers} |")
    md += ["", "Generation runs the prompt as one prefill and then one token at a time with a KV "
           "cache, in a batch; scoring runs the whole sequence as one prefill: in bfloat16 the "
           "different kernels and batch shapes round differently and some top-k choices flip."]
    (RESULTS / "rollout_payload.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
