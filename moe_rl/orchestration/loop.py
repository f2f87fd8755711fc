"""The RL loop, top to bottom: prompts -> n samples per prompt -> rewards -> pi_old -> advantages
and corrections -> updates -> weight sync -> metrics -> checkpoint. The run around it (its
directory, processes, teardown and ending) is :class:`moe_rl.orchestration.run.Run`."""
from __future__ import annotations

import os
import time

import ray

from moe_rl.config import Config
from moe_rl.config.schema import DataConfig, LoggingConfig, TrainerConfig
from moe_rl.errors import first_line
from moe_rl.rollout.evaluation import eval_due
from moe_rl.outputs.metrics_log import MetricsLogger, PhaseTimer, StepProgress, step_fields
from moe_rl.orchestration import checkpoint
from moe_rl.orchestration.failures import RunFailed
from moe_rl.orchestration.processes import Trainers
from moe_rl.orchestration.run import Run
from moe_rl.rewards.service import reward_setting
from moe_rl.rollout.batch import BatchSummary, extra_prompts, step_seed
from moe_rl.orchestration.run_inputs import RunInputs

# steps in a row whose every advantage was 0 before the run says it learns nothing
NO_SIGNAL_STEPS = 3


def run_training(cfg: Config, inputs: RunInputs | None = None, resume: bool = False,
                 resume_from: str | None = None, overwrite: bool = False,
                 allow_changes: tuple[str, ...] = (),
                 resume_command: str | None = None) -> list[dict]:
    """Run the configured RL job (``inputs``: the loaded model tokenizer, prompts and reward,
    loaded here when not given; the other arguments as :class:`Run` takes them). A stop signal
    (see :mod:`.stop`) ends the run cleanly with :class:`RunStopped`, whose message ends with
    ``resume_command``. Returns the per-step metrics."""
    run = Run(cfg, inputs, resume=resume, resume_from=resume_from, overwrite=overwrite,
              allow_changes=allow_changes, resume_command=resume_command)
    with run:
        run.place()
        StepLoop(run).run()
    return run.outcome()


