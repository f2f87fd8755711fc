"""Metric outputs of a run: TensorBoard scalars, a JSONL copy, further sinks (W&B), phase timers
and per-step progress (a bar on a terminal, lines elsewhere)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import sys
import time

from tqdm import tqdm

from moe_rl.errors import UserError
from moe_rl.owned_dirs import write_atomic


def _step_of(line: str) -> int | None:
    """The step of a JSONL record; None for a line a crash cut short or one that is not a
    record of a step (no integer ``step``): such a line is dropped."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def keep_lines_before(path: str, start_step: int) -> list[str]:
    """Keep in ``path`` the JSONL lines whose step comes before ``start_step`` (each returned
    with its newline). A line a crash cut short, anywhere (inside a multi-byte character
    too), one that is not UTF-8 JSON or names no integer step, is dropped. The file is
    replaced whole (a stop meanwhile leaves the old one); one that is a link or not a regular
    file is refused (UserError), as the run directory's check refuses it."""
    if os.path.islink(path) or not stat.S_ISREG(os.stat(path).st_mode):
        raise UserError(f"{path}: not a regular file; a run writes only inside its own "
                        f"directory, into files of its own")
    with open(path, "rb") as fh:
        pieces = fh.read().split(b"\n")
    keep = []
    for piece in pieces:
        try:
            line = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        step = _step_of(line) if line.strip() else None
        if step is not None and step < start_step:
            keep.append(line + "\n")
    write_atomic(path, "".join(keep))
    return keep


class MetricsLogger:
    """Writes one record per step to TensorBoard (``run_dir/tb``) and ``run_dir/metrics.jsonl``.

    Non-finite values are written as null in JSONL and skipped (and counted) in TensorBoard.
    ``start_step``: on resume, JSONL lines of steps >= start_step are dropped first; the rows
    kept are :attr:`earlier` (read back, for the summary of the whole run). ``sinks``: further
    outputs, each with ``log(step, metrics)`` and ``close()`` (W&B).
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, jsonl: bool = True,
                 start_step: int = 0, sinks: list | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.sinks = list(sinks or [])
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl") if jsonl else None
        self.earlier: list[dict] = []
        if self.jsonl_path and os.path.lexists(self.jsonl_path):
            keep = keep_lines_before(self.jsonl_path, start_step)
            self.earlier = [json.loads(line) for line in keep]
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Record ``metrics`` at ``step``; ``kind``: "train" (a step's row) or "eval" (an
        evaluation's, marked ``"kind": "eval"`` in JSONL)."""
        clean = {}
        for k, v in sorted(metrics.items()):
            v = float(v)
            finite = math.isfinite(v)
            clean[k] = v if finite else None
            if self.writer is not None and finite:   # JSONL records it as null
                self.writer.add_scalar(k, v, step)
        if self.jsonl_path:
            with open(self.jsonl_path, "a", encoding="utf-8") as fh:
                mark = {"kind": kind} if kind != "train" else {}
                fh.write(json.dumps({"step": step, **mark, **clean}) + "\n")
        if self.writer is not None:
            self.writer.flush()
        for sink in self.sinks:
            sink.log(step, metrics, kind)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for sink in self.sinks:
            sink.close()


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


def _duration(seconds: float) -> str:
    """``1h02m``, ``6m40s`` or ``12s``."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class StepProgress:
    """Progress a person can follow anywhere: on a terminal (stderr a TTY) a tqdm bar; otherwise
    (nohup, Slurm, a pipe) one line on stdout every ``interval`` steps and at the last one:
    ``<desc> 12/100 | reward 0.512 | ... | 4.1 s/step | ETA 6m01s``, with ``skipped N`` once a
    step was skipped (float16's overflows). ``enabled`` False: neither. ``tty``: force the choice
    (None: look at stderr)."""

    def __init__(self, total: int, desc: str, enabled: bool = True, interval: int = 1,
                 first: int = 0, tty: bool | None = None):
        self.total, self.desc, self.interval, self.done = total, desc, max(1, interval), first
        self.enabled, self.skipped = enabled, 0
        self.start, self.first = time.perf_counter(), first
        tty = sys.stderr.isatty() if tty is None else tty
        self.bar = tqdm(total=total, initial=first, desc=desc, leave=False, dynamic_ncols=True,
                        disable=not enabled or not tty)
        self.lines = enabled and not tty

    def update(self, fields: dict[str, str], skipped: float = 0) -> None:
        """One more step done; ``fields``: what to show of it, already formatted; ``skipped``:
        its optimizer steps that were skipped (counted over the run)."""
        self.done += 1
        self.skipped += int(skipped)
        if self.skipped:
            fields = {**fields, "skipped": str(self.skipped)}
        self.bar.update(1)
        self.bar.set_postfix(fields, refresh=False)
        if not self.lines or (self.done % self.interval and self.done != self.total):
            return
        per_step = (time.perf_counter() - self.start) / (self.done - self.first)
        parts = [f"{self.desc} {self.done}/{self.total}", *(f"{k} {v}" for k, v in fields.items()),
                 f"{per_step:.1f} s/step", f"ETA {_duration(per_step * (self.total - self.done))}"]
        print(" | ".join(parts), flush=True)

    def close(self) -> None:
        self.bar.close()


def step_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The per-step progress fields of an RL step's metrics: reward, mismatch k3, routing
    agreement (those present)."""
    shown = {"reward": ("reward/mean", "{:.3f}"), "k3": ("mismatch/k3", "{:.2e}"),
             "agreement": ("routing/agreement", "{:.4f}")}
    return {name: fmt.format(metrics[key]) for name, (key, fmt) in shown.items()
            if isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key])}
