"""The RL loop, top to bottom: prompts -> n samples per prompt -> rewards -> pi_old -> advantages
and corrections -> updates -> weight sync -> metrics -> checkpoint."""
from __future__ import annotations

import os
import time

import ray
import torch

from moe_rl import run_dir as run_dir_checks
from moe_rl.config import Config, dump_config
from moe_rl.data.mixture import make_sampler
from moe_rl.data.prompts import PromptSampler
from moe_rl.errors import first_line
from moe_rl.evaluation import eval_due
from moe_rl.metrics_log import MetricsLogger, PhaseTimer, StepProgress, step_fields
from moe_rl.orchestration import checkpoint
from moe_rl.orchestration.weight_check import WeightCheck
from moe_rl.orchestration.weight_sync import weight_sync_for
from moe_rl.orchestration.placement import make_plan
from moe_rl.orchestration.sharding import per_rank
from moe_rl.orchestration.ray_placement import reserve, start_ray, stopped_from_outside
from moe_rl.orchestration.failures import RunFailed, lost_process
from moe_rl.orchestration.stop import Abandoned, RunStopped, StopRequest, abandoned_in
from moe_rl.orchestration.workers import (EngineHost, RolloutWorker, TrainerWorker,
                                          served_checkpoint)
from moe_rl.rewards.service import reward_setting
from moe_rl.run_inputs import RunInputs, load_run_inputs
from moe_rl.run_summary import run_summary
from moe_rl.sample_log import SampleLog
from moe_rl.trainer.parallel import free_port
from moe_rl.types import RolloutBatch, Sample



def _cfg_tree(cfg: Config) -> dict:
    import yaml
    return yaml.safe_load(dump_config(cfg))


def place_engines(cfg: Config, plan, reservation, model_path: str, log_dir: str) -> list:
    """Start every engine server of ``plan`` on its node (an :class:`EngineHost` actor each, in
    its node's bundle); returns the hosts once every server answers /health, with the plan's
    engine entries updated to the address and port each server took."""
    import dataclasses
    from moe_rl.orchestration.placement import PlannedProcess
    os.makedirs(log_dir, exist_ok=True)
    tree = _cfg_tree(cfg)
    hosts = [EngineHost.options(**reservation.options(cfg, p)).remote(
        tree, dataclasses.asdict(p), plan.nodes, model_path,
        os.path.join(log_dir, f"engine_{p.index}.log")) for p in plan.of("engine")]
    ray.get([h.placed.remote() for h in hosts])   # every port held before any is released
    placed = ray.get([h.start.remote() for h in hosts])
    engines = iter(PlannedProcess(**d) for d in placed)
    plan.processes = [next(engines) if p.role == "engine" else p for p in plan.processes]
    return hosts


def sft_samples(prompts, indices: list[int], tokenizer, environment: type | None = None,
                vocab_size: int | None = None) -> list[Sample]:
    """Supervised warm-start examples: prompt + reference answer + end of text; with an
    environment, prompt + its demonstration, the observation segments loss-masked."""
    from moe_rl.envs import demonstration_segments
    out = []
    for k, i in enumerate(indices):
        rec = prompts[i]
        if environment is None:
            segs = [tokenizer(rec.answer, add_special_tokens=False)["input_ids"]
                    + [tokenizer.eos_token_id]]
        else:
            segs = demonstration_segments(environment(tokenizer), rec, vocab_size)
        ids = [t for seg in segs for t in seg]
        mask = [j % 2 == 0 for j, seg in enumerate(segs) for _ in seg]
        out.append(Sample(prompt_ids=rec.ids, response_ids=ids, loss_mask=mask,
                          rollout_logprobs=torch.zeros(len(ids)), sample_id=k, group_id=k))
    return out


