"""What one trainer GPU and one SGLang GPU will hold, estimated before a run (``moe-rl plan``):
the parameters counted on transformers' own model built on the ``meta`` device (nothing
allocated), split the way the trainer splits them, and the activations by the formula of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", their
eq. 2 without the attention scores, which flash/fused attention does not keep), its MLP term
scaled to each layer's feed-forward width. An estimate (allocator fragmentation, communication
buffers and CUDA context are not in it): docs/clusters.md says how to read it."""
from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config import Config
from moe_rl.families import transformers_config
from moe_rl.families.shape import MoEShape

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the model: the routed experts', the embedding and LM head's, the rest."""
    experts: int
    embedding: int
    dense: int

    @property
    def total(self) -> int:
        return self.experts + self.embedding + self.dense


def param_counts(hf_config: dict) -> ParamCounts:
    """Count the parameters of the model ``hf_config`` describes on transformers' own class
    (built on the meta device; tied embeddings counted once)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = transformers_config(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = embedding = dense = 0
    for name, p in model.named_parameters():
        if ".experts." in name:   # the shared experts ("shared_expert(s).") are dense
            experts += p.numel()
        elif "embed_tokens" in name or name.startswith("lm_head"):
            embedding += p.numel()
        else:
            dense += p.numel()
    return ParamCounts(experts, embedding, dense)


# the part of a GPU an estimate should leave free (docs/clusters.md asks for 10-20 %)
HEADROOM = 0.10


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one trainer GPU by what holds them."""
    weights: float
    gradients: float
    optimizer: float
    ema: float              # the float32 EMA of the weights (trainer.ema.decay)
    reference: float        # the KL reference model (algorithm.kl.coef > 0)
    activations: float
    logits: float
    tokens: float           # of one micro-batch on this rank

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.ema + self.reference
                + self.activations + self.logits)

    def parts(self) -> dict[str, float]:
        """{what a person calls it: bytes}, the biggest first."""
        named = {"weights": self.weights, "gradients (float32)": self.gradients,
                 "optimizer (Adam's moments, float32 master weights)": self.optimizer,
                 "EMA (float32; only the final export reads it, unless trainer.ema.policy "
                 "serves it; trainer.ema.decay=null drops it)": self.ema,
                 "KL reference model": self.reference, "activations": self.activations,
                 "logits": self.logits}
        return dict(sorted(named.items(), key=lambda kv: -kv[1]))


def _ffn_widths(hf: dict) -> list[int]:
    """Each layer's feed-forward width per token: the dense layers' intermediate size, the MoE
    layers' top-k x expert size (+ the shared experts')."""
    moe_shape = MoEShape.from_hf(hf)
    moe = set(moe_shape.moe_layers)
    expert = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size"))
    shared = (int(hf.get("shared_expert_intermediate_size") or 0)
              + int(hf.get("n_shared_experts") or 0) * expert)
    dense = int(hf.get("intermediate_size") or expert)
    return [moe_shape.topk * expert + shared if i in moe else dense
            for i in range(moe_shape.num_layers)]


def trainer_memory(cfg: Config, hf: dict, counts: ParamCounts, seq_len: int) -> TrainerMemory:
    """One trainer rank's memory: parameters split by tensor (and, for the experts, expert)
    parallelism; float32 gradients (megatron's grad_reduce_in_fp32); Adam's two moments plus a
    float32 master copy for 16-bit weights, sharded over the data-parallel ranks with the
    distributed optimizer; activations of one micro-batch of ``seq_len``-token sequences (or
    ``trainer.max_tokens_per_micro_batch`` tokens) split by tensor (sequence) and context
    parallelism, and its float32 logits."""
    t = cfg.trainer
    tp, cp, ep = t.parallel.tensor, t.parallel.context, t.parallel.expert
    world = cfg.cluster.trainer_workers
    dp, edp = world // (tp * cp), world // (tp * ep)
    b = DTYPE_BYTES[cfg.model.dtype]
    dense = (counts.dense + counts.embedding) / tp
    experts = counts.experts / (tp * ep)
    params = dense + experts
    state = 8 + (4 if b < 4 else 0)   # Adam's m and v, the float32 master copy
    distributed = t.optim.distributed and cfg.cluster.gpus_per_node   # as on GPUs
    sharded = dense / dp + experts / edp if distributed else params
    ema = 4 * params if t.ema.decay is not None else 0
    reference = b * params if cfg.algorithm.kl.coef > 0 else 0
    tokens = (t.max_tokens_per_micro_batch or (t.micro_batch_size or 1) * seq_len) / cp
    h = int(hf["hidden_size"])
    per_layer = [15 * h + 19 * h * width / (4 * h) for width in _ffn_widths(hf)]
    scale = b / 2   # the formula counts 16-bit activations
    if t.recompute_activations:   # each layer's input kept; one layer recomputed at a time
        act = tokens * scale * (2 * h * len(per_layer) + max(per_layer))
    else:
        act = tokens * scale * sum(per_layer)
    # the log-prob kernel holds one chunk of rows' float32 logits at a time (forward:
    # the logits; backward: them and their gradient), and the response rows' hidden states
    from moe_rl_kernels.logprob_torch import DEFAULT_CHUNK
    rows = min(DEFAULT_CHUNK, tokens)
    logits = rows * int(hf["vocab_size"]) / tp * 4 * 2 + tokens * h * 4
    return TrainerMemory(b * params, 4 * params, state * sharded, ema, reference, act / tp, logits,
                         tokens)


@dataclass(frozen=True)
class EngineMemory:
    """One SGLang GPU: its share of the weights, the KV pool it is left with
    (``--mem-fraction-static`` of the GPU minus the weights) and the tokens that pool holds."""
    weights: float
    kv_pool: float
    kv_tokens: int


def format_memory(trainer: TrainerMemory, engine: EngineMemory | None, gpu_bytes: float
                  ) -> list[str]:
    """The estimates as a person reads them, with a warning when the trainer's exceeds the GPU
    or leaves it less than :data:`HEADROOM` free (naming the biggest parts)."""
    def gib(x: float) -> str:
        return f"{x / GIB:.1f} GiB"
    lines = [f"memory per trainer GPU (estimate, micro-batches of {trainer.tokens:.0f} "
             f"tokens): weights "
             f"{gib(trainer.weights)}, gradients {gib(trainer.gradients)}, optimizer "
             f"{gib(trainer.optimizer)}, EMA {gib(trainer.ema)}, reference "
             f"{gib(trainer.reference)}, activations {gib(trainer.activations)}, logits "
             f"{gib(trainer.logits)}: total {gib(trainer.total)} of {gib(gpu_bytes)} "
             f"({trainer.total / gpu_bytes:.0%})"]
    biggest = "; ".join(f"{name} {gib(size)}" for name, size in
                        list(trainer.parts().items())[:3] if size)
    fixes = ("raise trainer.parallel.expert or trainer.parallel.tensor, set "
             "trainer.recompute_activations, or lower trainer.max_tokens_per_micro_batch / "
             "micro_batch_size")
    if trainer.total > gpu_bytes:
        lines.append(f"warning: the trainer's estimate ({gib(trainer.total)}) exceeds the "
                     f"{gib(gpu_bytes)} of a GPU: {fixes}; the biggest parts: {biggest}")
    elif trainer.total > (1 - HEADROOM) * gpu_bytes:
        lines.append(f"warning: the trainer's estimate ({gib(trainer.total)}, "
                     f"{trainer.total / gpu_bytes:.0%} of {gib(gpu_bytes)}) leaves less than "
                     f"the {HEADROOM:.0%} headroom an estimate needs (allocator fragmentation, "
                     f"communication buffers, docs/clusters.md); the biggest parts: {biggest}; "
                     f"to make room: {fixes}")
    if engine is not None:
        lines.append(f"memory per SGLang GPU (estimate): weights {gib(engine.weights)}, KV pool "
                     f"{gib(engine.kv_pool)} (~{engine.kv_tokens:,} tokens per server)")
        if engine.kv_tokens == 0:
            lines.append("warning: no room for SGLang's KV pool: raise "
                         "rollout.sglang.mem_fraction_static or rollout.sglang.tp_size")
    return lines
