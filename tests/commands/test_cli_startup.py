"""`moe-rl --help` and `moe-rl config` stay quick: building the command line and printing a
resolved config import none of the heavy libraries (times are measured in
benchmarks/cli_startup.py, never asserted here)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ["torch", "transformers", "ray", "fastapi", "megatron", "matplotlib", "numpy",
         "tensorboard", "safetensors", "pyarrow"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return {m.split(".")[0] for m in out.split()}


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["serve-reference", "--help"],
                                  ["init-model", "--help"], ["report", "--help"],
                                  ["check-model", "--help"],
                                  ["config", "--config", "configs/tiny_cpu.yaml", "--no-inputs"]])
def test_no_heavy_import_before_work(argv):
    code = ("import contextlib, io\nfrom moe_rl import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            f"        cli.main({argv!r})\n"
            "    except SystemExit:\n"
            "        pass")
    loaded = _modules_after(code) & set(HEAVY)
    assert not loaded, f"moe-rl {' '.join(argv)} imported {sorted(loaded)}"


def test_heavy_imports_are_seen():
    """The probe itself can fail: loading the server that `serve-reference` runs is seen."""
    assert {"torch", "fastapi"} <= _modules_after("import moe_rl.engines.reference.server")
