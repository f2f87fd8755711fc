"""Small helpers shared by the algorithm modules: dtype promotion and masked reductions."""
from __future__ import annotations

import torch

EXP_CLAMP = 20.0   # every log-ratio is clamped to +-20 before an exp (it guards overflow only)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any input is float64: per-token algorithm arithmetic never runs
    in bfloat16 / float16 (a GSPO ratio of 1.002 reads as 1.0 there)."""
    return (torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32)


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with every position outside ``mask`` set to 0 by selection, so a NaN or inf at a
    masked position never reaches a sum (0 * NaN would)."""
    return torch.where(mask.to(torch.bool), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of ``x`` over masked tokens, [B]."""
    return zero_masked(x, mask).sum(-1)


def masked_seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of ``x`` over masked tokens ([B]); 0 for a sequence with no token."""
    n = mask.to(x.dtype).sum(-1)
    return zero_masked(x, mask).sum(-1) / n.clamp_min(1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over all masked tokens of the batch (0 when there is none)."""
    return zero_masked(x, mask).sum() / mask.to(x.dtype).sum().clamp_min(1)


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
