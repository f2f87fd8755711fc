"""The locks of the tested versions (`make lock`): each inside setup.py's ranges, the one of the
running Python the environment the tests run in, and the "tested" lines of README and the
manual the locks' own versions."""
import importlib.util
import re
import sys

import pytest
from packaging.requirements import Requirement

from tests.helpers import ROOT, setup_lists

LOCKS = {"cpu": "constraints-py311-cpu.txt", "upstream": "constraints-py312-upstream.txt",
         "gpu": "constraints-gpu.txt"}
# the locked set of the Python running the tests (the targets install with it)
RUNNING_LOCK = {(3, 11): "cpu", (3, 12): "upstream"}.get(sys.version_info[:2])
_spec = importlib.util.spec_from_file_location("lock", ROOT / ".ci" / "lock.py")
lock_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_tool)


def lock(kind: str) -> dict[str, str]:
    return lock_tool.read_lock(str(ROOT / LOCKS[kind]))


def makefile_value(name: str) -> str:
    return re.search(rf"^{name} \??:?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def locked_set(kind: str) -> dict[str, str]:
    """The lock with torch, which the Makefile installs by itself."""
    pins = lock(kind)
    if kind == "cpu":
        pins["torch"] = makefile_value("TORCH_VERSION")
    elif kind == "upstream":
        for pin in makefile_value("UPSTREAM_PINS").split():
            name, version = pin.split("==")
            pins[lock_tool.normalise(name)] = version
    return pins


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_every_locked_version_lies_in_setup_pys_ranges(kind):
    lists = setup_lists()
    reqs = [Requirement(r) for r in [*lists["install_requires"],
                                     *(r for v in lists["extras_require"].values() for r in v)]]
    pins = locked_set(kind)
    assert pins, kind
    for req in reqs:
        name = lock_tool.normalise(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"{LOCKS[kind]}: {name} {pins[name]} outside setup.py's {req.specifier}"


def test_the_makefile_installs_every_target_with_its_lock():
    """Every install of the project holds to its Python's lock, but the canary's and
    `make lock`'s own (the newest versions setup.py allows)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    installs = [ln for ln in text.splitlines() if 'pip install --quiet -e ".[' in ln]
    locked = [ln for ln in installs if "NEWEST_VENV" not in ln and "LOCK_VENV" not in ln]
    assert len(installs) == 7 and len(locked) == 4, installs
    for line in locked:
        want = "-c $(LOCK_UPSTREAM)" if "$(UPSTREAM_PINS)" in line else "-c $(LOCK_CPU)"
        assert want in line, line


@pytest.mark.skipif(RUNNING_LOCK is None, reason="no lock for this Python")
def test_the_environment_under_test_is_its_lock():
    """What `make test` (3.11) or `make test-upstream` (3.12) runs in is what the lock says."""
    pins = locked_set(RUNNING_LOCK)
    have = lock_tool.installed(sys.executable)   # a fresh interpreter: site-packages alone
    off = [f"{name} {have[name]} (locked {version})" for name, version in sorted(pins.items())
           if name in have and have[name].split("+")[0] != version.split("+")[0]]
    assert off == [], "the environment differs from its lock (make setup reinstalls it)"


def _tested_line(page: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index("Tested (the locks")
    return " ".join(text[start:text.index("(`make test-upstream`", start)].split())


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_tested_lines_name_the_locked_versions(page):
    line = _tested_line(page)
    cpu, upstream = line.split("Python 3.12")
    for part, kind in ((cpu, "cpu"), (upstream, "upstream")):
        named = re.findall(r"(megatron-core|torch|transformers|Ray) (\d[\w.]*\d)", part)
        assert {n for n, _ in named} == {"megatron-core", "torch", "transformers", "Ray"}, part
        pins = locked_set(kind)
        for name, version in named:
            assert pins[lock_tool.normalise(name)] == version, f"{page}: {name} {version} " \
                f"({LOCKS[kind]}: {pins[lock_tool.normalise(name)]})"


def test_the_gpu_matrix_of_the_manual_is_the_gpu_lock():
    text = (ROOT / "docs" / "install.md").read_text()
    rows = dict(re.findall(r"^\| (SGLang|torch|transformers|megatron-core) \| ([\d.]+) \|", text,
                           re.M))
    assert {lock_tool.normalise(k): v for k, v in rows.items()} == lock("gpu")


def test_the_canary_names_what_moved(tmp_path):
    """.ci/lock.py newer: every package at another version than the lock, and the new ones."""
    pinned = tmp_path / "lock.txt"
    here = lock_tool.installed(sys.executable)
    pins = {n: v for n, v in here.items() if not lock_tool.UNLOCKED.match(n)}
    moved = sorted(pins)[0]
    pins[moved] = "0.0.1"
    dropped = sorted(pins)[1]
    del pins[dropped]
    lock_tool.write_lock(str(pinned), "t", pins)
    assert lock_tool.read_lock(str(pinned)) == pins
    said = lock_tool.moved_packages(sys.executable, str(pinned))
    assert said == [f"{moved} 0.0.1 -> {here[moved]}", f"{dropped} {here[dropped]} (new)"]
