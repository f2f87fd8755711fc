"""Checkpoint files never run code: torch DCP's ``.metadata`` (a pickle) is read through an
allow-list of DCP's own metadata records (hostile-input round 2, finding 1)."""
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_metadata(path, marker) -> None:
    """Overwrite the pickle at ``path`` with one that runs ``touch marker`` when unpickled,
    padded to the original size (a size-only manifest would pass it)."""
    size = os.path.getsize(path)
    data = pickle.dumps(_RunsCode(str(marker)))
    assert len(data) <= size
    with open(path, "wb") as fh:
        fh.write(data + b"\0" * (size - len(data)))


def _dcp_save(path):
    import torch.distributed.checkpoint as dcp
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return state


def test_dcp_metadata_loads_through_the_allow_list_and_crafted_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    from moe_rl.trainer.dcp_metadata import UnsafeMetadata, install, read_metadata
    saved = _dcp_save(tmp_path / "ck")
    install()
    install()   # idempotent
    meta = read_metadata(str(tmp_path / "ck" / ".metadata"))
    assert set(meta.state_dict_metadata) == {"w", "step"}
    back = {"w": torch.zeros(2, 3), "step": torch.tensor(0)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")), no_dist=True)
    assert torch.equal(back["w"], saved["w"]) and int(back["step"]) == 3
    marker = tmp_path / "pwned"
    crafted_metadata(tmp_path / "ck" / ".metadata", marker)
    with pytest.raises(BaseException) as info:   # DCP wraps the reader's error with its own
        dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")), no_dist=True)
    import traceback
    assert "refused to load checkpoint metadata naming" in "".join(
        traceback.format_exception(info.value))
    assert not marker.exists()
    with pytest.raises(UnsafeMetadata, match="posix.system|os.system"):
        read_metadata(str(tmp_path / "ck" / ".metadata"))
    assert not marker.exists()


def _craft_step(step, marker, manifest_too: bool) -> None:
    """Replace the step's DCP metadata by a pickle that runs a command; ``manifest_too``: an
    attacker who also rewrites the manifest's record of it (size and SHA-256)."""
    import hashlib
    import json
    meta = step / "trainer" / "dist" / ".metadata"
    crafted_metadata(meta, marker)
    if manifest_too:
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"]["trainer/dist/.metadata"] = {
            "size": meta.stat().st_size, "sha256": hashlib.sha256(meta.read_bytes()).hexdigest()}
        (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.loop   # a real run (`moe-rl train`): make test-loop
@pytest.mark.e2e
@pytest.mark.parametrize("manifest_too", [False, True], ids=["manifest_kept", "manifest_forged"])
def test_convert_of_a_checkpoint_with_crafted_metadata_runs_nothing(trained_run, tmp_path,
                                                                    manifest_too):
    """`moe-rl convert --to hf --checkpoint` of a run's step whose trainer/dist/.metadata was
    replaced by a same-size pickle that runs a command: refused by the manifest's SHA-256, and
    with a forged manifest by the metadata allow-list; nothing ran either way."""
    step = tmp_path / "iter_0000003"
    shutil.copytree(trained_run / "run" / "checkpoints" / "iter_0000003", step)
    marker = tmp_path / "pwned"
    _craft_step(step, marker, manifest_too)
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf",
                          "--checkpoint", str(step), "--hf", str(trained_run / "model"),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2 and not marker.exists()
    assert "Traceback" not in res.stdout + res.stderr
    expect = "refused to load checkpoint metadata" if manifest_too else "SHA-256"
    assert expect in res.stdout + res.stderr and ".metadata" in res.stdout + res.stderr


@pytest.mark.loop   # a real run (`moe-rl train`): make test-loop
@pytest.mark.e2e
def test_resume_from_a_checkpoint_with_crafted_metadata_runs_nothing(trained_run, tmp_path):
    """`moe-rl train --resume` of a run whose latest step carries crafted DCP metadata and a
    forged manifest: the trainer refuses the metadata before anything in it is called."""
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    marker = tmp_path / "pwned"
    _craft_step(tmp_path / "run" / "checkpoints" / "iter_0000003", marker, manifest_too=True)
    from tests.helpers import ROOT
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config",
                          str(ROOT / "configs" / "tiny_cpu.yaml"),
                          f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
                          "trainer.steps=5", "logging.progress=false",
                          "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
                          "algorithm.corrections=[icepop,seq_mis]",   # as the run was trained
                          "--resume"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and not marker.exists()
    assert "Traceback" not in res.stdout + res.stderr
    assert "refused to load checkpoint metadata" in res.stdout + res.stderr


def _two_steps(tmp_path):
    from moe_rl.config import ModelInitConfig, load_config
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration import checkpoint
    from tests.helpers import FakeTrainers
    write_tiny_model(ModelInitConfig(), str(tmp_path / "model"))
    cfg = load_config(None, [f"model.path={tmp_path / 'model'}", "trainer.checkpoint.keep=3"])
    ck = tmp_path / "ck"
    ck.mkdir()
    for step in (4, 10):
        checkpoint.save(FakeTrainers(), {"step": step, "sampler": {}}, cfg, str(ck), step)
    return cfg, ck


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "edited_loop_state"])
def test_a_damaged_step_is_refused_naming_the_file_and_resume_says_it_falls_back(
        tmp_path, capsys, damage):
    """Every file carries a SHA-256 in the manifest: a flipped byte (same size), a truncated
    shard and loop_state.json edited to another step (same size) are refused naming the file;
    the latest-step search falls back to the previous complete step and says so."""
    from moe_rl.orchestration import checkpoint
    cfg, ck = _two_steps(tmp_path)
    step = ck / "iter_0000010"
    if damage == "flipped_byte":
        target = step / "trainer" / "dist" / "__0_0.distcp"
        data = bytearray(target.read_bytes())
        data[100] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target = step / "trainer" / "rank1.pt"
        target.write_bytes(target.read_bytes()[:-10])
    else:
        target = step / "loop_state.json"
        target.write_text(target.read_text().replace('"step": 10', '"step": 40'))
    with pytest.raises(checkpoint.CheckpointError, match=target.name):
        checkpoint.open_checkpoint(str(step), cfg)
    capsys.readouterr()
    assert checkpoint.latest(str(ck)) == str(ck / "iter_0000004")
    err = capsys.readouterr().err
    assert "checkpoint skipped" in err and target.name in err and "iter_0000004" in err
