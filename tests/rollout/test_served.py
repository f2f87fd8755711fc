"""The record of what the engine servers serve (rollout side): how a restarted server is
restored and labelled, and the restarted servers handed to the next sync once."""
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
