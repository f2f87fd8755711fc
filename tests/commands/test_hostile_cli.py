"""Every refusal a user can cause from the CLI is one clear line on stderr, exit 2, no
traceback: convert of garbage or crafted files, missing directories, damaged checkpoints."""
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from tests.helpers import ROOT


class _Runs:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _cli(*args, cwd, python_flags=()):
    return subprocess.run([sys.executable, *python_flags, "-m", "moe_rl.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _one_line_refusal(res, *expected):
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("moe-rl ")]
    assert len(lines) == 1, res.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def test_convert_refuses_garbage_crafted_and_missing_inputs_in_one_line(tmp_path):
    model = tmp_path / "model"
    write_tiny_model(ModelInitConfig(), str(model))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(bytes(range(256)) * 40)
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.pt"
    crafted.write_bytes(pickle.dumps({"model": _Runs(marker)}))
    import torch
    wrong = tmp_path / "wrong.pt"
    torch.save({"model": {"no.such.weight": torch.zeros(2)}}, wrong)
    cases = [
        (["--to", "hf", "--megatron", str(junk), "--hf", str(model)], [str(junk), "--megatron"]),
        (["--to", "hf", "--megatron", str(crafted), "--hf", str(model)],
         [str(crafted), "more than tensors"]),
        (["--to", "hf", "--megatron", str(wrong), "--hf", str(model)],
         [str(wrong), "does not fit"]),
        (["--to", "hf", "--megatron", str(tmp_path / "absent.pt"), "--hf", str(model)],
         ["no such file"]),
        (["--to", "hf", "--megatron", str(junk), "--hf", str(tmp_path / "nowhere")],
         ["--hf", "no config.json"]),
        (["--to", "megatron", "--hf", str(tmp_path / "nowhere")], ["--hf", "nowhere"]),
        (["--to", "hf", "--checkpoint", str(tmp_path / "nowhere")],
         ["--checkpoint", "no complete checkpoint"]),
        (["--to", "hf", "--hf", str(model)], ["give one of"]),
    ]
    for args, expected in cases:
        res = _cli("convert", *args, "--out", str(tmp_path / "out"), cwd=tmp_path,
                   python_flags=("-X", "importtime"))
        _one_line_refusal(res, *expected)
        # refused before megatron-core is imported, except a file that must meet the model
        imported = re.search(r"\|\s+megatron\.core$", res.stderr, re.M) is not None
        assert imported == ("does not fit" in expected), expected
    assert not marker.exists()


@pytest.mark.loop   # a real run (`moe-rl train`): make test-loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`; CI: the crafted-metadata resume (test_checkpoint_hostile)
def test_resume_of_a_damaged_or_crafted_checkpoint_is_one_line(trained_run, tmp_path):
    """`--resume-from` a step with a truncated shard (its manifest forged to match) and
    `--resume` of a run whose every step is refused: one line naming the step, exit 2."""
    import hashlib
    import json
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    ck = tmp_path / "run" / "checkpoints"
    step = sorted(p for p in ck.iterdir() if p.name.startswith("iter_"))[-1]
    shard = sorted((step / "trainer" / "dist").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    common = ["train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
              f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
              "trainer.steps=5", "logging.progress=false", "rollout.prompts_per_step=4",
              "rollout.n_samples_per_prompt=4", "algorithm.corrections=[icepop,seq_mis]"]
    res = _cli(*common, "--resume-from", str(step), cwd=tmp_path)
    _one_line_refusal(res, str(step), shard.name)
    manifest = json.loads((step / "manifest.json").read_text())   # forged to match the damage
    manifest["files"][str(shard.relative_to(step))] = {
        "size": shard.stat().st_size, "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    res = _cli(*common, "--resume-from", str(step), cwd=tmp_path)
    _one_line_refusal(res, str(step), "cannot be loaded")


@pytest.mark.parametrize("overrides,expected", [
    (["model.init.hidden_size=2000000"], "model.init: this shape has 7,338,000,064 parameters"),
    (["model.init.num_experts=65535", "model.init.moe_intermediate_size=100000"],
     "init-model writes test models of at most 1,073,741,824"),
    (["model.init.num_hidden_layers=100000"], "model.init: num_hidden_layers: 100000"),
    (["model.init.deepseek.expert_bias_std=1e300"], "model.init.deepseek.expert_bias_std: 1e+300"),
    (["model.init.seed=" + "9" * 30], "model.init.seed")])
def test_init_model_refuses_a_shape_past_its_bounds_before_allocating(tmp_path, overrides,
                                                                      expected):
    """`moe-rl init-model` of a huge shape or seed: one line naming the key, in seconds, nothing
    written (it grew memory for minutes, then an allocation traceback; 1e300 wrote infinite
    expert biases that check-model called aligned)."""
    res = _cli("init-model", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--out",
               str(tmp_path / "m"), *overrides, cwd=tmp_path)
    _one_line_refusal(res, expected)
    assert not (tmp_path / "m").exists()
