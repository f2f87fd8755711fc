"""The lines a run prints when it ends (``moe-rl train`` and ``moe-rl demo``): steps and time,
the reward's rise, the mismatch and routing agreement, where the checkpoint and policy are."""
from __future__ import annotations

import math
import os

from moe_rl.engines.factory import engine_kind
from moe_rl.config.schema import TrainerConfig


def _mean(history: list[dict], key: str, rows: slice = slice(None)) -> float:
    vals = [h[key] for h in history[rows] if isinstance(h.get(key), (int, float))
            and math.isfinite(h[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def eval_line(evals: list[dict]) -> str | None:
    """Each held-out set's pass@1 at the first and the last evaluation of the run (the one,
    when there was one)."""
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    once = first["step"] == last["step"]
    parts = [f"{key.split('/')[1]} pass@1 {first[key]:.3f} (after {first['step']} updates)"
             + ("" if once else f" -> {last[key]:.3f} (after {last['step']})")
             for key in sorted(last) if key.endswith("/pass@1") and key in first
             and isinstance(first[key], float) and isinstance(last[key], float)]
    return "  eval: " + "; ".join(parts) if parts else None


def run_summary(history: list[dict], trainer: TrainerConfig, log_dir: str, seconds: float,
                checkpoint: str | None, evals: list[dict] = (), resumed_at: int = 0) -> str:
    """What the run in ``log_dir`` did, in a few lines (``history``: the per-step metrics of
    the whole run, the steps before a resume included; ``evals``: its evaluation rows;
    ``seconds``: this process's time, which began at step ``resumed_at``)."""
    done = len(history)
    if not done:
        return (f"run finished: no RL step left to do (trainer.steps={trainer.steps}); "
                f"checkpoint {checkpoint or 'none'}")
    k = max(1, min(10, done // 2))
    first, last = _mean(history, "reward/mean", slice(0, k)), _mean(history, "reward/mean",
                                                                     slice(-k, None))
    session = f", resumed at step {resumed_at}" if resumed_at else ""
    timed = [h for h in history if h["step"] >= resumed_at]
    rise = (f"mean reward {first:.3f}" if done == 1 else
            f"mean reward of the first {k} steps {first:.3f}, of the last {k} {last:.3f} (rise "
            f"{last - first:+.3f})")
    lines = [f"run finished: {done} RL steps (steps {history[0]['step']}-{history[-1]['step']}) "
             f"in {seconds / 60:.1f} min{session} ({_mean(timed, 'timing/step_s'):.1f} s/step); "
             f"{rise}",
             f"  mismatch/k3 {_mean(history, 'mismatch/k3'):.2e} (mean), routing/agreement "
             f"{_mean(history, 'routing/agreement'):.4f} (mean)",
             f"  run directory {log_dir}; last checkpoint {checkpoint or 'none'}"]
    if eval_line(list(evals)):
        lines.insert(2, eval_line(list(evals)))
    if trainer.checkpoint.export_hf:
        lines.append(f"  final policy (HF) {os.path.join(log_dir, 'final_hf')}")
    return "\n".join(lines)


def replay_summary(history: list[dict], cfg) -> str:
    """What the engine/trainer difference was and what routing replay did about it, averaged
    over the run's steps."""
    r = cfg.rollout
    engine = f"{r.quantization} " if r.quantization != "none" else ""
    lines = [f"engine: {engine}{engine_kind(cfg).describe()}; trainer: {cfg.model.dtype}"]
    if cfg.algorithm.replay == "r3":
        lines.append(f"  without replay the trainer's own routers would have agreed with the "
                     f"engine on {100 * _mean(history, 'routing/agreement'):.2f}% of (token, "
                     f"layer) choices; {100 * _mean(history, 'routing/token_differs_frac'):.1f}% "
                     f"of tokens would have been routed differently in some layer")
        lines.append(f"  with R3 the trainer replays the engine's routing: mismatch/k3 "
                     f"{_mean(history, 'mismatch/k3'):.2e}, extreme_frac "
                     f"{_mean(history, 'mismatch/extreme_frac'):.4f} (what is left is the FP8 / "
                     f"bfloat16 arithmetic itself)")
    else:
        lines.append(f"  replay {cfg.algorithm.replay}: routing agreement "
                     f"{_mean(history, 'routing/agreement'):.4f}, mismatch/k3 "
                     f"{_mean(history, 'mismatch/k3'):.2e}")
    return "\n".join(lines)
