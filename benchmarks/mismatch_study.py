"""Mismatch study: what routing replay, the keep-sampling-mask and n-pass pi_old remove of the
engine/trainer gap, on real engine differences. Trainer: megatron-core in float32. Engines: the
CPU reference engine in float32, bfloat16 and FP8 (block-wise E4M3 weights, per-token activation
groups, bfloat16 activations), all batch-variant (split-KV attention); same weights.

For each model (the tiny demo shape warmed up by 30 supervised steps; the `medium` preset:
Qwen3-30B-A3B's MoE at CPU scale, 8 layers, 64 experts, top-8, warmed up and cached under
outputs/), on ONE set of sequences (generated once by the bfloat16 engine, then scored by every
engine, so every row compares the same batches):
  1. engine x replay {off, r2, r3}: routing agreement (overall, per layer), the share of tokens
     routed differently in at least one layer, mismatch/k1, k3, extreme_frac, abs_diff_max, and
     the trainer-side time of each mode;
  2. keep-sampling-mask on vs off (top-k 20, top-p 0.9 sampling from the FP8 engine, R3);
  3. pi_old from n = 1, 2, 4, 8 engine passes of the FP8 engine (16 passes, disjoint groups):
     the variance of the estimate against n, its ratio to 1/n, the distance to the trainer, and
     the engine time of the passes.
Writes benchmarks/results/mismatch_study.{json,md} and PNG plots. Usage:
python benchmarks/mismatch_study.py [--prompts 16] [--samples 4] [--models tiny,medium]
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
ENGINES = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
           "fp8": ("bfloat16", "fp8")}
KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/extreme_frac", "mismatch/abs_diff_max",
        "routing/agreement", "routing/token_differs_frac"]
PASSES = 16


def _cfg(model_dir: str, **algo):
    from moe_rl.config import config_from_dict
    rollout = {"n_samples_per_prompt": 4, "max_new_tokens": 8}
    if algo.get("keep_sampling_mask"):
        rollout["top_k"] = 20
    return config_from_dict({"model": {"path": model_dir}, "rollout": rollout,
                             "trainer": {"optim": {"lr": 3e-3}, "micro_batch_size": 16},
                             "data": {"toy_max_operand": 9, "chat_template": False},
                             "algorithm": algo})


def tiny_model(out: str, steps: int = 30) -> str:
    """The tiny demo shape written and warmed up by ``steps`` supervised steps."""
    from transformers import AutoTokenizer
    from moe_rl.config import ModelInitConfig
    from moe_rl.data.prompts import PromptSampler, load_prompts
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration.warm_start import sft_samples
    from moe_rl.trainer.policy import PolicyTrainer
    base = out + "_init"
    write_tiny_model(ModelInitConfig(max_position_embeddings=128, **TINY), base)
    cfg = _cfg(base)
    tok = AutoTokenizer.from_pretrained(base)
    prompts = load_prompts(cfg.data, tok)
    trainer = PolicyTrainer(cfg, base)
    sampler = PromptSampler(len(prompts), 32, 0)
    for _ in range(steps):
        trainer.sft_step(sft_samples(prompts, sampler.next_batch(), tok), 3e-3)
    trainer.export_hf(out)
    trainer.replay.close()
    return out


def _server(model_dir: str, engine: str):
    """A reference engine server; fp8 serves the FP8 checkpoint moe_rl writes for
    ``rollout.quantization: fp8`` (as a run does)."""
    from moe_rl.weights.fp8 import write_fp8_checkpoint
    from moe_rl.engines.reference.launcher import ReferenceServer
    from moe_rl.trainer.parallel import free_port
    dtype, quant = ENGINES[engine]
    if quant == "fp8":
        model_dir = write_fp8_checkpoint(model_dir, model_dir + "_fp8")
    return ReferenceServer(model_dir, free_port(), dtype=dtype).start(600)


def _rescore(url: str, samples, layout) -> float:
    """Replace each sample's rollout log-probs and routing by this engine's (one batched
    scoring request of every sequence); returns the seconds it took."""
    import httpx
    from moe_rl.engines.sglang.decode import decode_routing, score_from_response
    body = {"input_ids": [s.prompt_ids.tolist() + s.response_ids.tolist() for s in samples],
            "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": [s.prompt_len - 1 for s in samples],
            "return_routed_experts": True}
    t0 = time.perf_counter()
    out = httpx.post(url + "/generate", json=body, timeout=3600).json()
    seconds = time.perf_counter() - t0
    for s, r in zip(samples, out):
        n = s.prompt_len + s.response_len
        s.rollout_logprobs = score_from_response(r, s.prompt_len, n)
        s.routing = decode_routing(r["meta_info"]["routed_experts"], n - 1, layout)
    return seconds


def model_inputs(name: str, work: str, n_prompts: int):
    """(model folder, MoE layout, tokenised toy prompts, shape summary) of model ``name``: the
    warmed-up tiny demo shape in ``work``, or a preset cached under outputs/."""
    from transformers import AutoTokenizer
    from moe_rl.data.prompts import toy_problems
    from moe_rl.models.presets import write_preset
    from moe_rl.families.shape import MoEShape
    model_dir = tiny_model(f"{work}/tiny") if name == "tiny" else \
        write_preset(name, str(ROOT / "outputs" / f"{name}_moe"))
    hf = json.loads(pathlib.Path(model_dir, "config.json").read_text())
    layout = MoEShape.from_hf(hf)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"]
               for p, _ in toy_problems(9, n_prompts, 3)]
    shape = {k: hf.get(k) for k in ("num_hidden_layers", "hidden_size", "num_experts_per_tok")}
    shape["num_experts"] = layout.num_experts
    return model_dir, layout, prompts, shape


def study_model(name: str, work: str, n_prompts: int, n_samples: int) -> dict:
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.rollout.trajectories import generate_samples
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.trainer.policy import PolicyTrainer
    model_dir, layout, prompts, shape = model_inputs(name, work, n_prompts)
    out: dict = {"model": name, "shape": shape, "trainer": "float32", "engines": {}}
    proc = _server(model_dir, "bfloat16")
    try:
        eng = SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                           need_mask=False)
        base = generate_samples(eng, prompts, n_samples, SamplingConfig(max_new_tokens=8), seed=0)
    finally:
        proc.stop()
    scored, masked = {}, None
    for engine in ENGINES:   # every engine scores the same sequences
        proc = _server(model_dir, engine)
        try:
            scored[engine] = copy.deepcopy(base)
            out["engines"][engine] = {"engine_scoring_s": _rescore(proc.url, scored[engine],
                                                                   layout), "replay": {}}
            if engine == "fp8":
                eng = SGLangEngine(lambda: ServerPool([proc.url]), layout,
                                   need_routing=True, need_mask=False)
                t0 = time.perf_counter()
                eng.score(scored[engine], PASSES)
                out["engines"][engine]["engine_avg_s_per_pass"] = \
                    (time.perf_counter() - t0) / PASSES
                masked = generate_samples(
                    SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                                 need_mask=True),
                    prompts, n_samples, SamplingConfig(top_k=20, top_p=0.9, max_new_tokens=8),
                    seed=1)
        finally:
            proc.stop()
    for mode in ("off", "r2", "r3"):   # one trainer (megatron model) alive at a time
        trainer = PolicyTrainer(_cfg(model_dir, replay=mode), model_dir)
        for engine, samples in scored.items():
            t0 = time.perf_counter()
            batch, m = trainer.prepare(copy.deepcopy(samples))
            out["engines"][engine]["replay"][mode] = {
                "trainer_s": time.perf_counter() - t0,
                **{k: v for k, v in m.items()
                   if k in KEYS or k.startswith("routing/agreement_layer")}}
            if mode == "r3" and engine == "fp8":
                out["engines"][engine]["engine_avg"] = pass_variance(samples, batch.lp_trainer,
                                                                     batch.mask)
        trainer.replay.close()
    out["engines"]["fp8"]["sampling_mask"] = {}
    for on in (False, True):   # fp8 samples drawn with top-k / top-p, scored on / off the set
        trainer = PolicyTrainer(_cfg(model_dir, replay="r3", keep_sampling_mask=on), model_dir)
        t0 = time.perf_counter()
        m = trainer.prepare(copy.deepcopy(masked))[1]
        out["engines"]["fp8"]["sampling_mask"]["on" if on else "off"] = {
            "trainer_s": time.perf_counter() - t0, **{k: m[k] for k in KEYS if k in m}}
        trainer.replay.close()
    return out


def pass_variance(samples, lp_trainer: torch.Tensor, mask: torch.Tensor) -> dict:
    """Variance across disjoint n-pass estimates of lp_old, and their distance to the trainer."""
    from moe_rl.algo import average_pass_logprobs
    from moe_rl.trainer.passes import pad_rows
    passes = torch.stack([pad_rows([s.pass_logprobs[j] for s in samples])
                          for j in range(PASSES)])
    rows = {}
    for n in (1, 2, 4, 8):
        est = torch.stack([average_pass_logprobs(passes[g * n:(g + 1) * n], mask)[0]
                           for g in range(PASSES // n)])
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
    modes = ["off", "r2", "r3"]
    keys = ["mismatch/k3", "mismatch/extreme_frac", "routing/agreement"]
    fig, axes = plt.subplots(len(results), 3, figsize=(14, 3.4 * len(results)), squeeze=False)
    for r, row_axes in zip(results, axes):
        for ax, key in zip(row_axes, keys):
            for engine, e in r["engines"].items():
                ax.plot(modes, [e["replay"][m].get(key, np.nan) for m in modes], "o-",
                        label=engine)
            ax.set_title(f"{r['model']}: {key}")
            if key != "routing/agreement":
                ax.set_yscale("symlog", linthresh=1e-6)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("engine (float32 / bfloat16 / fp8) vs float32 trainer: routing replay")
    fig.tight_layout()
    files.append("mismatch_study_replay.png")
    fig.savefig(RESULTS / files[-1], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in results:
        ea = r["engines"].get("fp8", {}).get("engine_avg")
        if not ea:
            continue
        ns = sorted(int(n) for n in ea)
        var = [ea[n]["estimate_variance"] for n in ns]
        ax.loglog(ns, var, "o-", label=r["model"])
        if var[0] > 0:
            ax.loglog(ns, [var[0] / n for n in ns], ":", color="gray")
    ax.set_xlabel("n passes")
    ax.set_ylabel("variance of the lp_old estimate")
    ax.set_title("fp8 engine, engine_avg (dotted: 1/n)")
    ax.legend()
    fig.tight_layout()
    files.append("mismatch_study_engine_avg.png")
    fig.savefig(RESULTS / files[-1], dpi=100)
    plt.close(fig)
    return files


def markdown(results: list[dict], args, files: list[str]) -> str:
    md = ["# mismatch_study", "",
          f"Reference engine (float32, bfloat16, fp8 = block-wise E4M3 weights + per-token "
          f"activation groups with bfloat16 activations; split-KV attention that follows the "
          f"batch) against the megatron trainer in float32, same weights, the same "
          f"{args.prompts} prompts x {args.samples} sequences (up to 8 new tokens) scored by "
          f"every engine. Times are seconds on this 2-core machine (compare within a table).",
          ""]
    for r in results:
        sh = r["shape"]
        md += [f"## {r['model']} ({sh['num_hidden_layers']} layers, {sh['num_experts']} experts, "
               f"top-{sh['num_experts_per_tok']}, hidden {sh['hidden_size']})", "",
               "| engine | replay | routing agreement | tokens routed differently | k1 | k3 | "
               "extreme_frac | abs_diff_max | trainer s | per layer agreement |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for engine, e in r["engines"].items():
            for mode, m in e["replay"].items():
                layers = ", ".join(f"{m[k]:.3f}" for k in sorted(
                    (k for k in m if k.startswith("routing/agreement_layer")),
                    key=lambda k: int(k.rsplit("_", 1)[1])))
                md.append(f"| {engine} | {mode} | {m.get('routing/agreement', np.nan):.4f} | "
                          f"{m.get('routing/token_differs_frac', np.nan):.3f} | "
                          f"{m['mismatch/k1']:.2e} | {m['mismatch/k3']:.2e} | "
                          f"{m['mismatch/extreme_frac']:.4f} | {m['mismatch/abs_diff_max']:.3f} | "
                          f"{m['trainer_s']:.2f} | {layers} |")
        md += ["", "| engine | scoring s (all sequences, one batch) |", "|---|---|"]
        md += [f"| {engine} | {e['engine_scoring_s']:.2f} |" for engine, e in r["engines"].items()]
        fp8 = r["engines"].get("fp8", {})
        if "sampling_mask" in fp8:
            md += ["", "| fp8 engine, top-k 20 / top-p 0.9, R3: keep-sampling-mask | k1 | k3 | "
                   "extreme_frac | abs_diff_max | trainer s |", "|---|---|---|---|---|---|"]
            for on, m in fp8["sampling_mask"].items():
                md.append(f"| {on} | {m['mismatch/k1']:.2e} | {m['mismatch/k3']:.2e} | "
                          f"{m['mismatch/extreme_frac']:.4f} | "
                          f"{m['mismatch/abs_diff_max']:.3f} | {m['trainer_s']:.2f} |")
        if "engine_avg" in fp8:
            md += ["", f"fp8 engine, pi_old = mean of n passes ({PASSES} passes, "
                   f"{fp8['engine_avg_s_per_pass']:.2f} s per pass):", "",
                   "| n passes | variance of lp_old estimate | ratio to n=1 | 1/n | "
                   "mean abs diff to fp32 trainer | pi_old/pass_std |",
                   "|---|---|---|---|---|---|"]
            for n, row in fp8["engine_avg"].items():
                ratio = row["variance_ratio"]
                md.append(f"| {n} | {row['estimate_variance']:.3e} | "
                          f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {1 / int(n):.3f} | "
                          f"{row['abs_diff_to_trainer']:.3e} | {row['pass_std']:.3e} |")
        md.append("")
    md += [f"![{f}]({f})" for f in files]
    return "\n".join(md) + "\n"


def main() -> int:
    """Run the study on the models and write the results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--models", default="tiny,medium")
    args = ap.parse_args()
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            results.append(study_model(name, work, args.prompts, args.samples))
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mismatch_study.json").write_text(json.dumps(results, indent=2))
    files = plots(results)
    text = markdown(results, args, files)
    (RESULTS / "mismatch_study.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
