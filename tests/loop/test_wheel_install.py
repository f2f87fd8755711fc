"""moe_rl installed as a regular wheel, away from the source tree: the shipped configs are
package data, `moe-rl init-model` and `moe-rl demo` run from any directory (relative paths land
under it), and a second demo is a run of its own."""
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.helpers import engine_base_port
from tests.helpers import ROOT

pytestmark = pytest.mark.xdist_group("wheel")   # its fixture made once


def _sources(dest: pathlib.Path) -> None:
    """The project's files (tracked, or new and not ignored) copied to ``dest``: the wheel is
    built from what a clone holds, and the build leaves nothing in the checkout."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding the moe_rl wheel alone; its dependencies come from this
    interpreter's site-packages (a .pth line: that folder's own .pth files, this checkout's
    editable install among them, are not read)."""
    tmp = tmp_path_factory.mktemp("wheel")
    _sources(tmp / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp / "dist"), str(tmp / "src")], check=True, timeout=300)
    wheel = next((tmp / "dist").glob("moe_rl-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    py = tmp / "venv" / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                   timeout=300)
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, tmp / "venv" / "bin", work


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_wheel_ships_the_configs_and_runs_outside_the_source_tree(installed):
    wheel, bin_dir, work = installed
    names = zipfile.ZipFile(wheel).namelist()
    for config in ("tiny_cpu.yaml", "tiny_agentic_cpu.yaml", "qwen3_30b_a3b_r3_gspo.yaml"):
        assert f"moe_rl/configs/{config}" in names
    where = subprocess.run([str(bin_dir / "python"), "-c", "import moe_rl; print(moe_rl.__file__)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where and str(ROOT) not in where
    res = subprocess.run([str(bin_dir / "moe-rl"), "init-model", "--config", "tiny_cpu.yaml"],
                         cwd=work, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (work / "outputs" / "tiny_model" / "config.json").is_file()   # relative to the cwd
    # a shipped config with data files: they are found beside it, in the package
    for command in ("init-model", "config"):
        res = subprocess.run([str(bin_dir / "moe-rl"), command, "--config", "tiny_math_cpu"],
                             cwd=work, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    shipped_data = pathlib.Path(where).parent / "configs" / "data"
    assert f"path: {shipped_data / 'tiny_math_train.jsonl'}" in res.stdout
    assert f"path: {shipped_data / 'tiny_math_eval.jsonl'}" in res.stdout
    missing = subprocess.run([str(bin_dir / "moe-rl"), "config", "--config", "nope.yaml"],
                             cwd=work, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "tiny_cpu.yaml" in missing.stderr


@pytest.mark.loop
def test_demo_from_the_wheel_twice_takes_a_fresh_run_directory_each_time(installed):
    _, bin_dir, work = installed
    runs = []
    for _ in range(2):
        res = subprocess.run([str(bin_dir / "moe-rl"), "demo", "trainer.steps=1",
                              "trainer.warmup.steps=0", "trainer.checkpoint.export_hf=false",
                              "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                              f"rollout.servers.base_port={engine_base_port()}"],
                             cwd=work, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        assert "run finished: 1 RL steps" in res.stdout
        runs += [line.split(": ", 1)[1] for line in res.stdout.splitlines()
                 if line.startswith("run directory: ")]
    assert runs == [str(work / "runs" / "tiny_cpu"), str(work / "runs" / "tiny_cpu-2")]
    for run in runs:
        assert len((pathlib.Path(run) / "metrics.jsonl").read_text().splitlines()) == 1
