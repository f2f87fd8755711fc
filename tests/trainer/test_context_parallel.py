"""Context parallelism's splitting and gathering code on CPU (the forward itself needs Transformer
Engine's attention: benchmarks/gpu_check.py runs CP=2 on GPUs). Each map is checked against an
independent reference: which rank owns a position is computed from the position itself; the
gather runs over a real gloo group of CP ranks."""
from __future__ import annotations

import os

import pytest
import torch

from moe_rl.trainer.packing import pack_one
from moe_rl.trainer.context_parallel import every_rank_positions, local_kept, local_positions
from moe_rl.trainer.parallel import free_port
from moe_rl.trainer.replay import context_parallel_slice
from moe_rl.rollout_record import Sample
from tests.helpers import start_ranks


def owner(q: int, length: int, cp: int) -> int:
    """The CP rank holding offset ``q`` of a span of ``length`` positions (load-balanced)."""
    k = q // (length // (2 * cp))
    return k if k < cp else 2 * cp - 1 - k


def _samples(lengths, P=3, mask=True):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(0, 50, (n,), generator=g)
        R = n - P
        sizes = torch.randint(1, 4, (R,), generator=g)
        kept = [torch.cat([ids[P + j:P + j + 1], 60 + torch.arange(int(sizes[j]) - 1)])
                for j in range(R)]
        out.append(Sample(prompt_ids=ids[:P], response_ids=ids[P:],
                          rollout_logprobs=torch.zeros(R),
                          routing=torch.randint(0, 8, (n - 1, 2, 2), generator=g,
                                                dtype=torch.long).to(torch.uint8),
                          sampling_mask_offsets=torch.cat([torch.zeros(1, dtype=torch.long),
                                                           sizes.cumsum(0)]) if mask else None,
                          sampling_mask_ids=torch.cat(kept) if mask else None))
    return out


def _layouts(cp):
    samples = _samples([9, 5, 14, 7])
    padded = pack_one(samples, [0, 1, 2, 3], pad_token_id=0, num_experts=8,
                      pad_to_multiple=2 * cp)
    packed = pack_one(samples, [2, 0, 3, 1], pad_token_id=0, num_experts=8, packed=True,
                      slot_multiple=2 * cp, pad_to_multiple=4 * cp)
    return samples, padded, packed


@pytest.mark.parametrize("cp", [2, 3])
def test_positions_partition_every_span_load_balanced(cp):
    _, padded, packed = _layouts(cp)
    S = padded.shape[1]
    maps = [local_positions(padded, r, cp) for r in range(cp)]
    for r, pos in enumerate(maps):
        assert pos.tolist() == [p for p in range(S) if owner(p, S, cp) == r]
    cu = packed.cu_seqlens().tolist()
    maps = [local_positions(packed, r, cp) for r in range(cp)]
    for r, pos in enumerate(maps):   # slot by slot, the owner from the offset in the slot
        want = [p for a, b in zip(cu, cu[1:]) for p in range(a, b) if owner(p - a, b - a, cp) == r]
        assert pos.tolist() == want
    assert sorted(torch.cat(maps).tolist()) == list(range(packed.shape[1]))
    assert torch.equal(every_rank_positions(packed, cp), torch.stack(maps))


@pytest.mark.parametrize("cp", [2, 3])
def test_replay_rows_and_kept_sets_follow_the_rank_positions(cp):
    samples, padded, packed = _layouts(cp)
    for mb in (padded, packed):
        B, S = mb.shape
        flat = mb.replay_indices()[1]   # router order s * B + b
        # the reference: each response position's kept set, read from the sample's own record
        sets = {}
        for i, s in enumerate(samples[j] for j in mb.sample_indices):
            b, o, P = int(mb.sample_rows[i]), int(mb.sample_starts[i]), s.prompt_len
            for j in range(s.response_len):
                lo, hi = int(s.sampling_mask_offsets[j]), int(s.sampling_mask_offsets[j + 1])
                sets[(b, o + P - 1 + j)] = s.sampling_mask_ids[lo:hi].tolist()
        for r in range(cp):
            pos = local_positions(mb, r, cp)
            rows = context_parallel_slice(flat, S, B, pos)
            for s_loc, p in enumerate(pos.tolist()):
                for b in range(B):
                    assert torch.equal(rows[s_loc * B + b], flat[p * B + b])
            kept = local_kept(mb, pos)
            want = [sets[(b, p)] for b in range(B) for p in pos.tolist() if (b, p) in sets]
            got = [kept.ids[int(kept.offsets[t]):int(kept.offsets[t + 1])].tolist()
                   for t in range(kept.offsets.numel() - 1)]
            assert got == want


def _gather_worker(rank, cp, port, out):
    import torch.distributed as dist
    from moe_rl.trainer.context_parallel import gather_positions, gather_rows
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    _, padded, packed = _layouts(cp)
    result = {}
    for name, mb in (("padded", padded), ("packed", packed)):
        B, S = mb.shape
        full = torch.arange(B * S, dtype=torch.float64).reshape(B, S).sin()
        every = torch.stack([local_positions(mb, r, cp) for r in range(cp)])
        local = full[:, every[rank]].clone().requires_grad_(True)
        got = gather_positions(local, every, S, None)
        weight = torch.arange(B * S, dtype=torch.float64).reshape(B, S).cos()
        (got * weight).sum().backward()
        rows = torch.arange(S * B * 2).reshape(S * B, 2)
        mine = context_parallel_slice(rows, S, B, every[rank])
        result[name] = {"equal": torch.equal(got.detach(), full),
                        "grad": torch.equal(local.grad, weight[:, every[rank]]),
                        "rows": torch.equal(gather_rows(mine, every, S, B, None), rows)}
    torch.save(result, os.path.join(out, f"cp{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("cp", [2, 3])
def test_gather_puts_every_rank_back_in_order_over_gloo(tmp_path, cp):
    start_ranks(_gather_worker, (cp, free_port(), str(tmp_path)), cp)
    for r in range(cp):
        res = torch.load(tmp_path / f"cp{r}.pt")
        for name in ("padded", "packed"):
            assert res[name] == {"equal": True, "grad": True, "rows": True}, (r, name)


def _data_rank_worker(rank, port, sizes, out):
    from megatron.core import parallel_state as ps
    from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(*sizes))
    torch.save(ps.get_data_parallel_rank(), os.path.join(out, f"dp{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.parametrize("sizes,want", [((2, 1, 1, 1), [0, 0]), ((1, 1, 1, 2), [0, 0]),
                                        ((1, 1, 2, 1), [0, 1]), ((1, 1, 1, 1), [0, 1])],
                         ids=["tp2", "cp2", "ep2", "dp2"])
def test_tensor_and_context_parallel_ranks_share_a_shard(tmp_path, sizes, want):
    """The loop hands each trainer rank its data-parallel rank's shard (megatron's own layout):
    TP and CP ranks the same samples, EP and DP ranks their own."""
    from moe_rl.orchestration.sharding import per_rank
    start_ranks(_data_rank_worker, (free_port(), sizes, str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"dp{r}.pt") for r in range(2)]
    assert ranks == want
    shards = [f"shard{d}" for d in range(max(ranks) + 1)]
    assert per_rank(shards, ranks) == [f"shard{d}" for d in want]
    with pytest.raises(ValueError, match="do not match 2 shards"):
        per_rank(["a", "b"], [0, 0])
