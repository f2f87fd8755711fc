"""One float16 loss scale for the whole model. megatron-core builds a dynamic loss scaler per
leaf optimizer (the dense parameters' and, under expert parallelism, the experts'), each
updated on its own leaf's overflow, while the loss is scaled by the first leaf's scale only:
after an overflow in one leaf the scales part, and that leaf's gradients are unscaled by a
scale the loss never had (off by powers of two), or every step is skipped while the stop at the
minimum scale reads the other leaf's. :func:`share_loss_scale` gives every leaf the same scaler,
updated once a step from the overflow of any leaf."""
from __future__ import annotations

from moe_rl.trainer.sharded_state import leaf_optimizers


def share_loss_scale(optimizer) -> bool:
    """Every leaf of ``optimizer`` on the first leaf's loss scaler, updated once per step with
    whether any leaf's gradients overflowed (in place); False when there is nothing to share
    (one leaf, or no loss scaler: bfloat16, float32)."""
    leaves = [leaf for leaf in leaf_optimizers(optimizer)
              if getattr(leaf, "grad_scaler", None) is not None]
    if len(leaves) < 2:
        return False
    shared = leaves[0].grad_scaler
    for leaf in leaves:
        leaf.grad_scaler = shared
    prepare_all = optimizer.prepare_grads

    def prepare_grads() -> bool:
        shared.update = lambda found_inf: None   # each leaf's own update: the step's is below
        try:
            found_inf = prepare_all()   # every leaf unscaled by the one scale; any overflow
        finally:
            del shared.update
        shared.update(found_inf)
        return found_inf

    optimizer.prepare_grads = prepare_grads
    return True
