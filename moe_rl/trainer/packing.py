"""Packing samples into micro-batches for the megatron-core forward, with the routing replay
tensors in the order the router sees tokens and the kept-id sets re-indexed.

Two layouts. Padded: sample b occupies positions 0..P+R-1 of row b (right padding), under one
causal mask. Packed (``trainer.pack_sequences``): the samples lie one after another in a single
row, each in a slot of its length rounded up to ``slot_multiple``, with position ids restarting
at 0 in every slot and attention confined to the slot: the slots' cumulative lengths are THD's
``cu_seqlens`` (Transformer Engine's attention on GPU, :mod:`moe_rl.trainer.local_attention` on
CPU). Either way a sample starting at position o scores response token j at position o+P-1+j
(position s predicts token s+1). Megatron's GPTModel runs in [S, B, H] layout, so its router
sees token (s, b) at index ``s * B + b``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_rl.rollout_record import Sample
from moe_rl_kernels.logprob import KeptSets


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch (B rows, S positions)."""
    input_ids: torch.Tensor          # [B, S] long
    position_ids: torch.Tensor       # [B, S] long
    attention_mask: torch.Tensor | None   # None: causal (every padded row; a packed one's
                                          # slots each causal, THD); [1, 1, S, S] bool, True =
                                          # masked: attention follows this mask instead
    targets: torch.Tensor            # [B, S] long, the next token (0 where none)
    score_mask: torch.Tensor         # [B, S] bool, predicts a response token with loss_mask
    response_mask: torch.Tensor      # [B, S] bool, predicts any response token
    routing: torch.Tensor | None     # [B, S, L, K] long, padding rows filled with valid ids
    routing_valid: torch.Tensor | None   # [B, S] bool, rows that hold a recorded route
    kept: KeptSets | None            # kept sets of the response rows, b-major (response_mask
                                     # order): the kernel's rows, built and checked once
    sample_indices: list[int]
    prompt_lens: torch.Tensor        # [N] per sample (N = B when padded)
    response_lens: torch.Tensor      # [N]
    sample_rows: torch.Tensor        # [N] the row each sample lies in
    sample_starts: torch.Tensor      # [N] its first position in that row
    segments: torch.Tensor | None = None   # [B, S] slot of every position (packed; None when
                                           # padded): attention stays inside a slot

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def replay_indices(self) -> list[torch.Tensor]:
        """One LongTensor [S*B, K] per MoE layer, in the router's token order (s * B + b)."""
        if self.routing is None:
            raise ValueError("routing: this micro-batch carries no routing to replay")
        B, S, L, K = self.routing.shape
        flat = self.routing.permute(1, 0, 2, 3).reshape(S * B, L, K)
        return [flat[:, layer].contiguous() for layer in range(L)]

    def routing_valid_router_order(self) -> torch.Tensor:
        """``routing_valid`` flattened in the router's order (s * B + b)."""
        return self.routing_valid.t().reshape(-1)

    @property
    def packed(self) -> bool:
        return self.segments is not None

    def response_slices(self) -> list[tuple[int, slice]]:
        """(row, positions) scoring each sample's response tokens, in sample order."""
        out = []
        for i in range(len(self.sample_indices)):
            P, R = int(self.prompt_lens[i]), int(self.response_lens[i])
            o = int(self.sample_starts[i])
            out.append((int(self.sample_rows[i]), slice(o + P - 1, o + P - 1 + R)))
        return out

    def sample_positions(self, chosen: torch.Tensor) -> torch.Tensor:
        """[B, S] bool: the routed positions (all but the last token) of the samples
        ``chosen`` [N] bool."""
        out = torch.zeros(self.shape, dtype=torch.bool)
        for i in chosen.nonzero().flatten().tolist():
            o = int(self.sample_starts[i])
            n = int(self.prompt_lens[i] + self.response_lens[i]) - 1
            out[int(self.sample_rows[i]), o:o + n] = True
        return out

    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative slot lengths of the packed row (int32, THD's ``cu_seqlens``): every slot,
        the row's tail padding included, is one sequence."""
        if not self.packed or self.shape[0] != 1:
            raise ValueError("cu_seqlens: only a packed single-row micro-batch has slots")
        seg = self.segments[0]
        starts = torch.cat([torch.tensor([True]), seg[1:] != seg[:-1]]).nonzero().flatten()
        return torch.cat([starts, torch.tensor([seg.numel()])]).to(torch.int32)

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-position values [B, S] (or [..., B, S]) -> one [R] tensor per sample."""
        return [values[..., b, sl] for b, sl in self.response_slices()]

    def padded_to(self, rows: int, length: int, num_experts: int) -> "MicroBatch":
        """The same micro-batch grown to [rows, length] by rows and positions that hold no
        response (nothing scored, kept sets unchanged; routing filled with valid ids). The
        original rows' results are unchanged: attention is causal and MoE routing dropless."""
        B, S = self.shape
        if (rows, length) == (B, S):
            return self
        if rows < B or length < S:
            raise ValueError(f"padded_to: [{rows}, {length}] is smaller than [{B}, {S}]")
        if self.packed and rows != 1:
            raise ValueError(f"padded_to: a packed micro-batch is one row, not {rows}")

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((rows, length, *t.shape[2:]), dtype=t.dtype)
            out[:B, :S] = t
            return out

        routing = valid = None
        if self.routing is not None:
            L, K = self.routing.shape[2:]
            fill = padding_routing_rows(length * rows, K, num_experts).reshape(length, rows, K)
            routing = fill.permute(1, 0, 2)[:, :, None, :].expand(rows, length, L, K).clone()
            routing[:B, :S] = self.routing
            valid = grow(self.routing_valid)
        segments = None
        if self.packed:   # the new positions form one more slot of their own
            segments = grow(self.segments)
            segments[:B, S:] = int(self.segments.max()) + 1
        position_ids = torch.arange(length, dtype=torch.long)[None, :].expand(rows, length).clone()
        position_ids[:B, :S] = self.position_ids
        return replace(
            self, input_ids=grow(self.input_ids), targets=grow(self.targets),
            score_mask=grow(self.score_mask), response_mask=grow(self.response_mask),
            routing=routing, routing_valid=valid, position_ids=position_ids,
            segments=segments, attention_mask=None)

    def to_response_padded(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-position [B, S] values -> response-aligned [B, R_max] (the algorithm layout)."""
        R_max = int(self.response_lens.max())
        out = torch.full((len(self.sample_indices), R_max), fill, dtype=values.dtype,
                         device=values.device)
        for i, (b, sl) in enumerate(self.response_slices()):
            out[i, :sl.stop - sl.start] = values[b, sl]
        return out


def padding_routing_rows(n_rows: int, topk: int, num_experts: int, start: int = 0
                         ) -> torch.Tensor:
    """Valid, distinct-per-row expert ids for rows without a recorded route:
    ``((start + r) * K + arange(K)) % E`` (never all zeros, which breaks the dispatcher)."""
    if topk > num_experts:
        raise ValueError(f"topk: {topk} exceeds num_experts {num_experts}")
    r = torch.arange(start, start + n_rows, dtype=torch.long)[:, None]
    return (r * topk + torch.arange(topk, dtype=torch.long)[None, :]) % num_experts


def plan_micro_batches(lengths: list[int], *, micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None) -> list[list[int]]:
    """Group sample indices into micro-batches: sorted by length (stable, longest first), then
    filled greedily up to ``micro_batch_size`` rows and/or ``max_tokens`` padded tokens."""
    if micro_batch_size is None and max_tokens_per_micro_batch is None:
        raise ValueError("micro_batch_size / max_tokens_per_micro_batch: give at least one")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in cur] + [lengths[i]])
        too_many = micro_batch_size is not None and len(cur) + 1 > micro_batch_size
        too_long = (max_tokens_per_micro_batch is not None
                    and longest * (len(cur) + 1) > max_tokens_per_micro_batch)
        if cur and (too_many or too_long):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def slot_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def plan_packed_micro_batches(lengths: list[int], *, max_tokens_per_micro_batch: int,
                              micro_batch_size: int | None = None, slot_multiple: int = 1
                              ) -> list[list[int]]:
    """Group sample indices into packed rows by first-fit decreasing: samples taken longest
    first (stable), each put in the first row whose slots still fit it within
    ``max_tokens_per_micro_batch`` tokens (and ``micro_batch_size`` samples), else in a new
    row. A sample longer than the budget gets a row of its own."""
    slots = [slot_length(n, slot_multiple) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    used: list[int] = []
    for i in order:
        for r, row in enumerate(rows):
            fits = used[r] + slots[i] <= max_tokens_per_micro_batch
            if fits and (micro_batch_size is None or len(row) < micro_batch_size):
                row.append(i)
                used[r] += slots[i]
                break
        else:
            rows.append([i])
            used.append(slots[i])
    return rows


def plan(lengths: list[int], *, micro_batch_size: int | None,
         max_tokens_per_micro_batch: int | None, pack_sequences: bool = False,
         slot_multiple: int = 1) -> list[list[int]]:
    """The micro-batches of samples of ``lengths``: padded rows (:func:`plan_micro_batches`) or,
    with ``pack_sequences``, packed rows (:func:`plan_packed_micro_batches`)."""
    if not pack_sequences:
        return plan_micro_batches(lengths, micro_batch_size=micro_batch_size,
                                  max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    if max_tokens_per_micro_batch is None:
        raise ValueError("max_tokens_per_micro_batch: packed rows need a token budget")
    return plan_packed_micro_batches(lengths, micro_batch_size=micro_batch_size,
                                     max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                     slot_multiple=slot_multiple)


def pack_micro_batches(samples: list[Sample], *, pad_token_id: int,
                       micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None,
                       num_experts: int | None = None, pad_to_multiple: int = 1,
                       pack_sequences: bool = False, slot_multiple: int = 1
                       ) -> list[MicroBatch]:
    """Pack ``samples`` into the micro-batches :func:`plan` chooses (see :class:`MicroBatch`)."""
    groups = plan([s.prompt_len + s.response_len for s in samples],
                  micro_batch_size=micro_batch_size,
                  max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                  pack_sequences=pack_sequences, slot_multiple=slot_multiple)
    return [pack_one(samples, idx, pad_token_id=pad_token_id, num_experts=num_experts,
                     pad_to_multiple=pad_to_multiple, packed=pack_sequences,
                     slot_multiple=slot_multiple) for idx in groups]


def pack_one(samples: list[Sample], indices: list[int], *, pad_token_id: int,
             num_experts: int | None = None, pad_to_multiple: int = 1, packed: bool = False,
             slot_multiple: int = 1) -> MicroBatch:
    """Pack the samples ``indices`` (in that order) into one micro-batch: one padded row each,
    or with ``packed`` one row of slots (each ``slot_multiple``-aligned, the row's length a
    multiple of ``pad_to_multiple``; its tail padding a slot of its own)."""
    chosen = [samples[i] for i in indices]
    N = len(chosen)
    lengths = [s.prompt_len + s.response_len for s in chosen]
    if packed:
        slots = [slot_length(n, slot_multiple) for n in lengths]
        starts = torch.tensor([0] + slots[:-1], dtype=torch.long).cumsum(0)
        rows = torch.zeros(N, dtype=torch.long)
        B, S = 1, slot_length(sum(slots), pad_to_multiple)
        segments = torch.full((1, S), N, dtype=torch.long)
        position_ids = torch.arange(S, dtype=torch.long)[None, :] - sum(slots)
        for k, (o, n) in enumerate(zip(starts.tolist(), slots)):
            segments[0, o:o + n] = k
            position_ids[0, o:o + n] = torch.arange(n)
    else:
        starts, rows = torch.zeros(N, dtype=torch.long), torch.arange(N)
        B, S = N, slot_length(max(lengths), pad_to_multiple)
        segments = None
        position_ids = torch.arange(S, dtype=torch.long)[None, :].expand(B, S).clone()
    input_ids = torch.full((B, S), pad_token_id, dtype=torch.long)
    targets = torch.zeros((B, S), dtype=torch.long)
    score = torch.zeros((B, S), dtype=torch.bool)
    resp = torch.zeros((B, S), dtype=torch.bool)
    has_routing = [s.routing is not None for s in chosen]
    if any(has_routing) and not all(has_routing):
        raise ValueError("routing: either every sample of a micro-batch has routing or none")
    routing = valid = None
    if all(has_routing):
        if num_experts is None:
            raise ValueError("num_experts: needed to fill routing rows without a recorded route")
        L, K = chosen[0].routing.shape[1:]
        # fill everything with distinct valid ids in router order (s * B + b), then copy routes
        fill = padding_routing_rows(S * B, K, num_experts).reshape(S, B, K)
        routing = fill.permute(1, 0, 2)[:, :, None, :].expand(B, S, L, K).clone()
        valid = torch.zeros((B, S), dtype=torch.bool)
    has_mask = [s.sampling_mask_offsets is not None for s in chosen]
    if any(has_mask) and not all(has_mask):
        raise ValueError("sampling mask: either every sample of a micro-batch has one or none")
    kept_lengths: list[torch.Tensor] = []
    kept_parts: list[torch.Tensor] = []
    for s, b, o in zip(chosen, rows.tolist(), starts.tolist()):
        P, R = s.prompt_len, s.response_len
        tokens = torch.cat([s.prompt_ids, s.response_ids]).long()
        input_ids[b, o:o + P + R] = tokens
        targets[b, o:o + P + R - 1] = tokens[1:]
        pos = slice(o + P - 1, o + P - 1 + R)
        resp[b, pos] = True
        score[b, pos] = s.loss_mask
        if routing is not None:
            if s.routing.shape[1:] != (L, K):
                raise ValueError(f"sample {s.sample_id}: routing: expected [*, {L}, {K}], got "
                                 f"{list(s.routing.shape)}")
            routing[b, o:o + P + R - 1] = s.routing.long()
            valid[b, o:o + P + R - 1] = True
        if all(has_mask):
            kept_lengths.append(s.sampling_mask_offsets[1:] - s.sampling_mask_offsets[:-1])
            kept_parts.append(s.sampling_mask_ids)
    kept = None
    if all(has_mask):   # the samples' own offsets re-based once onto the response rows
        offsets = torch.zeros(sum(s.response_len for s in chosen) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(torch.cat(kept_lengths).long(), 0)
        kept = KeptSets(offsets, torch.cat(kept_parts).long())
    return MicroBatch(input_ids=input_ids, position_ids=position_ids,
                      attention_mask=None, targets=targets,
                      score_mask=score, response_mask=resp,
                      routing=routing, routing_valid=valid, kept=kept,
                      sample_indices=list(indices),
                      prompt_lens=torch.tensor([s.prompt_len for s in chosen]),
                      response_lens=torch.tensor([s.response_len for s in chosen]),
                      sample_rows=rows, sample_starts=starts, segments=segments)
