"""No folder hides an installed package: the checkout's top level holds no regular package or
module an installed distribution also provides, and every Python process moe_rl starts keeps its
working directory off sys.path (transformers 5.25 imports the PyPI package `kernels`, which the
checkout's `kernels/` hid while it held an `__init__.py`)."""
import os
import pathlib
import subprocess
import sys

from moe_rl.checks.node import check_working_directory
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.engines.sglang.launcher import sglang_env
from moe_rl.safe_path import SAFE_PATH_ENV, importable_names, shadowed_packages

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a folder standing in for PyYAML, which every moe-rl command imports
POISON = "raise ImportError('the folder, not the installed package')\n"


def poisoned(folder: pathlib.Path, name: str = "yaml") -> pathlib.Path:
    (folder / name).mkdir()
    (folder / name / "__init__.py").write_text(POISON)
    return folder


def test_no_top_level_folder_of_the_checkout_hides_an_installed_package():
    assert shadowed_packages(str(ROOT)) == {}
    # kernels/ and configs/ install under other names and are plain folders
    assert "kernels" not in importable_names(str(ROOT))
    assert "configs" not in importable_names(str(ROOT))


def test_the_check_finds_a_package_a_module_and_passes_a_plain_folder(tmp_path):
    poisoned(tmp_path)
    (tmp_path / "tqdm.py").write_text("")
    (tmp_path / "numpy").mkdir()      # no __init__.py: a namespace portion, found last
    found = shadowed_packages(str(tmp_path))
    assert set(found) == {"yaml", "tqdm"}
    assert found["yaml"] == ["PyYAML"] and found["tqdm"] == ["tqdm"]


def test_the_installed_kernels_package_wins_from_the_checkout_root():
    """What failed on 2026-12-03: transformers' modeling_utils from the root, as pytest and
    `python -m` import it (the checkout first on sys.path)."""
    got = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, ''); "
                          "import transformers.modeling_utils, importlib.util as u; "
                          "print(u.find_spec('kernels').origin)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-800:]
    assert not got.stdout.strip().startswith(str(ROOT / "kernels")), got.stdout


def test_every_process_moe_rl_starts_keeps_its_working_directory_off_sys_path(tmp_path):
    """The reference engine's server command, run as its launcher runs it, from a folder that
    holds a `yaml` package: it starts (its help answers); without the launcher's environment
    the folder's yaml is imported and it dies."""
    poisoned(tmp_path)
    argv, env = ReferenceServer("MODEL", 1).command()
    argv = argv[:argv.index("serve-reference") + 1] + ["--help"]
    good = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert good.returncode == 0 and "--model" in good.stdout, good.stderr[-800:]
    bare = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in env.items() if k != "PYTHONSAFEPATH"})
    assert bare.returncode != 0 and "the folder, not the installed package" in bare.stderr
    assert SAFE_PATH_ENV.items() <= sglang_env([], "cpu").items()
    assert SAFE_PATH_ENV.items() <= sglang_env([0], "cuda").items()
    sbatch = (ROOT / "launch" / "slurm_multinode.sbatch").read_text()
    assert "\nexport PYTHONSAFEPATH=1\n" in sbatch


def test_doctor_fails_a_working_directory_that_hides_a_package(tmp_path):
    """Through the console script, from the folder that hides it."""
    poisoned(tmp_path)
    assert check_working_directory(str(ROOT)).status == "ok"
    script = os.path.join(os.path.dirname(sys.executable), "moe-rl")
    got = subprocess.run([script, "doctor", f"logging.dir={tmp_path}/run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 1, got.stdout + got.stderr
    assert f"{tmp_path}/yaml hides the installed yaml (PyYAML)" in got.stdout
    assert "working-directory" in got.stdout.splitlines()[-1]
