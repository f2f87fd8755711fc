"""Stability runs on FP8 rollouts: the tiny demo model trained by real ``moe-rl train`` runs whose
engine serves FP8 numerics (block-wise E4M3 weights, per-token activation groups, bfloat16
activations) against the float32 trainer, with an honest amplifier (learning rate 1e-2, 2 epochs
x 2 mini-batches per step, so updates go off-policy). Runs: no replay and no correction; R3;
R3 + seq-MIS; R3 + IcePop + seq-MIS; GSPO + R3; engine_avg pi_old with n = 4 (+ R3); the
collapse guard on (no replay, no correction). The no-replay / R3 comparison is repeated over 3
seeds so an effect can be told from noise. The curves and degradation table come from
``moe-rl report``.

Writes benchmarks/results/stability/ (report.md with the summary, PNGs, each run's
metrics.jsonl). Usage: python benchmarks/stability_runs.py [--steps 60] [--seeds 1,2,3]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "stability"
COMMON = ["rollout.engine_dtype=bfloat16", "rollout.quantization=fp8", "trainer.optim.lr=1e-2",
          "trainer.epochs=2", "trainer.mini_batches=2", "trainer.micro_batch_size=32",
          "logging.progress=false", "trainer.checkpoint.export_hf=false"]
PPO = ["algorithm.loss=ppo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
       "algorithm.aggregation=token-mean"]
RUNS = {
    "no_replay_no_correction": ["algorithm.replay=off", *PPO, "algorithm.corrections=[]"],
    "r3": ["algorithm.replay=r3", *PPO, "algorithm.corrections=[]"],
    "r3_seq_mis": ["algorithm.replay=r3", *PPO, "algorithm.corrections=[seq_mis]"],
    "r3_icepop_seq_mis": ["algorithm.replay=r3", *PPO, "algorithm.corrections=[icepop,seq_mis]"],
    "gspo_r3": ["algorithm.replay=r3", "algorithm.loss=gspo", "algorithm.corrections=[]"],
    "engine_avg_n4_r3": ["algorithm.replay=r3", *PPO, "algorithm.corrections=[]",
                         "algorithm.pi_old=engine_avg", "algorithm.pi_old_passes=4"],
    "guard_no_replay": ["algorithm.replay=off", *PPO, "algorithm.corrections=[]",
                        "algorithm.collapse_guard_k3=0.02"],
}
SEEDED = ("no_replay_no_correction", "r3")   # repeated over every seed


def _summary(rows: list[dict]) -> dict:
    r = [x["reward/mean"] for x in rows]
    k3 = [x["mismatch/k3"] for x in rows if "mismatch/k3" in x]
    return {"first10": sum(r[:10]) / 10, "last10": sum(r[-10:]) / 10, "max": max(r),
            "k3_mean": sum(k3) / max(len(k3), 1),
            "agreement_mean": statistics.fmean(x.get("routing/agreement", float("nan"))
                                               for x in rows)}


def main() -> int:
    """Run every configuration (the seeded ones once per seed), then the report."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    from moe_rl.trainer.parallel import free_port
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    summary: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        model = work / "model"
        subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config", cfg,
                        "--out", str(model)], check=True, capture_output=True)
        dirs = []
        for name, overrides in RUNS.items():
            for seed in (seeds if name in SEEDED else seeds[:1]):
                label = f"{name}_seed{seed}"
                run_dir = work / label
                res = subprocess.run(
                    [sys.executable, "-m", "moe_rl.cli", "train", "--config", cfg,
                     f"model.path={model}", f"logging.dir={run_dir}",
                     f"trainer.steps={args.steps}", f"rollout.servers.base_port={free_port()}",
                     f"trainer.seed={seed}", f"data.shuffle_seed={seed}", *COMMON, *overrides],
                    capture_output=True, text=True, cwd=work)
                if res.returncode:
                    print(res.stdout[-2000:], res.stderr[-4000:])
                    return 1
                rows = [json.loads(x) for x in
                        (run_dir / "metrics.jsonl").read_text().splitlines()]
                summary[label] = _summary(rows)
                print(f"{label}: {summary[label]}", flush=True)
                (OUT / label).mkdir(exist_ok=True)
                shutil.copy(run_dir / "metrics.jsonl", OUT / label / "metrics.jsonl")
                dirs.append(str(run_dir))
        subprocess.run([sys.executable, "-m", "moe_rl.cli", "report", *dirs, "--out", str(OUT)],
                       check=True, capture_output=True)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["# Stability runs on FP8 rollouts", "",
             f"Tiny demo model, FP8 reference engine (bfloat16 activations) vs float32 trainer, "
             f"lr 1e-2, 2 epochs x 2 mini-batches per step, {args.steps} steps; seeds "
             f"{seeds} for {', '.join(SEEDED)}, seed {seeds[0]} for the others. Overrides common "
             f"to all runs: `{' '.join(COMMON)}`.", ""]
    lines += [f"- **{n}**: `{' '.join(o)}`" for n, o in RUNS.items()] + [""]
    lines += ["| run | reward first 10 | reward last 10 | max | mean mismatch/k3 | "
              "mean routing/agreement |", "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {v['first10']:.3f} | {v['last10']:.3f} | {v['max']:.3f} | "
              f"{v['k3_mean']:.2e} | {v['agreement_mean']:.4f} |" for k, v in summary.items()]
    lines += ["", "Across seeds (mean ± std of the per-seed value):", "",
              "| configuration | reward last 10 | mean mismatch/k3 |", "|---|---|---|"]
    for name in SEEDED:
        vals = [summary[f"{name}_seed{s}"] for s in seeds]
        last = [v["last10"] for v in vals]
        k3 = [v["k3_mean"] for v in vals]
        sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        lines.append(f"| {name} | {statistics.fmean(last):.3f} ± {sd(last):.3f} | "
                     f"{statistics.fmean(k3):.2e} ± {sd(k3):.2e} |")
    text = (OUT / "report.md").read_text()
    (OUT / "report.md").write_text("\n".join(lines) + "\n\n" + text.replace("# Run report\n", ""))
    print((OUT / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
