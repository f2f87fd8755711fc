"""The experts of an MoE layer in two grouped GEMMs (``torch._grouped_mm``) instead of
megatron-core's ``SequentialMLP`` loop over them (about 29 dispatched ops per expert, 3,800 per
layer at 128 experts).

:class:`GroupedExperts` is a ``SequentialMLP``: the same parameters under the same names (each
expert's ``linear_fc1`` / ``linear_fc2``), so its checkpoints (``sharded_state_dict``), the
Hugging Face export and import, every weight sync and expert parallelism (``allreduce=False``
on expert parameters) are the loop's, and a checkpoint crosses between the two paths as is. Only
``forward`` differs: the tokens arrive grouped by expert (megatron's dispatcher permutes them),
so one GEMM per projection covers every local expert, with each expert's weights stacked for
the call and not kept (:class:`GroupedLinear` stacks them again in the backward pass). The
activation, the gate's scaling and the biases follow megatron's ``MLP.forward`` step for step,
so both paths agree bit for bit on CPU (``tests/trainer/test_grouped_experts.py``).

Where the loop stays: FP8/FP4 experts and ``moe_apply_probs_on_input`` (what megatron pads or
scales before its experts), and sizes whose rows ``torch._grouped_mm`` cannot take (its strides
must be multiples of 16 bytes: :func:`config_unsupported`).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from moe_rl.trainer.expert_path import grouped_unsupported



def config_unsupported(config, dtype: torch.dtype) -> str | None:
    """Why megatron-core ``config``'s experts stay in the loop in ``dtype`` (None: grouped)."""
    if config.fp8 or getattr(config, "fp4", None):
        return "FP8/FP4 experts pad their tokens inside megatron's loop"
    if config.moe_apply_probs_on_input:
        return "moe_apply_probs_on_input scales the inputs inside megatron's loop"
    width = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
    return grouped_unsupported(config.hidden_size, width, dtype)


class GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e].T`` for every expert ``e`` at once; ``offs``
    (int32, on x's device): each expert's end row. The stacked weights live for one call."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs)
        grad_w = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):   # each expert's rows, summed over its tokens
            grad_w = list(torch._grouped_mm(grad.t(), x, offs=offs).unbind(0))
        return grad_x, None, *grad_w


class BiasRows(torch.autograd.Function):
    """``biases[e]`` for each of expert ``e``'s ``counts[e]`` rows (no host sync: the row count
    is given); each bias's gradient summed over its rows in float32 and rounded once, as the
    loop's broadcast add sums it (the order of the sum differs: equal within float32's
    rounding, not bit for bit)."""

    @staticmethod
    def forward(ctx, counts, rows: int, *biases):
        ctx.save_for_backward(counts)
        ctx.rows = rows
        return torch.repeat_interleave(torch.stack(biases), counts, dim=0, output_size=rows)

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        experts = torch.arange(counts.numel(), device=grad.device)
        owner = torch.repeat_interleave(experts, counts, output_size=ctx.rows)
        sums = grad.new_zeros((counts.numel(), grad.shape[1]), dtype=torch.float32)
        sums.index_add_(0, owner, grad.float())
        return None, None, *sums.to(grad.dtype).unbind(0)


class GroupedExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP`` computed in grouped GEMMs (see the module's doc)."""

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor):
        if self.num_local_experts == 1 or config_unsupported(self.config, hidden.dtype):
            return super().forward(hidden, tokens_per_expert, probs)
        experts = self.local_experts
        counts = torch.as_tensor(tokens_per_expert).to(hidden.device, non_blocking=True)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = hidden.shape[0]
        fc1 = [e.linear_fc1 for e in experts]
        h = GroupedLinear.apply(hidden, offs, *(lin.weight for lin in fc1))
        if getattr(fc1[0], "bias", None) is not None:
            h = h + BiasRows.apply(counts, rows, *(lin.bias for lin in fc1))
        h = self._activation(h)
        dtype = h.dtype   # megatron's MLP scales by the gate in the promoted type, then casts
        h = (h * probs.unsqueeze(-1)).to(dtype)
        fc2 = [e.linear_fc2 for e in experts]
        out = GroupedLinear.apply(h, offs, *(lin.weight for lin in fc2))
        if getattr(fc2[0], "bias", None) is not None:
            scaled = BiasRows.apply(counts, rows, *(lin.bias for lin in fc2)) * probs.unsqueeze(-1)
            out = (out + scaled).to(out.dtype)
        return out, None

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron's MLP activation (unfused): the gated linear unit with its optional clamp
        and offset, or the plain activation."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(h)
        glu, linear = torch.chunk(h, 2, dim=-1)
        if (limit := c.activation_func_clamp_value) is not None:
            glu = glu.clamp(min=None, max=limit)
            linear = linear.clamp(min=-limit, max=limit)
        return c.activation_func(glu) * (linear + c.glu_linear_offset)


def use_grouped_experts(block) -> int:
    """Every MoE layer of decoder block spec ``block`` builds :class:`GroupedExperts` for its
    experts (in place); returns how many layers changed."""
    changed = 0
    for layer in block.layer_specs:
        mlp = layer.submodules.mlp
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is not None and experts.module is SequentialMLP:
            experts.module = GroupedExperts
            changed += 1
    return changed
