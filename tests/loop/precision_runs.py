"""What the precision runs through `moe-rl train` share (tests/loop/test_bf16.py,
tests/loop/test_fp16.py): the tiny CPU model, a work directory per run, its metrics and weights,
and the whole-versus-resumed pair of runs."""
import json
import pathlib

from safetensors.torch import load_file

from tests.helpers import init_tiny_model
from tests.helpers import WALL_CLOCK, train_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
WEIGHTS_ONLY = {"token_tis", "seq_tis", "snis"}   # reweight; is/* shows them


def write_tiny_cpu_model(tmp_path_factory):
    """The tiny CPU config's model, written once for a module."""
    out = tmp_path_factory.mktemp("precision_model") / "model"
    init_tiny_model(str(out))
    return out


def workdir(tmp_path, model_dir, name):
    work = tmp_path / name
    work.mkdir()
    (work / "model").symlink_to(model_dir)
    return work


def rows_of(work):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)}
            for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]


def weights_in(folder):
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def whole_and_resumed(tmp_path, model_dir, *overrides):
    """Four deterministic steps in one go ("whole") and two, a stop and `--resume` for two more
    ("parts"): the two work directories."""
    det = ("rollout.sglang.deterministic_inference=true", *overrides)
    whole = workdir(tmp_path, model_dir, "whole")
    train_cli(whole, 4, *det)
    parts = workdir(tmp_path, model_dir, "parts")
    train_cli(parts, 2, *det)
    train_cli(parts, 4, *det, resume=True)
    return whole, parts
