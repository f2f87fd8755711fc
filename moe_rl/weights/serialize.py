"""How weights are serialised for the engines: dtype names of the update requests, and SGLang's
``MultiprocessingSerializer`` format of CUDA tensors shared by IPC handle (tensor sync); the
trainer ranks' payloads gathered on rank 0 as bytes (no pickling)."""
from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float8_e4m3fn": torch.float8_e4m3fn}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype string of the update request ("bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (ValueError naming the field for others)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtypes: unsupported dtype {name!r}; expected one of "
                         f"{sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


CUDA_IPC_DEVICE_ARG = 6   # position of the device in torch's CUDA-tensor rebuild arguments
# positions of the share's reference counter (shared-memory file, slot) in those arguments
CUDA_IPC_COUNTER_ARGS = (11, 12)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _torch_reduce_tensor():
    """torch's own reduction of a tensor for inter-process sharing (SGLang's original when its
    patch is installed in this process)."""
    from torch.multiprocessing import reductions
    return getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)


def reduce_cuda_tensor(tensor: torch.Tensor) -> tuple:
    """``(rebuild, args)`` of a CUDA tensor as SGLang's receiver reads it: torch's CUDA IPC
    handle with the device named by GPU UUID (an index names another GPU under another
    ``CUDA_VISIBLE_DEVICES``), rebuilt by ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
    looked up by name at load time (SGLang's patch, installed in its workers, maps the UUID
    back). Only module-level functions are referenced, so nothing local is pickled and every
    global is one SGLang's ``SafeUnpickler`` admits."""
    from torch.multiprocessing import reductions
    _, args = _torch_reduce_tensor()(tensor)
    args = tuple(_device_uuid(a) if i == CUDA_IPC_DEVICE_ARG and isinstance(a, int) else a
                 for i, a in enumerate(args))
    return reductions.rebuild_cuda_tensor, args


class _IPCPickler(pickle.Pickler):
    """A pickler that shares CUDA tensors by IPC handle (:func:`reduce_cuda_tensor`) and keeps
    each share's reference counter (:attr:`counters`)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.counters: list[tuple[bytes, int]] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if not is_ipc_tensor(obj):
                raise ValueError(f"cluster.weight_sync: tensor sync hands CUDA tensors to "
                                 f"colocated SGLang; got a tensor on {obj.device}")
            rebuild, args = reduce_cuda_tensor(obj)
            handle, slot = (args[i] for i in CUDA_IPC_COUNTER_ARGS)
            self.counters.append((handle, slot))
            return rebuild, args
        return NotImplemented


def is_ipc_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be shared by CUDA IPC handle."""
    return tensor.is_cuda


@dataclass(frozen=True)
class SharedBucket:
    """One rank's serialised bucket: the payload a server opens and the reference counters of
    its shares (torch frees a shared block only once every counter is back to 0)."""
    text: str
    counters: tuple[tuple[bytes, int], ...] = ()


def share_named_tensors(named: list[tuple[str, torch.Tensor]]) -> SharedBucket:
    """SGLang's ``MultiprocessingSerializer`` format (a pickle, base64) of ``[(name, tensor)]``
    with CUDA tensors as IPC handles (:func:`reduce_cuda_tensor`): the tensors must stay alive
    until the server has loaded them, and a payload no server opens must be given back
    (:func:`release_unopened`). This produces a pickle for SGLang to read; moe_rl itself never
    unpickles network data."""
    buf = io.BytesIO()
    pickler = _IPCPickler(buf)
    pickler.dump(list(named))
    return SharedBucket(base64.b64encode(buf.getvalue()).decode("ascii"),
                        tuple(pickler.counters))


def release_unopened(shared: SharedBucket) -> None:
    """Give back the shares of a payload no server opened: each reference counter is
    decremented as a consumer does when it frees its copy (torch's own
    ``_release_ipc_counter``, which its receiver calls for a share it already holds), then
    torch frees the blocks whose counters reached 0 (``torch.cuda.ipc_collect``). Without it a
    failed sync's bucket stays allocated until the trainer exits."""
    for handle, slot in shared.counters:
        torch.UntypedStorage._release_ipc_counter(handle, slot)
    if shared.counters:
        torch.cuda.ipc_collect()


def gather_strings(text: str, group=None) -> list[str] | None:
    """Every rank's ``text`` in rank order on rank 0 (None elsewhere), as bytes tensors over the
    trainer's process group (no pickling)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [text]
    data = torch.tensor(list(text.encode("ascii")), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    width = int(max(int(n) for n in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    if dist.get_rank(group) != 0:
        return None
    return [bytes(p[:int(n)].tolist()).decode("ascii") for p, n in zip(parts, sizes)]


def rank0_verdict(failed: bool, released: set[int], group=None) -> tuple[bool, bool]:
    """Rank 0's word on a bucket, on every rank (one broadcast over the trainer's process
    group): whether the sync failed, and whether this rank's payload was never opened
    (``released``: the ranks whose shares are to be given back)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return failed, 0 in released
    world = dist.get_world_size(group)
    t = torch.tensor([int(failed)] + [int(r in released) for r in range(world)],
                     dtype=torch.uint8)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return bool(t[0].item()), bool(t[1 + dist.get_rank(group)].item())
