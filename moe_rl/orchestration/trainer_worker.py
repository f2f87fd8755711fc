"""The trainer's Ray actor: one :class:`TrainerWorker` per rank (torch.distributed inside: gloo on
CPU, NCCL on GPU). Shards arrive as rollout-record bytes, by reference through Ray's object
store."""
from __future__ import annotations

import os

import ray

from moe_rl.config import config_from_dict
from moe_rl.rollout_record import RolloutBatch
from moe_rl.trainer.parallel import free_port, init_distributed, init_model_parallel, ParallelSizes
from moe_rl.trainer.policy import PolicyTrainer


@ray.remote
class TrainerWorker:
    """Rank ``rank`` of the trainer: megatron parallel state, the policy, its optimizer."""

    def __init__(self, cfg_tree: dict, rank: int, world: int, master_addr: str,
                 master_port: int, gpu: int | None = None):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        cfg = config_from_dict(cfg_tree)
        t = cfg.trainer
        init_distributed(rank=rank, world_size=world, master_addr=master_addr,
                         master_port=master_port, gpu=gpu)
        init_model_parallel(ParallelSizes(t.parallel.tensor, t.parallel.pipeline,
                                          t.parallel.expert, t.parallel.context))
        self.rank = rank
        self.trainer = PolicyTrainer(cfg, cfg.model.path)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def compute_paths(self) -> dict[str, tuple[str, str]]:
        """How this rank's MoE experts (``trainer.experts`` as built), attention and token
        dispatch compute, and why: ``{"experts": (path, why), "attention": ..., "dispatch":
        ...}``."""
        return self.trainer.compute_paths

    def data_parallel_rank(self) -> int:
        """This rank's data-parallel rank (megatron's layout): which shard it trains on."""
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def free_port(self, host: str | None = None) -> int:
        """A port free on ``host`` of this rank's node (default: the node's address; the
        weight-update group's rendezvous)."""
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
