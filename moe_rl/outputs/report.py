"""``moe-rl report``: PNG plots (matplotlib) and a markdown summary of one or more runs, read
from their TensorBoard event files; several runs are overlaid. Mismatch metrics are drawn on a
log scale (a float32 run's 1e-14 and an FP8 run's 1e-4 on one axis), noisy curves may be
smoothed, and evaluation metrics (``eval/*``) get a panel of their own when a run has them."""
from __future__ import annotations

import os
import sys

import numpy as np

from moe_rl.errors import UserError

PANELS = {
    "reward": ["reward/mean"],
    "mismatch": ["mismatch/k1", "mismatch/k3", "mismatch/extreme_frac"],
    "routing_agreement": ["routing/agreement"],
    "ess": ["is/ess"],
    "grad_norm": ["grad_norm"],
}
SUMMARY_KEYS = ["reward/mean", "mismatch/k3", "mismatch/extreme_frac", "routing/agreement",
                "is/ess", "grad_norm"]
LOG_SCALE_PREFIX = "mismatch/"
MAX_EVAL_PLOTS = 6
MAX_TICKS = 8   # labelled ticks on a symmetric-log axis, about
COLUMNS = 3     # panels in a row of one PNG


def read_scalars(run_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{tag: (steps, values)} from the TensorBoard events under ``run_dir`` (or ``run_dir/tb``);
    empty when there are none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    path = os.path.join(run_dir, "tb") if os.path.isdir(os.path.join(run_dir, "tb")) else run_dir
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        events = acc.Scalars(tag)
        out[tag] = (np.array([e.step for e in events]), np.array([e.value for e in events]))
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


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` in [0, 1),
    debiased at the start (weight 0: the values unchanged)."""
    out, acc, norm = np.empty(len(values)), 0.0, 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def default_out(run_dirs: list[str]) -> str:
    """``<run>/report`` for one run; ``<first run>/report-vs-<other names>`` for several."""
    first = os.path.normpath(run_dirs[0])
    if len(run_dirs) == 1:
        return os.path.join(first, "report")
    others = "-".join(os.path.basename(os.path.normpath(d)) for d in run_dirs[1:])
    return os.path.join(first, f"report-vs-{others}")


def load_runs(run_dirs: list[str]) -> dict[str, dict]:
    """{name: scalars} of every run that has scalars; a run without any is skipped with a
    warning on stderr; UserError for a missing directory or when no run is left."""
    runs = {}
    for d in run_dirs:
        if not os.path.isdir(d):
            raise UserError(f"RUN_DIR {d}: no such directory (give a run's logging.dir)")
        data = read_scalars(d)
        if not data:
            print(f"moe-rl report: {d}: no TensorBoard scalars (is logging.tensorboard off, or "
                  f"did the run stop before its first step?); skipped", file=sys.stderr)
            continue
        name = os.path.basename(os.path.normpath(d)) or d
        runs[name if name not in runs else os.path.normpath(d)] = data
    if not runs:
        raise UserError(f"RUN_DIR: none of {', '.join(run_dirs)} holds TensorBoard scalars")
    return runs


def _scale(ax, tag: str, runs: dict) -> None:
    """A log axis for mismatch metrics: log when every value is > 0, symmetric log when some
    are <= 0 and some not (at most :data:`MAX_TICKS` labelled decades), linear when all are 0."""
    from matplotlib.ticker import SymmetricalLogLocator
    if not tag.startswith(LOG_SCALE_PREFIX):
        return
    vals = np.concatenate([d[tag][1] for d in runs.values() if tag in d] or [np.zeros(0)])
    vals = vals[np.isfinite(vals)]
    nonzero = np.abs(vals[vals != 0])
    if not len(nonzero):
        return
    if (vals > 0).all():
        ax.set_yscale("log")
        return
    linthresh = float(nonzero.min())
    ax.set_yscale("symlog", linthresh=linthresh)
    decades = np.log10(float(nonzero.max()) / linthresh) + 1
    base = 10.0 ** max(1, int(np.ceil(decades / (MAX_TICKS // 2))))   # both signs share it
    ax.yaxis.set_major_locator(SymmetricalLogLocator(linthresh=linthresh, base=base))


def _figure(path: str, tags: list[str], runs: dict, weight: float) -> None:
    """One PNG: a panel per tag, at most :data:`COLUMNS` to a row."""
    import matplotlib.pyplot as plt
    cols = min(COLUMNS, len(tags))
    rows = -(-len(tags) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(tags):]:
        ax.set_visible(False)
    for ax, tag in zip(axes.flat, tags):
        for k, (name, data) in enumerate(runs.items()):
            if tag not in data:
                continue
            steps, values = data[tag]
            color = f"C{k % 10}"
            if weight > 0:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, smooth(values, weight), color=color, label=name)
            else:
                ax.plot(steps, values, color=color, label=name)
        _scale(ax, tag, runs)
        ax.set_title(tag + (" (log)" if ax.get_yscale() != "linear" else ""))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(tag in d for d in runs.values()):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def eval_panel(tags: list[str]) -> list[str]:
    """The ``eval/*`` curves the eval plot draws (at most :data:`MAX_EVAL_PLOTS`): every set's
    pass@1 and reward mean first, then its pass@k, then the rest; not the seconds taken."""
    return sorted((t for t in tags if t != "eval/time_s"),
                  key=lambda t: (0 if t.endswith(("/reward_mean", "/pass@1")) else
                                 1 if "/pass@" in t else 2, t))[:MAX_EVAL_PLOTS]


def make_report(run_dirs: list[str], out_dir: str | None = None, smoothing: float = 0.0) -> str:
    """Write one PNG per panel (and ``eval.png`` when a run has ``eval/*`` metrics) and
    ``report.md`` to ``out_dir`` (default: :func:`default_out`); returns the markdown path.
    ``smoothing``: TensorBoard's EMA weight in [0, 1) drawn over the raw curves."""
    import matplotlib
    matplotlib.use("Agg")
    if not 0 <= smoothing < 1:
        raise UserError(f"--smooth: expected a weight in [0, 1), got {smoothing}")
    runs = load_runs(run_dirs)
    out_dir = out_dir or default_out(run_dirs)
    os.makedirs(out_dir, exist_ok=True)
    panels = dict(PANELS)
    evals = sorted({t for d in runs.values() for t in d if t.startswith("eval/")})
    if evals:
        panels["eval"] = eval_panel(evals)
    for panel, tags in panels.items():
        _figure(os.path.join(out_dir, f"{panel}.png"), tags, runs, smoothing)
    lines = ["# Run report", "",
             "Degraded: first step where the 5-step moving average of reward/mean falls more than "
             "0.2 below its running maximum.", ""]
    for name, data in runs.items():
        lines += [f"## {name}", "", "| metric | first | last | min | max | mean |",
                  "|---|---|---|---|---|---|"]
        for tag in SUMMARY_KEYS + evals:
            if tag in data:
                v = data[tag][1]
                lines.append(f"| {tag} | {v[0]:.4g} | {v[-1]:.4g} | {v.min():.4g} | "
                             f"{v.max():.4g} | {v.mean():.4g} |")
        deg = degradation_step(*data["reward/mean"]) if "reward/mean" in data else None
        lines += ["", f"degraded at step: {deg if deg is not None else 'never'}", ""]
    lines += ["## Plots", ""] + [f"![{p}]({p}.png)" for p in panels]
    md = os.path.join(out_dir, "report.md")
    with open(md, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return md
