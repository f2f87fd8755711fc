"""Each trainer rank's place in the parallel groups (moe_rl/orchestration/trainer_layout.py), judged
by megatron-core's own RankGenerator (what initialize_model_parallel builds its groups from), and
`moe-rl plan` printing it."""
import pytest

from moe_rl.config import load_config
from moe_rl.orchestration.trainer_layout import format_layout, trainer_layout

SIZES = [  # world, tp, pp, cp, ep (the trainer runs without pipeline schedules: pp 1)
    (8, 1, 1, 1, 8), (8, 2, 1, 1, 2), (16, 2, 1, 1, 4), (8, 1, 1, 2, 2), (12, 2, 1, 3, 2),
    (32, 4, 1, 2, 4), (64, 2, 1, 2, 8), (4, 1, 1, 1, 1)]
ON_GPUS = ["cluster.num_nodes=9", "cluster.gpus_per_node=8", "rollout.engine=sglang",
           "rollout.prompts_per_step=64",
           "rollout.engine_dtype=bfloat16", "model.dtype=bfloat16"]


@pytest.mark.parametrize("world,tp,pp,cp,ep", SIZES)
def test_every_rank_sits_where_megatrons_rank_generator_puts_it(world, tp, pp, cp, ep):
    from megatron.core.parallel_state import RankGenerator
    cfg = load_config(None, [*ON_GPUS, f"cluster.trainer_workers={world}",
                             f"trainer.parallel.tensor={tp}", f"trainer.parallel.pipeline={pp}",
                             f"trainer.parallel.context={cp}", f"trainer.parallel.expert={ep}",
                             f"trainer.parallel.sequence={tp > 1}"])
    layout = trainer_layout(cfg)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=order)
    seen = {}
    for gen, token, field in ((dense, "tp", "tp"), (dense, "cp", "cp"), (dense, "dp", "dp"),
                              (dense, "pp", "pp"), (expert, "ep", "ep"), (expert, "dp", "edp")):
        for group in gen.get_ranks(token):
            for index, rank in enumerate(group):
                seen[rank, field] = index
    assert len(layout.ranks) == world
    for place in layout.ranks:
        for field in ("tp", "cp", "dp", "pp", "ep", "edp"):
            assert getattr(place, field) == seen[place.rank, field], (place, field)
    assert layout.sizes == dict(tp=tp, cp=cp, dp=world // (tp * cp * pp), pp=pp, ep=ep,
                                edp=world // (tp * ep * pp))


def test_the_layout_reads_as_sizes_then_one_line_per_rank():
    cfg = load_config(None, [*ON_GPUS, "cluster.trainer_workers=4", "trainer.parallel.tensor=2",
                             "trainer.parallel.sequence=true", "trainer.parallel.expert=2"])
    text = format_layout(trainer_layout(cfg)).splitlines()
    assert text[0] == ("trainer ranks: TP 2 x CP 1 x DP 2 x PP 1 (experts: EP 2 x expert DP 1 "
                       "x PP 1)")
    assert text[1:] == [f"  trainer {r:<4} tp {r % 2}  cp 0  dp {r // 2}  pp 0  ep {r // 2}  "
                        f"edp 0" for r in range(4)]
