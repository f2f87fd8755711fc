"""Partial rollouts on a long-tailed task: RL steps per hour and reward with ``rollout.partial``
against the same pipeline without it, in one run, over several seeds. Each run is a real
``moe-rl train`` (CPU reference engine, Ray, HTTP, R3 + GSPO + seq-MIS, configs/tiny_cpu.yaml).

The task: prompt ``"n:"``, answer the digits ``1234567890...`` cut to n characters, the demo's
reward (1 for exactly the answer then end of text, less for a right prefix or digits). n is
log-normal (median MEDIAN, sigma SIGMA) with the longest set to 10x the median, so after the
supervised warm start the response lengths are long-tailed as in ``long_sequences.py``.

Arms (same seeds): ``sync`` (max_staleness 1 without partial rollouts: batches launched one step
ahead) against ``partial`` (max_staleness 2 with partial rollouts: also launched one step ahead,
one version left to the continued responses), ``partial_mask`` (the same, a response past the
bound kept with its old tokens out of the loss instead of restarted) and ``partial_mask_e2``
(that with 2 extra groups in flight instead of 4); and ``k0`` (the synchronous loop) against
``partial_k1`` (partial rollouts, nothing launched ahead). ``--arms`` runs a subset (the report
shows the pairs it holds). Per run: RL steps per hour (RL steps
/ summed ``timing/step_s``), generated tokens per second, mean reward of the first and last 20
steps, the partial figures. Writes benchmarks/results/partial_rollouts.{json,md}.
Usage: python benchmarks/partial_rollouts.py [--steps 60] [--seeds 3] [--arms sync partial ...]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MEDIAN, SIGMA, SIZE, CAP = 6, 0.8, 200, 64
COMMON = ["logging.progress=false", "trainer.checkpoint.export_hf=false", "data.source=jsonl",
          "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=8",
          f"rollout.max_new_tokens={CAP}", "trainer.warmup.steps=30"]
PARTIAL = ["rollout.max_staleness=2", "rollout.partial.enabled=true"]
ARMS = {"sync": ["rollout.max_staleness=1"],
        "partial": PARTIAL,
        "k0": ["rollout.max_staleness=0"],
        "partial_k1": ["rollout.max_staleness=1", "rollout.partial.enabled=true"],
        "partial_mask": PARTIAL + ["rollout.partial.stale=mask"],
        "partial_mask_e2": PARTIAL + ["rollout.partial.stale=mask",
                                      "rollout.partial.extra_groups=2"]}
PAIRS = (("partial", "sync"), ("partial_k1", "k0"), ("partial_mask", "sync"),
         ("partial_mask_e2", "sync"))


def lengths(n: int, seed: int = 0) -> list[int]:
    """``n`` answer lengths: log-normal (median MEDIAN, sigma SIGMA) in [1, 10 x MEDIAN], the
    longest set to 10 x MEDIAN."""
    rng = random.Random(seed)
    z = [rng.gauss(0.0, 1.0) for _ in range(n)]
    out = [min(10 * MEDIAN, max(1, round(MEDIAN * math.exp(SIGMA * v)))) for v in z]
    out[max(range(n), key=z.__getitem__)] = 10 * MEDIAN
    return out


def write_task(path: pathlib.Path) -> list[int]:
    """The task's JSONL rows at ``path``; returns the answer lengths."""
    ns = lengths(SIZE)
    digits = "1234567890" * (10 * MEDIAN // 10 + 1)
    with open(path, "w", encoding="utf-8") as fh:
        for n in ns:
            fh.write(json.dumps({"prompt": f"{n}:", "answer": digits[:n]}) + "\n")
    return ns


def run(work: pathlib.Path, name: str, seed: int, steps: int, extra: list[str]) -> list[dict]:
    run_dir = work / f"{name}_s{seed}"
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
           str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={work / 'model'}",
           f"logging.dir={run_dir}", f"trainer.steps={steps}", f"data.path={work / 'task.jsonl'}",
           f"trainer.seed={seed + 1}", *COMMON, *extra]
    res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise RuntimeError(f"{name} seed {seed}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def summarise(rows: list[dict]) -> dict:
    wall = float(sum(r["timing/step_s"] for r in rows))
    reward = [r["reward/mean"] for r in rows]
    return {"steps": len(rows), "rl_wall_s": wall, "steps_per_hour": 3600.0 * len(rows) / wall,
            "tokens_per_s": float(sum(r["rollout/generated_tokens"] for r in rows)) / wall,
            "reward_first20": float(np.mean(reward[:20])),
            "reward_last20": float(np.mean(reward[-20:])),
            "response_len_mean": float(np.mean([r["response_len/mean"] for r in rows])),
            "partial_frac": float(np.mean([r.get("rollout/partial_frac", 0.0) for r in rows])),
            "token_lag_mean": float(np.mean([r.get("rollout/token_version_lag_mean", 0.0)
                                             for r in rows])),
            "partial_dropped": float(sum(r.get("rollout/partial_dropped", 0.0) for r in rows)),
            "mismatch_k3_max": float(max(abs(r["mismatch/k3"]) for r in rows)),
            "reward": reward}


def report(results: dict, steps: int, seeds: int, ns: list[int]) -> str:
    arms = sorted({k.rsplit("_s", 1)[0] for k in results}, key=list(ARMS).index)
    chosen = "" if arms == list(ARMS) else " --arms " + " ".join(arms)
    lines = ["# Partial rollouts on a long-tailed task (CPU, 2 cores)", "",
             f"{steps} RL steps per run after a {COMMON[-1].split('=')[1]}-step supervised warm "
             f"start; `python benchmarks/partial_rollouts.py --steps {steps} --seeds {seeds}"
             f"{chosen}`. "
             f"Answer lengths: median {int(np.median(ns))}, longest {max(ns)} "
             f"(log-normal, sigma {SIGMA}); responses capped at {CAP} tokens.", "",
             "RL steps per hour, ratio to the same pipeline without partial rollouts (per seed, "
             "then the mean):", ""]
    for arm, base in PAIRS:
        if arm not in arms or base not in arms:
            continue
        ratios = [results[f"{arm}_s{s}"]["steps_per_hour"] / results[f"{base}_s{s}"]
                  ["steps_per_hour"] for s in range(seeds)]
        lines.append(f"- {arm} vs {base}: " + ", ".join(f"{r:.2f}x" for r in ratios) +
                     f"; mean **{np.mean(ratios):.2f}x**")
    lines += ["", "Mean reward of the last 20 steps over seeds:", ""]
    for arm in arms:
        last = [results[f"{arm}_s{s}"]["reward_last20"] for s in range(seeds)]
        lines.append(f"- {arm}: mean {np.mean(last):.3f}, min {min(last):.3f}, "
                     f"max {max(last):.3f}")
    lines += ["", "| run | RL steps/h | tokens/s | response length | partial frac | token lag "
              "| restarted | max mismatch k3 | reward first 20 | reward last 20 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['steps_per_hour']:.0f} | {r['tokens_per_s']:.1f} | "
                     f"{r['response_len_mean']:.1f} | {r['partial_frac']:.2f} | "
                     f"{r['token_lag_mean']:.2f} | {r['partial_dropped']:.0f} | "
                     f"{r['mismatch_k3_max']:.1e} | {r['reward_first20']:.3f} | "
                     f"{r['reward_last20']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        ns = write_task(work / "task.jsonl")
        subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                        str(ROOT / "configs" / "tiny_cpu.yaml"), "--out", str(work / "model"),
                        f"model.init.max_position_embeddings={2 * CAP + 8}"],
                       check=True, capture_output=True, timeout=300)
        for seed in range(args.seeds):   # the arms of one seed back to back (shared machine)
            for arm in args.arms:
                rows = run(work, arm, seed, args.steps, ARMS[arm])
                results[f"{arm}_s{seed}"] = summarise(rows)
                print(f"{arm} seed {seed}: {results[f'{arm}_s{seed}']['steps_per_hour']:.0f} "
                      f"steps/h, reward last 20 "
                      f"{results[f'{arm}_s{seed}']['reward_last20']:.3f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "partial_rollouts.json").write_text(json.dumps(
        {"steps": args.steps, "seeds": args.seeds, "median": MEDIAN, "sigma": SIGMA, "cap": CAP,
         "runs": results}, indent=1))
    (RESULTS / "partial_rollouts.md").write_text(report(results, args.steps, args.seeds, ns))
    print((RESULTS / "partial_rollouts.md").read_text())


if __name__ == "__main__":
    main()
