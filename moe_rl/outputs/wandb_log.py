"""Weights & Biases logging of a run (``logging.wandb``): the resolved config once, then every
step's scalars (the ones TensorBoard gets) and each evaluation as a table, into one W&B run per run
directory, which a resumed run continues (its id is kept in ``<run>/wandb_run_id``). Files go under
``<run>/wandb``."""
from __future__ import annotations

import math
import os
import secrets

from moe_rl.config.schema import WandbConfig

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: str) -> str:
    """The W&B run id of ``run_dir``: the one it was given, else a new one (kept)."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    rid = secrets.token_hex(4)   # W&B's ids: 8 lower-case letters and digits
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(rid + "\n")
    return rid


class WandbLog:
    """A metrics sink: ``log(step, metrics)`` and ``close()``, as :class:`MetricsLogger` calls
    them; the W&B run records ``config`` (the resolved configuration, as a mapping)."""

    def __init__(self, w: WandbConfig, run_dir: str, config: dict):
        import wandb
        self.run = wandb.init(project=w.project, entity=w.entity,
                              name=w.name or os.path.basename(os.path.abspath(run_dir)),
                              mode=w.mode, tags=list(w.tags), dir=run_dir,
                              config=config, id=run_id(run_dir), resume="allow")

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """The step's finite scalars at ``step``; an evaluation's also as the table
        ``eval/table`` (one row per set: step, set, then each metric)."""
        row = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        if kind == "eval":
            row["eval/table"] = self._eval_table(step, metrics)
        self.run.log(row, step=step)

    @staticmethod
    def _eval_table(step: int, metrics: dict[str, float]):
        import wandb
        sets: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3:   # eval/<set>/<metric>
                sets.setdefault(parts[1], {})[parts[2]] = float(value)
        columns = sorted({m for per in sets.values() for m in per})
        return wandb.Table(columns=["step", "set", *columns],
                           data=[[step, name, *(per.get(m) for m in columns)]
                                 for name, per in sorted(sets.items())])

    def close(self) -> None:
        self.run.finish()
