"""Each trainer rank's place in megatron-core's parallel groups, as
``initialize_model_parallel`` lays the ranks out (its default order ``tp-cp-ep-dp-pp``, tensor
parallel fastest; the experts' layout with the expert tensor-parallel size equal to the tensor
one, as moe_rl initialises it), computed without starting anything: what ``moe-rl plan`` prints
for each rank."""
from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config import Config


@dataclass(frozen=True)
class RankPlace:
    """One rank's index in each of its groups: tensor (tp), context (cp), data (dp), pipeline
    (pp) parallel; expert parallel (ep) and the experts' data parallel (edp)."""
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class Layout:
    """The group sizes (by :class:`RankPlace`'s field names) and every rank's place."""
    sizes: dict[str, int]
    ranks: list[RankPlace]


def _digits(rank: int, sizes: tuple[int, ...]) -> list[int]:
    """``rank`` in the mixed radix ``sizes`` (first size fastest)."""
    out = []
    for size in sizes:
        out.append(rank % size)
        rank //= size
    return out


def trainer_layout(cfg: Config) -> Layout:
    """The layout of ``cluster.trainer_workers`` ranks under the ``trainer.parallel`` sizes
    (the config checks make them divide the world)."""
    t, world = cfg.trainer, cfg.cluster.trainer_workers
    tp, pp, cp, ep = (t.parallel.tensor, t.parallel.pipeline, t.parallel.context,
                      t.parallel.expert)
    dp = world // (tp * cp * pp)
    edp = world // (tp * ep * pp)
    ranks = []
    for rank in range(world):
        r_tp, r_cp, r_dp, r_pp = _digits(rank, (tp, cp, dp, pp))
        _, r_ep, r_edp, _ = _digits(rank, (tp, ep, edp, pp))
        ranks.append(RankPlace(rank, r_tp, r_cp, r_dp, r_pp, r_ep, r_edp))
    return Layout(dict(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, edp=edp), ranks)


def format_layout(layout: Layout) -> str:
    """The layout as a person reads it: the sizes, then one line per rank."""
    n = layout.sizes
    lines = [f"trainer ranks: TP {n['tp']} x CP {n['cp']} x DP {n['dp']} x PP {n['pp']} "
             f"(experts: EP {n['ep']} x expert DP {n['edp']} x PP {n['pp']})"]
    for r in layout.ranks:
        lines.append(f"  trainer {r.rank:<4} tp {r.tp}  cp {r.cp}  dp {r.dp}  pp {r.pp}  "
                     f"ep {r.ep}  edp {r.edp}")
    return "\n".join(lines)