class StepLoop:
    """The steps of a placed :class:`Run`, from its start step to ``trainer.steps`` or a stop
    signal; each one's metrics go to the run's sinks and history."""

    def __init__(self, run: Run):
        self.run_, self.cfg = run, run.cfg
        self.pipeline = RolloutPipeline(run.cfg, run.rollout, run.sampler, run.trainers.n_data,
                                        run.start_step)
        self.bar = StepProgress(run.cfg.trainer.steps, "RL step", run.cfg.logging.progress,
                                run.cfg.logging.log_interval, first=run.start_step)
        self.failed_batches = 0
        self.no_signal = 0   # steps in a row whose every advantage was 0
        self.timeouts_named = False
        self.last_save = time.monotonic()

    def run(self) -> None:
        run, cfg = self.run_, self.cfg
        # a resumed run repeats the evaluation its rows lost
        if eval_due(cfg.eval, cfg.trainer.steps, run.start_step):
            run.evals.append(run_eval(run.rollout, run.logger, run.start_step))
        for step in range(run.start_step, cfg.trainer.steps):
            if run.stop.signum:
                break
            metrics = self.step(step)
            run.logger.log(step, metrics)
            run.history.append({"step": step, **metrics})
            self.bar.update(step_fields(metrics), skipped=metrics.get("train/skipped_steps", 0))
            self.say_when_nothing_is_learned(step, metrics)
            self.after(step)
        run.stop.stop_clock()
        self.bar.close()
        if not run.stop.signum:
            run.weights.wait()
            export_final(cfg.trainer, cfg.logging, run.trainers)

    def step(self, step: int) -> dict:
        """One RL step: its batch (launched ahead in the asynchronous pipeline), the update,
        the weight sync; its metrics."""
        run, cfg = self.run_, self.cfg
        timer = PhaseTimer()
        t0 = time.perf_counter()
        self.pipeline.launch(version=step)
        with timer.phase("wait_rollout"):
            summary, shards = self.pipeline.next_batch(step)
        timer.metrics.update(summary.timing)
        self.check_rollout(step, summary)
        if cfg.cluster.colocate:   # the engines give their memory to the trainer
            with timer.phase("engine_release"):
                ray.get(run.rollout.release_memory.remote())
        with timer.phase("train"):   # a batch left empty (every trajectory dropped)
            metrics = run.trainers.train_step(shards) if summary.samples else {}
        run.samples_log.log(step, summary.shown, metrics.pop("sample_notes", []))
        if cfg.cluster.colocate:
            with timer.phase("engine_resume"):
                ray.get(run.rollout.resume_memory.remote())
        with timer.phase("weight_sync"):   # asynchronous pipeline: queued, not awaited
            run.weights.sync(step + 1, wait=cfg.rollout.max_staleness == 0)
        metrics.update(timer.metrics)
        metrics["timing/step_s"] = time.perf_counter() - t0
        metrics.update(summary.metrics())
        metrics.update(throughput(metrics))
        restarts = ray.get(run.rollout.restarts.remote())
        if restarts > (run.history[-1]["rollout/engine_restarts"] if run.history else 0):
            print(f"step {step}: engine servers restarted so far: {restarts} (a server stopped "
                  f"answering; restarted and given the current weights)", flush=True)
        metrics["rollout/engine_restarts"] = float(restarts)
        metrics["rollout/weight_sync_recoveries"] = float(run.weights.recoveries)
        if run.weights.check is not None:   # the last checked version's figures
            metrics.update(run.weights.check.metrics)
        return metrics

    def check_rollout(self, step: int, summary: BatchSummary) -> None:
        """Stop on batches the reward failed on entirely (:func:`check_batch`); say once that
        rewards timed out, and when trajectories were dropped on environment errors."""
        self.failed_batches = (self.failed_batches + 1 if summary.reward_failed_everywhere
                               else 0)
        check_batch(self.cfg.data, summary, self.failed_batches)
        if summary.reward_timeouts_total and not self.timeouts_named:
            self.timeouts_named = True
            scorer, bound = reward_setting(self.cfg.data)
            print(f"step {step}: {scorer} did not return within the time allowed ({bound}) on "
                  f"{summary.reward_timeouts_total} sample(s), dropped (counted in "
                  f"reward/timeouts)", flush=True)
        dropped = (summary.counts.get("rollout/env_errors", 0)
                   + summary.counts.get("rollout/env_timeouts", 0))
        if dropped and summary.first_env_error:
            print(f"step {step}: {int(dropped)} trajectories dropped on environment errors or "
                  f"timeouts; first: {summary.first_env_error}", flush=True)

    def say_when_nothing_is_learned(self, step: int, metrics: dict) -> None:
        """After :data:`NO_SIGNAL_STEPS` steps in a row whose every advantage was 0 (every
        response of a group scored alike: no gradient from the policy loss), say so once per
        such stretch, with the likely causes."""
        self.no_signal = self.no_signal + 1 if metrics.get("advantage/zero_frac") == 1.0 else 0
        if self.no_signal != NO_SIGNAL_STEPS:
            return
        alike = ("every reward 0" if metrics.get("reward/mean") == 0
                 and metrics.get("reward/std") == 0 else "no spread within any group")
        warm = self.cfg.trainer.warmup.steps
        print(f"warning: step {step}: no learning signal for {NO_SIGNAL_STEPS} steps: every "
              f"response of each group scored alike ({alike}; advantage/zero_frac 1), so the "
              f"policy loss has no gradient. Likely causes: "
              + ("a model that never answers in the reward's format yet (a new `moe-rl "
                 "init-model` model is random: warm it up with trainer.warmup.steps, "
                 "supervised steps on the data's answers); " if warm == 0 else "")
              + f"the answer format the reward ({self.cfg.data.reward}) expects differs from "
              f"what the model writes (see samples.jsonl); prompts all too hard or too easy "
              f"for the model", flush=True)

    def after(self, step: int) -> None:
        """After step ``step``: the checkpoint when due (or when stopping), the evaluation and
        the HF export when due."""
        run, cfg = self.run_, self.cfg
        since_save = time.monotonic() - self.last_save
        if checkpoint_due(cfg.trainer, step + 1, since_save) or run.stop.signum:
            # the data order as of the consumed steps: in-flight batches are regenerated
            run.saved = checkpoint.save(run.trainers, {"step": step + 1,
                                                       "sampler": self.pipeline.sampler_state()},
                                        cfg, run.checkpoints, step + 1)
            self.last_save = time.monotonic()
        # after the sync it names
        if eval_due(cfg.eval, cfg.trainer.steps, step + 1) and not run.stop.signum:
            run.evals.append(run_eval(run.rollout, run.logger, step + 1))
        every = cfg.trainer.checkpoint.export_hf_interval
        if every and (step + 1) % every == 0:
            run.trainers.export(os.path.join(run.dir, "hf", f"iter_{step + 1:07d}"))


