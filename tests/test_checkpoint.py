"""Run checkpoints (orchestration/checkpoint.py) without Ray: numbered folders published by a
rename, an atomic tracker, pruning, a failed save that leaves the previous one, truncated files
never chosen and named, another model or layout refused naming the difference."""
import os

import pytest

from moe_rl.config import ModelInitConfig, load_config
from moe_rl.models.tiny import write_tiny_model
from moe_rl.orchestration import checkpoint


class FakeTrainers:
    """Writes one file per rank, as the trainer actors do."""
    def __init__(self, ranks=2, fail=False):
        self.ranks, self.fail = ranks, fail

    def save(self, path):
        for r in range(self.ranks):
            with open(f"{path}.rank{r}", "wb") as fh:
                fh.write(os.urandom(1000 + r))
        if self.fail:
            raise OSError(28, "No space left on device")


@pytest.fixture()
def cfg(tmp_path):
    write_tiny_model(ModelInitConfig(), str(tmp_path / "model"))
    return load_config(None, [f"model.path={tmp_path / 'model'}", "trainer.keep_checkpoints=2"])


def test_numbered_folders_tracker_and_pruning(tmp_path, cfg):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    for step in (1, 2, 3):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, ck, step)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000003",
                                      "latest_checkpointed_iteration.txt"]
    assert checkpoint.latest(ck).endswith("iter_0000003")
    assert checkpoint.open_checkpoint(checkpoint.latest(ck), cfg)["step"] == 3
    # a save that fails (no space left) leaves the previous checkpoint and the tracker
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(FakeTrainers(fail=True), {"step": 4}, cfg, ck, 4)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000003",
                                      "latest_checkpointed_iteration.txt"]
    assert checkpoint.latest(ck).endswith("iter_0000003")
    # a crash in the middle of a save leaves a .tmp folder: never chosen, removed by the next save
    os.makedirs(os.path.join(ck, "iter_0000004.tmp"))
    assert checkpoint.latest(ck).endswith("iter_0000003")
    checkpoint.save(FakeTrainers(), {"step": 5, "sampler": {}}, cfg, ck, 5)
    assert sorted(os.listdir(ck)) == ["iter_0000003", "iter_0000005",
                                      "latest_checkpointed_iteration.txt"]


def test_truncated_checkpoint_is_not_chosen_and_is_named(tmp_path, cfg):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    for step in (1, 2):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, ck, step)
    victim = os.path.join(ck, "iter_0000002", "trainer.pt.rank1")
    with open(victim, "r+b") as fh:
        fh.truncate(10)
    assert checkpoint.latest(ck).endswith("iter_0000001")   # the newest complete one
    with pytest.raises(checkpoint.CheckpointError, match="trainer.pt.rank1: 10 bytes, the "
                                                         "manifest says 1001"):
        checkpoint.open_checkpoint(os.path.join(ck, "iter_0000002"), cfg)
    with pytest.raises(checkpoint.CheckpointError, match="no manifest.json"):
        checkpoint.open_checkpoint(str(tmp_path), cfg)


def test_another_model_or_layout_is_refused_naming_the_difference(tmp_path, cfg):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    path = checkpoint.save(FakeTrainers(), {"step": 1, "sampler": {}}, cfg, ck, 1)
    other = load_config(None, [f"model.path={cfg.model.path}", "cluster.trainer_workers=2",
                               "trainer.expert_parallel=2", "rollout.prompts_per_step=2"])
    with pytest.raises(checkpoint.CheckpointError, match="trainer_workers: checkpoint 1, this "
                                                         "run 2"):
        checkpoint.open_checkpoint(path, other)
    write_tiny_model(ModelInitConfig(hidden_size=32), str(tmp_path / "small"))
    smaller = load_config(None, [f"model.path={tmp_path / 'small'}"])
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size"):
        checkpoint.open_checkpoint(path, smaller)
