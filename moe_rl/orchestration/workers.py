"""Ray actors: one trainer worker per rank (torch.distributed inside: gloo on CPU, NCCL on GPU)
and a rollout worker that owns its engine servers and makes each step's data (samples, rewards,
engine scoring passes, data-parallel shards). Shards cross actors as safetensors bytes, by
reference through Ray's object store."""
from __future__ import annotations

import os

import ray

from moe_rl.config import config_from_dict, engine_avg_refusal, probe_temperature
from moe_rl.families.shape import MoEShape
from moe_rl.orchestration.run_inputs import load_run_inputs
from moe_rl.rollout_record import RolloutBatch


@ray.remote
class TrainerWorker:
    """Rank ``rank`` of the trainer: megatron parallel state, the policy, its optimizer."""

    def __init__(self, cfg_tree: dict, rank: int, world: int, master_addr: str,
                 master_port: int, gpu: int | None = None):
        from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
        from moe_rl.trainer.policy import PolicyTrainer
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        cfg = config_from_dict(cfg_tree)
        t = cfg.trainer
        init_distributed(rank=rank, world_size=world, master_addr=master_addr,
                         master_port=master_port, gpu=gpu)
        init_model_parallel(ParallelSizes(t.tensor_parallel, t.pipeline_parallel,
                                          t.expert_parallel, t.context_parallel))
        self.rank = rank
        self.trainer = PolicyTrainer(cfg, cfg.model.path)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank (megatron's layout): which shard it trains on."""
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def free_port(self, host: str | None = None) -> int:
        """A port free on ``host`` of this rank's node (default: the node's address; the
        weight-update group's rendezvous)."""
        from moe_rl.trainer.parallel import free_port
        return free_port(host or ray.util.get_node_ip_address())

    def train_step(self, data: bytes) -> dict:
        """The step's metrics, and under ``sample_notes`` what the trainer knows of the
        batch's first samples (for samples.jsonl)."""
        metrics = self.trainer.train_step(RolloutBatch.from_bytes(data).samples)
        return {**metrics, "sample_notes": self.trainer.passes.notes}

    def probe(self, data: bytes) -> list[tuple]:
        """The weight check's trainer side: the probe's log-probs and the trainer's own routing
        under the current weights (see StepPasses.probe)."""
        return self.trainer.passes.probe(RolloutBatch.from_bytes(data).samples)

    def sft_step(self, data: bytes, lr: float) -> dict:
        return self.trainer.sft_step(RolloutBatch.from_bytes(data).samples, lr)

    def export_hf(self, out_dir: str, use_ema: bool = False, version: int | None = None) -> int:
        """A HF checkpoint of the policy in ``out_dir`` (see :meth:`PolicyTrainer.export_hf`);
        returns the weight version written."""
        return self.trainer.export_hf(out_dir, use_ema=use_ema, version=version)

    def connect_engines(self, urls: list[str], sources: list[list[int]] | None,
                        single_node: bool) -> None:
        """This rank's weight sender to the engine servers at ``urls`` (the transport of
        ``cluster.weight_sync``; ``sources``: the plan's tensor sources); ``single_node``: the
        transport meets on loopback."""
        from moe_rl.engines.factory import engine_kind
        self.sender = engine_kind(self.trainer.cfg).sender(urls, self.rank, sources)
        self.single_node = single_node

    def send_weights(self, version: int, reopen: bool = False) -> dict:
        """Collective over the trainer ranks: the policy to every server as weight ``version``,
        in buckets of ``cluster.weight_sync_bucket_mb``. Rank 0 first (re)opens the transport
        when it has none or ``reopen`` (a server restarted, or the last update failed).
        Returns the tensors sent and, when it opened one, the transport in words."""
        opened = None
        if self.rank == 0 and (reopen or not self.sender.opened):
            # one node: the servers are local, the group stays on loopback
            address = "127.0.0.1" if self.single_node else self.node_ip()
            opened = self.sender.open(address, self.free_port(address))
        sent = self.sender.send(self.trainer.hf_buckets(everywhere=self.sender.everywhere),
                                version)
        return {"sent": sent, "opened": opened}

    def abort_weight_update(self) -> None:
        """After a failed update: close whatever the servers still have open."""
        self.sender.abort()

    def save(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load(self, path: str) -> int:
        self.trainer.load_checkpoint(path)
        return self.trainer.step


def served_checkpoint(cfg, path: str, fp8_dir: str | None = None) -> str:
    """The checkpoint the engines load for the HF checkpoint ``path``: itself, or with
    ``rollout.quantization: fp8`` its FP8 checkpoint (written to ``fp8_dir``, default
    ``path/fp8``, so it is dropped with its export)."""
    if cfg.rollout.quantization != "fp8":
        return path
    from moe_rl.weights.fp8 import write_fp8_checkpoint
    return write_fp8_checkpoint(path, fp8_dir or os.path.join(path, "fp8"))


def check_served_version(served: list[str], started: set[str], version: int, step: int) -> None:
    """Every server must report weight ``version`` (before the first sync, a version a server
    started with counts as 0); else RuntimeError: a weight update that did not land where the
    loop expects it stops the run instead of training on samples of other weights."""
    fine = [v == str(version) or (version == 0 and v in started) for v in served]
    if not all(fine):
        raise RuntimeError(f"rollout: step {step}'s batch is to be generated from weight "
                           f"version {version}, but the engine servers report {served}")


@ray.remote(concurrency_groups={"status": 1})
class RolloutWorker:
    """Starts the engine servers (CPU reference engine or SGLang) and serves the loop's rollout
    calls through the SGLang-protocol client. Its calls run one at a time, in order (the
    asynchronous pipeline relies on it: a weight update queued behind a batch waits for it),
    except the status reads (``restarts``), which answer at once from their own thread."""

    def __init__(self, cfg_tree: dict, hosts: list, training: bool = True):
        from moe_rl.engines.base import SamplingConfig
        from moe_rl.engines.factory import engine_kind
        cfg = config_from_dict(cfg_tree)
        kind = engine_kind(cfg)
        self.cfg = cfg
        r = cfg.rollout
        self.hosts = hosts   # EngineHost actors, servers started (the driver placed them)
        self.server_urls = ray.get([h.url.remote() for h in hosts])
        shape = MoEShape.from_model_dir(cfg.model.path)
        engine_avg_refusal(cfg, shape.vocab_size)
        self.weights_path: str | None = None
        self.version = 0
        self.trainer_actors: list = []     # non-disk sync: where a restarted server's weights
        self.export_dir: str | None = None  # come from
        self.group_stale = False

        def restarter(host, url):
            def restart():
                ray.get(host.restart.remote())
                restored = self._weights_for_restart()
                if restored is not None:   # a restarted server serves the version it is labelled with
                    kind.receiver([url]).load_from_disk(*restored)
            return restart

        self.engine = kind.connect(self.server_urls, shape,
                                   [restarter(h, u) for h, u in zip(hosts, self.server_urls)])
        self.sampling = SamplingConfig(r.temperature, r.top_p, r.top_k, r.min_p, r.max_new_tokens)
        self.inputs = load_run_inputs(cfg, training)   # tokenizer, prompts, reward function
        self.eval_scorer = None   # eval.reward (made at the first evaluation)
        self.started_versions = set(self.engine.weight_versions())   # version 0, unsynced
        self.partial = None   # rollout.partial: the responses in flight between steps
        if r.partial and training:
            from moe_rl.rollout.partial import partial_rollout
            self.partial = partial_rollout(cfg, self.engine, self.inputs)

    def _served(self, path: str) -> str:
        return served_checkpoint(self.cfg, path)

    def set_weight_source(self, trainer_actors: list, export_dir: str) -> None:
        """Non-disk weight sync: a server restarted outside a sync gets the trainer's current
        weights exported to ``export_dir`` (the trainer ranks are idle then)."""
        self.trainer_actors, self.export_dir = trainer_actors, export_dir

    def _weights_for_restart(self) -> tuple[str, int] | None:
        """The checkpoint a restarted server loads and the version it is: the last disk sync's;
        for the other sync modes an export of the trainer (its weight group must then be
        rebuilt) of the version the servers serve, which the asynchronous pipeline's trainer
        still holds while it trains the next one (else its current weights, labelled with
        their own version); None inside a sync (the loop recovers the sync itself) or before
        any sync."""
        if self.cfg.cluster.weight_sync == "disk":
            return None if self.weights_path is None else (self.weights_path, self.version)
        self.group_stale = True
        if not self.trainer_actors:
            return None
        import ray as _ray
        path = os.path.join(self.export_dir, "restart")
        written = _ray.get([a.export_hf.remote(path, False, self.version)
                            for a in self.trainer_actors])
        return self._served(path), written[0]

    def take_group_stale(self) -> bool:
        """Whether a server restarted since the weight group was built (and reset the flag)."""
        stale, self.group_stale = self.group_stale, False
        return stale

    def health(self) -> bool:
        """Every server answers /health; a dead one is restarted first (raises when it cannot
        be)."""
        self.engine.check_health()
        return True

    def check_serving(self, version: int, step: int) -> None:
        """The pipeline's invariant, checked before a batch is generated (see
        :func:`check_served_version`)."""
        check_served_version(self.engine.weight_versions(), self.started_versions, version, step)

    def collect(self, indices: list[int], step: int, version: int, seed: int, shards: int,
                extra: list[int] = ()) -> tuple:
        """One step's data, made here so it crosses to the trainers by reference: generate
        ``n_samples_per_prompt`` samples of the prompts ``indices`` (with dynamic sampling, more
        from ``extra`` as needed), score their rewards, add the engine's n scoring passes
        (``pi_old: engine_avg``), cut whole prompt groups into ``shards`` data-parallel shards.
        Returns (summary, shard bytes ...); call it with ``num_returns = shards + 1`` and hand
        the shard references to the trainer ranks. The engines must serve weight ``version``
        (:meth:`check_serving`)."""
        import time
        from moe_rl.orchestration.sharding import shard_by_group
        from moe_rl.config import set_name
        from moe_rl.rollout.groups import retraction_counts, reward_by_set
        from moe_rl.outputs.sample_log import shown_samples
        self.check_serving(version, step)
        cfg, inp = self.cfg, self.inputs
        timing = {}
        t0 = time.perf_counter()
        errors_before, timeouts_before = inp.reward.errors, inp.reward.timeouts
        if self.partial is not None:   # extra: groups started beyond this step's
            from moe_rl.rollout.partial import score_with
            groups = self.partial.collect(self.engine, inp.prompts, list(indices) + list(extra),
                                          cfg.rollout.n_samples_per_prompt, self.sampling, step,
                                          seed, cfg.rollout.prompts_per_step, score_with(inp))
        else:
            from moe_rl.rollout.groups import build_groups
            groups = build_groups(self.engine, cfg, inp, self.sampling, indices, extra, seed)
        samples, counts, reward_s = groups.samples, groups.counts, groups.reward_s
        counts.update(retraction_counts(samples, cfg.rollout.retracted == "mask"
                                        and cfg.algorithm.replay == "r3"))
        counts.update(reward_by_set(samples, [set_name(e) for e in cfg.data.sets],
                                    inp.set_sizes))
        env_error = groups.first_env_error
        timing["timing/rollout_s"] = time.perf_counter() - t0 - reward_s
        timing["timing/reward_s"] = reward_s
        errors = inp.reward.errors - errors_before   # scored 0 (timed-out samples are gone)
        timeouts = inp.reward.timeouts - timeouts_before
        summary = {"samples": len(samples), "reward_failures": errors + timeouts,
                   "reward_calls": len(samples) + timeouts,
                   "reward_errors_total": inp.reward.errors,
                   "reward_timeouts_total": inp.reward.timeouts,
                   "reward_clipped_total": inp.reward.clipped,
                   "last_reward_error": inp.reward.last_error, "first_env_error": env_error,
                   "stale_samples": sum(s.weight_version < step for s in samples),
                   "counts": counts,
                   "shown": shown_samples(samples, inp.tokenizer, inp.prompts,
                                          cfg.logging.samples_per_step)}
        if samples and errors < len(samples) and cfg.algorithm.pi_old == "engine_avg":
            t2 = time.perf_counter()
            self.engine.score(samples, cfg.algorithm.pi_old_passes,
                              temperature=cfg.rollout.temperature,
                              window=cfg.rollout.score_window_tokens)
            timing["timing/engine_scoring_s"] = time.perf_counter() - t2
        timing["timing/collect_s"] = time.perf_counter() - t0
        summary["timing"] = timing
        return (summary, *[RolloutBatch(part).to_bytes()
                           for part in shard_by_group(samples, shards)])

    def evaluate(self, done: int, version: int) -> dict:
        """The ``eval/*`` metrics of the held-out sets with the engines at weight ``version``
        (the policy after ``done`` updates); rewards by ``eval.reward``, else the run's reward,
        counted apart from the training's reward errors."""
        import time
        from moe_rl.rollout.evaluation import evaluate
        from moe_rl.rewards.service import reward_scorer
        self.check_serving(version, done)
        if self.eval_scorer is None:
            self.eval_scorer = reward_scorer(self.cfg.data, self.cfg.eval.reward)
        t0 = time.perf_counter()
        metrics = evaluate(self.cfg, self.engine, self.inputs.tokenizer, self.inputs.eval_sets,
                           self.eval_scorer, seed=self.cfg.trainer.seed * 1_000_033 + 17)
        metrics["eval/time_s"] = time.perf_counter() - t0
        return metrics

    def make_probe(self) -> None:
        """The weight check's fixed probe: one response to each of the first
        ``rollout.weight_check_prompts`` training prompts, sampled (seeded) as the run samples,
        by the weights the engines serve at the run's start."""
        from moe_rl.rollout.trajectories import generate_samples
        n = min(self.cfg.rollout.weight_check_prompts, len(self.inputs.prompts))
        self.probe = generate_samples(self.engine, [p.ids for p in self.inputs.prompts[:n]], 1,
                                      self.sampling, seed=self.cfg.trainer.seed + 7_000_003)

    def probe_batch(self) -> bytes:
        """The probe as rollout-batch bytes (for the trainer's side of the check)."""
        return RolloutBatch(self.probe).to_bytes()

    def score_probe(self) -> bytes:
        """The probe scored by every server at the weights they serve now: ``pass_logprobs``
        row j of sample i by server (i + j) % servers (one pass per server), as pi_old's
        engine passes are scored; with routing, each sample's routing refetched from server
        i % servers. Returns the rollout-batch bytes for the trainer's side."""
        import asyncio
        import copy
        samples = [copy.deepcopy(s) for s in self.probe]
        servers = len(self.server_urls)
        self.engine.score(samples, servers, temperature=probe_temperature(self.cfg),
                          window=self.cfg.rollout.score_window_tokens)
        if samples and samples[0].routing is not None:
            async def refetch(session):
                return await asyncio.gather(*(
                    session.routing(s.prompt_ids.tolist() + s.response_ids.tolist(), 0,
                                    server=i % servers) for i, s in enumerate(samples)))
            for s, routing in zip(samples, self.engine.run(refetch)):
                s.routing = routing
        return RolloutBatch(samples).to_bytes()

    def update_weights(self, path: str, version: int) -> list[str]:
        """Every server loads the HF checkpoint at ``path`` (its FP8 form with FP8 rollouts) as
        ``version``; returns the versions they report."""
        path = self._served(path)
        self.engine.weights.load_from_disk(path, version)
        self.weights_path, self.version = path, version
        return self.engine.weight_versions()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def urls(self) -> list[str]:
        return list(self.server_urls)

    def set_version(self, version: int) -> list[str]:
        self.version = version
        return self.engine.weight_versions()

    @ray.method(concurrency_group="status")
    def restarts(self) -> int:
        """Engine servers restarted so far (answers while a batch is being generated)."""
        return sum(ray.get([h.restarts.remote() for h in self.hosts]))

    def shutdown(self) -> None:
        ray.get([h.stop.remote() for h in self.hosts])