def throughput(metrics: dict) -> dict[str, float]:
    """``throughput/tokens_per_s``: the response tokens the model generated for the step over
    the step's wall time; ``throughput/rollout_tokens_per_s``: the same tokens over the time of
    their generation (``timing/rollout_s``; in the asynchronous pipeline it ran beside an
    earlier step's training)."""
    tokens = metrics.get("rollout/generated_tokens")
    if tokens is None:
        return {}
    out = {"throughput/tokens_per_s": tokens / metrics["timing/step_s"]}
    if metrics.get("timing/rollout_s", 0) > 0:
        out["throughput/rollout_tokens_per_s"] = tokens / metrics["timing/rollout_s"]
    return out


class RolloutPipeline:
    """The rollout side of the loop: with ``rollout.max_staleness`` k = 0, each step's batch is
    generated when the step starts (the synchronous loop); with k >= 1 the batches of the next
    steps are generated while the trainer trains, each from the weights of its launch, at most
    k versions older than the step that trains on it. With partial rollouts
    (``rollout.partial``) the pipeline launches at most k - 1 steps ahead: one version of the
    bound is left to the responses continued from the step before (every token is at most k
    versions old when trained); the first batch also starts ``rollout.partial.extra_groups`` more
    groups.

    Versions, named once: training step s trains on the batch of step s and its update makes
    weight version s + 1 (version 0: the starting weights, after the warm start if any); the
    prompt sampler's position after drawing step s's prompts is s + 1 batches (a checkpoint
    saves it as of the consumed steps). The batch of step t is generated from version v with
    t - max_staleness <= v <= t, v being the version :meth:`launch` is given.

    Weight updates never land in the middle of a request: the rollout worker is one Ray actor
    that runs one call at a time, so a weight sync queued behind a batch's generation waits
    until that batch is finished (a barrier between batches; no pause/continue needed). The
    worker checks before each batch that every server reports the version the batch was
    launched with (``RolloutWorker._check_serving``), so no sample is silently generated from
    other weights if that order ever broke."""

    def __init__(self, cfg: Config, rollout, sampler, n_shards: int, start_step: int):
        self.cfg, self.rollout, self.sampler, self.n_shards = cfg, rollout, sampler, n_shards
        self.next_step = start_step
        self.started = False   # partial rollouts: the first batch also starts the extra groups
        self.pending: list[tuple[int, dict, list]] = []   # (step, sampler state before, refs)

    def launch(self, version: int) -> None:
        """Start generating every batch the staleness bound allows, with the engines at weight
        ``version``: the steps up to ``version + max_staleness`` (and the trainer's steps)."""
        r, steps = self.cfg.rollout, self.cfg.trainer.steps
        ahead = r.max_staleness - 1 if r.partial.enabled else r.max_staleness
        while self.next_step < steps and self.next_step - version <= ahead:
            state = self.sampler.state_dict()
            indices = self.sampler.next_batch()
            extra = extra_prompts(self.cfg.rollout, self.sampler, first=not self.started)
            self.started = True
            t = self.next_step
            refs = self.rollout.collect.options(num_returns=self.n_shards + 1).remote(
                indices, t, version, step_seed(self.cfg.trainer.seed, t), self.n_shards, extra)
            self.pending.append((t, state, refs))
            self.next_step += 1

    def next_batch(self, step: int) -> tuple[BatchSummary, list]:
        """The summary and the shard references of ``step``'s batch (waits for it)."""
        t, _, (summary_ref, *shards) = self.pending.pop(0)
        if t != step:
            raise RuntimeError(f"rollout pipeline: expected the batch of step {step}, got {t}")
        return ray.get(summary_ref), shards

    def sampler_state(self) -> dict:
        """The prompt sampler as of the consumed steps (before any in-flight batch drew)."""
        return self.pending[0][1] if self.pending else self.sampler.state_dict()


