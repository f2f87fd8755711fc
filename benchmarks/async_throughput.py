"""Asynchronous pipeline and dynamic sampling: throughput and learning against the synchronous
loop. Each run is a real ``moe-rl train`` (CPU reference engine, Ray, HTTP) of the demo task:

- tiny Qwen3-MoE (configs/tiny_cpu.yaml): sync (k = 0), k = 1, k = 2, each without dynamic
  sampling; sync and k = 1 with dynamic sampling; sync and k = 1 over ``--seeds`` seeds so the
  reward curves can be told apart from seed-to-seed noise; sync and k = 1 with a trainer-heavy
  step (``trainer.epochs=4``: the trainer's time comparable to the engine's);
- tiny DeepSeek-V3 (configs/deepseek_tiny_cpu.yaml): sync vs k = 1;
- a medium MoE shaped like Qwen3-30B-A3B's at CPU scale (8 layers, 64 experts, top-8, hidden
  256; warmed up by the config's supervised steps): sync vs k = 1 over ``--medium-steps``.

Per run: RL steps per hour (RL steps / summed ``timing/step_s``), generated tokens per second,
trainer idle fraction (1 - train time / step time), engine idle fraction (1 - generation and
scoring time / step time), mean reward of the first and last 20 steps, staleness. Writes
benchmarks/results/async_throughput.{json,md} and async_throughput_reward.png (reward against
step and against wall time). Usage: python benchmarks/async_throughput.py [--steps 100]
[--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COMMON = ["logging.progress=false", "trainer.checkpoint.export_hf=false"]
MEDIUM = ["model.init.hidden_size=256", "model.init.num_hidden_layers=8",
          "model.init.num_attention_heads=8", "model.init.num_key_value_heads=4",
          "model.init.head_dim=32", "model.init.moe_intermediate_size=128",
          "model.init.num_experts=64", "model.init.num_experts_per_tok=8"]
MODELS = {"tiny": ("tiny_cpu.yaml", []), "deepseek": ("deepseek_tiny_cpu.yaml", []),
          "medium": ("tiny_cpu.yaml", MEDIUM)}


def _run(config: str, model: pathlib.Path, run_dir: pathlib.Path, steps: int,
         extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(ROOT / "configs" / config),
           f"model.path={model}", f"logging.dir={run_dir}", f"trainer.steps={steps}",
           *COMMON, *extra]
    res = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise RuntimeError(f"{' '.join(extra)}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def summarise(rows: list[dict]) -> dict:
    """Throughput, idle fractions and reward of one run's metrics."""
    def total(key):
        return float(sum(r.get(key, 0.0) for r in rows))
    wall = total("timing/step_s")
    reward = [r["reward/mean"] for r in rows]
    return {"steps": len(rows), "rl_wall_s": wall,
            "steps_per_hour": 3600.0 * len(rows) / wall,
            "tokens_per_s": total("rollout/generated_tokens") / wall,
            "trainer_idle_frac": 1.0 - total("timing/train_s") / wall,
            "engine_idle_frac": 1.0 - total("timing/collect_s") / wall,
            "reward_first20": float(np.mean(reward[:20])),
            "reward_last20": float(np.mean(reward[-20:])),
            "staleness_mean": float(np.mean([r.get("rollout/staleness_mean", 0.0)
                                             for r in rows])),
            "generated_groups": total("rollout/generated_groups"),
            "dropped_groups": total("rollout/dropped_groups"),
            "reward": reward,
            "wall": list(np.cumsum([r["timing/step_s"] for r in rows]))}


def plan(seeds: int, steps: int, medium_steps: int
         ) -> list[tuple[str, str, str, int, int, list[str]]]:
    """(name, model, variant, seed, steps, overrides) of every run."""
    runs = []
    for seed in range(seeds):
        for k in (0, 1):
            runs.append((f"tiny_k{k}_s{seed}", "tiny", f"k{k}", seed, steps,
                         [f"rollout.max_staleness={k}", f"trainer.seed={seed + 1}"]))
    runs.append(("tiny_k2_s0", "tiny", "k2", 0, steps,
                 ["rollout.max_staleness=2", "trainer.seed=1"]))
    for k in (0, 1):
        runs.append((f"tiny_k{k}_dyn_s0", "tiny", f"k{k}+dyn", 0, steps,
                     [f"rollout.max_staleness={k}", "rollout.dynamic_sampling=true",
                      "trainer.seed=1"]))
        runs.append((f"tiny4ep_k{k}_s0", "tiny", f"k{k}", 0, steps,
                     [f"rollout.max_staleness={k}", "trainer.epochs=4", "trainer.seed=1"]))
        runs.append((f"deepseek_k{k}_s0", "deepseek", f"k{k}", 0, steps,
                     [f"rollout.max_staleness={k}", "trainer.seed=1"]))
        runs.append((f"medium_k{k}_s0", "medium", f"k{k}", 0, medium_steps,
                     [f"rollout.max_staleness={k}", "trainer.seed=1"]))
    return runs


