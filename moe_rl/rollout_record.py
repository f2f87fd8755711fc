"""The rollout record: one typed object per sample and per batch, validated, serialised without
pickle (safetensors), with routing stored compactly (uint8 / int16, MoE layers only)."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save as st_save

from moe_rl.families.shape import MoEShape

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,   # model.dtype, engine dtype
                "float16": torch.float16}

FORMAT_VERSION = 1


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 for <= 256 experts, int16 up to 32768."""
    if num_experts <= 0:
        raise ValueError(f"num_experts: expected > 0, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts: {num_experts} exceeds the int16 routing record (32768)")


def compact_routing(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Convert int32/int64 expert ids to the compact dtype, checking 0 <= id < num_experts."""
    if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) >= num_experts):
        raise ValueError(f"routing: expert ids must lie in [0, {num_experts}), got "
                         f"[{int(routing.min())}, {int(routing.max())}]")
    return routing.to(routing_dtype(num_experts))


class RecordError(ValueError):
    """A rollout record that does not hold together; the message names sample and field."""


@dataclass
class Sample:
    """One prompt + response with everything the trainer needs to reproduce the engine."""
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    loss_mask: torch.Tensor | None = None
    pass_logprobs: torch.Tensor | None = None
    routing: torch.Tensor | None = None
    sampling_mask_offsets: torch.Tensor | None = None
    sampling_mask_ids: torch.Tensor | None = None
    kept_logmass: torch.Tensor | None = None
    reward: float = 0.0
    group_id: int = 0
    weight_version: int = 0
    sample_id: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    # partial rollouts: the weight version that sampled each response token (None: every token
    # ``weight_version``'s) and, for each later version's segment, the routing of the positions
    # before it as that version's prefill computed them (what the segment's tokens attended to)
    token_versions: torch.Tensor | None = None
    segment_routing: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = torch.as_tensor(self.prompt_ids, dtype=torch.int32)
        self.response_ids = torch.as_tensor(self.response_ids, dtype=torch.int32)
        self.rollout_logprobs = torch.as_tensor(self.rollout_logprobs, dtype=torch.float32)
        if self.loss_mask is None:
            self.loss_mask = torch.ones(self.response_ids.numel(), dtype=torch.bool)
        self.loss_mask = torch.as_tensor(self.loss_mask).to(torch.bool)
        if self.pass_logprobs is not None:
            self.pass_logprobs = torch.as_tensor(self.pass_logprobs, dtype=torch.float32)
        if self.sampling_mask_offsets is not None:
            self.sampling_mask_offsets = torch.as_tensor(self.sampling_mask_offsets,
                                                         dtype=torch.int64)
            self.sampling_mask_ids = torch.as_tensor(self.sampling_mask_ids, dtype=torch.int32)
        if self.kept_logmass is not None:
            self.kept_logmass = torch.as_tensor(self.kept_logmass, dtype=torch.float32)
        if self.token_versions is not None:
            self.token_versions = torch.as_tensor(self.token_versions, dtype=torch.int64)
        self.reward = float(self.reward)
        self.validate()

    # ------------------------------------------------------------------ shape facts
    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())

    @property
    def routed_positions(self) -> int:
        """Positions the engine ran through the model: prompt + response - 1."""
        return self.prompt_len + self.response_len - 1

    def versions(self) -> torch.Tensor:
        """The weight version that sampled each response token [R]."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full((self.response_len,), self.weight_version, dtype=torch.int64)

    def segments(self) -> list[tuple[int, int, int]]:
        """(version, first, end) of each run of response tokens one weight version sampled,
        in order (one for a sample that no weight update interrupted)."""
        if self.token_versions is None:
            return [(self.weight_version, 0, self.response_len)]
        v = self.token_versions
        bounds = [0] + ((v[1:] != v[:-1]).nonzero().flatten() + 1).tolist() + [v.numel()]
        return [(int(v[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def routing_of_segment(self, k: int) -> torch.Tensor | None:
        """The routing that reproduces segment ``k``'s tokens at its own version: the positions
        before it as its version's prefill routed them, then the rows recorded while it was
        sampled (later rows do not reach its tokens)."""
        if self.routing is None or k == 0:
            return self.routing
        start = self.prompt_len + self.segments()[k][1] - 1
        return torch.cat([self.segment_routing[k - 1], self.routing[start:]])

    def segment_view(self, k: int) -> "Sample":
        """The sample cut after segment ``k``, routed as :meth:`routing_of_segment` and marked
        one version throughout: scoring it at segment ``k``'s weights reproduces that segment's
        tokens as the engine sampled them (the tokens before it are scored too, and ignored)."""
        version, _, end = self.segments()[k]
        P = self.prompt_len
        mask = None
        if self.sampling_mask_offsets is not None:
            mask = self.sampling_mask_offsets[:end + 1]
        routing = self.routing_of_segment(k)
        return Sample(prompt_ids=self.prompt_ids, response_ids=self.response_ids[:end],
                      rollout_logprobs=self.rollout_logprobs[:end],
                      loss_mask=self.loss_mask[:end],
                      pass_logprobs=None if self.pass_logprobs is None
                      else self.pass_logprobs[:, :end],
                      routing=None if routing is None else routing[:P + end - 1],
                      sampling_mask_offsets=mask,
                      sampling_mask_ids=None if mask is None
                      else self.sampling_mask_ids[:int(mask[-1])],
                      kept_logmass=None if self.kept_logmass is None
                      else self.kept_logmass[:end],
                      reward=self.reward, group_id=self.group_id, weight_version=version,
                      sample_id=self.sample_id, metadata=self.metadata)

    def _fail(self, field_name: str, what: str) -> RecordError:
        return RecordError(f"sample {self.sample_id}: {field_name}: {what}")

    # ------------------------------------------------------------------ validation
    def validate(self, vocab_size: int | None = None, moe_shape: MoEShape | None = None
                 ) -> None:
        """Check shapes, ranges and finiteness; raise :class:`RecordError` naming the field."""
        P, R = self.prompt_len, self.response_len
        for name in ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask"):
            if getattr(self, name).dim() != 1:
                raise self._fail(name, f"expected a 1-D tensor, got shape "
                                       f"{list(getattr(self, name).shape)}")
        if P < 1:
            raise self._fail("prompt_ids", "expected at least one prompt token")
        if R < 1:
            raise self._fail("response_ids", "expected at least one response token")
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(self, name)
            if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
                raise self._fail(name, f"token ids must lie in [0, {vocab_size or 'vocab'}), got "
                                       f"[{int(ids.min())}, {int(ids.max())}]")
        if self.loss_mask.numel() != R:
            raise self._fail("loss_mask", f"expected {R} entries (one per response token), got "
                                          f"{self.loss_mask.numel()}")
        self._check_logprobs("rollout_logprobs", self.rollout_logprobs, (R,))
        if self.pass_logprobs is not None:
            if (self.pass_logprobs.dim() != 2 or self.pass_logprobs.shape[1] != R
                    or self.pass_logprobs.shape[0] < 1):
                raise self._fail("pass_logprobs", f"expected [n_passes >= 1, {R}], got "
                                                  f"{list(self.pass_logprobs.shape)}")
            self._check_logprobs("pass_logprobs", self.pass_logprobs, None)
        if self.routing is not None:
            self._check_routing(moe_shape)
        if (self.sampling_mask_offsets is None) != (self.sampling_mask_ids is None):
            raise self._fail("sampling_mask_ids", "offsets and ids must be given together")
        if self.sampling_mask_offsets is not None:
            self._check_sampling_mask(vocab_size)
        if self.kept_logmass is not None:
            self._check_logprobs("kept_logmass", self.kept_logmass, (R,))
        if not math.isfinite(self.reward):
            raise self._fail("reward", f"expected a finite number, got {self.reward}")
        if self.token_versions is not None:
            self._check_token_versions()

    def _check_token_versions(self) -> None:
        v = self.token_versions
        if v.dim() != 1 or v.numel() != self.response_len:
            raise self._fail("token_versions", f"expected {self.response_len} entries (one per "
                                               f"response token), got {list(v.shape)}")
        if bool((v[1:] < v[:-1]).any()):
            raise self._fail("token_versions", "expected non-decreasing versions (a response "
                                               "continues under newer weights only)")
        if int(v[0]) != self.weight_version:
            raise self._fail("token_versions", f"the first token's version {int(v[0])} must be "
                                               f"the sample's weight_version {self.weight_version}")
        starts = [first for _, first, _ in self.segments()[1:]]
        if self.routing is None:
            if self.segment_routing:
                raise self._fail("segment_routing", "given without routing")
            return
        rows = self.segment_routing or []
        if len(rows) != len(starts):
            raise self._fail("segment_routing", f"expected one routing block per later "
                                                f"version's segment ({len(starts)}), got "
                                                f"{len(rows)}")
        for k, (block, first) in enumerate(zip(rows, starts)):
            want = (self.prompt_len + first - 1, *self.routing.shape[1:])
            if tuple(block.shape) != want or block.dtype != self.routing.dtype:
                raise self._fail("segment_routing", f"block {k}: expected shape {list(want)} "
                                                    f"and dtype {self.routing.dtype}, got "
                                                    f"{list(block.shape)} {block.dtype}")

    def _check_logprobs(self, name: str, lp: torch.Tensor, shape: tuple | None) -> None:
        if shape is not None and tuple(lp.shape) != shape:
            raise self._fail(name, f"expected shape {list(shape)}, got {list(lp.shape)}")
        if not torch.isfinite(lp).all():
            bad = int((~torch.isfinite(lp)).flatten().nonzero()[0, 0])
            raise self._fail(name, f"non-finite log-prob at flat index {bad}")
        if lp.numel() and float(lp.max()) > 1e-4:
            raise self._fail(name, f"log-probs must be <= 0, got {float(lp.max())}")

    def _check_routing(self, moe_shape: MoEShape | None) -> None:
        r = self.routing
        if r.dtype not in (torch.uint8, torch.int16):
            raise self._fail("routing", f"expected dtype uint8 or int16, got {r.dtype}")
        if r.dim() != 3:
            raise self._fail("routing", f"expected [positions, moe_layers, topk], got "
                                        f"{list(r.shape)}")
        if r.shape[0] != self.routed_positions:
            raise self._fail("routing", f"expected {self.routed_positions} positions (prompt "
                                        f"{self.prompt_len} + response {self.response_len} - 1), "
                                        f"got {r.shape[0]}")
        if r.numel() and int(r.min()) < 0:
            raise self._fail("routing", "negative expert id")
        if moe_shape is not None:
            if r.shape[1] != moe_shape.num_moe_layers:
                raise self._fail("routing", f"expected {moe_shape.num_moe_layers} MoE layers, got "
                                            f"{r.shape[1]}")
            if r.shape[2] != moe_shape.topk:
                raise self._fail("routing", f"expected top-k {moe_shape.topk}, got {r.shape[2]}")
            if r.numel() and int(r.max()) >= moe_shape.num_experts:
                raise self._fail("routing", f"expert id {int(r.max())} >= num_experts "
                                            f"{moe_shape.num_experts}")
            if r.dtype != routing_dtype(moe_shape.num_experts):
                want = routing_dtype(moe_shape.num_experts)
                raise self._fail("routing", f"expected dtype {want} for "
                                            f"{moe_shape.num_experts} experts, got {r.dtype}")

    def _check_sampling_mask(self, vocab_size: int | None) -> None:
        off, ids = self.sampling_mask_offsets, self.sampling_mask_ids
        R = self.response_len
        if off.dim() != 1 or off.numel() != R + 1:
            raise self._fail("sampling_mask_offsets", f"expected {R + 1} offsets, got "
                                                      f"{off.numel()}")
        if int(off[0]) != 0 or int(off[-1]) != ids.numel() or bool((off[1:] < off[:-1]).any()):
            raise self._fail("sampling_mask_offsets", f"expected non-decreasing offsets from 0 "
                                                      f"to {ids.numel()}")
        if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None
                                                   and int(ids.max()) >= vocab_size)):
            raise self._fail("sampling_mask_ids", f"ids must lie in [0, {vocab_size or 'vocab'})")
        lengths = off[1:] - off[:-1]
        if bool((lengths == 0).any()):
            j = int((lengths == 0).nonzero()[0, 0])
            raise self._fail("sampling_mask_ids", f"response token {j} has an empty kept set")
        row = torch.repeat_interleave(torch.arange(R), lengths)
        key = row * (int(ids.max()) + 1 if ids.numel() else 1) + ids.long()
        if key.unique().numel() != key.numel():
            raise self._fail("sampling_mask_ids", "a response token's kept set lists an id twice")
        hit = torch.zeros(R, dtype=torch.long).index_add_(
            0, row, (ids.long() == self.response_ids.long()[row]).long())
        if bool((hit == 0).any()):
            j = int((hit == 0).nonzero()[0, 0])
            raise self._fail("sampling_mask_ids", f"response token {j} (id "
                                                  f"{int(self.response_ids[j])}) is not in its "
                                                  f"kept set")

    def kept_set(self, j: int) -> torch.Tensor:
        """Kept token ids of response token ``j``."""
        if self.sampling_mask_offsets is None:
            raise self._fail("sampling_mask_ids", "this sample has no sampling mask")
        offsets = self.sampling_mask_offsets
        return self.sampling_mask_ids[offsets[j]:offsets[j + 1]]


# ---------------------------------------------------------------------- batch + serialisation

def _cat(parts: list[torch.Tensor], dtype: torch.dtype, tail: tuple = ()) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros((0,) + tail, dtype=dtype)


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


def _read_header(data: bytes) -> dict:
    if len(data) < 8:
        raise RecordError("rollout batch: truncated data (no safetensors header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise RecordError("rollout batch: truncated data (header larger than the payload)")
    try:
        return json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"rollout batch: corrupt header: {exc}") from None


def _check_boundaries(entries: list, t: dict) -> None:
    """The header's per-sample lengths must equal the payload's, and add up to its tensors."""
    try:
        header = [(int(e["prompt_len"]), int(e["response_len"])) for e in entries]
    except (KeyError, TypeError, ValueError):
        raise RecordError("rollout batch: header: every sample needs integer prompt_len and "
                          "response_len") from None
    if "prompt_lens" not in t or "response_lens" not in t:
        raise RecordError("rollout batch: payload: missing prompt_lens / response_lens")
    payload = list(zip(t["prompt_lens"].tolist(), t["response_lens"].tolist()))
    if header != payload:
        bad = next((i for i, (h, p) in enumerate(zip(header, payload)) if h != p),
                   min(len(header), len(payload)))
        raise RecordError(f"rollout batch: sample {bad}: header lengths {header[bad:bad + 1]} "
                          f"disagree with the payload's {payload[bad:bad + 1]}")
    for name, total in (("prompt_ids", sum(p for p, _ in header)),
                        ("response_ids", sum(r for _, r in header)),
                        ("loss_mask", sum(r for _, r in header)),
                        ("rollout_logprobs", sum(r for _, r in header))):
        if t[name].shape[0] != total:
            raise RecordError(f"rollout batch: {name}: {t[name].shape[0]} entries, the samples' "
                              f"lengths add up to {total}")


def _token_versions(segments, R: int) -> tuple[torch.Tensor, list[int]]:
    """The per-token versions of a header's ``segments`` ([version, first, end] runs covering
    the R response tokens in order), and the first token of every segment after the first."""
    try:
        runs = [(int(v), int(a), int(b)) for v, a, b in segments]
    except (TypeError, ValueError):
        raise RecordError("rollout batch: header: segments must be [version, first, end] "
                          "integer triples") from None
    if [a for _, a, _ in runs] != [0] + [b for _, _, b in runs[:-1]] or runs[-1][2] != R or any(
            b <= a for _, a, b in runs):
        raise RecordError(f"rollout batch: header: segments {runs} do not cover the {R} "
                          f"response tokens in order")
    versions = torch.cat([torch.full((b - a,), v, dtype=torch.int64) for v, a, b in runs])
    return versions, [a for _, a, _ in runs[1:]]


@dataclass
class RolloutBatch:
    """A list of samples with validation and pickle-free binary serialisation."""
    samples: list[Sample]

    def __len__(self) -> int:
        return len(self.samples)

    def validate(self, vocab_size: int | None = None, moe_shape: MoEShape | None = None
                 ) -> None:
        """Validate every sample against the model's vocabulary and routing spec."""
        for s in self.samples:
            s.validate(vocab_size, moe_shape)

    def to_bytes(self) -> bytes:
        """Serialise to safetensors bytes: concatenated tensors + offsets, scalars in the header.

        Prompt routing rows (the first P rows) identical to those of an earlier sample of the
        same group are stored once.
        """
        ss = self.samples
        tensors: dict[str, torch.Tensor] = {
            "prompt_ids": _cat([s.prompt_ids for s in ss], torch.int32),
            "response_ids": _cat([s.response_ids for s in ss], torch.int32),
            "loss_mask": _cat([s.loss_mask.to(torch.uint8) for s in ss], torch.uint8),
            "rollout_logprobs": _cat([s.rollout_logprobs for s in ss], torch.float32),
            # the per-sample boundaries, in the payload too: the header must agree with them
            "prompt_lens": torch.tensor([s.prompt_len for s in ss], dtype=torch.int64),
            "response_lens": torch.tensor([s.response_len for s in ss], dtype=torch.int64),
        }
        meta_samples = []
        n_passes = {s.pass_logprobs.shape[0] for s in ss if s.pass_logprobs is not None}
        if len(n_passes) > 1:
            raise RecordError(f"pass_logprobs: every sample of a batch needs the same number of "
                              f"passes, got {sorted(n_passes)}")
        pass_parts, prompt_blocks, resp_parts, mask_len_parts, mask_id_parts = [], [], [], [], []
        logmass_parts: list[torch.Tensor] = []
        seg_parts: list[torch.Tensor] = []
        block_of_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
        rdtypes = {s.routing.dtype for s in ss if s.routing is not None}
        if len(rdtypes) > 1:
            raise RecordError(f"routing: mixed dtypes in one batch: {rdtypes}")
        for s in ss:
            entry = {"prompt_len": s.prompt_len, "response_len": s.response_len,
                     "reward": s.reward, "group_id": s.group_id, "weight_version": s.weight_version,
                     "sample_id": s.sample_id, "metadata": s.metadata,
                     "has_passes": s.pass_logprobs is not None, "prompt_block": -1,
                     "has_mask": s.sampling_mask_offsets is not None,
                     "has_logmass": s.kept_logmass is not None}
            if s.token_versions is not None:   # runs of one version: [version, first, end]
                entry["segments"] = [list(x) for x in s.segments()]
                seg_parts.extend(s.segment_routing or [])
            if s.pass_logprobs is not None:
                pass_parts.append(s.pass_logprobs)
            if s.kept_logmass is not None:
                logmass_parts.append(s.kept_logmass)
            if s.routing is not None:
                prompt_rows = s.routing[:s.prompt_len]
                block = -1
                for idx, rows in block_of_group.get(s.group_id, []):
                    if rows.shape == prompt_rows.shape and torch.equal(rows, prompt_rows):
                        block = idx
                        break
                if block < 0:
                    block = len(prompt_blocks)
                    prompt_blocks.append(prompt_rows)
                    block_of_group.setdefault(s.group_id, []).append((block, prompt_rows))
                entry["prompt_block"] = block
                resp_parts.append(s.routing[s.prompt_len:])
            if s.sampling_mask_offsets is not None:
                mask_len_parts.append((s.sampling_mask_offsets[1:] - s.sampling_mask_offsets[:-1])
                                      .to(torch.int32))
                mask_id_parts.append(s.sampling_mask_ids)
            meta_samples.append(entry)
        if pass_parts:
            tensors["pass_logprobs"] = torch.cat(pass_parts, dim=1).contiguous()
        if logmass_parts:
            tensors["kept_logmass"] = torch.cat(logmass_parts)
        if prompt_blocks:
            rd = rdtypes.pop()
            L, K = prompt_blocks[0].shape[1:]
            tensors["routing_prompt"] = torch.cat(prompt_blocks).contiguous()
            tensors["routing_prompt_offsets"] = _offsets([b.shape[0] for b in prompt_blocks])
            tensors["routing_response"] = _cat(resp_parts, rd, (L, K)).contiguous()
        if seg_parts:
            tensors["segment_routing"] = torch.cat(seg_parts).contiguous()
        if mask_len_parts:
            tensors["mask_lengths"] = torch.cat(mask_len_parts)
            tensors["mask_ids"] = _cat(mask_id_parts, torch.int32)
        header = {"format_version": str(FORMAT_VERSION), "samples": json.dumps(meta_samples)}
        return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=header)

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int | None = None,
                   moe_shape: MoEShape | None = None) -> "RolloutBatch":
        """Inverse of :meth:`to_bytes`; validates every sample (and the optional spec)."""
        from safetensors.torch import load as st_load
        header = _read_header(data)
        meta = header.get("__metadata__") or {}
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise RecordError(f"rollout batch: unsupported format_version "
                              f"{meta.get('format_version')!r} (expected {FORMAT_VERSION})")
        try:
            t = st_load(data)
            entries = json.loads(meta["samples"])
        except Exception as exc:  # safetensors raises its own error types
            raise RecordError(f"rollout batch: corrupt payload: {exc}") from None
        _check_boundaries(entries, t)
        out = []
        p_off = r_off = pass_off = rr_off = m_off = mid_off = lm_off = sr_off = 0
        for e in entries:
            P, R = e["prompt_len"], e["response_len"]
            kw: dict[str, Any] = {}
            kw["prompt_ids"] = t["prompt_ids"][p_off:p_off + P]
            kw["response_ids"] = t["response_ids"][r_off:r_off + R]
            kw["loss_mask"] = t["loss_mask"][r_off:r_off + R].to(torch.bool)
            kw["rollout_logprobs"] = t["rollout_logprobs"][r_off:r_off + R]
            if e["has_passes"]:
                kw["pass_logprobs"] = t["pass_logprobs"][:, pass_off:pass_off + R]
                pass_off += R
            if e.get("has_logmass"):
                kw["kept_logmass"] = t["kept_logmass"][lm_off:lm_off + R]
                lm_off += R
            if e["prompt_block"] >= 0:
                po = t["routing_prompt_offsets"]
                b = e["prompt_block"]
                prompt_rows = t["routing_prompt"][po[b]:po[b + 1]]
                resp_rows = t["routing_response"][rr_off:rr_off + R - 1]
                kw["routing"] = torch.cat([prompt_rows, resp_rows])
                rr_off += R - 1
            if e["has_mask"]:
                lens = t["mask_lengths"][m_off:m_off + R].to(torch.int64)
                kw["sampling_mask_offsets"] = _offsets(lens.tolist())
                n = int(lens.sum())
                kw["sampling_mask_ids"] = t["mask_ids"][mid_off:mid_off + n]
                m_off += R
                mid_off += n
            if e.get("segments"):
                kw["token_versions"], blocks = _token_versions(e["segments"], R)
                if e["prompt_block"] >= 0 and blocks:
                    kw["segment_routing"] = []
                    for first in blocks:
                        n = P + first - 1
                        kw["segment_routing"].append(t["segment_routing"][sr_off:sr_off + n])
                        sr_off += n
            p_off += P
            r_off += R
            s = Sample(reward=e["reward"], group_id=e["group_id"],
                       weight_version=e["weight_version"], sample_id=e["sample_id"],
                       metadata=e["metadata"],
                       **{k: [b.clone() for b in v] if isinstance(v, list) else v.clone()
                          for k, v in kw.items()})
            s.validate(vocab_size, moe_shape)
            out.append(s)
        return cls(out)

    def save(self, path: str) -> None:
        """Write :meth:`to_bytes` to ``path``."""
        with open(path, "wb") as fh:
            fh.write(self.to_bytes())

    @classmethod
    def load(cls, path: str, vocab_size: int | None = None,
             moe_shape: MoEShape | None = None) -> "RolloutBatch":
        """Read a batch written by :meth:`save`, validating it."""
        with open(path, "rb") as fh:
            return cls.from_bytes(fh.read(), vocab_size, moe_shape)

