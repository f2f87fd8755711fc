"""Mismatch study: does routing replay, the keep-sampling-mask and n-pass pi_old remove the
engine/trainer gap? Engine: the CPU reference engine in bfloat16; trainer: megatron-core in
float32; same weights, same batches.

For each model (the tiny demo shape and a larger one), after a short supervised warm start so the
distributions are not uniform:
  1. replay off / R2 / R3: mismatch/k1, k3, extreme_frac, abs_diff_max, routing agreement;
  2. top-k/top-p sampling, trainer scoring with the keep-sampling-mask on vs off, against the
     engine's truncated (behaviour) log-probs;
  3. pi_old from n = 1, 2, 4, 8 engine passes: variance of the estimate vs n (1/n expected if the
     passes are independent) and its distance to the float32 trainer.
Writes benchmarks/results/mismatch_study.{json,md} and PNG plots. Usage:
python benchmarks/mismatch_study.py [--prompts 16] [--samples 4]
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import tempfile

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, moe_intermediate_size=256, num_experts=16,
                  num_experts_per_tok=4),
}
KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/extreme_frac", "mismatch/abs_diff_max",
        "routing/agreement"]


def _cfg(model_dir: str, **algo):
    from moe_rl.config import config_from_dict
    rollout = {"n_samples_per_prompt": 4, "max_new_tokens": 8}
    if algo.get("keep_sampling_mask"):
        rollout["top_k"] = 20
    return config_from_dict({"model": {"path": model_dir}, "rollout": rollout,
                             "trainer": {"lr": 3e-3, "micro_batch_size": 16},
                             "data": {"toy_max_operand": 4, "chat_template": False},
                             "algorithm": algo})


def warm_model(shape: dict, out: str, steps: int = 30) -> str:
    """The model of the study: written from ``shape`` then ``steps`` supervised steps."""
    from transformers import AutoTokenizer
    from moe_rl.config import ModelInitConfig
    from moe_rl.data.prompts import PromptSampler, load_prompts
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration.loop import sft_samples
    from moe_rl.trainer.policy import PolicyTrainer
    base = out + "_init"
    write_tiny_model(ModelInitConfig(max_position_embeddings=128, **shape), base)
    cfg = _cfg(base)
    tok = AutoTokenizer.from_pretrained(base)
    prompts = load_prompts(cfg.data, tok)
    trainer = PolicyTrainer(cfg, base)
    sampler = PromptSampler(len(prompts), 32, 0)
    for _ in range(steps):
        trainer.sft_step(sft_samples(prompts, sampler.next_batch(), tok), 3e-3)
    trainer.export_hf(out)
    return out


def study_model(name: str, shape: dict, n_prompts: int, n_samples: int, work: str) -> dict:
    import httpx
    from moe_rl.moe_shape import MoEShape
    from moe_rl.rollout.decode import sample_from_response
    from moe_rl.rollout.engine import HTTPRolloutEngine, SamplingConfig
    from moe_rl.rollout.pool import ServerPool
    from moe_rl.rollout.reference_process import ServerProcess
    from moe_rl.trainer.parallel import free_port
    from moe_rl.trainer.policy import PolicyTrainer
    model_dir = warm_model(shape, f"{work}/{name}")
    facts = MoEShape.from_hf(json.load(open(f"{model_dir}/config.json")))
    layout = facts
    proc = ServerProcess(model_dir, free_port(), dtype="bfloat16").start()
    out: dict = {"model": name, "shape": shape, "engine": "bfloat16", "trainer": "float32"}
    try:
        eng = HTTPRolloutEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                                need_mask=False)
        prompts = [[6 + i % 5, 68, 6 + (i * 3) % 5, 72] for i in range(n_prompts)]
        samples = eng.generate(prompts, n_samples, SamplingConfig(max_new_tokens=8), seed=0)
        # 1. replay modes
        out["replay"] = {}
        for mode in ("off", "r2", "r3"):
            trainer = PolicyTrainer(_cfg(model_dir, replay=mode), model_dir)
            m = trainer.prepare(copy.deepcopy(samples))[1]
            out["replay"][mode] = {k: v for k, v in m.items()
                                   if k in KEYS or k.startswith("routing/agreement_layer")}
        # 2. keep-sampling-mask on vs off, behaviour = the engine's truncated distribution
        masked = []
        with httpx.Client(timeout=300) as client:
            for k, p in enumerate(prompts):
                for j in range(n_samples):
                    r = client.post(proc.url + "/generate", json={
                        "input_ids": p, "return_logprob": True, "return_routed_experts": True,
                        "return_sampling_mask": True,
                        "sampling_params": {"top_k": 20, "top_p": 0.9, "max_new_tokens": 8,
                                            "sampling_seed": 1000 * k + j}}).json()
                    s = sample_from_response(r, p, layout, need_routing=True, need_mask=True,
                                             group_id=k, sample_id=len(masked))
                    s.rollout_logprobs = torch.tensor(
                        r["meta_info"]["output_token_sampling_logprobs"], dtype=torch.float32)
                    masked.append(s)
        out["sampling_mask"] = {}
        for on in (False, True):
            trainer = PolicyTrainer(_cfg(model_dir, replay="r3", keep_sampling_mask=on),
                                    model_dir)
            m = trainer.prepare(copy.deepcopy(masked))[1]
            out["sampling_mask"]["on" if on else "off"] = {k: m[k] for k in KEYS if k in m}
        # 3. pi_old from n engine passes
        eng.score(samples, 16)
        trainer = PolicyTrainer(_cfg(model_dir, replay="r3"), model_dir)
        batch, _ = trainer.prepare(copy.deepcopy(samples))
        out["engine_avg"] = pass_variance(samples, batch.lp_trainer, batch.mask)
    finally:
        proc.stop()
    return out


def pass_variance(samples, lp_trainer: torch.Tensor, mask: torch.Tensor) -> dict:
    """Variance across disjoint n-pass estimates of lp_old, and their distance to the trainer."""
    from moe_rl.algo import average_pass_logprobs
    from moe_rl.trainer.policy import _pad_rows
    passes = torch.stack([_pad_rows([s.pass_logprobs[j] for s in samples]) for j in range(16)])
    rows = {}
    for n in (1, 2, 4, 8):
        est = torch.stack([average_pass_logprobs(passes[g * n:(g + 1) * n], mask)[0]
                           for g in range(16 // n)])
        var = est.var(dim=0, unbiased=True)[mask].mean().item()
        dist = (est - lp_trainer[None]).abs()[:, mask].mean().item()
        std = average_pass_logprobs(passes[:n], mask)[2]["pi_old/pass_std"]
        rows[n] = {"estimate_variance": var, "abs_diff_to_trainer": dist, "pass_std": std}
    v1 = rows[1]["estimate_variance"]
    for n in rows:
        rows[n]["variance_ratio"] = rows[n]["estimate_variance"] / v1 if v1 > 0 else None
    return rows


def plots(results: list[dict]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for r in results:
        modes = ["off", "r2", "r3"]
        for ax, key in zip(axes, ["mismatch/k3", "mismatch/extreme_frac", "routing/agreement"]):
            ax.plot(modes, [r["replay"][m].get(key, np.nan) for m in modes], "o-",
                    label=r["model"])
            ax.set_title(key)
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("bf16 engine vs fp32 trainer: routing replay")
    fig.tight_layout()
    files.append("mismatch_study_replay.png")
    fig.savefig(RESULTS / files[-1], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in results:
        ns = sorted(int(n) for n in r["engine_avg"])
        var = [r["engine_avg"][n]["estimate_variance"] for n in ns]
        ax.loglog(ns, var, "o-", label=r["model"])
        if var[0] > 0:
            ax.loglog(ns, [var[0] / n for n in ns], ":", color="gray")
    ax.set_xlabel("n passes")
    ax.set_ylabel("variance of the lp_old estimate")
    ax.set_title("engine_avg (dotted: 1/n)")
    ax.legend()
    fig.tight_layout()
    files.append("mismatch_study_engine_avg.png")
    fig.savefig(RESULTS / files[-1], dpi=100)
    plt.close(fig)
    return files


def main() -> int:
    """Run the study on both models and write the results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    with tempfile.TemporaryDirectory() as work:
        results = [study_model(name, shape, args.prompts, args.samples, work)
                   for name, shape in MODELS.items()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mismatch_study.json").write_text(json.dumps(results, indent=2))
    files = plots(results)
    md = ["# mismatch_study", "",
          f"Reference engine in bfloat16, megatron trainer in float32, same weights; "
          f"{args.prompts} prompts x {args.samples} samples, up to 8 new tokens.", ""]
    for r in results:
        md += [f"## {r['model']} ({r['shape']['num_hidden_layers']} layers, "
               f"{r['shape']['num_experts']} experts, top-{r['shape']['num_experts_per_tok']}, "
               f"hidden {r['shape']['hidden_size']})", "",
               "| replay | k1 | k3 | extreme_frac | abs_diff_max | routing agreement | per layer |",
               "|---|---|---|---|---|---|---|"]
        for mode, m in r["replay"].items():
            layers = ", ".join(f"{m[k]:.3f}" for k in sorted(m)
                               if k.startswith("routing/agreement_layer"))
            md.append(f"| {mode} | {m['mismatch/k1']:.2e} | {m['mismatch/k3']:.2e} | "
                      f"{m['mismatch/extreme_frac']:.4f} | {m['mismatch/abs_diff_max']:.3f} | "
                      f"{m.get('routing/agreement', float('nan')):.4f} | {layers} |")
        md += ["", "| keep-sampling-mask (top-k 20, top-p 0.9) | k1 | k3 | extreme_frac | "
               "abs_diff_max |", "|---|---|---|---|---|"]
        for on, m in r["sampling_mask"].items():
            md.append(f"| {on} | {m['mismatch/k1']:.2e} | {m['mismatch/k3']:.2e} | "
                      f"{m['mismatch/extreme_frac']:.4f} | {m['mismatch/abs_diff_max']:.3f} |")
        md += ["", "| n passes | variance of lp_old estimate | ratio to n=1 | 1/n | "
               "mean abs diff to fp32 trainer | pi_old/pass_std |", "|---|---|---|---|---|---|"]
        for n, row in r["engine_avg"].items():
            ratio = row["variance_ratio"]
            md.append(f"| {n} | {row['estimate_variance']:.3e} | "
                      f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {1 / int(n):.3f} | "
                      f"{row['abs_diff_to_trainer']:.3e} | {row['pass_std']:.3e} |")
        md.append("")
    md += [f"![{f}]({f})" for f in files]
    (RESULTS / "mismatch_study.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
