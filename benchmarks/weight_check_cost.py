"""What the engine self-check after every weight update (``rollout.weight_check``) costs: the same
`moe-rl train` run of a shipped CPU config (its batch, model and engine) with the check on and
off, the check's own time (``timing/weight_check_s``: the trainer's probe forward, every
server's scoring and routing refetch) against the step's (``timing/step_s``), steps 2 onwards.

Usage: python benchmarks/weight_check_cost.py [--steps N] [--config NAME ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def run(config: str, model: pathlib.Path, out: pathlib.Path, steps: int, check: bool) -> dict:
    """Mean step and check seconds of one run, its first two steps left out (start-up)."""
    from moe_rl.trainer.parallel import free_port
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", config,
                    f"model.path={model}", f"logging.dir={out}", f"trainer.steps={steps}",
                    "trainer.warmup.steps=0", "trainer.checkpoint.export_hf=false",
                    "logging.progress=false", f"rollout.servers.base_port={free_port()}",
                    f"rollout.weight_check.enabled={str(check).lower()}"],
                   check=True, capture_output=True, timeout=1800, cwd=out.parent)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][2:]
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)   # noqa: E731
    return {"step_s": mean("timing/step_s"), "check_s": mean("timing/weight_check_s"),
            "probe_k3": mean("weights/probe_k3") if check else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--config", nargs="+", default=["tiny_cpu", "tiny_math_cpu"])
    args = ap.parse_args()
    rows = []
    for config in args.config:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                            config, "--out", str(tmp / "model")], check=True,
                           capture_output=True, timeout=600)
            on = run(config, tmp / "model", tmp / "on", args.steps, True)
            off = run(config, tmp / "model", tmp / "off", args.steps, False)
        rows.append({"config": config, "steps": args.steps, "step_s_check_on": on["step_s"],
                     "step_s_check_off": off["step_s"], "check_s": on["check_s"],
                     "check_share_of_step": on["check_s"] / on["step_s"],
                     "probe_k3": on["probe_k3"]})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "weight_check_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# Weight check cost (rollout.weight_check)", "",
             "`python benchmarks/weight_check_cost.py`: each config's run with the check on and "
             "off, 2 CPU cores; means over steps 2 onwards.", "",
             "| config | step s (check off) | step s (check on) | check s | share of step | "
             "probe k3 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['step_s_check_off']:.3f} | {r['step_s_check_on']:.3f} | "
              f"{r['check_s']:.3f} | {100 * r['check_share_of_step']:.1f}% | "
              f"{r['probe_k3']:.1e} |" for r in rows]
    (RESULTS / "weight_check_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
