"""Keep-sampling-mask helpers on the ragged kept-id table (row t restricted to
``ids[offsets[t]:offsets[t+1]]``; an empty row is the full vocabulary). The restricted log-prob and
entropy themselves are computed by the memory-bounded kernel (``moe_rl_kernels.logprob``)."""
from __future__ import annotations

import torch


def kept_set_sizes(kept_offsets: torch.Tensor) -> torch.Tensor:
    """Size of each row's kept set (0 = unrestricted)."""
    return kept_offsets[1:] - kept_offsets[:-1]
