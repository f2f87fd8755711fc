"""``moe-rl eval --config FILE (--checkpoint CKPT | --hf DIR) [--out FILE] [key.sub=value ...]``:
the evaluation of training (``eval.*``) on a saved policy, without training: the engines serve
the policy, every ``eval.sets`` entry is sampled and scored, the ``eval/*`` metrics are printed
(and written as JSON with ``--out``)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from moe_rl.safe_path import SAFE_PATH_ENV
from moe_rl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="YAML config file with eval.sets (or a shipped config's name)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run's saved step (iter_NNNNNNN) or checkpoint "
                                             "folder (its latest step), converted to HF first")
    source.add_argument("--hf", help="a Hugging Face model directory")
    parser.add_argument("--out", help="also write the metrics to this JSON file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. eval.n=8 eval.temperature=0.6")


def _export_checkpoint(checkpoint: str, out_dir: str) -> str:
    """The policy of ``checkpoint`` as a HF model in ``out_dir`` (``moe-rl convert``)."""
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf",
                          "--checkpoint", checkpoint, "--out", out_dir],
                         capture_output=True, text=True, env={**os.environ, **SAFE_PATH_ENV})
    if res.returncode != 0:
        raise UserError(f"--checkpoint {checkpoint}: {res.stderr.strip().splitlines()[-1]}")
    return out_dir


def evaluate_model(cfg) -> dict:
    """Serve ``model.path`` on the configured engines (placed as a training run places them)
    and evaluate it; the servers are stopped afterwards."""
    import ray
    from moe_rl.orchestration.placement import make_plan
    from moe_rl.orchestration.processes import ServedEngines
    from moe_rl.orchestration.ray_placement import reserve, start_ray
    plan = make_plan(cfg)
    start_ray(cfg, plan)
    reservation = reserve(plan)
    try:
        with (tempfile.TemporaryDirectory(prefix="moe-rl-eval-") as scratch,
              ServedEngines(cfg, plan, reservation) as engines):
            engines.start(cfg.model.path, scratch)
            rollout = engines.rollout_worker(training=False)
            return ray.get(rollout.evaluate.remote(0, version=0))
    finally:
        reservation.release()


def check_out_path(out: str) -> None:
    """``--out``: a file that can be written, checked before the evaluation (which may take
    long) rather than after it (UserError naming the path)."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise UserError(f"--out {out}: is a directory; give a file path")
    if not os.path.isdir(folder):
        raise UserError(f"--out {out}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise UserError(f"--out {out}: not writable here")


def run(args: argparse.Namespace) -> int:
    from moe_rl.config import load_config
    from moe_rl.orchestration.run_inputs import load_run_inputs
    if args.out:
        check_out_path(args.out)
    with tempfile.TemporaryDirectory(prefix="moe-rl-eval-model-") as tmp:
        model = args.hf or _export_checkpoint(args.checkpoint, os.path.join(tmp, "hf"))
        if args.hf and not os.path.isfile(os.path.join(args.hf, "config.json")):
            raise UserError(f"--hf {args.hf}: not a Hugging Face model directory (no config.json)")
        cfg = load_config(args.config, [*args.overrides, f"model.path={os.path.abspath(model)}"])
        if not cfg.eval.sets:
            raise UserError("eval.sets: no held-out set to evaluate; add eval.sets=[{path: "
                            "FILE}] to the config or the command line")
        # every set's rows checked before anything starts; the training data is not used
        load_run_inputs(cfg, training=False)
        metrics = evaluate_model(cfg)
    for key in sorted(metrics):
        print(f"{key:40s} {metrics[key]:.4f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"model": args.hf or args.checkpoint, **metrics}, fh, indent=1)
        print(f"wrote {args.out}")
    return 0
