"""Expert biases on megatron-core's local layer spec (gpt-oss).

megatron-core's MLP adds an expert's output bias in place, scaled by the token's gate
(``output += output_bias * per_token_scale``, transformer/mlp.py), to what its
``RowParallelLinear`` returned; on one tensor-parallel rank that is the linear's output handed
through a custom autograd Function unchanged, and autograd refuses the in-place write while
gradients are on ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified
inplace"). :func:`copy_expert_outputs` makes each expert's second linear hand back a copy.
Transformer Engine's linears return tensors of their own and need nothing.
"""
from __future__ import annotations


def copy_expert_outputs(model) -> int:
    """Every local-spec expert with an output bias returns a copy of its second linear's output
    (in place on ``model``); returns how many experts were changed."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    changed = 0
    for module in model.modules():
        if not isinstance(module, SequentialMLP):
            continue
        for expert in module.local_experts:
            fc2 = expert.linear_fc2
            if getattr(fc2, "bias", None) is None:
                continue
            fc2.forward = _copied(fc2.forward)
            changed += 1
    return changed


def _copied(forward):
    def forward_copy(*args, **kwargs):
        out, bias = forward(*args, **kwargs)
        return out.clone(), bias
    return forward_copy
