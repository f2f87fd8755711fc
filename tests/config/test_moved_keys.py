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
         ("trainer.distributed_optimizer", "trainer.optim.distributed", False),
         ("rollout.host", "rollout.servers.host", "0.0.0.0"),
         ("rollout.base_port", "rollout.servers.base_port", 31000),
         ("rollout.api_key", "rollout.servers.api_key", "k"),
         ("rollout.request_timeout_s", "rollout.servers.request_timeout_s", 60.0),
         ("rollout.max_retries", "rollout.servers.max_retries", 1),
         ("rollout.concurrency", "rollout.servers.concurrency", 8),
         ("rollout.health_timeout_s", "rollout.servers.health_timeout_s", 30.0),
         ("rollout.startup_timeout_s", "rollout.servers.startup_timeout_s", 600.0),
         ("rollout.weight_load_timeout_s", "rollout.servers.weight_load_timeout_s", 120.0),
         ("rollout.max_answer_mb", "rollout.servers.max_answer_mb", 16.0),
         ("rollout.temperature", "rollout.sampling.temperature", 0.7),
         ("rollout.top_p", "rollout.sampling.top_p", 0.9),
         ("rollout.top_k", "rollout.sampling.top_k", 20),
         ("rollout.min_p", "rollout.sampling.min_p", 0.05),
         ("rollout.sampling_mask_max_tokens", "rollout.sampling.mask_max_tokens", 512),
         ("rollout.partial", "rollout.partial.enabled", True),
         ("rollout.partial_extra_groups", "rollout.partial.extra_groups", 3),
         ("rollout.partial_stale", "rollout.partial.stale", "mask"),
         ("rollout.partial_mask_offpolicy", "rollout.partial.mask_offpolicy", True),
         ("rollout.weight_check", "rollout.weight_check.enabled", False),
         ("rollout.weight_check_prompts", "rollout.weight_check.prompts", 4),
         ("rollout.weight_check_factor", "rollout.weight_check.factor", 5.0),
         ("rollout.weight_check_floor", "rollout.weight_check.floor", 0.001),
         ("rollout.score_window_tokens", "rollout.scoring.window_tokens", 16),
         ("rollout.score_full_vocab_max", "rollout.scoring.full_vocab_max", 1024)]


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
          "trainer.sequence_parallel": [*GPUS, "trainer.parallel.tensor=2"],
          "rollout.partial": ["rollout.max_staleness=1"]}


def test_every_moved_key_is_tested_here_and_listed_in_the_manual():
    import pathlib
    assert MOVED_KEYS == {old: new for old, new, _ in MOVES}
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = page.split("### Keys that moved", 1)[1].split("### Every key", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows == [f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items()]


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
    top, flat = old.split(".")
    saved[top][flat] = value
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


def test_a_switch_that_became_a_section_loads_in_either_form(tmp_path, capsys):
    """``rollout.partial`` / ``rollout.weight_check`` were switches and are sections: a value
    under the name is the old switch (moved, warned), a mapping is the section (no warning)."""
    path = tmp_path / "new.yaml"
    path.write_text("rollout:\n  max_staleness: 1\n  partial:\n    enabled: true\n    stale: mask\n"
                    "  weight_check:\n    enabled: false\n")
    cfg = load_config(path)
    assert cfg.rollout.partial.enabled and cfg.rollout.partial.stale == "mask"
    assert not cfg.rollout.weight_check.enabled
    assert "warning" not in capsys.readouterr().err
    path.write_text("rollout:\n  max_staleness: 1\n  partial: true\n  partial_stale: mask\n")
    cfg = load_config(path)
    assert cfg.rollout.partial.enabled and cfg.rollout.partial.stale == "mask"
    assert capsys.readouterr().err.count("warning: rollout.partial") == 2
