"""The rollout side's Ray actor (:class:`RolloutWorker`): it owns the engine servers' client and
the record of the weights they serve, and makes each step's data (samples, rewards, engine
scoring passes, data-parallel shards: rollout-record bytes that cross to the trainers by
reference through Ray's object store)."""
from __future__ import annotations

import asyncio
import copy
import os
import time

import ray

from moe_rl.config import (config_from_dict, engine_avg_refusal, probe_temperature,
                           response_cap)
from moe_rl.families.shape import MoEShape
from moe_rl.orchestration.run_inputs import load_run_inputs
from moe_rl.rollout.served import ServedWeights
from moe_rl.rollout_record import RolloutBatch
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.factory import engine_kind
from moe_rl.orchestration.sharding import shard_by_group
from moe_rl.rewards.service import reward_scorer
from moe_rl.rollout.batch import make_batch
from moe_rl.rollout.evaluation import evaluate
from moe_rl.rollout.partial import partial_rollout
from moe_rl.rollout.trajectories import generate_samples
from moe_rl.weights.fp8 import write_fp8_checkpoint
from moe_rl.weights.hf import write_dequantised_mxfp4
from moe_rl.weights.mxfp4_checkpoint import is_mxfp4_checkpoint


def served_checkpoint(cfg, path: str, work_dir: str | None = None) -> str:
    """The checkpoint the engines load for the HF checkpoint ``path``: itself; with
    ``rollout.quantization: fp8`` its FP8 checkpoint (written to ``work_dir/fp8_start``, or
    without ``work_dir`` to ``path/fp8``, so it is dropped with its export); for a released
    MXFP4 checkpoint its bfloat16 copy (``work_dir/bf16_start``: every weight update hands the
    engines unquantised tensors)."""
    if work_dir is not None and is_mxfp4_checkpoint(path):   # (exports are never MXFP4)
        return write_dequantised_mxfp4(path, os.path.join(work_dir, "bf16_start"))
    if cfg.rollout.quantization != "fp8":
        return path
    return write_fp8_checkpoint(path, os.path.join(work_dir, "fp8_start") if work_dir
                                else os.path.join(path, "fp8"))


