"""run_dir on its own: what counts as a run, refusal / moving aside (a separate checkpoint
folder too), fresh demo directories, the keys a resume may change, and when a checkpoint is
due (steps or minutes, whichever first); nothing inside a run directory is a link out of it."""
import os

import pytest

from moe_rl.config import load_config
from moe_rl.errors import UserError
from moe_rl.orchestration.loop import checkpoint_due
from moe_rl.orchestration import run_dir


def _cfg(tmp_path, *extra):
    return load_config(None, [f"logging.dir={tmp_path / 'run'}", *extra])


def test_a_directory_holding_a_run_is_refused_or_moved_aside_whole(tmp_path):
    cfg = _cfg(tmp_path, f"trainer.checkpoint.dir={tmp_path / 'ck'}")
    run_dir.prepare(cfg, resume=False, overwrite=False)   # nothing there: fine
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")   # not a run's file
    run_dir.prepare(cfg, resume=False, overwrite=False)
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "ck" / "iter_0000004").mkdir(parents=True)
    with pytest.raises(UserError, match=r"already holds a run; continue it with --resume"):
        run_dir.prepare(cfg, resume=False, overwrite=False)
    run_dir.prepare(cfg, resume=True, overwrite=False)     # a resume continues it
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    run_dir.prepare(cfg, resume=False, overwrite=True)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()
    assert (tmp_path / "run.old-1" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "ck.old-1" / "iter_0000004").is_dir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").mkdir()
    run_dir.prepare(cfg, resume=False, overwrite=True)
    assert (tmp_path / "run.old-2" / "tb").is_dir()


