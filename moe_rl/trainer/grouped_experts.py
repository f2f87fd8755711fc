"""The experts of an MoE layer in two grouped GEMMs (``torch._grouped_mm``) instead of
megatron-core's ``SequentialMLP`` loop over them (about 29 dispatched ops per expert, 3,800 per
layer at 128 experts).

:class:`GroupedExperts` is a ``SequentialMLP``: the same parameters under the same names (each
expert's ``linear_fc1`` / ``linear_fc2``), so its checkpoints (``sharded_state_dict``), the
Hugging Face export and import, every weight sync and expert parallelism (``allreduce=False``
on expert parameters) are the loop's, and a checkpoint crosses between the two paths as is. Only
``forward`` differs: the tokens arrive grouped by expert (megatron's dispatcher permutes them),
so one GEMM per projection covers every local expert, with each expert's weights stacked for
the call and not kept (:class:`GroupedLinear` stacks them again in the backward pass), and one
GEMM gives every expert's weight gradient, deposited in one op (:func:`deposit_grads`; the
experts' ops per layer do not grow with their number: 94 at E = 128, 348 when autograd
accumulated each expert's, ``benchmarks/trainer_ops.py``). The
activation, the gate's scaling and the biases follow megatron's ``MLP.forward`` step for step,
so both paths agree bit for bit on CPU (``tests/trainer/test_grouped_experts.py``).

Where the loop stays: FP8/FP4 experts and ``moe_apply_probs_on_input`` (what megatron pads or
scales before its experts), and sizes whose rows ``torch._grouped_mm`` cannot take (its strides
must be multiples of 16 bytes: :func:`config_unsupported`).
"""
from __future__ import annotations

import functools

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


def deposit_grads(params, grads: torch.Tensor) -> None:
    """Add ``grads[e]`` to expert ``e``'s parameter gradient, for all experts in one op: into
    megatron DDP's ``main_grad`` when the parameter has one (what DDP's per-parameter hook
    would add; no overlapped reduce is configured, so the hook has nothing else to do), else
    into ``.grad`` as autograd would accumulate it. Parameters that do not learn are left."""
    learning = [p.requires_grad for p in params]
    if not any(learning):
        return
    params = [p for p, learns in zip(params, learning) if learns]
    main = hasattr(params[0], "main_grad")
    if main:   # DDP's buffers are float32: the stacked gradient converted once
        grads = grads.to(params[0].main_grad.dtype)
    rows = [g for g, learns in zip(grads.unbind(0), learning) if learns]
    if main:
        torch._foreach_add_([p.main_grad for p in params], rows)
        return
    held = [(p.grad, g) for p, g in zip(params, rows) if p.grad is not None]
    for p, g in zip(params, rows):
        if p.grad is None:
            p.grad = g
    if held:
        torch._foreach_add_([h for h, _ in held], [g for _, g in held])


def _learning(x: torch.Tensor, params) -> torch.Tensor:
    """``x``, made to carry a gradient when ``params`` learn and ``x`` does not (the backward
    below, which feeds the parameters, runs only for an input that carries one)."""
    if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in params):
        return x.detach().requires_grad_()
    return x


class GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weights[e].T`` for every expert ``e`` at once; ``offs``
    (int32, on x's device): each expert's end row. The experts' weights are not autograd inputs
    (one per expert would cost autograd one accumulation per expert): the backward stacks their
    gradient in one GEMM and deposits it (:func:`deposit_grads`). The stacked weights live for
    one call."""

    @staticmethod
    def forward(ctx, x, offs, weights):
        ctx.save_for_backward(x, offs)
        ctx.weights = weights
        with torch.no_grad():
            stacked = torch.stack(weights)
        return torch._grouped_mm(x, stacked.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs = ctx.saved_tensors
        weights = ctx.weights
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                stacked = torch.stack(weights)
            grad_x = torch._grouped_mm(grad, stacked, offs=offs)
        if any(w.requires_grad for w in weights):   # each expert's rows, summed over its tokens
            deposit_grads(weights, torch._grouped_mm(grad.t(), x, offs=offs))
        return grad_x, None, None


class BiasRows(torch.autograd.Function):
    """``biases[e]`` for each of expert ``e``'s ``counts[e]`` rows (no host sync: the row count
    is given; ``anchor``: the rows' input, through which the backward runs); each bias's
    gradient summed over its rows in float32 and rounded once, as the loop's broadcast add sums
    it (the order of the sum differs: equal within float32's rounding, not bit for bit), and
    deposited like the weights'."""

    @staticmethod
    def forward(ctx, anchor, counts, rows: int, biases):
        ctx.save_for_backward(counts)
        ctx.rows, ctx.biases = rows, biases
        with torch.no_grad():
            return torch.repeat_interleave(torch.stack(biases), counts, dim=0, output_size=rows)

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        if any(b.requires_grad for b in ctx.biases):
            experts = torch.arange(counts.numel(), device=grad.device)
            owner = torch.repeat_interleave(experts, counts, output_size=ctx.rows)
            sums = grad.new_zeros((counts.numel(), grad.shape[1]), dtype=torch.float32)
            sums.index_add_(0, owner, grad.float())
            deposit_grads(ctx.biases, sums.to(grad.dtype))
        return None, None, None, None


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
        fc2 = [e.linear_fc2 for e in experts]
        hidden = _learning(hidden, [p for lin in fc1 + fc2 for p in lin.parameters()])
        h = GroupedLinear.apply(hidden, offs, [lin.weight for lin in fc1])
        if getattr(fc1[0], "bias", None) is not None:
            h = h + BiasRows.apply(h, counts, rows, [lin.bias for lin in fc1])
        h = self._activation(h)
        dtype = h.dtype   # megatron's MLP scales by the gate in the promoted type, then casts
        h = (h * probs.unsqueeze(-1)).to(dtype)
        out = GroupedLinear.apply(h, offs, [lin.weight for lin in fc2])
        if getattr(fc2[0], "bias", None) is not None:
            bias = BiasRows.apply(out, counts, rows, [lin.bias for lin in fc2])
            out = (out + bias * probs.unsqueeze(-1)).to(out.dtype)
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
    experts (in place); returns how many layers changed. megatron-core writes a layer's MLP as
    a ``ModuleSpec`` (up to 0.16) or a ``functools.partial`` (0.19): both are read."""
    changed = 0
    for layer in block.layer_specs:
        mlp = layer.submodules.mlp
        subs = getattr(mlp, "submodules", None)
        if subs is None and isinstance(mlp, functools.partial):
            subs = mlp.keywords.get("submodules")
        experts = getattr(subs, "experts", None)
        if experts is None:
            continue
        if getattr(experts, "module", None) is SequentialMLP:
            experts.module = GroupedExperts
            changed += 1
        elif isinstance(experts, functools.partial) and experts.func is SequentialMLP:
            subs.experts = functools.partial(GroupedExperts, *experts.args, **experts.keywords)
            changed += 1
    return changed
