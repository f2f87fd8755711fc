"""Train-step time and peak memory with R3 routing replay against replay off, same batch, as
ratios; on the tiny demo model and on a larger Qwen3-MoE that fits these machines.

Each (model, mode) runs in a fresh subprocess: build the trainer, 2 warm-up steps, then
``--steps`` timed steps on the same batch (median). Peak memory: resident-set high-water mark
(CPU, VmHWM reset after warm-up) or torch.cuda.max_memory_allocated (GPU), above the level
after warm-up. Usage: python benchmarks/replay_overhead.py [--steps 5]
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.memory import proc_status_bytes, reset_peak_rss  # noqa: E402
MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2),
    "medium": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, moe_intermediate_size=384, num_experts=32,
                   num_experts_per_tok=4),
}


def run_one(model: str, mode: str, steps: int) -> dict:
    """One (model, replay mode) measurement in this process."""
    import torch
    from moe_rl.config import ModelInitConfig, config_from_dict
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    from tests.helpers import engine_samples
    import transformers
    torch.manual_seed(0)
    d = tempfile.mkdtemp()
    write_tiny_model(ModelInitConfig(max_position_embeddings=256, **MODELS[model]), d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    samples = engine_samples(hf, n_groups=4, group_size=4, seed=0, prompt_len=32, max_resp=32)
    init_distributed()
    init_model_parallel()
    cfg = config_from_dict({"model": {"path": d},
                            "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 32},
                            "trainer": {"optim": {"lr": 1e-5}, "micro_batch_size": 8},
                            "algorithm": {"replay": mode}})
    trainer = PolicyTrainer(cfg, d)
    for _ in range(2):
        trainer.train_step(copy.deepcopy(samples))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = reset_peak_rss()
    times = []
    for _ in range(steps):
        batch = copy.deepcopy(samples)
        t = time.perf_counter()
        trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() if cuda else proc_status_bytes("VmHWM")) - base
    total = proc_status_bytes("VmHWM")
    return {"model": model, "mode": mode, "step_s": statistics.median(times), "times": times,
            "peak_extra_bytes": peak, "process_peak_bytes": total,
            "tokens": sum(s.prompt_len + s.response_len for s in samples)}


def main() -> int:
    """Measure both models in both modes and write benchmarks/results/replay_overhead.*."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.steps)))
        return 0
    rows = []
    for model in MODELS:
        for mode in ("off", "r3", "off", "r3"):   # interleaved: noise hits both
            out = subprocess.run([sys.executable, __file__, "--one", model, mode, "--steps",
                                  str(args.steps)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1]["model"], rows[-1]["mode"], f"{rows[-1]['step_s']:.3f}s", flush=True)
    summary = {}
    for model in MODELS:
        get = lambda mode, k: min(r[k] for r in rows if r["model"] == model and r["mode"] == mode)
        summary[model] = {
            "off_step_s": get("off", "step_s"), "r3_step_s": get("r3", "step_s"),
            "time_ratio": get("r3", "step_s") / get("off", "step_s"),
            "off_process_peak_bytes": get("off", "process_peak_bytes"),
            "r3_process_peak_bytes": get("r3", "process_peak_bytes"),
            "memory_ratio": get("r3", "process_peak_bytes") / get("off", "process_peak_bytes"),
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replay_overhead.json").write_text(json.dumps({"runs": rows, "summary": summary},
                                                             indent=2))
    md = ["# replay_overhead", "",
          f"One train step (pi_old pass + update) on 16 sequences of ~{rows[0]['tokens'] // 16} "
          f"tokens, R3 vs replay off, best of 2 fresh processes each (median of {args.steps} "
          "steps). Memory: process peak RSS.", "",
          "| model | off (s) | R3 (s) | time R3/off | memory R3/off |", "|---|---|---|---|---|"]
    for model, s in summary.items():
        md.append(f"| {model} | {s['off_step_s']:.3f} | {s['r3_step_s']:.3f} | "
                  f"{s['time_ratio']:.3f}x | {s['memory_ratio']:.3f}x |")
    md += ["", "Goal: <= 1.03x time, <= 1.02x memory. Models: " +
           "; ".join(f"{k}: {v}" for k, v in MODELS.items())]
    (RESULTS / "replay_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
