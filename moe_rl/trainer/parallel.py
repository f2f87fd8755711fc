"""torch.distributed and megatron-core parallel state for the trainer (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.trainer.cpu_compat import apply_cpu_shims, cuda_absent


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel sizes; data parallel is what remains of the world size."""
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1


# rendezvous ports are picked here, outside the kernel's ephemeral range and Ray's worker ports
# (10002-19999), below SGLang's own NCCL picks (22000-29999) and moe_rl's engine ports (30000+)
RENDEZVOUS_PORTS = range(20000, 22000)


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (bind(0), outgoing connections' source ports)."""
    try:
        low, high = map(int, open(path).read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (an address of this machine) outside the ephemeral range: no
    bind(0) or outgoing connection of another process (gloo's pairs, NCCL, Ray) takes it between
    this pick and its listener's bind, so no one else's client connects to it and a client that
    connects before the listener is up cannot connect to itself."""
    low, high = ephemeral_range()
    pool = [p for p in (*RENDEZVOUS_PORTS, *range(high + 1, 65536)) if not low <= p <= high]
    for port in random.sample(pool, min(64, len(pool))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # every candidate taken: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


GPU_BACKENDS = "cpu:gloo,cuda:nccl"


def default_backend(cuda: bool) -> str:
    """The default group's backend: gloo on CPU; on GPUs NCCL for CUDA tensors *and* gloo for
    CPU ones. The trainer reduces CPU tensors every step (metric sums, row gathers, text) over
    the default group and megatron's groups, which inherit this backend; a bare ``"nccl"``
    serves CUDA tensors only ("No backend type associated with device type cpu")."""
    return GPU_BACKENDS if cuda else "gloo"


def init_distributed(rank: int | None = None, world_size: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None,
                     gpu: int | None = None) -> None:
    """Initialise the default process group once (env:// style; single process by default).
    On GPUs the rank uses GPU ``gpu`` (the placement plan's; default ``LOCAL_RANK``, else the
    rank modulo the visible GPUs)."""
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if master_addr is not None:   # the plan's rank-0 address wins over an inherited one
        os.environ["MASTER_ADDR"] = master_addr   # (some Slurm templates export MASTER_ADDR)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = default_backend(cuda=not cuda_absent())
    if not cuda_absent():
        if gpu is None:
            local = os.environ.get("LOCAL_RANK")
            gpu = int(local) if local is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
    if world_size == 1:   # no rendezvous: a port picked free may be taken before it is bound
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def init_model_parallel(sizes: ParallelSizes = ParallelSizes()) -> None:
    """Initialise megatron's parallel state (after :func:`init_distributed`) and the shims."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    apply_cpu_shims()
    world = dist.get_world_size()
    model = sizes.tensor * sizes.pipeline * sizes.context
    if world % model:
        raise ValueError(f"world size {world} is not divisible by tensor x pipeline x context "
                         f"= {model}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
    )
    if not cuda_absent():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def destroy() -> None:
    """Tear down megatron's parallel state and the process group."""
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
