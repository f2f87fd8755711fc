"""One forward of a micro-batch, as every pass of the step runs it: samples packed into
micro-batches (aligned in count over the data-parallel ranks, a dummy where a rank has none),
padded to the expert-parallel group's common shape, routed as the pass's :class:`Route` says, and
scored at the rollout's temperature (on the kept sets with the keep-sampling-mask)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl.config import Config
from moe_rl.trainer.packing import MicroBatch, pack_one, plan
from moe_rl.trainer.dp import dp_max
from moe_rl.trainer.context_parallel import local_positions
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.trainer.replay import ReplayController
from moe_rl.trainer.replay_plan import Route
from moe_rl.rollout_record import Sample


class Forwarder:
    """Micro-batching and the routed forward of one trainer rank."""

    def __init__(self, cfg: Config, num_experts: int, dispatcher: str):
        self.cfg = cfg
        self.num_experts = num_experts
        self.dispatcher = dispatcher   # megatron's moe_token_dispatcher_type
        self._dummy_mb: MicroBatch | None = None

    def micro_batches(self, samples: list[Sample], indices: list[int]) -> list[MicroBatch]:
        """``samples[indices]`` in micro-batches: padded rows, at most
        ``trainer.micro_batch_size`` of them and ``trainer.max_tokens_per_micro_batch`` padded
        tokens (sorted longest first, filled greedily), or with ``trainer.pack_sequences`` one
        packed row each of at most that many tokens (first-fit decreasing): :func:`plan`."""
        t = self.cfg.trainer
        lengths = [samples[i].prompt_len + samples[i].response_len for i in indices]
        # context parallelism cuts every sequence (slot) in 2 x CP chunks; sequence parallelism
        # then splits each CP rank's positions over the TP ranks
        slot = 2 * t.parallel.context if t.parallel.context > 1 else 1
        multiple = slot * (t.parallel.tensor if t.parallel.sequence else 1)
        groups = plan(lengths, micro_batch_size=t.micro_batch_size,
                      max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
                      pack_sequences=t.pack_sequences, slot_multiple=slot)
        return [pack_one(samples, [indices[j] for j in group], pad_token_id=0,
                         num_experts=self.num_experts, pad_to_multiple=multiple,
                         packed=t.pack_sequences, slot_multiple=slot)
                for group in groups]

    def aligned(self, mbs: list[MicroBatch]) -> list[MicroBatch | None]:
        """``mbs`` padded with None (a dummy micro-batch) to the largest count of any
        data-parallel rank: expert-parallel dispatch runs collectives in every forward and
        backward, so every rank must run as many, with or without work."""
        return mbs + [None] * (dp_max(len(mbs)) - len(mbs))

    def _dummy(self) -> MicroBatch:
        """A one-token micro-batch whose loss is multiplied by 0 (for ranks with less work)."""
        if self._dummy_mb is None:
            keep = self.cfg.algorithm.keep_sampling_mask
            s = Sample(prompt_ids=[0], response_ids=[0], rollout_logprobs=[0.0],
                       loss_mask=[False], sampling_mask_offsets=[0, 1] if keep else None,
                       sampling_mask_ids=[0] if keep else None)
            self._dummy_mb = self.micro_batches([s], [0])[0]
        return self._dummy_mb

    def dummy_forward(self, model, replay: ReplayController, grad: bool = False) -> None:
        """Enter the forward's (and, with ``grad``, the backward's) collectives with no work."""
        lp, _ = self.forward(model, replay, self._dummy(), Route.OFF, grad=grad)
        if grad:
            (lp.sum() * 0.0).backward()

    def forward(self, model, replay: ReplayController, mb: MicroBatch, mode: Route,
                 grad: bool = False, collect_own: bool = False, kept_sets: bool = True,
                 router_scores: bool = False, temperature: float | None = None):
        """Log-probs and entropies of one micro-batch from ``model``, routed as ``mode`` (see
        :class:`Route`) through ``replay``. ``kept_sets=False`` scores on the full vocabulary even
        with ``keep_sampling_mask`` (supervised samples have no kept sets). ``router_scores``
        also reads the routers' log-scores (``replay.router_scores()`` afterwards) of the
        experts this forward activates, or, routing freely, of those ``mb.routing`` holds.
        ``temperature``: the logits' (None: the rollout's)."""
        a = self.cfg.algorithm
        if temperature is None:
            temperature = self.cfg.rollout.sampling.temperature or 1.0
        shape = mb.shape
        run = mb.padded_to(*self._ep_common_shape(shape), self.num_experts)
        B, S = run.shape
        carried = None
        if mb.routing is not None and (mode is Route.REPLAY or router_scores):
            carried = replay.local_indices(run.replay_indices(), S, B, self.cp_positions(run))
        if mode is Route.REPLAY:
            if mb.routing is None:
                raise ValueError("algorithm.replay=r3: the rollout carries no routing (start "
                                 "SGLang with --enable-return-routed-experts)")
            replay.replay(carried, collect_own=collect_own)
        elif mode is Route.RECORD:
            replay.record()
        else:
            replay.off()
        if router_scores:
            if mode is Route.OFF and carried is None:
                raise ValueError("router scores: a freely routed forward needs the experts to "
                                 "read in the micro-batch's routing")
            replay.capture_scores(None if mode is Route.RECORD else carried)
        with torch.set_grad_enabled(grad):
            lp, ent = forward_logprobs(model, run, temperature=temperature,
                                       use_kept_sets=a.keep_sampling_mask and kept_sets,
                                       fp32_output_layer=self.cfg.model.fp32_output_layer)
        replay.finish_forward()
        if run is not mb:
            replay.crop(run.shape, shape)
            lp, ent = lp[:shape[0], :shape[1]], ent[:shape[0], :shape[1]]
        # the step's per-token bookkeeping ([B, R] rows, the loss) lives on the CPU; the copy is
        # differentiable, so the backward reaches the model on its GPU
        return lp.cpu(), ent.cpu()

    @staticmethod
    def cp_positions(mb: MicroBatch) -> torch.Tensor | None:
        """The positions of ``mb`` this context-parallel rank holds (None without CP)."""
        from megatron.core import parallel_state as ps
        if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
            return None
        return local_positions(mb, ps.get_context_parallel_rank(),
                               ps.get_context_parallel_world_size())

    def _ep_common_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The [rows, positions] every rank of the expert-parallel group forwards: with
        megatron's allgather token dispatcher (CPU) the group gathers hidden states, so all its
        micro-batches must have one shape (the largest, others padded); else ``shape``."""
        from megatron.core import parallel_state as ps
        if (self.dispatcher != "allgather"
                or ps.get_expert_tensor_and_model_parallel_world_size() == 1):
            return shape
        t = torch.tensor(shape, dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX,
                        group=ps.get_expert_tensor_and_model_parallel_group())
        return int(t[0]), int(t[1])
