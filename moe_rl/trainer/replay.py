"""Routing replay (off / R2 / R3) on megatron-core's native RouterReplay, plus routing agreement.

The controller binds to the routers of one model by walking its MoE layers (global layer
index from ``layer_number``, so pipeline stages and dense layers are handled), never by position
in megatron's global registry. It wraps each router's ``get_replay_topk`` to (a) count that the
replay tensor was consumed and (b) compute, while replaying, the top-k the router would have
chosen from its own scores, for the routing-agreement metric; and its ``gating`` to read, when
asked, the router's log-scores of given experts (RSPO's router-shift weight).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from moe_rl.algo.metrics import routing_agreement
from moe_rl.algo.router_shift import router_log_scores

MODES = ("off", "r2", "r3")


def sequence_parallel_slice(indices: torch.Tensor, seq_len: int, batch: int, tp_rank: int,
                            tp_size: int) -> torch.Tensor:
    """The rows [S*B, K] (router order s*B+b) that sequence-parallel rank ``tp_rank`` routes: the
    contiguous sequence shard ``[rank*S/tp, (rank+1)*S/tp)``."""
    if seq_len % tp_size:
        raise ValueError(f"sequence length {seq_len} is not divisible by tensor_parallel {tp_size}")
    shard = seq_len // tp_size
    return indices.reshape(seq_len, batch, -1)[tp_rank * shard:(tp_rank + 1) * shard].reshape(
        shard * batch, -1)


def context_parallel_slice(indices: torch.Tensor, seq_len: int, batch: int,
                           positions: torch.Tensor) -> torch.Tensor:
    """Rows [S*B, K] -> the rows at the sequence ``positions`` a context-parallel rank holds
    (router order kept: s_local * B + b)."""
    return indices.reshape(seq_len, batch, -1)[positions].reshape(positions.numel() * batch, -1)


@dataclass
class _Router:
    layer: int                  # global decoder-layer index
    moe_index: int              # index among the model's MoE layers (routing record column)
    replay: object              # megatron RouterReplay instance
    module: object = None       # megatron TopKRouter
    calls: int = 0
    own_topk: list = field(default_factory=list)
    score_at: torch.Tensor | None = None   # experts whose log-scores the next forward reads
    scores: torch.Tensor | None = None     # ... read: [tokens, K] (or [tokens, E] until the
                                           # recorded choice is known)


class ReplayController:
    """Drives the routers of one model. Typical use per micro-batch::

        ctl.replay(indices)        # R3 / R2 updates: list of [tokens, K] per MoE layer
        out = model(...)           # forward
        ctl.finish_forward()       # checks every replay tensor was consumed
        with ctl.backward():       # REPLAY_BACKWARD during activation recomputation
            loss.backward()
    """

    def __init__(self, model, moe_layers: tuple[int, ...], topk: int, num_experts: int,
                 recompute: bool = False):
        self.num_model_moe_layers = len(moe_layers)
        from megatron.core.transformer.moe.router_replay import (RouterReplay,
                                                                 RouterReplayAction)
        self.action = RouterReplayAction
        self.topk, self.num_experts, self.recompute = topk, num_experts, recompute
        self.routers: list[_Router] = []
        for layer in model.decoder.layers:
            mlp = getattr(layer, "mlp", None)
            router = getattr(mlp, "router", None)
            if router is None:
                continue
            if router.config.moe_router_fusion:
                raise ValueError("moe_router_fusion: the fused router skips routing replay; turn "
                                 "it off to replay routing")
            if router.router_replay is None:
                raise ValueError("moe_enable_routing_replay: the model was built without routing "
                                 "replay support")
            g = layer.layer_number - 1
            if g not in moe_layers:
                raise ValueError(f"layer {g} is MoE in the model but not in the config's MoE "
                                 f"layers {moe_layers}")
            self.routers.append(_Router(g, moe_layers.index(g), router.router_replay, router))
        self.layer_names = [r.layer for r in self.routers]
        self._mode: str | None = None
        self._expected_rows: int | None = None
        self.collect_own = False
        self._crop = None   # see crop()
        self._capture = False   # see capture_scores()
        for r in self.routers:
            self._wrap(r)
        self.registry = RouterReplay
        config = getattr(model, "config", None)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    # -------------------------------------------------------------- wrapping
    def _wrap(self, r: _Router) -> None:
        original = r.replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            r.calls += 1
            if (self._mode == "replay" and self._expected_rows is not None
                    and scores.shape[0] != self._expected_rows):
                raise RuntimeError(f"routing replay: layer {r.layer} routes {scores.shape[0]} "
                                   f"tokens but the replay tensor has {self._expected_rows} "
                                   f"rows (packing, padding or parallel slicing differ from the "
                                   f"router's token order)")
            if self.collect_own and default_compute_topk is not None:
                with torch.no_grad():
                    _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups,
                                                  group_topk=group_topk)
                r.own_topk.append(own.detach().cpu())
            return original(scores, topk, num_groups, group_topk, default_compute_topk)

        r.replay.get_replay_topk = get_replay_topk
        gating = r.module.gating

        def gating_with_scores(inputs, *args, **kwargs):
            logits = gating(inputs, *args, **kwargs)
            if self._capture and r.scores is None:   # once per forward (not in recomputation)
                with torch.no_grad():
                    flat = logits.detach().reshape(-1, logits.shape[-1])   # [s * B + b, E]
                    scores = router_log_scores(flat, r.module.score_function)
                    if r.score_at is not None:
                        scores = scores.gather(-1, r.score_at.to(scores.device).long())
                    r.scores = scores
            return logits

        r.module.gating = gating_with_scores

    # -------------------------------------------------------------- control
    @property
    def num_moe_layers(self) -> int:
        return len(self.routers)

    def check(self, indices: list[torch.Tensor]) -> None:
        """Layer count, top-k, id range, distinct ids per row and equal row counts, before any
        forward (the row count is checked against each router's token count during it)."""
        if len(indices) != len(self.routers):
            raise ValueError(f"routing: expected one replay tensor per MoE layer on this stage "
                             f"({len(self.routers)}), got {len(indices)}")
        rows = None
        for r, t in zip(self.routers, indices):
            if t.dim() != 2 or t.shape[1] != self.topk:
                raise ValueError(f"routing: layer {r.layer}: expected [tokens, {self.topk}], got "
                                 f"{list(t.shape)}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_experts):
                raise ValueError(f"routing: layer {r.layer}: expert ids must lie in "
                                 f"[0, {self.num_experts})")
            if t.shape[1] > 1:
                ordered = t.sort(-1).values
                if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
                    row = int((ordered[:, 1:] == ordered[:, :-1]).any(-1).nonzero()[0, 0])
                    raise ValueError(f"routing: layer {r.layer}: row {row} repeats an expert id "
                                     f"({t[row].tolist()}); a token's top-k experts are distinct")
            if rows is not None and t.shape[0] != rows:
                raise ValueError(f"routing: layer {r.layer}: {t.shape[0]} rows, other layers "
                                 f"have {rows}")
            rows = t.shape[0]

    def _reset(self) -> None:
        self._crop = None
        self._capture = False
        for r in self.routers:
            r.replay.clear_indices()
            r.calls = 0
            r.own_topk = []
            r.score_at = r.scores = None

    def local_rows(self, rows: torch.Tensor, seq_len: int, batch: int,
                   cp_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [S*B, ...] (router order) -> the rows this rank's routers see: the positions
        ``cp_positions`` its context-parallel rank holds (None without CP), then the
        sequence-parallel shard."""
        from megatron.core import parallel_state as ps
        flat = rows.dim() == 1
        out = rows[:, None] if flat else rows
        if cp_positions is not None:
            out = context_parallel_slice(out, seq_len, batch, cp_positions)
            seq_len = cp_positions.numel()
        if ps.model_parallel_is_initialized():
            tp = ps.get_tensor_model_parallel_world_size()
            if tp > 1 and self.sequence_parallel:
                out = sequence_parallel_slice(out, seq_len, batch,
                                              ps.get_tensor_model_parallel_rank(), tp)
        return out[:, 0] if flat else out

    def local_indices(self, indices: list[torch.Tensor], seq_len: int, batch: int,
                      cp_positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """From the whole model's routing (one [S*B, K] tensor per MoE layer, router order) to
        this rank's routers: this pipeline stage's MoE layers, then :meth:`local_rows`."""
        if len(indices) != self.num_model_moe_layers:
            raise ValueError(f"routing: expected one replay tensor per MoE layer of the model "
                             f"({self.num_model_moe_layers}), got {len(indices)}")
        return [self.local_rows(indices[r.moe_index], seq_len, batch, cp_positions)
                for r in self.routers]

    def replay(self, indices: list[torch.Tensor], collect_own: bool = True) -> None:
        """Replay ``indices`` (one [tokens, K] LongTensor per MoE layer of this stage, in the
        order its routers see tokens; see :meth:`local_indices`) in the next forward; with
        ``collect_own`` also record the router's own choice."""
        self.check(indices)
        self._reset()
        for r, t in zip(self.routers, indices):
            r.replay.set_target_indices(t.long())
            r.replay.set_router_replay_action(self.action.REPLAY_FORWARD)
        self._mode = "replay"
        self._expected_rows = int(indices[0].shape[0]) if indices else None
        self.collect_own = collect_own

    def record(self) -> None:
        """Let the routers choose (ordinary top-k) and record their choice."""
        self._reset()
        for r in self.routers:
            r.replay.set_router_replay_action(self.action.RECORD)
        self._mode = "record"
        self.collect_own = False

    def off(self) -> None:
        """Ordinary routing, nothing recorded."""
        self._reset()
        for r in self.routers:
            r.replay.clear_router_replay_action()
        self._mode = None
        self.collect_own = False

    def recorded(self) -> list[torch.Tensor]:
        """Top-k ids chosen in the last recording forward, one [tokens, K] per MoE layer."""
        out = []
        for r in self.routers:
            t = r.replay.get_recorded_indices()
            if t is None:
                raise RuntimeError(f"routing: layer {r.layer} recorded nothing; did the forward "
                                   f"run in record mode?")
            out.append(self._cropped(t.detach().cpu()))
        return out

    def capture_scores(self, at: list[torch.Tensor] | None) -> None:
        """Read, in the next forward (set after :meth:`replay` / :meth:`record` / :meth:`off`),
        each router's log-scores of the experts ``at`` (one [tokens, K] per MoE layer of this
        stage, as :meth:`replay` takes), or with None of the experts it chooses (record mode);
        :meth:`router_scores` returns them."""
        if at is None and self._mode != "record":
            raise ValueError("router scores: say at which experts (only a recording forward "
                             "knows them by itself)")
        if at is not None:
            self.check(at)
        for i, r in enumerate(self.routers):
            r.score_at = None if at is None else at[i]
        self._capture = True

    def router_scores(self) -> list[torch.Tensor]:
        """The log-scores read in the last forward (:meth:`capture_scores`), one [tokens, K]
        float32 per MoE layer, on the CPU."""
        out = []
        for r in self.routers:
            if r.scores is None:
                raise RuntimeError(f"router scores: layer {r.layer} read none; was "
                                   f"capture_scores() called before the forward?")
            t = r.scores
            if r.score_at is None:
                t = t.gather(-1, r.replay.get_recorded_indices().to(t.device).long())
            out.append(self._cropped(t.cpu()))
        return out

    def crop(self, padded: tuple[int, int], shape: tuple[int, int]) -> None:
        """The last forward ran on a micro-batch padded from [B, S] ``shape`` to ``padded``
        (expert parallelism on CPU): report only the original tokens' routing."""
        self._crop = (padded, shape)

    def _cropped(self, t: torch.Tensor) -> torch.Tensor:
        if self._crop is None:
            return t
        (B2, S2), (B, S) = self._crop   # router order s * B + b
        return t.reshape(S2, B2, *t.shape[1:])[:S, :B].reshape(S * B, *t.shape[1:])

    def finish_forward(self) -> None:
        """Assert every MoE router of this stage ran exactly once in the last forward."""
        for r in self.routers:
            if self._mode is not None and r.calls != 1:
                raise RuntimeError(f"routing replay: layer {r.layer} router ran {r.calls} times in "
                                   f"one forward (expected 1): replay tensors not consumed")

    @contextlib.contextmanager
    def backward(self):
        """Around ``loss.backward()``: with activation recomputation, recomputed forwards pop the
        replayed ids (REPLAY_BACKWARD); afterwards every backward replay tensor must be used."""
        if self._mode != "replay" or not self.recompute:
            yield
            return
        for r in self.routers:
            r.replay.set_router_replay_action(self.action.REPLAY_BACKWARD)
        collect, self.collect_own = self.collect_own, False
        try:
            yield
        finally:
            self.collect_own = collect
            for r in self.routers:
                r.replay.set_router_replay_action(self.action.REPLAY_FORWARD)
        left = [r.layer for r in self.routers if r.replay.replay_backward_list]
        if left:
            raise RuntimeError(f"routing replay: backward replay tensors of layers {left} were "
                               f"not consumed by the recomputation")

    def own_choice(self) -> list[torch.Tensor]:
        """The top-k each router would have chosen from its own scores in the last forward."""
        if any(len(r.own_topk) != 1 for r in self.routers):
            raise RuntimeError("routing: the router's own choice was not collected once per layer")
        return [self._cropped(r.own_topk[0]) for r in self.routers]

    def agreement(self, engine: list[torch.Tensor], valid: torch.Tensor | None = None,
                  trainer: list[torch.Tensor] | None = None) -> dict[str, float]:
        """routing/agreement (+ per layer) between the trainer's own top-k (collected while
        replaying, or ``trainer`` e.g. recorded with replay off) and the engine's."""
        own = trainer if trainer is not None else self.own_choice()
        a = torch.stack([t.long() for t in own], dim=1)
        b = torch.stack([t.long().cpu() for t in engine], dim=1)
        return routing_agreement(a, b, valid, layer_names=self.layer_names)

    def close(self) -> None:
        """Clear all replay state (call between model builds)."""
        self.off()
        self.registry.clear_global_router_replay_instances()
