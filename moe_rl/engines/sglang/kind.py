"""The engine kinds whose servers speak SGLang's HTTP protocol (SGLang itself, and the CPU
reference engine, which imitates it): their engine, weight receiver and weight senders over
running servers (:class:`SGLangProtocolKind`); and SGLang's own kind (:class:`SGLangKind`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from moe_rl.config import ConfigError
from moe_rl.config.model_facts import model_hf_fields
from moe_rl.engines.base import EngineKind
from moe_rl.engines.needs import requests_routing, requests_sampling_mask
from moe_rl.engines.sglang.checks import check_config
from moe_rl.engines.sglang.launcher import sglang_argv, sglang_env
from moe_rl.engines.sglang.node_check import check_sglang_environment
from moe_rl.families import FAMILIES
from moe_rl.config.memory_estimate import DTYPE_BYTES, EngineMemory
from moe_rl.engines.sglang.pool import ServerPool

if TYPE_CHECKING:   # the client and senders (torch) load where a run connects: the process
    # that only starts a server (the engine host) goes without torch
    from moe_rl.engines.sglang.client import SGLangEngine, SGLangWeightReceiver
    from moe_rl.families.shape import MoEShape

# SGLang 0.5.23 under --enable-dp-attention on one node also binds port+233 (its ZMQ_TCP_PORT_DELTA)
# and port+234..port+239 (server_args.py:728,818-846)
DP_ATTENTION_PORT_SPAN = 233 + 7


class SGLangProtocolKind(EngineKind):
    """An engine kind whose servers speak SGLang's protocol: one client, receiver and sender
    set serves them all."""

    def _pool_factory(self, urls: list[str], restarters=None) -> Callable[[], ServerPool]:
        s = self.cfg.rollout.servers
        return lambda: ServerPool(urls, api_key=s.api_key, timeout=s.request_timeout_s,
                                  max_retries=s.max_retries, concurrency=s.concurrency,
                                  restarters=restarters, health_timeout=s.health_timeout_s,
                                  weight_timeout=s.weight_load_timeout_s,
                                  answer_limit_mb=s.max_answer_mb)

    def connect(self, urls, moe_shape: MoEShape, restarters=None) -> SGLangEngine:
        from moe_rl.engines.sglang.client import SGLangEngine
        return SGLangEngine(self._pool_factory(urls, restarters), moe_shape,
                            need_routing=requests_routing(self.cfg.algorithm, self.cfg.rollout),
                            need_mask=requests_sampling_mask(self.cfg.algorithm),
                            ranks_per_server=self.weight_ranks_per_server())

    def receiver(self, urls) -> SGLangWeightReceiver:
        from moe_rl.engines.sglang.client import SGLangWeightReceiver
        return SGLangWeightReceiver(self._pool_factory(urls), self.weight_ranks_per_server())

    def sender(self, urls, rank, sources=None):
        from moe_rl.engines.sglang.sender import DistributedSender, TensorSender
        c, r = self.cfg.cluster, self.cfg.rollout
        fp8 = r.quantization == "fp8"
        if c.weight_sync == "distributed":
            return DistributedSender(self.receiver(urls), rank, fp8,
                                     backend="nccl" if c.gpus_per_node > 0 else "gloo",
                                     world=1 + len(urls) * self.weight_ranks_per_server(),
                                     timeout_s=r.servers.request_timeout_s)
        if c.weight_sync == "tensor":
            return TensorSender(self.receiver(urls), rank, fp8, sources)
        raise ConfigError(f"cluster.weight_sync: {c.weight_sync!r} has no in-memory sender; "
                          "expected 'distributed' or 'tensor'")


class SGLangKind(SGLangProtocolKind):
    """SGLang servers, on GPUs or on CPU (from `moe-rl sglang-cpu-env`'s environment); SGLang
    binds its port itself."""

    def describe(self) -> str:
        """With the dtype moe_rl sets on CPU; on GPUs the checkpoint's."""
        g = self.cfg.rollout.sglang
        return (f"{self.cfg.rollout.engine_dtype} SGLang on cpu" if g.device == "cpu"
                else "SGLang on GPUs")

    def gpus_per_server(self) -> int:
        """tp_size x dp_size (tp_size with DP attention); none on CPU."""
        g = self.cfg.rollout.sglang
        if g.device == "cpu":
            return 0
        dp = 1 if "--enable-dp-attention" in g.extra_args else g.dp_size
        return g.tp_size * dp

    def gpu_memory(self, hf: dict, params: int, gpu_bytes: float):
        """One GPU of a server of ``tp_size`` GPUs: its share of the weights, and the KV pool
        ``--mem-fraction-static`` of the GPU leaves beside them (KV heads split over the GPUs;
        an MLA model's latent is not split); none on CPU."""
        g = self.cfg.rollout.sglang
        if g.device == "cpu":
            return None
        b = DTYPE_BYTES[self.cfg.rollout.engine_dtype]
        weights = params * b / g.tp_size
        pool = max(g.mem_fraction_static * gpu_bytes - weights, 0.0)
        layers = int(hf["num_hidden_layers"])
        if hf.get("kv_lora_rank"):   # MLA: the compressed latent and the rope key per token
            per_token = layers * (int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"])) * b
        else:
            heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
            head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) //
                           int(hf["num_attention_heads"]))
            per_token = 2 * layers * max(heads // g.tp_size, 1) * head_dim * b
        return EngineMemory(weights, pool, int(pool // per_token))

    def port_span(self) -> int:
        """1, or with ``--enable-dp-attention`` the :data:`DP_ATTENTION_PORT_SPAN` that SGLang
        derives from it (servers on one node are spaced by this, or the second cannot bind)."""
        return (DP_ATTENTION_PORT_SPAN
                if "--enable-dp-attention" in self.cfg.rollout.sglang.extra_args else 1)

    def weight_ranks_per_server(self) -> int:
        """One per TP rank."""
        return self.cfg.rollout.sglang.tp_size

    def check_config(self) -> None:
        check_config(self.cfg)

    def config_warnings(self) -> list[str]:
        """float16 with attention sinks (gpt-oss): SGLang 0.5.23 keeps the sinks in bfloat16
        under --dtype float16 (models/gpt_oss.py), the trainer in float16."""
        fam = FAMILIES.get(model_hf_fields(self.cfg.model).get("model_type"))
        if self.cfg.rollout.engine_dtype != "float16" or fam is None or not fam.ATTENTION_SINKS:
            return []
        return ["warning: rollout.engine_dtype=float16 with attention sinks (gpt-oss): SGLang "
                "keeps the sinks in bfloat16 under --dtype float16 while the trainer keeps them "
                "in float16, so the two sides' log-probs differ by the sinks' bfloat16 rounding "
                "(bfloat16 on both sides avoids it)"]

    def check_node(self) -> tuple[str, str, str]:
        return check_sglang_environment(self.cfg)

    def server_command(self, host, port, gpus, index, model_path):
        return (sglang_argv(self.cfg, model_path, host, port),
                sglang_env(list(gpus), self.cfg.rollout.sglang.device))
