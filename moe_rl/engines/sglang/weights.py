"""SGLang's weight-update dialect: the process group the trainer and the servers build together
and the request bodies of each update path (the serialisation of the tensors is
:mod:`moe_rl.weights.serialize`).

Distributed: a process group between trainer rank 0 and the servers (SGLang's
``/init_weights_update_group`` + ``/update_weights_from_distributed``): NCCL between GPUs, gloo on
CPU (the reference engine implements the same protocol, so the path is tested here).
Tensor (colocated SGLang on the same GPUs): ``/update_weights_from_tensor`` with the tensors in
SGLang's own serialisation (torch's ForkingPickler, CUDA IPC handles, base64), one copy per
tensor-parallel rank of the server.

The group is separate from the trainer's own and built exactly as SGLang builds its side: rank 0
the trainer, ranks ``rank_offset ..`` the engines. Tensors travel by broadcast from rank 0 in the
order of the update request's ``names``; nothing is pickled.
"""
from __future__ import annotations

import datetime
import inspect
import time

import torch
from torch.distributed import PrefixStore

from moe_rl.weights.serialize import dtype_name, parse_dtype


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as broadcast: FP8 on CPU travels as its bytes (gloo has no FP8 type); on GPUs
    NCCL broadcasts FP8 itself, as SGLang's receiver expects."""
    if t.device.type == "cpu" and t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


class WeightGroup:
    """The weight-update process group and the store it was built on (kept alive together)."""

    def __init__(self, store, group):
        self.store, self.group = store, group

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Broadcast ``tensor`` from ``root`` in place; returns the work handle."""
        return self.group.broadcast(tensor, root)


def open_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, timeout_s: float = 600.0) -> WeightGroup:
    """Join (rank 0: host) the weight-update group, built the way SGLang builds its side in
    ``init_weights_update_group`` (``init_custom_process_group`` in ``sglang/srt/utils``): a
    ``tcp://address:port`` rendezvous store, wrapped in ``PrefixStore(group_name)``, handed to
    torch's process-group constructor under ``group_name`` (which prefixes ``group_name/`` again)
    with the identity rank map. Any other construction waits on other store keys and hangs.
    Blocks until every member has joined, ``timeout_s`` at most in all (rendezvous and the
    backend's connection share one deadline); the group's collectives then wait ``timeout_s``."""

    from torch.distributed import distributed_c10d as c10d
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    store, rank, world_size = next(c10d.rendezvous(
        f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    store.set_timeout(left)
    store = PrefixStore(group_name, store)
    options = ("backend_options" if "backend_options"
               in inspect.signature(c10d._new_process_group_helper).parameters else "pg_options")
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=left,
                                              **{options: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    c10d._set_pg_timeout(timeout, group)
    return WeightGroup(store, group)


def close_group(group: WeightGroup) -> None:
    """Tear down a weight-update group (it may be broken: a member died); never raises."""
    from torch.distributed import distributed_c10d as c10d
    try:
        c10d.destroy_process_group(group.group)
    except Exception:   # a group whose peer died may refuse a clean shutdown; it is dropped
        c10d._world.pg_group_ranks.pop(group.group, None)


def abort_group(group: WeightGroup) -> None:
    """Abandon a group whose collective failed midway: abort its communicators first (NCCL: the
    pending broadcast ends now, before its watchdog would take this process down with it), then
    tear it down; never raises."""
    try:
        group.group.abort()
    except Exception:   # a backend without abort, or one already broken: torn down below
        pass
    close_group(group)


def init_group_request(master_address: str, master_port: int, rank_offset: int,
                       world_size: int, group_name: str, backend: str) -> dict:
    """Body of ``/init_weights_update_group`` for one server."""
    return {"master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}


def update_request(named: list[tuple[str, torch.Tensor]], version: int, group_name: str,
                   flush_cache: bool = True) -> dict:
    """Body of ``/update_weights_from_distributed`` for one bucket: the tensors' metadata, in
    broadcast order; ``flush_cache`` (SGLang's field) on the last bucket of an update only."""
    return {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": str(version)}


def broadcast_tensors(group, named: list[tuple[str, torch.Tensor]], answer=None) -> None:
    """Rank 0: send every tensor, in order. ``answer``: the future of the bucket's announcement;
    when it fails while a broadcast waits (the server refused the bucket and will never join),
    its error is raised at once instead of waiting out the group's timeout (the group is then
    unusable: the caller rebuilds it)."""
    for _, t in named:
        work = group.broadcast(_wire(t.contiguous()), 0)
        while answer is not None and not work.is_completed():
            if answer.done() and answer.exception() is not None:
                raise answer.exception()
            time.sleep(0.001)
        work.wait()


def receive_tensors(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    device: str = "cpu") -> dict[str, torch.Tensor]:
    """Engine side: receive the tensors announced by an update request."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names / dtypes / shapes: expected lists of equal length")
    out = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=parse_dtype(dt), device=device)
        group.broadcast(_wire(t), 0).wait()
        out[name] = t
    return out


def tensor_update_request(payloads: list[str], version: int, flush_cache: bool = True) -> dict:
    """Body of SGLang's ``/update_weights_from_tensor`` for one server and one bucket:
    ``payloads[j]`` is the serialisation (:func:`share_named_tensors`) of the bucket's tensors
    on its TP rank j's GPU; ``flush_cache`` on the last bucket only."""
    return {"serialized_named_tensors": list(payloads), "load_format": None,
            "flush_cache": flush_cache, "weight_version": str(version)}
