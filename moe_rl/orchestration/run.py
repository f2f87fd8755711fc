"""A run's lifecycle around the loop of :mod:`.loop`. :class:`Run` is a context manager:

- made: the run directory (new, resumed, or the old run moved aside), the resume point and the
  data order, the resolved config written, the metric sinks, the plan (decided once);
- entered: Ray started or joined, the plan's resources reserved, stop signals caught;
- :meth:`Run.place`: the trainer ranks, the engine servers (the plan at the nodes' real
  addresses), the rollout worker, the weight sync; the checkpoint loaded or the warm start,
  the first sync, the weight check's start;
- left: the servers stopped, the reservation released, the sinks closed; an exception that
  means the run lost a process (or was stopped from outside, or abandoned a step on a second
  signal) is recorded, not raised;
- :meth:`Run.outcome`: the one line the run ends with (:class:`RunFailed`,
  :class:`RunStopped`) or its summary.
"""
from __future__ import annotations

import contextlib
import os
import time

import ray

from moe_rl.orchestration import run_dir as run_dir_checks
from moe_rl.config import Config, as_dict, dump_config
from moe_rl.data.mixture import make_sampler
from moe_rl.errors import first_line
from moe_rl.engines.factory import engine_kind
from moe_rl.outputs.metrics_log import MetricsLogger
from moe_rl.orchestration import checkpoint
from moe_rl.orchestration.failures import RunFailed, lost_process
from moe_rl.orchestration.placement import make_plan
from moe_rl.orchestration.processes import ServedEngines, Trainers, write_plan
from moe_rl.orchestration.ray_placement import reserve, start_ray, stopped_from_outside
from moe_rl.orchestration.stop import Abandoned, RunStopped, StopRequest, abandoned_in
from moe_rl.orchestration.warm_start import warm_start
from moe_rl.orchestration.weight_check import WeightCheck
from moe_rl.orchestration.weight_sync import WeightSync
from moe_rl.orchestration.run_inputs import RunInputs, load_run_inputs
from moe_rl.outputs.run_summary import run_summary
from moe_rl.owned_dirs import write_atomic
from moe_rl.outputs.sample_log import SampleLog
from moe_rl.outputs.wandb_log import WandbLog


