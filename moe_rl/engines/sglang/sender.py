"""The trainer's side of SGLang's in-memory weight updates, one sender per transport (the CPU
reference engine speaks the same endpoints):

- :class:`DistributedSender`: trainer rank 0 and every server's ranks form a process group
  (``/init_weights_update_group``); rank 0 announces each bucket
  (``/update_weights_from_distributed``) while it broadcasts the bucket's tensors.
- :class:`TensorSender`: colocated servers take each bucket as tensors on the GPUs they share
  with the trainer (``/update_weights_from_tensor``), server s's TP rank j from the trainer rank
  on its GPU.

Both run inside SGLang's weight-update session (``/begin_weight_update`` ..
``/end_weight_update``) and send FP8 weights with their scales when the engines serve FP8."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from moe_rl.engines.base import Bucket, WeightSender
from moe_rl.engines.sglang.client import SGLangWeightReceiver, TensorsNotLoaded
from moe_rl.engines.sglang.weights import (WeightGroup, abort_group, broadcast_tensors,
                                           close_group, open_group)
from moe_rl.weights import serialize
from moe_rl.weights.fp8 import quantise_named


class _SessionSender(WeightSender):
    """Rank 0 opens the servers' weight-update session, hands over the buckets, closes it."""

    def __init__(self, receiver: SGLangWeightReceiver, rank: int, fp8: bool):
        self.receiver, self.rank, self.fp8 = receiver, rank, fp8

    def _served(self, bucket: Bucket) -> Bucket:
        """The bucket as the engines serve it: E4M3 weights and their scales under FP8."""
        return quantise_named(bucket) if self.fp8 else bucket

    def _begin(self) -> Exception | None:
        """Rank 0: open the session; the error instead of raising it, so that rank still takes
        part in the stream's collectives (the other ranks wait in them)."""
        if self.rank != 0:
            return None
        try:
            self.receiver.begin()
        except Exception as exc:
            return exc
        return None

    def abort(self) -> None:
        if self.rank == 0:
            self.receiver.end(missing_ok=True)


class DistributedSender(_SessionSender):
    """Broadcast each bucket from trainer rank 0 over a process group with every server's ranks
    (NCCL on GPUs, gloo on CPU); the group is (re)built by :meth:`open`."""

    def __init__(self, receiver: SGLangWeightReceiver, rank: int, fp8: bool, backend: str,
                 world: int, timeout_s: float):
        super().__init__(receiver, rank, fp8)
        self.backend, self.world, self.timeout_s = backend, world, timeout_s
        self.group: WeightGroup | None = None
        self.group_name: str | None = None
        self.groups_built = 0

    @property
    def opened(self) -> bool:
        return self.rank != 0 or self.group is not None

    def open(self, address: str, port: int) -> str:
        """Replace the group: the servers leave the previous one and join the new one while
        rank 0 creates its end."""
        if self.group is not None:
            close_group(self.group)
            self.group = None
        previous, self.group_name = self.group_name, f"moe_rl_weights_{self.groups_built}"
        self.groups_built += 1
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.receiver.join_group, address, port, self.group_name,
                                 self.backend, previous)
            try:
                self.group = open_group(self.backend, address, port, 0, self.world,
                                        self.group_name, timeout_s=self.timeout_s)
            finally:
                joined.result()
        return (f"weight-update group {self.group_name}: {self.backend} at {address}:{port}, "
                f"{self.world} ranks")

    def send(self, buckets: Iterable[tuple[Bucket, bool]], version: int) -> int:
        """Every rank takes part in streaming the buckets; rank 0 announces each to every
        server (``flush_cache`` on the last) while it broadcasts its tensors; after the first
        failure it sends nothing more. On NCCL the group is aborted at once (:attr:`opened` is
        then False); on gloo, which has no watchdog, it is replaced at the next sync: torn down
        right after the failed collective, the trainer's next requests to the servers hung
        until the group's timeout (measured: 316 s, the reference engine's sender test)."""
        sent, failure = 0, self._begin()
        with ThreadPoolExecutor(1) as pool:
            for bucket, last in buckets:
                if self.rank != 0 or failure is not None or not bucket:
                    continue
                bucket = self._served(bucket)
                answer = pool.submit(self.receiver.announce_bucket, bucket, version,
                                     self.group_name, last)
                try:
                    broadcast_tensors(self.group, bucket, answer)
                    answer.result()
                    sent += len(bucket)
                except Exception as exc:   # finish the stream (collectives), then report
                    failure = exc
                    if self.backend == "nccl":   # at once: a broadcast left pending would end
                        # this process at NCCL's watchdog timeout while the disk fallback loads
                        group, self.group = self.group, None
                        abort_group(group)
        if failure is not None:
            raise failure
        if self.rank == 0:
            self.receiver.end()
        return sent


class TensorSender(_SessionSender):
    """Colocated SGLang: every rank holds each bucket on its own GPU; server s's TP rank j takes
    the serialised bucket of trainer rank ``sources[s][j]`` (the rank on that TP rank's GPU).
    Only those ranks serialise (torch keeps a shared CUDA block alive until a consumer releases
    it: a payload no server opens would hold a model copy per sync); rank 0 gathers the
    payloads and hands each server its TP ranks' ones, keeping its tensors alive until the
    servers answered. When a bucket fails, the ranks whose payloads no server received give
    their shares back, and nobody serialises again in that sync."""

    everywhere = True

    def __init__(self, receiver: SGLangWeightReceiver, rank: int, fp8: bool,
                 sources: list[list[int]]):
        super().__init__(receiver, rank, fp8)
        self.sources = sources

    def unopened_ranks(self, unsent_servers: list[int]) -> set[int]:
        """The ranks whose payload only servers in ``unsent_servers`` were to open."""
        unsent = set(unsent_servers)
        return ({r for s in unsent for r in self.sources[s]} -
                {r for s, ranks in enumerate(self.sources) if s not in unsent for r in ranks})

    def send(self, buckets: Iterable[tuple[Bucket, bool]], version: int) -> int:
        """Every rank iterates the buckets (their gathers are collectives) and learns rank 0's
        word after each one (:func:`~moe_rl.weights.serialize.rank0_verdict`): a failure stops
        every rank's serialising, and a rank whose payload never reached a server releases
        it."""
        sent, failure = 0, self._begin()
        stopped = serialize.rank0_verdict(failure is not None, set())[0]
        consumed = self.rank in {r for ranks in self.sources for r in ranks}
        for bucket, last in buckets:
            if stopped:
                continue
            shared = (serialize.share_named_tensors(self._served(bucket)) if consumed
                      else serialize.SharedBucket(""))
            payloads = serialize.gather_strings(shared.text)
            unopened: set[int] = set()
            if self.rank == 0:
                try:
                    self.receiver.receive_tensors(
                        [[payloads[r] for r in ranks] for ranks in self.sources], version, last)
                    sent += len(bucket)
                except TensorsNotLoaded as exc:   # finish the stream (collectives), then report
                    failure, unopened = exc, self.unopened_ranks(exc.unsent)
                except Exception as exc:
                    failure = exc
            stopped, mine_unopened = serialize.rank0_verdict(failure is not None, unopened)
            if mine_unopened:
                serialize.release_unopened(shared)
        if self.rank == 0:
            if failure is not None:
                raise failure
            self.receiver.end()
        return sent