class Trainers:
    """The trainer worker group: one Ray actor per rank, on the node and GPU the plan says."""

    def __init__(self, cfg: Config, plan, reservation):
        tree = _cfg_tree(cfg)
        ranks = plan.of("trainer")
        first = reservation.options(cfg, ranks[0])
        # the rendezvous lives on rank 0's node: its address, and a port free there
        self.single_node = plan.nodes == 1   # then every rendezvous stays on 127.0.0.1
        address = "127.0.0.1" if plan.nodes == 1 else reservation.addresses[ranks[0].node]
        port = ray.get(ray.remote(free_port).options(
            scheduling_strategy=first["scheduling_strategy"], num_cpus=0).remote(
            "127.0.0.1" if plan.nodes == 1 else address))
        self.actors = [TrainerWorker.options(**reservation.options(cfg, p)).remote(
            tree, p.index, len(ranks), address, port, p.gpus[0] if p.gpus else None)
            for p in ranks]
        # tensor- and context-parallel ranks of one data-parallel rank share its samples
        self.data_ranks = ray.get([a.data_parallel_rank.remote() for a in self.actors])
        self.n_data = max(self.data_ranks) + 1

    def unreachable(self, timeout_s: float = 30.0) -> str | None:
        """The first rank that is gone or does not answer within ``timeout_s`` (after a peer's
        error, e.g. gloo's "Connection closed by peer": which rank was lost), else None."""
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.node_ip.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                return f"trainer rank {rank}: no answer within {timeout_s:g} s"
            except Exception as exc:   # noqa: BLE001  (what Ray says about the rank)
                return f"trainer rank {rank}: {lost_process(exc) or type(exc).__name__}"
        return None

    def addresses(self) -> list[str]:
        """The node address each rank runs at, as the rank itself sees it."""
        return ray.get([a.node_ip.remote() for a in self.actors])

    def train_step(self, shards: list) -> dict:
        """One RL step; ``shards``: one reference per data-parallel rank to its rollout-batch
        bytes (Ray hands each rank its bytes from the object store; the driver never holds
        them); the tensor- and context-parallel ranks of a data-parallel rank get the same."""
        return ray.get([a.train_step.remote(ref) for a, ref in
                        zip(self.actors, per_rank(shards, self.data_ranks))])[0]

    def probe(self, data: bytes) -> list[tuple]:
        """The weight check's trainer side on the probe ``data`` (rollout-batch bytes), held by
        data-parallel rank 0; every rank enters the forward."""
        shards = [data] + [RolloutBatch([]).to_bytes()] * (self.n_data - 1)
        return ray.get([a.probe.remote(d) for a, d in
                        zip(self.actors, per_rank(shards, self.data_ranks))])[0]

    def sft_step(self, samples: list[Sample], lr: float) -> dict:
        shards = [RolloutBatch(samples[i::self.n_data]).to_bytes() for i in range(self.n_data)]
        return ray.get([a.sft_step.remote(data, lr) for a, data in
                        zip(self.actors, per_rank(shards, self.data_ranks))])[0]

    def export(self, out_dir: str, use_ema: bool = False) -> None:
        """A HF checkpoint of the policy (``use_ema``: its exponential moving average)."""
        ray.get([a.export_hf.remote(out_dir, use_ema) for a in self.actors])

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path) for a in self.actors])

    def load(self, path: str) -> int:
        """Every rank loads checkpoint ``path``; a refusal (damaged or crafted files, another
        model or layout) is a CheckpointError naming it."""
        try:
            return ray.get([a.load.remote(path) for a in self.actors])[0]
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise checkpoint.CheckpointError(
                f"{path}: cannot be loaded ({type(cause).__name__}: {first_line(cause)})") \
                from None


