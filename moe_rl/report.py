"""``moe-rl report``: PNG plots (matplotlib) and a markdown summary of one or more runs, read
from their TensorBoard event files; several runs are overlaid."""
from __future__ import annotations

import os

import numpy as np

PANELS = {
    "reward": ["reward/mean"],
    "mismatch": ["mismatch/k1", "mismatch/k3", "mismatch/extreme_frac"],
    "routing_agreement": ["routing/agreement"],
    "ess": ["is/ess"],
    "grad_norm": ["grad_norm"],
}
SUMMARY_KEYS = ["reward/mean", "mismatch/k3", "mismatch/extreme_frac", "routing/agreement",
                "is/ess", "grad_norm"]


def read_scalars(run_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{tag: (steps, values)} from the TensorBoard events under ``run_dir`` (or ``run_dir/tb``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    path = os.path.join(run_dir, "tb") if os.path.isdir(os.path.join(run_dir, "tb")) else run_dir
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        events = acc.Scalars(tag)
        out[tag] = (np.array([e.step for e in events]), np.array([e.value for e in events]))
    if not out:
        raise ValueError(f"{run_dir}: no TensorBoard scalars found")
    return out


def degradation_step(steps: np.ndarray, reward: np.ndarray, window: int = 5,
                     drop: float = 0.2) -> int | None:
    """First step where the moving average (``window`` steps) of the reward falls more than
    ``drop`` below its running maximum: the run "degraded" there. None if it never does."""
    if len(reward) < window:
        return None
    avg = np.convolve(reward, np.ones(window) / window, mode="valid")
    best = np.maximum.accumulate(avg)
    bad = np.nonzero(best - avg > drop)[0]
    return int(steps[bad[0] + window - 1]) if len(bad) else None


def make_report(run_dirs: list[str], out_dir: str) -> str:
    """Write one PNG per panel and ``report.md``; returns the markdown path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    runs = {os.path.basename(os.path.normpath(d)) or d: read_scalars(d) for d in run_dirs}
    for panel, tags in PANELS.items():
        fig, axes = plt.subplots(1, len(tags), figsize=(5 * len(tags), 3.5), squeeze=False)
        for ax, tag in zip(axes[0], tags):
            for name, data in runs.items():
                if tag in data:
                    ax.plot(*data[tag], label=name)
            ax.set_title(tag)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if any(tag in d for d in runs.values()):
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{panel}.png"), dpi=100)
        plt.close(fig)
    lines = ["# Run report", "",
             "Degraded: first step where the 5-step moving average of reward/mean falls more than "
             "0.2 below its running maximum.", ""]
    for name, data in runs.items():
        lines += [f"## {name}", "", "| metric | first | last | min | max | mean |",
                  "|---|---|---|---|---|---|"]
        for tag in SUMMARY_KEYS:
            if tag in data:
                v = data[tag][1]
                lines.append(f"| {tag} | {v[0]:.4g} | {v[-1]:.4g} | {v.min():.4g} | "
                             f"{v.max():.4g} | {v.mean():.4g} |")
        deg = degradation_step(*data["reward/mean"]) if "reward/mean" in data else None
        lines += ["", f"degraded at step: {deg if deg is not None else 'never'}", ""]
    lines += ["## Plots", ""] + [f"![{p}]({p}.png)" for p in PANELS]
    md = os.path.join(out_dir, "report.md")
    with open(md, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return md