def test_fresh_directories_for_the_demo(tmp_path):
    base = str(tmp_path / "runs" / "tiny")
    assert run_dir.fresh(base) == base
    for name in ("tiny", "tiny-2"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text("")
    assert run_dir.fresh(base) == base + "-3"


def test_resume_changes_name_the_keys_that_shape_the_run(tmp_path):
    from moe_rl.config import dump_config
    saved = _cfg(tmp_path, "trainer.optim.lr=1e-3", "trainer.steps=10")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.yaml").write_text(dump_config(saved))
    same_run = _cfg(tmp_path, "trainer.optim.lr=1e-3", "trainer.steps=50", "rollout.servers.base_port=1234",
                    "cluster.trainer_workers=2", "trainer.checkpoint.interval=5",
                    "data.reward_timeout_s=5", f"logging.dir={tmp_path / 'moved'}")
    assert run_dir.resume_changes(str(tmp_path / "ck" / "config.yaml"), same_run) == []
    other = _cfg(tmp_path, "trainer.optim.lr=1e-5", "algorithm.replay=off")
    changes = run_dir.resume_changes(str(tmp_path / "ck" / "config.yaml"), other)
    assert [c[0] for c in changes] == ["algorithm.replay", "trainer.optim.lr"]
    with pytest.raises(UserError, match=r"^algorithm.replay: .* \(and trainer.optim.lr\)"):
        run_dir.check_resume(str(tmp_path / "ck"), other)
    run_dir.check_resume(str(tmp_path / "ck"), other, ("algorithm.replay", "trainer.optim.lr"))


def test_checkpoint_due_by_steps_or_minutes_whichever_first(tmp_path):
    cfg = _cfg(tmp_path, "trainer.steps=100", "trainer.checkpoint.interval=10",
               "trainer.checkpoint.interval_minutes=5")
    assert [d for d in range(1, 101) if checkpoint_due(cfg.trainer, d, 0.0)] == list(range(10, 101, 10))
    assert checkpoint_due(cfg.trainer, 3, 5 * 60)
    assert not checkpoint_due(cfg.trainer, 3, 5 * 60 - 1)
    only_end = _cfg(tmp_path, "trainer.steps=7", "trainer.checkpoint.interval=0",
                    "trainer.checkpoint.interval_minutes=0")
    assert [d for d in range(1, 8) if checkpoint_due(only_end.trainer, d, 1e9)] == [7]


def test_a_checkpoint_dir_inside_the_run_moves_aside_with_it(tmp_path):
    """trainer.checkpoint.dir set to <logging.dir>/checkpoints with --overwrite: the run moves
    aside whole, its checkpoints with it, nothing lost (the second move raised
    FileNotFoundError)."""
    cfg = _cfg(tmp_path, f"trainer.checkpoint.dir={tmp_path / 'run' / 'checkpoints'}")
    (tmp_path / "run" / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    run_dir.prepare(cfg, resume=False, overwrite=True)
    assert not (tmp_path / "run").exists()
    assert (tmp_path / "run.old-1" / "checkpoints" / "iter_0000002").is_dir()


def test_a_logging_dir_that_is_a_file_or_a_dangling_link_is_named(tmp_path):
    """One line naming the key instead of a traceback: a file, a link to a file, a link to
    nothing (read-only folders are refused alike, through os.access)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "to_file").symlink_to(tmp_path / "afile")
    (tmp_path / "to_nothing").symlink_to(tmp_path / "gone")
    for path, named in ((tmp_path / "afile", "is a file, not a folder"),
                        (tmp_path / "to_file", "is a file, not a folder"),
                        (tmp_path / "to_nothing", "is a symbolic link to")):
        cfg = load_config(None, [f"logging.dir={path}"])
        for resume in (False, True):
            with pytest.raises(UserError, match=f"logging.dir: {path} {named}"):
                run_dir.prepare(cfg, resume=resume, overwrite=False)


@pytest.mark.parametrize("folder", ["final_hf", "final_hf_raw", "weights/v3", "weights/restart",
                                    "hf/iter_0000002"])
def test_a_new_run_refuses_an_export_folder_it_did_not_write(tmp_path, folder):
    """Before anything starts: the export would overwrite the user's files there."""
    cfg = _cfg(tmp_path)
    (tmp_path / "run" / folder).mkdir(parents=True)
    (tmp_path / "run" / folder / "model.safetensors").write_text("theirs")
    with pytest.raises(UserError, match=rf"logging.dir: .*{folder}: holds files moe_rl did "
                                        r"not write \(model.safetensors\)"):
        run_dir.prepare(cfg, resume=False, overwrite=False)
    assert (tmp_path / "run" / folder / "model.safetensors").read_text() == "theirs"


def test_other_folders_and_moe_rls_own_exports_are_no_obstacle(tmp_path):
    from moe_rl.owned_dirs import claim
    cfg = _cfg(tmp_path)
    (tmp_path / "run" / "weights" / "precious").mkdir(parents=True)
    (tmp_path / "run" / "weights" / "precious" / "model.bin").write_text("data")
    claim(str(tmp_path / "run" / "weights" / "v2"))
    (tmp_path / "run" / "weights" / "v2" / "model.safetensors").write_text("an export")
    (tmp_path / "run" / "final_hf").mkdir()   # empty
    run_dir.prepare(cfg, resume=False, overwrite=False)   # no refusal, nothing moved or removed
    assert (tmp_path / "run" / "weights" / "precious" / "model.bin").read_text() == "data"
    assert (tmp_path / "run" / "weights" / "v2" / "model.safetensors").read_text() == "an export"
    assert (tmp_path / "run" / "final_hf").is_dir()
    assert not (tmp_path / "run.old-1").exists()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    path = tmp_path_factory.mktemp("model") / "m"
    write_tiny_model(ModelInitConfig(seed=1), str(path))
    return path


@pytest.mark.parametrize("entry,resume", [
    ("metrics.jsonl", True), ("samples.jsonl", True), ("config.yaml", True), ("weights", True),
    ("weights", False), ("bf16_start", False), ("weights/v3", True), ("fifo", True)])
def test_train_refuses_a_link_in_its_run_directory_and_touches_nothing(tmp_path, tiny_model,
                                                                       entry, resume):
    """`moe-rl train` (new or --resume) into a directory where a log, the config, weights/ or
    bf16_start is a symbolic link out of it (or a FIFO stands): one line naming the entry, and
    the link's target as it was (a resume truncated a linked metrics.jsonl's target, a linked
    weights/ took exports and lost another run's marked ones)."""
    import subprocess
    import sys
    from moe_rl.owned_dirs import claim
    from tests.helpers import ROOT
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    outside.mkdir()
    (outside / "data.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    claim(str(outside / "v1"))   # another run's marked export
    (outside / "v1" / "model.safetensors").write_text("theirs")
    if entry == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    elif entry in ("weights", "bf16_start"):
        (run / entry).symlink_to(outside)
    elif entry == "weights/v3":
        (run / "weights").mkdir()
        (run / entry).symlink_to(outside / "v1")
    else:
        (run / entry).symlink_to(outside / "data.jsonl")
    before = sorted((p.relative_to(outside), p.read_bytes()) for p in outside.rglob("*")
                    if p.is_file())
    res = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tiny_model}",
         f"logging.dir={run}", *(["--resume"] if resume else [])],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    named = "metrics.jsonl is neither a file nor a folder" if entry == "fifo" else \
        f"{entry} is a symbolic link"
    assert res.returncode == 2 and named in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert sorted((p.relative_to(outside), p.read_bytes()) for p in outside.rglob("*")
                  if p.is_file()) == before
