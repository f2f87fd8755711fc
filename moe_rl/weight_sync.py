"""Weight sync from the trainer to the engine servers.

Distributed: a process group between trainer rank 0 and the servers (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``): NCCL between GPUs, gloo on
CPU (the reference engine implements the same protocol, so the path is tested here).
Tensor (colocated SGLang on the same GPUs): ``/update_weights_from_tensor`` with the tensors in
SGLang's own serialisation (torch's ForkingPickler, CUDA IPC handles, base64), one copy per
tensor-parallel rank of the server.

The group is separate from the trainer's own: a TCP store at the trainer's address, rank 0 the
trainer, ranks ``rank_offset ..`` the engines. Tensors travel by broadcast from rank 0 in the
order of the update request's ``names``; nothing is pickled.
"""
from __future__ import annotations

import base64
import datetime
import io

import torch
from torch.distributed import PrefixStore, TCPStore

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightGroup:
    """A process group plus the TCP store it was built on (kept alive together)."""

    def __init__(self, store, group):
        self.store, self.group = store, group

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Broadcast ``tensor`` from ``root`` in place; returns the work handle."""
        return self.group.broadcast(tensor, root)


def open_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, timeout_s: float = 600.0) -> WeightGroup:
    """Join (rank 0: create) the weight-update group; blocks until every member has joined."""
    store = TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                     timeout=datetime.timedelta(seconds=timeout_s))
    prefixed = PrefixStore(group_name, store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo
        group = ProcessGroupGloo(prefixed, rank, world_size)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL
        group = ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    return WeightGroup(store, group)


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype string of the update request ("bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (ValueError naming the field for others)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtypes: unsupported dtype {name!r}; expected one of "
                         f"{sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def init_group_request(master_address: str, master_port: int, rank_offset: int,
                       world_size: int, group_name: str, backend: str) -> dict:
    """Body of ``/init_weights_update_group`` for one server."""
    return {"master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}


def update_request(named: list[tuple[str, torch.Tensor]], version: int, group_name: str) -> dict:
    """Body of ``/update_weights_from_distributed``: the tensors' metadata, in broadcast order."""
    return {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name,
            "flush_cache": True, "weight_version": str(version)}


def broadcast_tensors(group, named: list[tuple[str, torch.Tensor]]) -> None:
    """Rank 0: send every tensor, in order."""
    for _, t in named:
        group.broadcast(t.contiguous(), 0).wait()


def receive_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    device: str = "cpu") -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors announced by an update request."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names / dtypes / shapes: expected lists of equal length")
    out = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=parse_dtype(dt), device=device)
        group.broadcast(t, 0).wait()
        out[name] = t
    return out


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` format: ForkingPickler dump (CUDA tensors travel as
    IPC handles, so the tensors must stay alive until the server has loaded them), base64. This
    produces a pickle for SGLang to read; moe_rl itself never unpickles network data."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_update_request(named: list[tuple[str, torch.Tensor]], tp_size: int,
                          version: int) -> dict:
    """Body of SGLang's ``/update_weights_from_tensor`` (one serialised list per TP rank)."""
    payload = serialize_named_tensors(named)
    return {"serialized_named_tensors": [payload] * tp_size, "load_format": None,
            "flush_cache": True, "weight_version": str(version)}
