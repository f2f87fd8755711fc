"""Run checkpoints (orchestration/checkpoint.py) without Ray: numbered folders published by a
rename, an atomic tracker, pruning, a failed save that leaves the previous one, truncated files
never chosen and named, another model or optimizer refused naming the difference, another
parallel layout accepted (the sharded state is resharded: tests/trainer/test_checkpoint_reshard.py)."""
import json
import os

import pytest

from moe_rl.config import ModelInitConfig, load_config
from moe_rl.models.tiny import write_tiny_model
from moe_rl.orchestration import checkpoint
from tests.helpers import FakeTrainers


@pytest.fixture()
def cfg(tmp_path):
    write_tiny_model(ModelInitConfig(), str(tmp_path / "model"))
    return load_config(None, [f"model.path={tmp_path / 'model'}", "trainer.checkpoint.keep=2"])


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
    with pytest.raises(checkpoint.CheckpointError, match=r"saving step 4 to .*iter_0000004 "
                       r"failed: \[Errno 28\] No space left on device; the previous checkpoint "
                       r"\(.*iter_0000003\) and the tracker are untouched"):
        checkpoint.save(FakeTrainers(fail=True), {"step": 4}, cfg, ck, 4)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000003",
                                      "latest_checkpointed_iteration.txt"]
    assert checkpoint.latest(ck).endswith("iter_0000003")
    # a crash in the middle of a save leaves a .tmp folder (marked when the save began): never
    # chosen, removed by the next save
    from moe_rl.owned_dirs import claim
    claim(os.path.join(ck, "iter_0000004.tmp"))
    assert checkpoint.latest(ck).endswith("iter_0000003")
    checkpoint.save(FakeTrainers(), {"step": 5, "sampler": {}}, cfg, ck, 5)
    assert sorted(os.listdir(ck)) == ["iter_0000003", "iter_0000005",
                                      "latest_checkpointed_iteration.txt"]


def test_pruning_removes_only_checkpoints_moe_rl_saved(tmp_path, cfg):
    """Folders named like checkpoints or their leftovers that moe_rl did not write stay; a save
    onto a step folder moe_rl did not write is refused (UserError) and leaves it whole."""
    from moe_rl.errors import UserError
    ck = tmp_path / "ck"
    for name in ("iter_0000001", "iter_0000002.tmp", "iter_0000003.old"):
        (ck / name).mkdir(parents=True)
        (ck / name / "notes.txt").write_text("mine")
    for step in (4, 5, 6):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, str(ck), step)
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002.tmp", "iter_0000003.old",
                                      "iter_0000005", "iter_0000006",
                                      "latest_checkpointed_iteration.txt"]
    (ck / "iter_0000007").mkdir()
    (ck / "iter_0000007" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="iter_0000007: holds files moe_rl did not write"):
        checkpoint.save(FakeTrainers(), {"step": 7, "sampler": {}}, cfg, str(ck), 7)
    assert (ck / "iter_0000007" / "notes.txt").read_text() == "mine"
    assert checkpoint.latest(str(ck)).endswith("iter_0000006")


def test_truncated_checkpoint_is_not_chosen_and_is_named(tmp_path, cfg):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    for step in (1, 2):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, ck, step)
    victim = os.path.join(ck, "iter_0000002", "trainer", "dist", "__1_0.distcp")
    with open(victim, "r+b") as fh:
        fh.truncate(10)
    assert checkpoint.latest(ck).endswith("iter_0000001")   # the newest complete one
    with pytest.raises(checkpoint.CheckpointError, match="__1_0.distcp: 10 bytes, the "
                                                         "manifest says 5001"):
        checkpoint.open_checkpoint(os.path.join(ck, "iter_0000002"), cfg)
    os.remove(os.path.join(ck, "iter_0000001", "trainer", "rank0.pt"))
    assert checkpoint.latest(ck) is None
    with pytest.raises(checkpoint.CheckpointError, match="rank0.pt: missing"):
        checkpoint.open_checkpoint(os.path.join(ck, "iter_0000001"), cfg)
    with pytest.raises(checkpoint.CheckpointError, match="no manifest.json"):
        checkpoint.open_checkpoint(str(tmp_path), cfg)


def test_another_model_or_optimizer_is_refused_another_layout_resharded(tmp_path, cfg, capsys):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    path = checkpoint.save(FakeTrainers(), {"step": 1, "sampler": {}}, cfg, ck, 1)
    other = load_config(None, [f"model.path={cfg.model.path}", "cluster.trainer_workers=2",
                               "trainer.parallel.expert=2", "rollout.prompts_per_step=2"])
    assert checkpoint.open_checkpoint(path, other)["step"] == 1
    assert "resharding" in capsys.readouterr().out
    for override, named in (("trainer.ema.decay=0.9", "ema: checkpoint False, this run True"),
                            ("model.dtype=bfloat16", "optimizer_dtype: checkpoint 'float32'")):
        changed = load_config(None, [f"model.path={cfg.model.path}", override,
                                     "cluster.gpus_per_node=8"])
        with pytest.raises(checkpoint.CheckpointError, match=named):
            checkpoint.open_checkpoint(path, changed)
    write_tiny_model(ModelInitConfig(hidden_size=32), str(tmp_path / "small"))
    smaller = load_config(None, [f"model.path={tmp_path / 'small'}"])
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size"):
        checkpoint.open_checkpoint(path, smaller)


