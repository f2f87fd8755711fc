"""The record of what the engine servers serve (rollout side): how a restarted server is
restored and labelled, the restarted servers handed to the next sync once, and the version
every server must report before a batch is generated from it."""
import pytest

from moe_rl.rollout.served import ServedWeights


def test_a_restarted_server_is_restored_from_the_last_disk_load_with_its_version():
    served = ServedWeights(disk_only=True)
    assert served.restore_point("u0") is None   # before any load: its starting weights
    served.loaded("/run/weights/v3", 3)
    assert served.restore_point("u1") == ("/run/weights/v3", 3)
    assert served.take_restarted() == ["u0", "u1"]
    assert served.take_restarted() == []


def test_in_memory_a_restarted_server_gets_a_trainer_export_labelled_as_the_trainer_wrote_it():
    """The export is asked for the served version; the label is the version the trainer wrote
    (its current one when it no longer holds the served one), never the record's own."""
    served = ServedWeights(disk_only=False)
    assert served.restore_point("u0") is None   # not connected yet: the sync restores it
    asked = []
    served.trainer_export = lambda version: asked.append(version) or ("/x/restart", 5)
    served.synced(4)
    assert served.restore_point("u1") == ("/x/restart", 5)
    assert asked == [4] and served.version == 4
    served.loaded("/run/weights/v6", 6)   # a sync redone from disk
    assert served.restore_point("u0") == ("/x/restart", 5) and asked == [4, 6]
    assert served.take_restarted() == ["u0", "u1", "u0"]


def test_a_batch_is_generated_only_from_the_version_it_was_launched_with():
    """The pipeline's invariant (RolloutWorker._check_serving): every server must report the
    expected weight version; before the first sync a version the servers started with counts
    as 0. Any other answer stops the run naming the step and what the servers report."""
    sglang = ServedWeights(disk_only=False)
    sglang.record_start(["default", "default"])
    sglang.check_serving(["default", "default"], 0, 0)   # SGLang, never synced
    sglang.check_serving(["0", "0"], 0, 0)               # after the warm start
    sglang.check_serving(["3", "3"], 3, 4)               # one step stale, k >= 1
    with pytest.raises(RuntimeError, match=r"step 4's batch is to be generated from weight "
                                           r"version 4, but the engine servers report "
                                           r"\['4', '3'\]"):
        sglang.check_serving(["4", "3"], 4, 4)           # one server missed it
    reference = ServedWeights(disk_only=True)
    reference.record_start(["0"])
    with pytest.raises(RuntimeError, match="version 2"):
        reference.check_serving(["0"], 2, 2)   # a restarted server back at the start
    with pytest.raises(RuntimeError, match="version 0"):
        reference.check_serving(["default"], 0, 0)   # not a version it started with
