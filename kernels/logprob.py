"""moe_rl_kernels.logprob: memory-bounded log-prob and entropy of target tokens from hidden states.

``logprob_entropy`` never materialises the full [T, V] float32 softmax: torch implementation on
CPU and GPU, Triton kernels on GPU (``backend="triton"``), vocabulary split across
tensor-parallel ranks, temperature and keep-sampling-mask kept-id sets.
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

from moe_rl_kernels.logprob_torch import (DEFAULT_CHUNK, ChunkedLogprobEntropy, KeptSets,
                                          TorchBackend)

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Triton can run here: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _backend(name: str, hidden: torch.Tensor, kept: KeptSets | None):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    restricted = kept is not None and bool(kept.restricted().any())
    if name == "auto":
        name = "triton" if hidden.is_cuda and triton_available() and not restricted else "torch"
    if name == "triton":
        if restricted:
            raise ValueError("backend: 'triton' does not take kept-id sets; use 'torch' or 'auto'")
        if not triton_available():
            raise ValueError("backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1")
        from moe_rl_kernels.logprob_triton import TritonBackend
        return TritonBackend
    return TorchBackend


def logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    temperature: float = 1.0, kept_offsets: torch.Tensor | None = None,
                    kept_ids: torch.Tensor | None = None, kept: KeptSets | None = None,
                    chunk_size: int | None = None, tp_group=None, vocab_start: int = 0,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax(hidden @ weight.T / temperature)``.

    hidden [T, H] and weight [V_local, H] (bf16/fp16/fp32; statistics in float32), targets [T]
    global vocabulary ids. Kept sets: row t restricted to
    ``kept_ids[kept_offsets[t]:kept_offsets[t+1]]`` (global ids; empty row = full vocabulary),
    checked here (range, repeats, target membership); or ``kept``, a :class:`KeptSets` whose
    rows were already checked where they were built (the trainer's packed samples), used as is.
    ``tp_group``: this rank holds vocabulary rows [vocab_start, vocab_start + V_local); results
    are identical on every rank and the hidden-state gradient is summed across the group.
    Returns (logprobs [T], entropy [T]) in float32 (float64 for float64 inputs), differentiable w.r.t. hidden and weight.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [T, H], got {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected [V_local, {hidden.shape[1]}], got "
                         f"{list(weight.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError("hidden / weight: expected floating-point tensors")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    T = hidden.shape[0]
    if targets.shape != (T,) or targets.is_floating_point():
        raise ValueError(f"targets: expected integer ids of shape [{T}], got "
                         f"{targets.dtype} {list(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    chunk = DEFAULT_CHUNK if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    vocab = int(vocab_start) + weight.shape[0]
    if tp_group is not None and kept_ids is not None:   # the full vocabulary (shards may differ)
        end = torch.tensor([vocab], dtype=torch.long, device=weight.device)
        dist.all_reduce(end, op=dist.ReduceOp.MAX, group=tp_group)
        vocab = int(end)
    if kept is not None:
        if kept_offsets is not None or kept_ids is not None:
            raise ValueError("kept: give kept sets or kept_offsets / kept_ids, not both")
        if kept.offsets.numel() != T + 1:
            raise ValueError(f"kept: expected {T + 1} offsets, got {kept.offsets.numel()}")
        kept = KeptSets(kept.offsets.to(hidden.device), kept.ids.to(hidden.device))
    else:
        kept = _kept_sets(kept_offsets, kept_ids, T, targets, hidden.device, vocab)
    impl = _backend(backend, hidden, kept)
    return ChunkedLogprobEntropy.apply(hidden, weight, targets.long(), float(temperature), kept,
                                       chunk, tp_group, int(vocab_start), impl)


def check_kept_ids(row: torch.Tensor, ids: torch.Tensor, vocab: int) -> None:
    """Kept ids must lie in [0, vocab) (the full vocabulary, all tensor-parallel shards) and
    appear once per row: an id out of range would be dropped silently, a repeat counted twice."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"kept_ids: expected ids in [0, {vocab}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    key = row.long() * vocab + ids.long()
    if key.unique().numel() != key.numel():
        dup = key.sort().values
        first = int(dup[1:][dup[1:] == dup[:-1]][0])
        raise ValueError(f"kept_ids: row {first // vocab} lists id {first % vocab} twice")


def _kept_sets(offsets, ids, T, targets, device, vocab: int) -> KeptSets | None:
    if offsets is None and ids is None:
        return None
    if offsets is None or ids is None:
        raise ValueError("kept_offsets / kept_ids: give both or neither")
    offsets = offsets.to(device=device, dtype=torch.long)
    ids = ids.to(device=device, dtype=torch.long)
    if offsets.dim() != 1 or offsets.numel() != T + 1:
        raise ValueError(f"kept_offsets: expected {T + 1} entries, got {offsets.numel()}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool(
            (offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"kept_offsets: expected non-decreasing offsets from 0 to "
                         f"len(kept_ids) = {ids.numel()}")
    kept = KeptSets(offsets, ids)
    row, kid = kept.rows(0, T)
    check_kept_ids(row, kid, vocab)
    hit = torch.zeros(T, dtype=torch.long, device=device).index_add_(
        0, row, (kid == targets.to(device).long()[row]).long())
    missing = kept.restricted() & (hit == 0)
    if bool(missing.any()):
        bad = int(missing.nonzero()[0, 0])
        raise ValueError(f"kept_ids: row {bad}: target {int(targets[bad])} is not in its kept set")
    return kept


__all__ = ["BACKENDS", "KeptSets", "check_kept_ids", "logprob_entropy", "triton_available"]
