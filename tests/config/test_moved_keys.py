"""Keys that moved into a section (moe_rl/config/moved_keys.py) keep loading under their old
names, key by key: from a YAML file, an override and a saved run's config.yaml, each with a
one-line warning naming the new key; both names at once are refused; a resume compares a run
saved under the old names with the new ones."""
import subprocess
import sys

import pytest
import yaml

from moe_rl.config import ConfigError, config_from_dict, dump_config, load_config
from moe_rl.config.moved_keys import MOVED_KEYS

# (old key, new key, a value that is not the default)
MOVES = [("trainer.ema_decay", "trainer.ema.decay", 0.9),
         ("trainer.ema_policy", "trainer.ema.policy", True),
         ("trainer.ema_start_step", "trainer.ema.start_step", 3),
         ("trainer.sft_warmup_steps", "trainer.warmup.steps", 7),
         ("trainer.sft_lr", "trainer.warmup.lr", 0.02),
         ("trainer.save_interval", "trainer.checkpoint.interval", 7),
         ("trainer.save_interval_minutes", "trainer.checkpoint.interval_minutes", 5.0),
         ("trainer.stop_grace_s", "trainer.checkpoint.stop_grace_s", 30.0),
         ("trainer.checkpoint_dir", "trainer.checkpoint.dir", "/srv/ckpt"),
         ("trainer.keep_checkpoints", "trainer.checkpoint.keep", 3),
         ("trainer.export_hf", "trainer.checkpoint.export_hf", False),
         ("trainer.export_hf_interval", "trainer.checkpoint.export_hf_interval", 4),
         ("trainer.tensor_parallel", "trainer.parallel.tensor", 2),
         ("trainer.pipeline_parallel", "trainer.parallel.pipeline", 2),
         ("trainer.expert_parallel", "trainer.parallel.expert", 2),
         ("trainer.context_parallel", "trainer.parallel.context", 2),
         ("trainer.sequence_parallel", "trainer.parallel.sequence", True),
         ("trainer.lr", "trainer.optim.lr", 3e-4),
         ("trainer.min_lr", "trainer.optim.min_lr", 1e-7),
         ("trainer.lr_warmup_steps", "trainer.optim.warmup_steps", 5),
         ("trainer.lr_schedule", "trainer.optim.schedule", "cosine"),
         ("trainer.weight_decay", "trainer.optim.weight_decay", 0.1),
         ("trainer.adam_beta1", "trainer.optim.adam_beta1", 0.8),
         ("trainer.adam_beta2", "trainer.optim.adam_beta2", 0.95),
         ("trainer.grad_clip", "trainer.optim.grad_clip", 0.5),
         ("trainer.distributed_optimizer", "trainer.optim.distributed", False)]


def _value(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _nested(dotted, value):
    tree = value
    for part in reversed(dotted.split(".")):
        tree = {part: tree}
    return tree


def _with_ema(tree):   # the EMA's policy and start step need its decay (given by its new name)
    tree.setdefault("trainer", {}).setdefault("ema", {}).setdefault("decay", 0.5)
    return tree


NEEDS_DECAY = ("trainer.ema_policy", "trainer.ema_start_step")
# what a key's value needs beside it to load (parallel sizes: GPUs and ranks)
GPUS = ["cluster.gpus_per_node=8", "cluster.trainer_workers=8"]
BESIDE = {"trainer.tensor_parallel": [*GPUS, "trainer.parallel.sequence=true"],
          "trainer.expert_parallel": GPUS, "trainer.context_parallel": GPUS,
          "trainer.sequence_parallel": [*GPUS, "trainer.parallel.tensor=2"]}


def test_every_moved_key_is_tested_here():
    assert MOVED_KEYS == {old: new for old, new, _ in MOVES}


@pytest.mark.parametrize("old,new,value", MOVES, ids=[m[0] for m in MOVES])
def test_an_old_key_loads_in_its_new_place_with_a_warning(old, new, value, tmp_path, capsys):
    extra = ["trainer.ema.decay=0.5"] if old in NEEDS_DECAY else BESIDE.get(old, [])
    if old == "trainer.pipeline_parallel":   # no size but 1 loads: refused under its new name
        with pytest.raises(ConfigError, match=r"\(1\) trainer.parallel.pipeline: the training step"):
            load_config(None, [f"{old}={value}"])
        assert f"warning: {old} is now {new}" in capsys.readouterr().err
        return
    cfg = load_config(None, [f"{old}={value}", *extra])   # an override
    assert _value(cfg, new) == value
    assert f"warning: {old} is now {new}" in capsys.readouterr().err
    path = tmp_path / "old.yaml"   # a file
    tree = _nested(old, value)
    path.write_text(yaml.safe_dump(_with_ema(tree) if old in NEEDS_DECAY else tree))
    assert _value(load_config(path, BESIDE.get(old, [])), new) == value
    assert f"warning: {old} is now {new}" in capsys.readouterr().err
    saved = yaml.safe_load(dump_config(cfg))   # a saved config.yaml, written with old names
    parent, name = new.rsplit(".", 1)
    section = saved
    for part in parent.split("."):
        section = section[part]
    section.pop(name)
    saved["trainer"][old.split(".")[1]] = value
    assert _value(config_from_dict(saved), new) == value
    with pytest.raises(ConfigError, match=f"{old} and {new}: the same key under its old and new"):
        load_config(None, [f"{old}={value}", f"{new}={value}", *extra])


def test_a_resume_compares_a_run_saved_under_the_old_names(tmp_path):
    from moe_rl.orchestration.run_dir import resume_changes
    saved = yaml.safe_load(dump_config(load_config(None, ["trainer.ema.decay=0.9"])))
    saved["trainer"]["ema_decay"] = saved["trainer"]["ema"].pop("decay")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert resume_changes(str(path), load_config(None, ["trainer.ema.decay=0.9"])) == []
    assert resume_changes(str(path), load_config(None, ["trainer.ema.decay=0.8"])) == [
        ("trainer.ema.decay", 0.9, 0.8)]


def test_the_cli_says_the_new_name_of_an_old_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("trainer:\n  sft_warmup_steps: 4\n")
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--no-inputs", "--config",
                          str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("warning: trainer.sft_warmup_steps is now trainer.warmup.steps") == 1
    assert "warmup:\n    steps: 4" in res.stdout