def run_eval(rollout, logger: MetricsLogger, done: int) -> dict:
    """Evaluate the policy after ``done`` updates (the rollout worker runs it after every call
    queued before it, the weight sync of version ``done`` included), log it as an eval row at
    step ``done`` and return it."""
    metrics = ray.get(rollout.evaluate.remote(done, version=done))
    logger.log(done, metrics, kind="eval")
    shown = ", ".join(f"{k[5:]} {v:.3f}" for k, v in metrics.items()
                      if k.endswith(("/reward_mean", "/pass@1")))
    print(f"eval after {done} updates: {shown}", flush=True)
    return {"step": done, **metrics}


def checkpoint_due(trainer: TrainerConfig, done: int, since_save_s: float) -> bool:
    """Whether a checkpoint is due after ``done`` steps, ``since_save_s`` seconds after the last:
    at the last step, every ``trainer.checkpoint.interval`` steps, or ``interval_minutes`` after
    the last save, whichever comes first."""
    t = trainer
    c = t.checkpoint
    return (done == t.steps or bool(c.interval and done % c.interval == 0)
            or bool(c.interval_minutes and since_save_s >= 60 * c.interval_minutes))


def check_batch(data: DataConfig, summary: BatchSummary, failed_batches: int) -> None:
    """Stop the run (RunFailed: one line naming the key, exit 1) when the reward or the
    environment failed on everything for ``data.max_failed_reward_batches`` batches in a row."""
    if failed_batches < data.max_failed_reward_batches:
        return
    limit = f"data.max_failed_reward_batches={data.max_failed_reward_batches}"
    if not summary.samples and data.environment is not None:
        raise RunFailed(
            f"data.environment: {data.environment} failed on every trajectory of "
            f"{failed_batches} batch(es) in a row ({limit}); nothing is left to train on. "
            f"First error: {first_line(summary.first_env_error or '')}")
    raise RunFailed(
        f"{reward_setting(data)[0]} failed on every sample of {failed_batches} batch(es) "
        f"in a row ({limit}); training on zero rewards would learn nothing. Last error: "
        f"{first_line(summary.last_reward_error or '')}")


def export_final(trainer: TrainerConfig, logging: LoggingConfig, trainers: Trainers) -> None:
    """The final policy as a HF model in ``<run>/final_hf`` (with an EMA: the EMA there, the raw
    weights in ``final_hf_raw``), when ``trainer.checkpoint.export_hf``."""
    if not trainer.checkpoint.export_hf:
        return
    final = os.path.join(logging.dir, "final_hf")
    if trainer.ema.decay is not None and not trainer.ema.policy:   # EMA released
        trainers.export(final, use_ema=True)
        trainers.export(os.path.join(logging.dir, "final_hf_raw"))
        print(f"final policy (EMA, decay {trainer.ema.decay}) exported to {final}; "
              f"the raw weights to {final}_raw", flush=True)
    else:
        trainers.export(final)
        print(f"final policy exported to {final}", flush=True)