def test_resuming_the_distributed_optimizer_without_te_is_refused_before_loading(monkeypatch):
    """On an H100 without Transformer Engine, megatron-core 0.16.1's distributed optimizer saved
    but could not load (KeyError 'step'): the resume is refused first, naming the key and the
    two ways out, and nothing is read."""
    import types
    from megatron.core.optimizer import distrib_optimizer
    from moe_rl.trainer import sharded_state
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    leaf = distrib_optimizer.DistributedOptimizer.__new__(distrib_optimizer.DistributedOptimizer)
    chained = types.SimpleNamespace(chained_optimizers=[leaf])
    with pytest.raises(ValueError, match=r"trainer.optim.distributed: .*install "
                                         r"transformer-engine\[pytorch\], or run with "
                                         r"trainer.optim.distributed=false"):
        sharded_state.load_sharded("/nonexistent/dist", model=None, optimizer=chained, ema=None,
                                   step=1)


def test_a_step_saved_again_survives_a_kill_before_its_replacement_lands(tmp_path, cfg,
                                                                          monkeypatch):
    """Saving a step that exists (a resumed run saves its step again) sets the old one aside
    and removes it only once the new one is in place: killed in between, the resume finds the
    old one complete (it was removed first, and the kill lost the step)."""
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    checkpoint.save(FakeTrainers(), {"step": 3, "sampler": {}}, cfg, ck, 3)
    real_replace = os.replace

    def killed_at_the_swap(src, dst):
        if src.endswith("iter_0000003.tmp"):
            raise KeyboardInterrupt   # the process dies here
        real_replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", killed_at_the_swap)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(FakeTrainers(), {"step": 3, "sampler": {"again": 1}}, cfg, ck, 3)
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    found = checkpoint.latest(ck)
    assert found is not None and found.endswith("iter_0000003")
    assert checkpoint.open_checkpoint(found, cfg)["sampler"] == {}   # the old, complete one
    assert sorted(os.listdir(ck)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    checkpoint.save(FakeTrainers(), {"step": 3, "sampler": {"again": 1}}, cfg, ck, 3)
    assert checkpoint.open_checkpoint(checkpoint.latest(ck), cfg)["sampler"] == {"again": 1}
    assert sorted(os.listdir(ck)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("tamper,named", [
    (lambda m: {**m, "files": list(m["files"])}, "'files': expected an object"),
    (lambda m: {**m, "files": {k: {"sha256": v["sha256"]} for k, v in m["files"].items()}},
     "expected a size in bytes"),
    (lambda m: {**m, "files": {"../../etc/passwd": 10}}, "is not a file inside the checkpoint"),
    (lambda m: {**m, "step": "3"}, "'step': expected a non-negative integer"),
    (lambda m: [m], "expected a JSON object, got list"),
    ("[" * 100000 + "]" * 100000, "unreadable (RecursionError"),
    (b"\xff\xfe{}", "unreadable (UnicodeDecodeError"),
])
def test_a_tampered_manifest_is_one_line_in_convert_and_latest(tmp_path, cfg, capsys, tamper,
                                                               named):
    """`moe-rl convert --checkpoint` names the manifest and what is wrong (exit 2, no
    traceback); latest() passes over the step, saying why."""
    from moe_rl.cli import main
    ck = tmp_path / "ck"
    ck.mkdir()
    checkpoint.save(FakeTrainers(), {"step": 2, "sampler": {}}, cfg, str(ck), 2)
    manifest = ck / "iter_0000002" / checkpoint.MANIFEST
    if callable(tamper):
        manifest.write_text(json.dumps(tamper(json.loads(manifest.read_text()))))
    else:
        manifest.write_bytes(tamper if isinstance(tamper, bytes) else tamper.encode())
    assert main(["convert", "--to", "hf", "--checkpoint", str(ck / "iter_0000002"),
                 "--hf", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and checkpoint.MANIFEST in err and named in err, err
    assert checkpoint.latest(str(ck)) is None
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("tracker", ["²", "9" * 5000, "-1", "\xff\x00", "3.0", ""])
def test_a_tracker_that_is_not_a_plain_step_is_passed_over(tmp_path, cfg, tracker):
    ck = tmp_path / "ck"
    ck.mkdir()
    for step in (1, 2):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, str(ck), step)
    (ck / "latest_checkpointed_iteration.txt").write_text(tracker, encoding="utf-8")
    assert checkpoint.latest(str(ck)).endswith("iter_0000002")
