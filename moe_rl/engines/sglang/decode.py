"""Decode SGLang ``/generate`` responses into rollout records (never unpickling anything).

routed_experts: base64 of little-endian int32, flat [P+R-1-start, num_hidden_layers, K]; dense
layers (zeros) are dropped by the model's MoE-layer list and ids stored as uint8/int16.
output_token_logprobs: [(logprob, token_id, text)], log_softmax(logits / T) over the whole
vocabulary; output_token_sampling_mask: kept ids per token; output_token_sampling_logprobs
(sampling_logprobs_mode "selected"): the sampled token's log-prob on the renormalised kept set at T.
With the keep-sampling-mask on, the rollout log-prob is the latter (the distribution the token was
drawn from and the trainer scores); the difference of the two is log(mass of the kept set).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import numpy as np
import torch

from moe_rl.engines.sglang.launcher import ROUTING_BLIND_RUNNERS, ROUTING_RUNNER
from moe_rl.engines.base import ResponseError, Turn
from moe_rl.families.shape import MoEShape
from moe_rl.rollout_record import compact_routing

R3_FIX = ("start SGLang with --enable-return-routed-experts and send return_routed_experts: "
          "true (routing replay r3 needs the routing of every token)")
MASK_FIX = ("start SGLang with --sampling-mask-max-tokens N and send return_sampling_mask: true "
            "with a finite top_k (the keep-sampling-mask needs the kept sets)")


def decode_routing(payload: str, positions: int, moe_shape: MoEShape) -> torch.Tensor:
    """base64 int32 routing -> compact [positions, moe_layers, K] (uint8 / int16)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ResponseError(f"routed_experts: not valid base64: {exc}") from None
    expect = positions * moe_shape.num_layers * moe_shape.topk * 4
    if len(raw) != expect:
        raise ResponseError(f"routed_experts: {len(raw)} bytes, expected {expect} for "
                            f"[{positions}, {moe_shape.num_layers}, {moe_shape.topk}] int32")
    arr = np.frombuffer(raw, dtype="<i4").reshape(positions, moe_shape.num_layers, moe_shape.topk)
    moe = torch.from_numpy(arr[:, list(moe_shape.moe_layers)].copy())
    if moe_shape.topk > 1 and moe.numel():
        ordered = moe.sort(-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if bool(repeated.any()):
            pos, layer = (int(i) for i in repeated.nonzero()[0])
            raise ResponseError(
                f"routed_experts: position {pos}, MoE layer {moe_shape.moe_layers[layer]}: "
                f"the experts {moe[pos, layer].tolist()} repeat an id (a token's top-k are "
                f"distinct); all-zero rows come from an SGLang MoE runner that routes inside its "
                f"kernel and captures nothing ({', '.join(ROUTING_BLIND_RUNNERS)}): run it with "
                f"--moe-runner-backend {ROUTING_RUNNER}, as moe_rl does unless "
                f"rollout.sglang.extra_args names one")
    try:
        return compact_routing(moe, moe_shape.num_experts)
    except ValueError as exc:
        raise ResponseError(f"routed_experts: {exc}") from None


def decode_kept_sets(meta: dict, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """output_token_sampling_mask -> (offsets int64 [R+1], ids int32)."""
    sets = meta.get("output_token_sampling_mask")
    if sets is None:
        raise ResponseError(f"output_token_sampling_mask: missing; {MASK_FIX}")
    if len(sets) != n_tokens:
        raise ResponseError(f"output_token_sampling_mask: {len(sets)} sets for {n_tokens} tokens")
    lengths = [len(s) for s in sets]
    offsets = torch.zeros(n_tokens + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    ids = torch.tensor([i for s in sets for i in s], dtype=torch.int32)
    return offsets, ids


def decode_logprobs(entries: list, n_tokens: int, field: str) -> torch.Tensor:
    """[(logprob, token_id, text)] -> float32 [n]; entries with a None log-prob are refused."""
    if entries is None or len(entries) != n_tokens:
        raise ResponseError(f"{field}: expected {n_tokens} entries, got "
                            f"{None if entries is None else len(entries)}")
    vals = [e[0] for e in entries]
    if any(v is None for v in vals):
        raise ResponseError(f"{field}: a log-prob is null")
    return torch.tensor(vals, dtype=torch.float32)


def decode_sampling_logprobs(values, n_tokens: int) -> torch.Tensor:
    """output_token_sampling_logprobs ("selected" mode: one number per token) -> float32 [n]."""
    field = "output_token_sampling_logprobs"
    if values is None:
        raise ResponseError(f"{field}: missing; {MASK_FIX}")
    if not isinstance(values, list) or len(values) != n_tokens:
        raise ResponseError(f"{field}: expected {n_tokens} numbers, got "
                            f"{len(values) if isinstance(values, list) else type(values).__name__}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ResponseError(f"{field}: expected one number per token (sampling_logprobs_mode "
                            f"'selected')")
    return torch.tensor(values, dtype=torch.float32)


def decode_turn(resp: dict, input_len: int, moe_shape: MoEShape, *, need_routing: bool,
                need_mask: bool, routing_start: int = 0) -> Turn:
    """A generation response to ``input_len`` input ids (routing asked from position
    ``routing_start``) -> :class:`~moe_rl.engines.base.Turn`; ResponseError names the field that
    does not fit."""
    meta = resp.get("meta_info") or {}
    out = resp.get("output_ids")
    finish = meta.get("finish_reason") or {}
    finish = finish if isinstance(finish, dict) else {"type": str(finish)}
    aborted = finish.get("type") == "abort"
    if aborted and (out == [] or _answered_from_waiting_queue(meta, need_routing, need_mask)):
        # aborted before it ran, or while retracted: no progress (continued from the prefix)
        return Turn([], torch.zeros(0), None, None, None, None, _version(meta), finish, 0,
                    discarded=len(out) if isinstance(out, list) else 0)
    if not isinstance(out, list) or not out:
        raise ResponseError(f"output_ids: expected a non-empty list (request {meta.get('id')})")
    R = len(out)
    lp = decode_logprobs(meta.get("output_token_logprobs"), R, "output_token_logprobs")
    routing = None
    if need_routing:
        if not meta.get("routed_experts"):
            raise ResponseError(f"routed_experts: missing from the response; {R3_FIX}")
        routing = decode_routing(meta["routed_experts"], input_len + R - 1 - routing_start,
                                 moe_shape)
    offsets = ids = logmass = None
    if need_mask:
        offsets, ids = decode_kept_sets(meta, R)
        kept_lp = decode_sampling_logprobs(meta.get("output_token_sampling_logprobs"), R)
        logmass = (lp - kept_lp).clamp(max=0.0)   # log of the kept set's full-vocabulary mass
        lp = kept_lp
    cached = meta.get("cached_tokens", 0)
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached <= input_len:
        raise ResponseError(f"cached_tokens: expected an integer in [0, {input_len}], got "
                            f"{cached!r}")
    per_token = decode_weight_versions(meta.get("weight_versions"), R)
    version = _version(meta) if per_token is None else per_token[0]
    return Turn(out, lp, routing, offsets, ids, logmass, version, finish, cached, per_token,
                _retractions(meta))


def _answered_from_waiting_queue(meta: dict, need_routing: bool, need_mask: bool) -> bool:
    """Whether an aborted answer lacks the routing or kept sets the rollout asked for: SGLang
    answers a request that KV-pool pressure moved back to its waiting queue (retracted, its
    output ids kept) with ids and log-probs only (``tokenizer_manager._handle_abort_req``,
    "Abort in waiting queue")."""
    return ((need_routing and not meta.get("routed_experts"))
            or (need_mask and meta.get("output_token_sampling_mask") is None))


def _retractions(meta: dict) -> int:
    """How often the engine retracted the request under KV-pool pressure (SGLang's
    ``num_retractions``; 0 when absent)."""
    n = meta.get("num_retractions", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ResponseError(f"num_retractions: expected a non-negative integer, got {n!r}")
    return n


def stopped_before_abort(turn: Turn, stop_ids: tuple[int, ...]) -> Turn:
    """An aborted turn whose last token ends a generation (EOS, a request's stop id) finished:
    SGLang gives an aborted running request one more decode step, so its answer can end in such
    a token while ``finish_reason`` says abort (``schedule_batch.py``, the batch result
    processor); continuing it would generate past its end. Its finish becomes SGLang's
    ``{"type": "stop", "matched": id}``."""
    if turn.aborted and turn.output_ids and turn.output_ids[-1] in stop_ids:
        return dataclasses.replace(turn, finish_reason={"type": "stop",
                                                        "matched": turn.output_ids[-1]})
    return turn


def _version(meta: dict) -> int:
    """The response's weight version (moe_rl names versions by integers; 0 otherwise)."""
    try:
        return int(meta.get("weight_version"))
    except (TypeError, ValueError):
        return 0


def decode_weight_versions(spans, n_tokens: int) -> list[int] | None:
    """SGLang's ``weight_versions`` ([{version, start, end}] over the output tokens; SGLang
    0.5.23 sends it with every finished request) -> the version of each of the ``n_tokens``
    tokens when a weight update landed while the request ran; None when absent or one version
    throughout (``weight_version`` says which)."""
    if spans is None:
        return None
    field = "weight_versions"
    if not isinstance(spans, list) or not spans:
        raise ResponseError(f"{field}: expected a non-empty list of spans, got {spans!r}")
    runs, covered = [], 0
    for k, span in enumerate(spans):
        if not isinstance(span, dict) or not {"version", "start", "end"} <= span.keys():
            raise ResponseError(f"{field}[{k}]: expected {{version, start, end}}, got {span!r}")
        start, end = span["start"], span["end"]
        if start != covered or isinstance(end, bool) or not isinstance(end, int) or end < start:
            raise ResponseError(f"{field}[{k}]: span [{start}, {end}) does not continue the "
                                f"spans before it (at {covered})")
        runs.append((str(span["version"]), end - start))
        covered = end
    if covered != n_tokens:
        raise ResponseError(f"{field}: spans cover {covered} tokens, the response has "
                            f"{n_tokens}")
    if len({v for v, _ in runs}) == 1:
        return None
    try:
        out = [int(v) for v, n in runs for _ in range(n)]
    except ValueError:
        raise ResponseError(f"{field}: versions {[v for v, _ in runs]} are not the integers "
                            f"moe_rl names weight versions by") from None
    if out != sorted(out):
        raise ResponseError(f"{field}: versions {[v for v, _ in runs]} go backwards")
    return out


def decode_listed_logprobs(resp: dict, n_tokens: int, ids: list[int]) -> torch.Tensor:
    """``input_token_ids_logprobs`` of a scoring request that listed ``ids`` in
    ``token_ids_logprob`` (first entry None) -> float64 [n_tokens, len(ids)] raw log-probs."""
    field = "input_token_ids_logprobs"
    entries = (resp.get("meta_info") or {}).get(field)
    if not isinstance(entries, list) or len(entries) != n_tokens + 1:
        raise ResponseError(f"{field}: expected {n_tokens + 1} entries (first None), got "
                            f"{len(entries) if isinstance(entries, list) else entries!r}")
    col = {v: j for j, v in enumerate(ids)}
    out = torch.full((n_tokens, len(ids)), float("nan"), dtype=torch.float64)
    for t, row in enumerate(entries[1:]):
        if not isinstance(row, list):
            raise ResponseError(f"{field}[{t + 1}]: expected a list of (logprob, token_id, text)")
        for item in row:
            if (not isinstance(item, (list, tuple)) or len(item) < 2 or item[1] not in col
                    or isinstance(item[0], bool) or not isinstance(item[0], (int, float))):
                raise ResponseError(f"{field}[{t + 1}]: unexpected entry {item!r}")
            out[t, col[item[1]]] = float(item[0])
    if torch.isnan(out).any():
        raise ResponseError(f"{field}: a requested token id is missing from a position")
    return out


def score_from_response(resp: dict, prompt_len: int, total_len: int) -> torch.Tensor:
    """A scoring response (max_new_tokens 0, logprob_start_len P-1) -> response log-probs."""
    entries = (resp.get("meta_info") or {}).get("input_token_logprobs")
    n = total_len - prompt_len + 1
    if entries is None or len(entries) != n:
        raise ResponseError(f"input_token_logprobs: expected {n} entries (first None), got "
                            f"{None if entries is None else len(entries)}")
    return decode_logprobs(entries[1:], n - 1, "input_token_logprobs")
