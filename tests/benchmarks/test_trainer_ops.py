"""benchmarks/trainer_ops.py's counts: the grouped experts' ops per MoE layer grow by one
gradient hand-over per expert weight (2 per expert) where megatron's loop grows by ~29 per
expert, and only the loop synchronises with the host inside the experts."""
from __future__ import annotations

import pytest

from benchmarks.trainer_ops import moe_layer_ops


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    yield


def test_ops_per_moe_layer_and_host_syncs_on_each_path():
    grouped = {e: moe_layer_ops("grouped", e) for e in (8, 32)}
    loop = {e: moe_layer_ops("sequential", e) for e in (8, 32)}
    assert grouped[32]["ops"] - grouped[8]["ops"] == 2 * 24   # each fc1 / fc2 weight's grad
    assert loop[32]["ops"] - loop[8]["ops"] > 25 * 24
    assert grouped[8]["ops"] < 150 and loop[32]["ops"] > 5 * grouped[32]["ops"]
    assert grouped[8]["syncs"] == grouped[32]["syncs"] == 0
    assert loop[8]["syncs"] == 1   # tokens_per_expert.tolist()
