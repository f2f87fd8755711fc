"""How weights are serialised for the engines: dtype names of the update requests, and SGLang's
``MultiprocessingSerializer`` format of CUDA tensors shared by IPC handle (tensor sync); the
trainer ranks' payloads gathered on rank 0 as bytes (no pickling)."""
from __future__ import annotations

import base64
import io
import pickle

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
    """A pickler that shares CUDA tensors by IPC handle (:func:`reduce_cuda_tensor`)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if not is_ipc_tensor(obj):
                raise ValueError(f"cluster.weight_sync: tensor sync hands CUDA tensors to "
                                 f"colocated SGLang; got a tensor on {obj.device}")
            return reduce_cuda_tensor(obj)
        return NotImplemented


def is_ipc_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be shared by CUDA IPC handle."""
    return tensor.is_cuda


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` format (a pickle, base64) of ``[(name, tensor)]``
    with CUDA tensors as IPC handles (:func:`reduce_cuda_tensor`): the tensors must stay alive
    until the server has loaded them. This produces a pickle for SGLang to read; moe_rl itself
    never unpickles network data."""
    buf = io.BytesIO()
    _IPCPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


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


def rank0_flag(flag: bool, group=None) -> bool:
    """Rank 0's ``flag`` on every rank (a broadcast over the trainer's process group)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.uint8)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return bool(t.item())