@ray.remote(concurrency_groups={"status": 1})
class RolloutWorker:
    """Starts the engine servers (CPU reference engine or SGLang) and serves the loop's rollout
    calls through the SGLang-protocol client. Its calls run one at a time, in order (the
    asynchronous pipeline relies on it: a weight update queued behind a batch waits for it),
    except the status reads (``restarts``), which answer at once from their own thread."""

    def __init__(self, cfg_tree: dict, hosts: list, training: bool = True):
        cfg = config_from_dict(cfg_tree)
        kind = engine_kind(cfg)
        self.cfg = cfg
        r = cfg.rollout
        self.hosts = hosts   # EngineHost actors, servers started (the driver placed them)
        self.server_urls = ray.get([h.url.remote() for h in hosts])
        shape = MoEShape.from_model_dir(cfg.model.path)
        engine_avg_refusal(cfg.algorithm, cfg.rollout, shape.vocab_size)
        self.served = ServedWeights(cfg.cluster.weight_sync == "disk")

        def restarter(host, url):
            def restart():
                ray.get(host.restart.remote())
                restored = self.served.restore_point(url)
                if restored is not None:   # it serves the version it is labelled with
                    kind.receiver([url]).load_from_disk(*restored)
            return restart

        self.engine = kind.connect(self.server_urls, shape,
                                   [restarter(h, u) for h, u in zip(hosts, self.server_urls)])
        s = r.sampling
        self.sampling = SamplingConfig(s.temperature, s.top_p, s.top_k, s.min_p, r.max_new_tokens)
        self.inputs = load_run_inputs(cfg, training)   # tokenizer, prompts, reward function
        self.eval_scorer = None   # eval.reward (made at the first evaluation)
        self.served.record_start(self.engine.weight_versions())   # version 0, unsynced
        self.partial = None   # rollout.partial: the responses in flight between steps
        if r.partial.enabled and training:
            self.partial = partial_rollout(r, response_cap(cfg), cfg.data.environment_timeout_s,
                                           self.engine, self.inputs)

    def _served(self, path: str) -> str:
        return served_checkpoint(self.cfg, path)

    def set_weight_source(self, trainer_actors: list, export_dir: str) -> None:
        """In-memory weight sync: a server restarted outside a sync is restored from an export
        of the trainer to ``export_dir`` (see :meth:`ServedWeights.restore_point`)."""
        def trainer_export(version: int) -> tuple[str, int]:
            path = os.path.join(export_dir, "restart")
            written = ray.get([a.export_hf.remote(path, False, version) for a in trainer_actors])
            return self._served(path), written[0]
        self.served.trainer_export = trainer_export

    def served_state(self) -> dict:
        """The weight sync's one read of the rollout side: every server answers /health (a
        dead one is restarted and restored first; raises when it cannot be), then each
        server's reported version (``versions``) and the servers restarted since the last read
        (``restarted``)."""
        self.engine.check_health()
        return {"versions": self.engine.weight_versions(),
                "restarted": self.served.take_restarted()}

    def _check_serving(self, version: int, step: int) -> None:
        """The pipeline's invariant, checked before a batch is generated (see
        :meth:`ServedWeights.check_serving`)."""
        self.served.check_serving(self.engine.weight_versions(), version, step)

    def collect(self, indices: list[int], step: int, version: int, seed: int, shards: int,
                extra: list[int] = ()) -> tuple:
        """One step's data, made here so it crosses to the trainers by reference: the batch of
        the prompts ``indices`` (and ``extra`` as the strategy uses them; see
        :func:`moe_rl.rollout.batch.make_batch`), cut by whole prompt groups into ``shards``
        data-parallel shards. Returns (its :class:`BatchSummary`, shard bytes ...); call it
        with ``num_returns = shards + 1`` and hand the shard references to the trainer ranks.
        The engines must serve weight ``version`` (:meth:`_check_serving`)."""
        self._check_serving(version, step)
        samples, summary = make_batch(self.engine, self.cfg, self.inputs, self.sampling,
                                      self.partial, indices, extra, step, seed)
        return (summary, *[RolloutBatch(part).to_bytes()
                           for part in shard_by_group(samples, shards)])

    def evaluate(self, done: int, version: int) -> dict:
        """The ``eval/*`` metrics of the held-out sets with the engines at weight ``version``
        (the policy after ``done`` updates); rewards by ``eval.reward``, else the run's reward,
        counted apart from the training's reward errors."""
        self._check_serving(version, done)
        if self.eval_scorer is None:
            self.eval_scorer = reward_scorer(self.cfg.data, self.cfg.eval.reward)
        t0 = time.perf_counter()
        metrics = evaluate(self.cfg, self.engine, self.inputs.tokenizer, self.inputs.eval_sets,
                           self.eval_scorer, seed=self.cfg.trainer.seed * 1_000_033 + 17)
        metrics["eval/time_s"] = time.perf_counter() - t0
        return metrics

    def make_probe(self) -> bytes:
        """The weight check's fixed probe, kept here and returned as rollout-batch bytes (for
        the trainer's side): one response to each of the first ``rollout.weight_check.prompts``
        training prompts, sampled (seeded) as the run samples, by the weights the engines serve
        at the run's start."""
        n = min(self.cfg.rollout.weight_check.prompts, len(self.inputs.prompts))
        self.probe = generate_samples(self.engine, [p.ids for p in self.inputs.prompts[:n]], 1,
                                      self.sampling, seed=self.cfg.trainer.seed + 7_000_003)
        return RolloutBatch(self.probe).to_bytes()

    def score_probe(self) -> bytes:
        """The probe scored by every server at the weights they serve now: ``pass_logprobs``
        row j of sample i by server (i + j) % servers (one pass per server), as pi_old's
        engine passes are scored; with routing, each sample's routing refetched from server
        i % servers. Returns the rollout-batch bytes for the trainer's side."""
        samples = [copy.deepcopy(s) for s in self.probe]
        servers = len(self.server_urls)
        self.engine.score(samples, servers, temperature=probe_temperature(self.cfg),
                          window=self.cfg.rollout.scoring.window_tokens)
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
        self.served.loaded(path, version)
        return self.engine.weight_versions()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def urls(self) -> list[str]:
        return list(self.server_urls)

    def mark_served(self, version: int) -> list[str]:
        """Every server took ``version`` in memory; returns the versions they report."""
        self.served.synced(version)
        return self.engine.weight_versions()

    @ray.method(concurrency_group="status")
    def restarts(self) -> int:
        """Engine servers restarted so far (answers while a batch is being generated)."""
        return sum(ray.get([h.restarts.remote() for h in self.hosts]))

    def shutdown(self) -> None:
        ray.get([h.stop.remote() for h in self.hosts])
