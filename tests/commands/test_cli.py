"""The moe-rl command line: --help of every command, convert round trip, config errors."""
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from moe_rl.cli import COMMANDS, parse_args
from tests.helpers import write_tiny_qwen


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as info:
            parse_args([name, "--help"])
        assert info.value.code == 0
        assert "usage: moe-rl " + name in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["train", "--config", "tiny_cpu", "logging.dir=runs/a", "--resume", "trainer.steps=101"],
     {"resume": True, "overrides": ["logging.dir=runs/a", "trainer.steps=101"]}),
    (["train", "a=1", "--overwrite", "b=2", "--config", "c", "d=3"],
     {"overwrite": True, "config": "c", "overrides": ["a=1", "b=2", "d=3"]}),
    (["eval", "--config", "tiny_math_cpu", "eval.n=2", "--hf", "DIR", "eval.pass_k=[2]"],
     {"hf": "DIR", "overrides": ["eval.n=2", "eval.pass_k=[2]"]}),
    (["plan", "cluster.nodes=2", "--config", "qwen3_30b_a3b", "cluster.gpus_per_node=8"],
     {"overrides": ["cluster.nodes=2", "cluster.gpus_per_node=8"]}),
])
def test_overrides_and_flags_in_any_order(argv, expected):
    args = parse_args(argv)
    assert args.command == argv[0]
    for key, value in expected.items():
        assert getattr(args, key) == value


def test_an_unknown_flag_is_still_refused(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["train", "--config", "tiny_cpu", "a=1", "--bogus"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["trian"])
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_convert_round_trip_is_bit_identical(tmp_path):
    src = tmp_path / "hf"
    write_tiny_qwen(src, seed=31)
    run = lambda *a: subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", *a],
                                    check=True, capture_output=True, text=True, timeout=300)
    run("--to", "megatron", "--hf", str(src), "--out", str(tmp_path / "m.pt"))
    run("--to", "hf", "--hf", str(src), "--megatron", str(tmp_path / "m.pt"),
        "--out", str(tmp_path / "back"))
    a = load_file(src / "model.safetensors")
    b = load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(a[k].equal(b[k]) for k in a)


def test_train_reports_config_errors():
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config",
                          "configs/tiny_cpu.yaml", "algorithm.replay=r5"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "algorithm.replay: expected one of" in out.stderr
    assert out.stdout == ""   # errors go to stderr


class _Payload:
    """Unpickling this runs code (writes a marker file): what weights_only=True refuses."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_files_cannot_run_code(tmp_path):
    import torch
    src = tmp_path / "hf"
    write_tiny_qwen(src, seed=31)
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.pt"
    torch.save({"model": _Payload(str(marker))}, crafted)
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf", "--hf",
                          str(src), "--megatron", str(crafted), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and not marker.exists()
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.config import config_from_dict
    init_distributed()
    init_model_parallel()
    trainer = PolicyTrainer(config_from_dict({"model": {"path": str(src)}}), str(src))
    crafted_ckpt = tmp_path / "ckpt"   # a checkpoint whose per-rank file is the payload
    crafted_ckpt.mkdir()
    (crafted_ckpt / "rank0.pt").write_bytes(crafted.read_bytes())
    with pytest.raises(Exception, match="Weights only load failed"):
        trainer.load_checkpoint(str(crafted_ckpt))
    assert not marker.exists()


def test_config_get_prints_one_resolved_value_for_scripts(capsys):
    from moe_rl import cli
    assert cli.main(["config", "--config", "tiny_cpu", "--get", "logging.dir",
                     "logging.dir=/shared/runs/x"]) == 0
    assert capsys.readouterr().out == "/shared/runs/x\n"
    assert cli.main(["config", "--get", "cluster.ray_address"]) == 0
    assert capsys.readouterr().out == "null\n"
    assert cli.main(["config", "--get", "logging.progress"]) == 0
    assert capsys.readouterr().out == "true\n"
    assert cli.main(["config", "--get", "logging"]) == 2
    assert "'logging' is a section" in capsys.readouterr().err
    assert cli.main(["config", "--get", "trainer.nope"]) == 2
    assert "--get: unknown key 'trainer.nope'" in capsys.readouterr().err


def test_config_output_into_a_closed_pipe_ends_quietly():
    res = subprocess.run(["bash", "-c", f"'{sys.executable}' -m moe_rl.cli config --keys | head -2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("| key | type |")
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


def test_config_says_what_it_checked_and_warns_of_characters_the_tokenizer_lacks(tmp_path):
    """`moe-rl config` ends with one line on stderr naming what it checked (stdout stays the
    YAML alone); prompts with characters the tiny character tokenizer maps to <|unk|> are
    named with the row and the characters (`train` prints the same warning)."""
    import yaml
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    model = tmp_path / "model"
    write_tiny_model(ModelInitConfig(seed=1), str(model))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "3$ + 4@ ~é=", "answer": "7"}\n')
    base = [sys.executable, "-m", "moe_rl.cli", "config", "--config", "tiny_cpu",
            f"model.path={model}"]
    res = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["model"]["path"] == str(model)
    assert res.stderr.strip() == (f"inputs checked: model {model} (tokenizer loads), 100 training "
                                  f"prompts, data.reward: toy; every prompt fits the context")
    res = subprocess.run(base + ["data.source=jsonl", f"data.path={data}"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    warning = res.stderr.splitlines()[0]
    assert warning.startswith("warning: the tokenizer of model.path maps characters of 1 "
                              "training prompt(s), first row 1 ('$' '@' '~' 'é') to '<|unk|>'")


def test_every_argument_of_every_command_is_described():
    """`moe-rl COMMAND --help` describes each flag and positional (key.sub=value included)."""
    from moe_rl.cli import build_parser
    _, commands = build_parser()
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in commands.items()
               for a in p._actions if a.dest != "help" and not (a.help or "").strip()]
    assert not missing, missing


def test_train_refuses_an_allowed_change_of_a_key_that_does_not_exist(tmp_path, capsys):
    """`moe-rl train --resume --allow-change KEY` with a misspelt KEY: one line naming it,
    exit 2, before anything starts (the CLI's entry point, in this process)."""
    from moe_rl.cli import main
    from tests.helpers import ROOT, init_tiny_model
    init_tiny_model(tmp_path / "model")
    capsys.readouterr()   # the model writer's progress
    code = main(["train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
                 f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
                 "--resume", "--allow-change", "trainer.optim.lr,trainer.lrr"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["moe-rl train: --allow-change trainer.lrr: not a config key "
                                 "(see moe-rl config --keys)"], err
    assert not (tmp_path / "run").exists()


def test_train_says_when_the_loss_has_the_other_losss_clip_ranges(tmp_path):
    """`moe-rl train` prints the warning before anything starts (here it then refuses
    --overwrite with --resume: nothing runs)."""
    from tests.helpers import ROOT, init_tiny_model
    init_tiny_model(tmp_path / "model", "tiny_math_cpu.yaml")
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config",
                          str(ROOT / "configs" / "tiny_math_cpu.yaml"),
                          f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
                          "algorithm.loss=gspo", "algorithm.aggregation=seq-mean-token-mean",
                          "--overwrite", "--resume"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 2, res.stderr[-2000:]
    warning, refusal = res.stderr.strip().splitlines()
    assert warning.startswith("warning: algorithm.loss=gspo with algorithm.clip_low/clip_high"
                              " = 0.2/0.28, ranges sized for a token's ratio")
    assert "--overwrite" in refusal and not (tmp_path / "run").exists()