class Run:
    """One training run (see the module). ``resume``: continue from the latest complete
    checkpoint of the run (a fresh start when there is none); ``resume_from``: from that
    checkpoint directory, refused when a key that shapes the run differs from the checkpoint's
    (unless named in ``allow_changes``). A new run into a directory holding one is refused, or
    with ``overwrite`` the old run is moved aside. ``resume_command`` ends the message of a
    stopped or failed run."""

    def __init__(self, cfg: Config, inputs: RunInputs | None = None, *, resume: bool = False,
                 resume_from: str | None = None, overwrite: bool = False,
                 allow_changes: tuple[str, ...] = (), resume_command: str | None = None):
        run_dir_checks.prepare(cfg, resume=bool(resume or resume_from), overwrite=overwrite)
        self.cfg, self.resume_command = cfg, resume_command
        self.inputs = inputs or load_run_inputs(cfg)
        self.dir = cfg.logging.dir
        self.checkpoints = run_dir_checks.checkpoint_dir(cfg.trainer.checkpoint,
                                                          cfg.logging.dir)
        self.resume_path = resume_from or (checkpoint.latest(self.checkpoints) if resume
                                           else None)
        self.sampler = make_sampler(cfg, self.inputs.set_sizes or [len(self.inputs.prompts)],
                                    cfg.rollout.prompts_per_step)
        self.start_step = 0
        if self.resume_path:   # checked before anything of the run directory is written
            state = checkpoint.open_checkpoint(self.resume_path, cfg)
            run_dir_checks.check_resume(self.resume_path, cfg, allow_changes)
            self.start_step = state["step"]
            self.sampler.load_state_dict(state["sampler"])
        self._write_config()
        self.logger = MetricsLogger(self.dir, cfg.logging.tensorboard, cfg.logging.jsonl,
                                    self.start_step, self._sinks())
        self.samples_log = SampleLog(self.dir, cfg.logging.samples_max_mb, self.start_step,
                                     self.logger.writer)
        self.plan = make_plan(cfg)
        self.history: list[dict] = []
        self.evals: list[dict] = []   # the eval rows (step = updates done before it)
        self.saved = self.resume_path   # the last complete checkpoint of this run
        self.started = time.perf_counter()
        self.engines: ServedEngines | None = None
        self.trainers = self.rollout = self.weights = self.reservation = None
        self.abandoned = self.lost = self.outside = None
        self.stop = StopRequest(cfg.trainer.checkpoint.stop_grace_s)
        self._own_ray = False   # this run connected Ray (and shuts it down at its end)
        self._exit = contextlib.ExitStack()

    def _write_config(self) -> None:
        os.makedirs(self.checkpoints, exist_ok=True)
        os.makedirs(self.dir, exist_ok=True)
        write_atomic(os.path.join(self.dir, "config.yaml"), dump_config(self.cfg))
        where = os.path.abspath(self.dir)
        print(f"run directory: {where}", flush=True)
        print(f"resolved config: {os.path.join(where, 'config.yaml')}", flush=True)
        if self.resume_path:
            print(f"resuming at step {self.start_step} from {self.resume_path}", flush=True)

    def _sinks(self) -> list:
        if not self.cfg.logging.wandb.enabled:
            return []
        return [WandbLog(self.cfg.logging.wandb, self.dir, as_dict(self.cfg))]

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Run":
        self._own_ray = start_ray(self.cfg, self.plan)
        self.reservation = reserve(self.plan)
        self._exit.enter_context(self.stop)
        self.stop.starting = True   # until place() is done
        return self

    def place(self) -> None:
        """Every process of the plan on its node, the policy at the run's starting point on
        the trainer and the engines, and the weight check's start."""
        cfg = self.cfg
        self.trainers = Trainers(cfg, self.plan, self.reservation)
        if cfg.cluster.colocate:   # the servers size their memory with the trainer's in place
            self.trainers.ready(self.stop)
        # the engines are the run's before their servers start: a stop ends them mid-load
        self.engines = ServedEngines(cfg, self.plan, self.reservation)
        self.plan = self.engines.start(cfg.model.path, self.dir, self.stop)
        self.trainers.ready(self.stop)   # built meanwhile (apart from colocated engines)
        for part, (path, why) in self.trainers.compute_paths().items():
            print(f"trainer {part}: {path} ({why})", flush=True)
        write_plan(self.plan, self.reservation, os.path.join(self.dir, "plan.json"),
                   self.trainers.addresses())
        self.rollout = self.engines.rollout_worker()
        self.weights = WeightSync(cfg, self.plan, self.trainers, self.rollout,
                                  os.path.join(self.dir, "weights"))
        if self.start_step:
            self.trainers.load(os.path.join(self.resume_path, "trainer"))
            self.weights.sync(self.start_step)
        elif cfg.trainer.warmup.steps:
            warm_start(cfg, self.trainers, self.inputs, self.stop)
            self.weights.sync(0)
        if cfg.rollout.weight_check.enabled:   # the probe, and what the engine's precision explains
            self.weights.check = WeightCheck(
                cfg.rollout.weight_check, self.trainers, self.rollout, cfg.cluster.weight_sync,
                engine_kind(cfg).describe())
            self.weights.check.record_trainer(self.start_step)
            self.weights.check.passes(self.start_step)
        self.stop.starting = False

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            return exc is not None and self._ended_by(exc)
        finally:
            self.stop.closing()
            self.logger.close()
            if self.engines is not None:
                self.engines.__exit__(None, None, None)
            self.reservation.release()
            if self._own_ray:   # while a further stop signal is only acknowledged: a second
                ray.shutdown()   # SIGTERM cannot cut Ray's shutdown (left agents, a traceback)
            self._exit.close()

    def _ended_by(self, exc: BaseException) -> bool:
        """Whether ``exc`` is how a run ends rather than a bug: a step abandoned on a second
        stop signal (Ray's C code may wrap it), or a lost process of the run (then also
        whether it was stopped from outside). Recorded for :meth:`outcome`."""
        inner = (exc if isinstance(exc, Abandoned)
                 else abandoned_in(exc) if isinstance(exc, Exception) else None)
        if inner is not None:
            self.abandoned = str(inner)
            return True
        if not isinstance(exc, Exception) or isinstance(exc, RunFailed):
            return False   # a failure already named (an engine that died at start) stays itself
        lost = lost_process(exc) or (self.trainers.unreachable() if self.trainers else None)
        if lost is None:
            return False
        self.outside = stopped_from_outside()
        if lost_process(exc) is None:
            seen = getattr(exc, "cause", None) or exc   # a rank's own error
            lost += f"; the error seen first: {type(seen).__name__}: {first_line(seen)}"
        self.lost = lost
        return True

    # ------------------------------------------------------------------ the end
    def outcome(self) -> list[dict]:
        """The run's end, after the ``with``: RunFailed for a lost process or a stop from
        outside, RunStopped for a stop signal (both naming the last checkpoint and how to go
        on), else the summary printed and the per-step metrics returned."""
        cfg, saved = self.cfg, self.saved
        shown = os.path.relpath(saved) if saved and os.path.abspath(saved).startswith(
            os.getcwd() + os.sep) else saved   # shorter, when under the current directory
        done = self.start_step + len(self.history)
        again = (f"; continue with: {self.resume_command}" if saved and self.resume_command
            else "")
        where = f"last checkpoint {shown}" if saved else "no checkpoint was written"
        if self.lost:
            where += again if saved else ""
            if self.outside:
                raise RunFailed(f"stopped from outside the run during step {done}: "
                                f"{self.outside} (not sent by the run: another job's `ray "
                                f"stop`, or a kill); {where}")
            raise RunFailed(f"lost a process of the run during step {done} ({self.lost}): "
                            f"{where}")
        if self.stop.signum:
            what = (f"during start-up, before step {done} of {cfg.trainer.steps}"
                    if self.abandoned == StopRequest.STARTUP else
                    f"{done} of {cfg.trainer.steps} steps done, the next one abandoned "
                    f"({self.abandoned})" if self.abandoned
                    else f"after step {done} of {cfg.trainer.steps}")
            raise RunStopped(f"stopped by {self.stop.name}, {what}: {where}{again}",
                             self.stop.signum)
        before = self.logger.earlier   # a resumed run's summary covers the whole run
        print(run_summary([r for r in before if "kind" not in r] + self.history, cfg.trainer,
                          cfg.logging.dir, time.perf_counter() - self.started, saved,
                          [r for r in before if r.get("kind") == "eval"] + self.evals,
                          resumed_at=self.start_step), flush=True)
        per_step = cfg.trainer.epochs * cfg.trainer.mini_batches
        if self.history and all(r.get("train/skipped_steps", 0) >= per_step
                                for r in self.history):
            raise RunFailed(f"every optimizer step of the run's {len(self.history)} RL steps was "
                            f"skipped: the float16 gradients overflowed at every loss scale "
                            f"tried, so the policy never changed; lower "
                            f"trainer.loss_scale.initial (or train in bfloat16); {where}")
        return self.history
