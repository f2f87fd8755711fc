"""Metric outputs of a run: TensorBoard scalars, a JSONL copy, phase timers and progress bars."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

from tqdm import tqdm


def _step_of(line: str) -> int:
    """The step of a JSONL record; a line cut short by a crash counts as no step (dropped)."""
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return 1 << 62


class MetricsLogger:
    """Writes one record per step to TensorBoard (``run_dir/tb``) and ``run_dir/metrics.jsonl``.

    Non-finite values are written as null in JSONL and skipped (and counted) in TensorBoard.
    ``start_step``: on resume, JSONL lines of steps >= start_step are dropped first.
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, jsonl: bool = True,
                 start_step: int = 0):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.skipped_nonfinite = 0
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl") if jsonl else None
        if self.jsonl_path and os.path.exists(self.jsonl_path):
            with open(self.jsonl_path, encoding="utf-8") as fh:
                keep = [line for line in fh if _step_of(line) < start_step]
            with open(self.jsonl_path, "w", encoding="utf-8") as fh:
                fh.writelines(keep)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step or None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` at ``step``."""
        clean = {}
        for k, v in sorted(metrics.items()):
            v = float(v)
            finite = math.isfinite(v)
            clean[k] = v if finite else None
            if self.writer is not None:
                if finite:
                    self.writer.add_scalar(k, v, step)
                else:
                    self.skipped_nonfinite += 1
        if self.jsonl_path:
            with open(self.jsonl_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class PhaseTimer:
    """``with timer.phase("rollout"):`` adds ``timing/rollout_s`` to :attr:`metrics`."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{name}_s"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start


def progress_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr; disabled when asked or when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                disable=not enabled or not sys.stderr.isatty())
