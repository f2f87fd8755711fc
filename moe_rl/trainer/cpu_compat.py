"""Shims that let megatron-core (0.16+) run on a CPU-only torch; applied only without CUDA.

1. ``torch.cuda.current_device`` returns "cpu" (rotary embedding moves ``inv_freq`` there).
2. The model-parallel RNG tracker's ``fork`` is a no-op context (it needs CUDA RNG states);
   dropout must be 0 on CPU because of it.
3. ``moe_utils.te_general_gemm = None`` (0.16.1 raises NameError without Transformer Engine):
   :func:`define_te_general_gemm`, applied on GPUs too (seen on an H100 without TE: every MoE
   router forward failed there, moe_utils.py:1192).
4. ``optimizer.clip_grad_by_total_norm_fp32`` asserts CUDA gradients: replaced by a CPU version
   that scales the gradients by ``max_norm / (total_norm + 1e-6)`` when below 1.
5. Activation recomputation saves and restores the CUDA RNG state: on CPU there is none, so
   ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` do nothing.
6. :func:`cuda_factories_on_cpu`: a context in which ``device='cuda'`` arguments of tensor
   factories become 'cpu' (megatron's optimizer builds flag tensors on CUDA), and in which a
   CPU tensor's ``type()`` reads as its CUDA type name (megatron's mixed-precision optimizer,
   ``Float16OptimizerWithFloat16Params``, sorts the parameters it wraps by that name and refuses
   any that is not ``torch.cuda.{Float,Half,BFloat16}Tensor``; optimizer.py:671-700 in 0.16.1).
7. ``torch.cuda.synchronize`` does nothing (``dist_checkpointing``'s writer waits for device
   copies with it; on CPU there are none).
8. ``torch.cuda.current_stream`` returns a stream that waits for nothing (megatron-core 0.19's
   DDP asks for it before every gradient reduction, to wait for CUDA-graph events,
   param_and_grad_buffer.py:632; on CPU there are none).
9. The causal and sliding-window masks of megatron's unfused softmax
   (``get_default_causal_mask``, ``get_sliding_window_causal_mask``, which allocate on "cuda";
   the forwarder passes no mask for causal rows, and gpt-oss's window layers) are built inside
   :func:`cuda_factories_on_cpu`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def cuda_absent() -> bool:
    """True on a CPU-only machine (the shims apply)."""
    return not torch.cuda.is_available()


def _clip_grads_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            g = p.decoupled_grad if use_decoupled_grad else p.grad
            if g is not None:
                g.mul_(coeff)


def define_te_general_gemm() -> None:
    """megatron-core 0.16.1's router tests ``te_general_gemm is not None`` but defines the name
    only when Transformer Engine imports (moe_utils.py:1192): define it as None otherwise."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _NoStream:
    """The current stream on CPU: nothing runs asynchronously, so there is nothing to wait
    for."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""


def apply_cpu_shims() -> bool:
    """Install the shims once when CUDA is absent; returns whether they are active. Shim 3
    applies on every device."""
    global _APPLIED
    define_te_general_gemm()
    if not cuda_absent():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    from megatron.core.tensor_parallel import random as tp_random
    tp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    tp_random._get_cuda_rng_state = lambda *a, **k: None
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    import megatron.core.optimizer.optimizer as mopt
    mopt.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
    import megatron.core.fusions.fused_softmax as fused_softmax
    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        setattr(fused_softmax, name, _on_cpu(getattr(fused_softmax, name)))
    _APPLIED = True
    return True


def _on_cpu(make_mask):
    """``make_mask`` with its "cuda" tensors made on the CPU."""
    def on_cpu(*args, **kwargs):
        with cuda_factories_on_cpu():
            return make_mask(*args, **kwargs)
    return on_cpu


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:   # the name, no cast
            name = func(*args)
            return (name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu"
                else name)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu():
    """Within this context ``torch.xxx(..., device='cuda')`` allocates on the CPU (CPU only)."""
    if not cuda_absent():
        yield
        return
    with _CudaToCpu():
        yield


def check_cpu_settings(*, tensor_parallel: int, pipeline_parallel: int, context_parallel: int,
                       sequence_parallel: bool, dispatcher: str) -> None:
    """Refuse megatron settings that cannot run on CPU, naming the setting."""
    if not cuda_absent():
        return
    if dispatcher != "allgather":
        raise ValueError(f"moe_token_dispatcher_type: '{dispatcher}' needs CUDA (it creates a "
                         f"torch.cuda.Stream); use 'allgather' on CPU")
    if tensor_parallel > 1:
        raise ValueError("trainer.parallel.tensor: > 1 needs sequence parallelism with MoE, which "
                         "the local layer norm refuses on CPU; run tensor parallelism on GPUs")
    if sequence_parallel:
        raise ValueError("trainer.parallel.sequence: not supported on CPU")
    if pipeline_parallel > 1:
        raise ValueError("trainer.parallel.pipeline: > 1 is not supported on CPU (megatron's "
                         "pipeline schedules use CUDA streams); run it on GPUs")
    if context_parallel > 1:
        raise ValueError("trainer.parallel.context: > 1 needs GPU attention kernels")
