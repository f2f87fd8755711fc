"""The routing of each forward pass of a step, decided once from the config (ReplayPlan)."""
import pytest

from moe_rl.config import load_config
from moe_rl.trainer.replay_plan import ReplayPlan, Route


@pytest.mark.parametrize("replay,kl_replay,want", [
    # (pi_old pass, reference pass, own-version re-scoring, update)
    ("r3", False, (Route.REPLAY, Route.OFF, Route.REPLAY, Route.REPLAY)),
    ("r3", True, (Route.REPLAY, Route.REPLAY, Route.REPLAY, Route.REPLAY)),
    ("r2", False, (Route.RECORD, Route.OFF, Route.RECORD, Route.REPLAY)),
    ("off", False, (Route.RECORD, Route.OFF, Route.RECORD, Route.OFF)),
])
def test_each_pass_routes_as_the_config_says(replay, kl_replay, want):
    cfg = load_config(None, [f"algorithm.replay={replay}",
                             f"algorithm.kl.replay_routing={str(kl_replay).lower()}"])
    plan = ReplayPlan.from_algorithm(cfg.algorithm)
    assert (plan.pi_old, plan.reference, plan.own_version, plan.update) == want
    assert plan.supervised is Route.OFF


def test_a_replay_without_routing_to_replay_runs_free():
    assert ReplayPlan.for_batch(Route.REPLAY, has_routing=False) is Route.OFF
    assert ReplayPlan.for_batch(Route.REPLAY, has_routing=True) is Route.REPLAY
    assert ReplayPlan.for_batch(Route.RECORD, has_routing=False) is Route.RECORD
    assert ReplayPlan.for_batch(Route.OFF, has_routing=True) is Route.OFF
