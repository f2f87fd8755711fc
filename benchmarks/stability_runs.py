"""Stability runs: the same seed and an amplified mismatch (bfloat16 engine, float32 trainer, a
high learning rate, 2 epochs x 2 mini-batches per step so updates go off-policy), with
no correction and no replay; R3; R3 + seq-MIS; GSPO (+ R3 + seq-MIS); and no correction with
the collapse guard. Each run is a real ``moe-rl train`` on the tiny demo model; the curves and
the degradation table come from ``moe-rl report``.

Writes benchmarks/results/stability/ (report.md, PNGs, each run's metrics.jsonl).
Usage: python benchmarks/stability_runs.py [--steps 80]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "stability"
COMMON = ["rollout.engine_dtype=bfloat16", "trainer.lr=1e-2", "trainer.epochs=2",
          "trainer.mini_batches=2", "trainer.micro_batch_size=32", "trainer.seed=7",
          "logging.progress=false", "trainer.export_hf=false"]
RUNS = {
    "no_correction_no_replay": ["algorithm.replay=off", "algorithm.loss=ppo",
                                "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
                                "algorithm.corrections=[]"],
    "r3": ["algorithm.replay=r3", "algorithm.loss=ppo", "algorithm.clip_low=0.2",
           "algorithm.clip_high=0.28", "algorithm.corrections=[]"],
    "r3_seq_mis": ["algorithm.replay=r3", "algorithm.loss=ppo", "algorithm.clip_low=0.2",
                   "algorithm.clip_high=0.28", "algorithm.corrections=[seq_mis]"],
    "gspo_r3_seq_mis": ["algorithm.replay=r3", "algorithm.loss=gspo",
                        "algorithm.corrections=[seq_mis]"],
    "no_correction_guard": ["algorithm.replay=off", "algorithm.loss=ppo",
                            "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
                            "algorithm.corrections=[]", "algorithm.collapse_guard_k3=0.02"],
}


def main() -> int:
    """Run every configuration, then the report."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    from moe_rl.trainer.parallel import free_port
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        model = work / "model"
        subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config", cfg,
                        "--out", str(model)], check=True, capture_output=True)
        dirs = []
        for name, overrides in RUNS.items():
            run_dir = work / name
            res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", cfg,
                                  f"model.path={model}", f"logging.dir={run_dir}",
                                  f"trainer.steps={args.steps}", f"rollout.base_port={free_port()}",
                                  *COMMON, *overrides], capture_output=True, text=True, cwd=work)
            if res.returncode:
                print(res.stdout[-2000:], res.stderr[-4000:])
                return 1
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            r = [x["reward/mean"] for x in rows]
            print(f"{name}: reward first10 {sum(r[:10]) / 10:.3f} last10 {sum(r[-10:]) / 10:.3f}",
                  flush=True)
            (OUT / name).mkdir(exist_ok=True)
            shutil.copy(run_dir / "metrics.jsonl", OUT / name / "metrics.jsonl")
            dirs.append(str(run_dir))
        subprocess.run([sys.executable, "-m", "moe_rl.cli", "report", *dirs, "--out", str(OUT)],
                       check=True, capture_output=True)
    text = (OUT / "report.md").read_text()
    header = ["# Stability runs", "", "Same seed, tiny demo model, bfloat16 engine vs float32 "
              "trainer, lr 1e-2, 2 epochs x 2 mini-batches per step, "
              f"{args.steps} steps. Overrides common to all runs: `{' '.join(COMMON)}`.", ""]
    header += [f"- **{n}**: `{' '.join(o)}`" for n, o in RUNS.items()] + [""]
    (OUT / "report.md").write_text("\n".join(header) + text.replace("# Run report\n", ""))
    print((OUT / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