class RolloutPipeline:
    """The rollout side of the loop: with ``rollout.max_staleness`` k = 0, each step's batch is
    generated when the step starts (the synchronous loop); with k >= 1 the batches of the next
    steps are generated while the trainer trains, each from the weights of its launch, at most
    k versions older than the step that trains on it.

    Versions, named once: training step s trains on the batch of step s and its update makes
    weight version s + 1 (version 0: the starting weights, after the warm start if any); the
    prompt sampler's position after drawing step s's prompts is s + 1 batches (a checkpoint
    saves it as of the consumed steps). The batch of step t is generated from version v with
    t - max_staleness <= v <= t, v being the version :meth:`launch` is given.

    Weight updates never land in the middle of a request: the rollout worker is one Ray actor
    that runs one call at a time, so a weight sync queued behind a batch's generation waits
    until that batch is finished (a barrier between batches; no pause/continue needed). The
    worker checks before each batch that every server reports the version the batch was
    launched with (``RolloutWorker.check_serving``), so no sample is silently generated from
    other weights if that order ever broke."""

    def __init__(self, cfg: Config, rollout, sampler, n_shards: int, start_step: int):
        self.cfg, self.rollout, self.sampler, self.n_shards = cfg, rollout, sampler, n_shards
        self.next_step = start_step
        self.pending: list[tuple[int, dict, list]] = []   # (step, sampler state before, refs)

    def launch(self, version: int) -> None:
        """Start generating every batch the staleness bound allows, with the engines at weight
        ``version``: the steps up to ``version + max_staleness`` (and the trainer's steps)."""
        r, steps = self.cfg.rollout, self.cfg.trainer.steps
        while self.next_step < steps and self.next_step - version <= r.max_staleness:
            state = self.sampler.state_dict()
            indices = self.sampler.next_batch()
            extra = []
            if r.dynamic_sampling:
                cap = r.prompts_per_step if r.max_oversample is None else r.max_oversample
                extra = [i for _ in range(-(-cap // r.prompts_per_step))
                         for i in self.sampler.next_batch()][:cap]
            t = self.next_step
            refs = self.rollout.collect.options(num_returns=self.n_shards + 1).remote(
                indices, t, version, self.cfg.trainer.seed * 100_003 + t * 10_007,
                self.n_shards, extra)
            self.pending.append((t, state, refs))
            self.next_step += 1

    def next_batch(self, step: int) -> tuple[dict, list]:
        """The summary and the shard references of ``step``'s batch (waits for it)."""
        t, _, (summary_ref, *shards) = self.pending.pop(0)
        if t != step:
            raise RuntimeError(f"rollout pipeline: expected the batch of step {step}, got {t}")
        return ray.get(summary_ref), shards

    def sampler_state(self) -> dict:
        """The prompt sampler as of the consumed steps (before any in-flight batch drew)."""
        return self.pending[0][1] if self.pending else self.sampler.state_dict()


def run_training(cfg: Config, inputs: RunInputs | None = None, resume: bool = False,
                 resume_from: str | None = None, overwrite: bool = False,
                 allow_changes: tuple[str, ...] = (),
                 resume_command: str | None = None) -> list[dict]:
    """Run the configured RL job (``inputs``: the loaded model tokenizer, prompts and reward,
    loaded here when not given); ``resume``: continue from the latest complete checkpoint of
    the run (a fresh start when there is none), ``resume_from``: from that checkpoint
    directory, refused when a key that shapes the run differs from the checkpoint's (unless
    named in ``allow_changes``). A new run into a directory holding one is refused, or with
    ``overwrite`` the old run is moved aside. A stop signal (see :mod:`.stop`) ends the run
    cleanly with :class:`RunStopped`, whose message ends with ``resume_command``. Returns the
    per-step metrics."""
    run_dir_checks.prepare(cfg, resume=bool(resume or resume_from), overwrite=overwrite)
    inputs = inputs or load_run_inputs(cfg)
    prompts = inputs.prompts
    run_dir = cfg.logging.dir
    ckpt_dir = run_dir_checks.checkpoint_dir(cfg)
    resume_path = resume_from or (checkpoint.latest(ckpt_dir) if resume else None)
    sampler = make_sampler(cfg, inputs.set_sizes or [len(prompts)], cfg.rollout.prompts_per_step)
    start_step = 0
    if resume_path:   # checked before anything of the run directory is written
        state = checkpoint.open_checkpoint(resume_path, cfg)
        run_dir_checks.check_resume(resume_path, cfg, allow_changes)
        start_step = state["step"]
        sampler.load_state_dict(state["sampler"])
    os.makedirs(ckpt_dir, exist_ok=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as fh:
        fh.write(dump_config(cfg))
    print(f"run directory: {os.path.abspath(run_dir)}", flush=True)
    print(f"resolved config: {os.path.join(os.path.abspath(run_dir), 'config.yaml')}",
          flush=True)
    if resume_path:
        print(f"resuming at step {start_step} from {resume_path}", flush=True)
    sinks = []
    if cfg.logging.wandb.enabled:
        from moe_rl.wandb_log import WandbLog
        sinks.append(WandbLog(cfg, run_dir))
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, cfg.logging.jsonl, start_step,
                           sinks)
    samples_log = SampleLog(run_dir, cfg.logging.samples_max_mb, start_step, logger.writer)
    plan = make_plan(cfg)
    start_ray(cfg, plan)
    reservation = reserve(cfg, plan)
    hosts: list = []
    history: list[dict] = []
    evals: list[dict] = []   # the eval rows (step = updates done before it)
    started = time.perf_counter()
    saved = resume_path   # the last complete checkpoint of this run
    abandoned = lost = outside = trainers = None
    with StopRequest(cfg.trainer.stop_grace_s) as stop:
        try:
            trainers = Trainers(cfg, plan, reservation)
            # FP8 rollouts: the engines serve the block-wise FP8 checkpoint of the weights
            served = served_checkpoint(cfg, cfg.model.path, os.path.join(run_dir, "fp8_start"))
            plan = make_plan(cfg, node_addresses=reservation.addresses, model_path=served)
            hosts = place_engines(cfg, plan, reservation, served, os.path.join(run_dir, "logs"))
            write_plan(plan, reservation, os.path.join(run_dir, "plan.json"),
                       trainers.addresses())
            rollout = RolloutWorker.options(**reservation.options(cfg, plan.of("rollout")[0])
                                            ).remote(_cfg_tree(cfg), hosts)
            weights = weight_sync_for(cfg, trainers, rollout, os.path.join(run_dir, "weights"))
            if start_step:
                trainers.load(os.path.join(resume_path, "trainer"))
                weights.sync(start_step)
            elif cfg.trainer.sft_warmup_steps:
                warm_start(cfg, trainers, inputs, stop)
                weights.sync(0)
            if cfg.rollout.weight_check:   # the probe, and what the engine's precision explains
                weights.check = WeightCheck(cfg, trainers, rollout)
                weights.check.record_trainer(start_step)
                weights.check.passes(start_step)
            bar = StepProgress(cfg.trainer.steps, "RL step", cfg.logging.progress,
                               cfg.logging.log_interval, first=start_step)
            failed_batches, reward_timeouts_named = 0, False
            pipeline = RolloutPipeline(cfg, rollout, sampler, trainers.n_data, start_step)
            last_save = time.monotonic()
            if eval_due(cfg, start_step):   # a resumed run repeats the one its rows lost
                evals.append(run_eval(rollout, logger, start_step))
            for step in range(start_step, cfg.trainer.steps):
                if stop.signum:
                    break
                timer = PhaseTimer()
                t0 = time.perf_counter()
                pipeline.launch(version=step)
                with timer.phase("wait_rollout"):
                    summary, shards = pipeline.next_batch(step)
                timer.metrics.update(summary["timing"])
                failed_batches = failed_batches + 1 \
                    if summary["reward_failures"] >= summary["reward_calls"] else 0
                check_batch(cfg, summary, failed_batches)
                if summary["reward_timeouts_total"] and not reward_timeouts_named:
                    reward_timeouts_named = True
                    scorer, bound = reward_setting(cfg.data)
                    print(f"step {step}: {scorer} did not return within the time allowed "
                          f"({bound}) on {summary['reward_timeouts_total']} sample(s), "
                          f"dropped (counted in reward/timeouts)", flush=True)
                dropped = summary["counts"].get("rollout/env_errors", 0) + \
                    summary["counts"].get("rollout/env_timeouts", 0)
                if dropped and summary["first_env_error"]:
                    print(f"step {step}: {int(dropped)} trajectories dropped on environment "
                          f"errors or timeouts; first: {summary['first_env_error']}", flush=True)
                if cfg.cluster.colocate:   # the engines give their memory to the trainer
                    with timer.phase("engine_release"):
                        ray.get(rollout.release_memory.remote())
                with timer.phase("train"):   # a batch left empty (every trajectory dropped)
                    metrics = trainers.train_step(shards) if summary["samples"] else {}
                samples_log.log(step, summary["shown"], metrics.pop("sample_notes", []))
                if cfg.cluster.colocate:
                    with timer.phase("engine_resume"):
                        ray.get(rollout.resume_memory.remote())
                with timer.phase("weight_sync"):   # asynchronous pipeline: queued, not awaited
                    weights.sync(step + 1, wait=cfg.rollout.max_staleness == 0)
                metrics.update(timer.metrics)
                metrics["timing/step_s"] = time.perf_counter() - t0
                metrics["reward/errors"] = float(summary["reward_errors_total"])
                metrics["reward/timeouts"] = float(summary["reward_timeouts_total"])
                metrics["rollout/stale_samples"] = float(summary["stale_samples"])
                metrics.update(summary["counts"])
                metrics["rollout/engine_restarts"] = float(ray.get(rollout.restarts.remote()))
                metrics["rollout/weight_sync_recoveries"] = float(weights.recoveries)
                if weights.check is not None:   # the last checked version's figures
                    metrics.update(weights.check.metrics)
                logger.log(step, metrics)
                history.append({"step": step, **metrics})
                bar.update(step_fields(metrics))
                if checkpoint_due(cfg, step + 1, time.monotonic() - last_save) \
                        or stop.signum:
                    # the data order as of the consumed steps: in-flight batches are regenerated
                    saved = checkpoint.save(trainers, {"step": step + 1,
                                                       "sampler": pipeline.sampler_state()},
                                            cfg, ckpt_dir, step + 1)
                    last_save = time.monotonic()
                if eval_due(cfg, step + 1) and not stop.signum:   # after the sync it names
                    evals.append(run_eval(rollout, logger, step + 1))
                every = cfg.trainer.export_hf_interval
                if every and (step + 1) % every == 0:
                    trainers.export(os.path.join(run_dir, "hf", f"iter_{step + 1:07d}"))
            stop.stop_clock()
            bar.close()
            if not stop.signum:
                weights.wait()
                export_final(cfg, trainers)
        except Abandoned as exc:
            abandoned = str(exc)
        except Exception as exc:   # the handler's Abandoned, wrapped by Ray's C code
            if abandoned_in(exc) is not None:
                abandoned = str(abandoned_in(exc))
            else:   # a node or process of the run went away (itself, or a rank's peer)
                lost = lost_process(exc) or (trainers.unreachable() if trainers else None)
                if lost is None:
                    raise
                outside = stopped_from_outside()
                if lost_process(exc) is None:
                    seen = getattr(exc, "cause", None) or exc   # a rank's own error
                    lost += f"; the error seen first: {type(seen).__name__}: {first_line(seen)}"
        finally:
            stop.closing()
            logger.close()
            stop_engines(hosts)
            reservation.release()
    shown = os.path.relpath(saved) if saved and os.path.abspath(saved).startswith(
        os.getcwd() + os.sep) else saved   # shorter, when under the current directory
    done = start_step + len(history)
    again = f"; continue with: {resume_command}" if saved and resume_command else ""
    if lost:
        where = f"last checkpoint {shown}{again}" if saved else "no checkpoint was written"
        if outside:
            raise RunFailed(f"stopped from outside the run during step {done}: {outside} (not "
                            f"sent by the run: another job's `ray stop`, or a kill); {where}")
        raise RunFailed(f"lost a process of the run during step {done} ({lost}): {where}")
    if stop.signum:
        where = f"last checkpoint {shown}" if saved else "no checkpoint was written"
        what = f"{done} of {cfg.trainer.steps} steps done, the next one abandoned ({abandoned})" \
            if abandoned else f"after step {done} of {cfg.trainer.steps}"
        raise RunStopped(f"stopped by {stop.name}, {what}: {where}{again}", stop.signum)
    before = logger.earlier   # a resumed run's summary covers the whole run
    print(run_summary([r for r in before if "kind" not in r] + history, cfg,
                      time.perf_counter() - started, saved,
                      [r for r in before if r.get("kind") == "eval"] + evals,
                      resumed_at=start_step), flush=True)
    return history


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


def checkpoint_due(cfg: Config, done: int, since_save_s: float) -> bool:
    """Whether a checkpoint is due after ``done`` steps, ``since_save_s`` seconds after the last:
    at the last step, every ``trainer.save_interval`` steps, or ``save_interval_minutes`` after
    the last save, whichever comes first."""
    t = cfg.trainer
    return (done == t.steps or bool(t.save_interval and done % t.save_interval == 0)
            or bool(t.save_interval_minutes and since_save_s >= 60 * t.save_interval_minutes))


def warm_start(cfg: Config, trainers: Trainers, inputs: RunInputs, stop: StopRequest) -> None:
    """``trainer.sft_warmup_steps`` supervised steps on the reference answers (or the
    environment's demonstrations), with their progress; a stop signal ends them early."""
    prompts, tokenizer = inputs.prompts, inputs.tokenizer
    sft = PromptSampler(len(prompts), cfg.rollout.prompts_per_step * 4, cfg.data.shuffle_seed + 1)
    bar = StepProgress(cfg.trainer.sft_warmup_steps, "warm start", cfg.logging.progress,
                       cfg.logging.log_interval)
    for _ in range(cfg.trainer.sft_warmup_steps):
        if stop.signum:
            break
        m = trainers.sft_step(sft_samples(prompts, sft.next_batch(), tokenizer,
                                          inputs.environment, len(tokenizer)), cfg.trainer.sft_lr)
        bar.update({"loss": f"{m['sft/loss']:.3f}"})
    bar.close()
    if bar.done:
        print(f"warm start: {bar.done} supervised steps, last loss {m['sft/loss']:.3f}",
              flush=True)


def check_batch(cfg: Config, summary: dict, failed_batches: int) -> None:
    """Stop the run (RunFailed: one line naming the key, exit 1) when the reward or the
    environment failed on everything for ``data.max_failed_reward_batches`` batches in a row."""
    if failed_batches < cfg.data.max_failed_reward_batches:
        return
    limit = f"data.max_failed_reward_batches={cfg.data.max_failed_reward_batches}"
    if not summary["samples"] and cfg.data.environment is not None:
        raise RunFailed(
            f"data.environment: {cfg.data.environment} failed on every trajectory of "
            f"{failed_batches} batch(es) in a row ({limit}); nothing is left to train on. "
            f"First error: {first_line(summary['first_env_error'] or '')}")
    raise RunFailed(
        f"{reward_setting(cfg.data)[0]} failed on every sample of {failed_batches} batch(es) "
        f"in a row ({limit}); training on zero rewards would learn nothing. First error: "
        f"{first_line(summary['first_reward_error'] or '')}")


def export_final(cfg: Config, trainers: Trainers) -> None:
    """The final policy as a HF model in ``<run>/final_hf`` (with an EMA: the EMA there, the raw
    weights in ``final_hf_raw``), when ``trainer.export_hf``."""
    if not cfg.trainer.export_hf:
        return
    final = os.path.join(cfg.logging.dir, "final_hf")
    if cfg.trainer.ema_decay is not None and not cfg.trainer.ema_policy:   # EMA released
        trainers.export(final, use_ema=True)
        trainers.export(os.path.join(cfg.logging.dir, "final_hf_raw"))
        print(f"final policy (EMA, decay {cfg.trainer.ema_decay}) exported to {final}; "
              f"the raw weights to {final}_raw", flush=True)
    else:
        trainers.export(final)
        print(f"final policy exported to {final}", flush=True)


def stop_engines(hosts: list, timeout_s: float = 60.0) -> None:
    """Stop every engine server (each host terminates its process, then kills it); a host that
    does not answer within ``timeout_s`` is left to Ray's shutdown."""
    refs = [h.stop.remote() for h in hosts]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def write_plan(plan, reservation, path: str, trainer_addresses: list[str]) -> None:
    """The plan as placed (real addresses and ports, each node's Ray node id, the address each
    trainer rank reports from where it runs) to ``path``."""
    import json
    tree = plan.to_json()
    ranks = iter(trainer_addresses)
    for proc in tree["processes"]:
        if proc["role"] == "trainer":
            proc["address"] = next(ranks)
    tree["ray_nodes"] = [{"node": i, "node_id": nid, "address": addr} for i, (nid, addr)
                         in enumerate(zip(reservation.node_ids, reservation.addresses))]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(tree, fh, indent=1)