def _plot(results: dict, out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {"k0": "tab:blue", "k1": "tab:orange", "k2": "tab:green",
               "k0+dyn": "tab:purple", "k1+dyn": "tab:red"}
    for name, r in results.items():
        if not name.startswith("tiny_"):
            continue
        smooth = np.convolve(r["reward"], np.ones(10) / 10, mode="valid")
        c = colours[r["variant"]]
        label = r["variant"] if r["seed"] == 0 else None
        axes[0].plot(np.arange(len(smooth)) + 9, smooth, color=c, alpha=0.8, label=label)
        axes[1].plot(np.array(r["wall"][9:]), smooth, color=c, alpha=0.8, label=label)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall time (s)")
    for ax in axes:
        ax.set_ylabel("reward/mean (10-step mean)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("tiny Qwen3-MoE, CPU: synchronous (k0) vs asynchronous (k1, k2) "
                 "and dynamic sampling (+dyn)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def _table(results: dict) -> list[str]:
    lines = ["| run | variant | RL steps/h | tokens/s | trainer idle | engine idle | "
             "staleness | groups generated / dropped | reward first 20 | reward last 20 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['variant']} | {r['steps_per_hour']:.0f} | "
                     f"{r['tokens_per_s']:.1f} | {r['trainer_idle_frac']:.2f} | "
                     f"{r['engine_idle_frac']:.2f} | {r['staleness_mean']:.2f} | "
                     f"{r['generated_groups']:.0f} / {r['dropped_groups']:.0f} | "
                     f"{r['reward_first20']:.3f} | {r['reward_last20']:.3f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--medium-steps", type=int, default=40)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        for model, (config, shape) in MODELS.items():
            subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                            str(ROOT / "configs" / config), "--out", str(work / model),
                            *shape], check=True, capture_output=True, timeout=300)
        for name, model, variant, seed, steps, extra in plan(args.seeds, args.steps,
                                                             args.medium_steps):
            rows = _run(MODELS[model][0], work / model, work / name, steps, extra)
            results[name] = {"model": model, "variant": variant, "seed": seed,
                             "overrides": extra, **summarise(rows)}
            r = results[name]
            print(f"{name}: {r['steps_per_hour']:.0f} steps/h, reward last 20 "
                  f"{r['reward_last20']:.3f}", flush=True)
    ratios = {}
    for setting in ("tiny_", "tiny4ep_", "deepseek_", "medium_"):
        base = [r["steps_per_hour"] for n, r in results.items()
                if n.startswith(setting) and r["variant"] == "k0"]
        for variant in ("k1", "k2", "k0+dyn", "k1+dyn"):
            got = [r["steps_per_hour"] for n, r in results.items()
                   if n.startswith(setting) and r["variant"] == variant]
            if base and got:
                ratios[f"{setting.rstrip('_')} {variant} vs k0"] = float(np.mean(got) /
                                                                        np.mean(base))
    spread = {}
    for variant in ("k0", "k1"):
        last = [r["reward_last20"] for n, r in results.items()
                if n.startswith("tiny_") and r["variant"] == variant]
        spread[variant] = {"mean": float(np.mean(last)), "min": float(min(last)),
                           "max": float(max(last)), "seeds": len(last)}
    (RESULTS / "async_throughput.json").write_text(json.dumps(
        {"steps": args.steps, "medium_steps": args.medium_steps, "ratios": ratios,
         "reward_last20_over_seeds": spread,
         "runs": {n: {k: v for k, v in r.items() if k not in ("reward", "wall")}
                  for n, r in results.items()},
         "curves": {n: {"reward": r["reward"], "wall": r["wall"]}
                    for n, r in results.items()}}, indent=1))
    _plot(results, RESULTS / "async_throughput_reward.png")
    lines = ["# Asynchronous pipeline and dynamic sampling (CPU, 2 cores)", "",
             f"{args.steps} RL steps per run ({args.medium_steps} for the medium model) after "
             f"the config's supervised warm start; `python benchmarks/async_throughput.py "
             f"--steps {args.steps} --seeds {args.seeds} --medium-steps {args.medium_steps}`.",
             "", "Throughput ratios against the synchronous loop (same model, mean over seeds):",
             ""] + [f"- {k}: **{v:.2f}x**" for k, v in ratios.items()] + [
             "", "Mean reward of the last 20 steps over seeds (tiny Qwen3-MoE):", ""] + [
             f"- {v}: mean {s['mean']:.3f}, min {s['min']:.3f}, max {s['max']:.3f} "
             f"({s['seeds']} seeds)" for v, s in spread.items()] + [
             "", *_table(results), "",
             "![reward](async_throughput_reward.png)", ""]
    (RESULTS / "async_throughput.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
