"""Small helpers shared by the algorithm modules: dtype promotion and masked reductions."""
from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64 (tests use float64 references)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def as_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 0/1 float mask of ``dtype`` from a bool or numeric mask."""
    return mask.to(dtype)


def seq_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """Number of response tokens of each sequence, [B]."""
    return mask.to(torch.float64).sum(-1)


def masked_seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of ``x`` over masked tokens, [B]."""
    return (x * mask.to(x.dtype)).sum(-1)


def masked_seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of ``x`` over masked tokens ([B]); 0 for a sequence with no token."""
    m = mask.to(x.dtype)
    n = m.sum(-1)
    return (x * m).sum(-1) / n.clamp_min(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over all masked tokens of the batch (0 when there is none)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


def broadcast_to_tokens(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence values [B] broadcast to [B, T]; a [B, T] input is returned as is."""
    if values.dim() == 1:
        return values[:, None].expand_as(like)
    if values.shape != like.shape:
        raise ValueError(f"expected per-sequence values [B] or per-token [B, T] = "
                         f"{list(like.shape)}, got {list(values.shape)}")
    return values


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first argument whose shape differs from the first one."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t is not None and t.shape != t0.shape:
            raise ValueError(f"{name}: expected shape {list(t0.shape)} (as {name0}), "
                             f"got {list(t.shape)}")
