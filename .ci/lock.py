"""The committed locks of the tested versions (pip constraints files) and the canary's report.

  python .ci/lock.py freeze PYTHON OUT TITLE   every distribution PYTHON's environment holds
                                               (moe_rl and the torch build's own packages left
                                               out) as OUT
  python .ci/lock.py gpu SGLANG_PYTHON OUT     the GPU matrix: SGLang's version and its exact pins
                                               (read from its installed metadata), megatron-core's
  python .ci/lock.py newer PYTHON LOCK         what PYTHON's environment holds at another version
                                               than LOCK (the canary names these when it fails)
"""
import json
import re
import subprocess
import sys

# never locked: moe_rl itself; torch and what its build brings (the Makefile installs the CPU
# build on disk, a GPU machine keeps its own CUDA torch, whose triton and nvidia-* pins differ)
UNLOCKED = re.compile(r"^(moe[-_]rl|torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$", re.I)
GPU_MEGATRON = "megatron-core==0.19.2"
GPU_PINNED_BY_SGLANG = ("torch", "transformers")


def installed(python: str) -> dict[str, str]:
    """{normalised name: version} of PYTHON's environment."""
    code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: "
            "d.version for d in m.distributions()}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True,
                         env={"PYTHONSAFEPATH": "1"}).stdout
    return {normalise(k): v for k, v in json.loads(out).items()}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[normalise(name)] = version
    return pins


def write_lock(path: str, title: str, pins: dict[str, str]) -> None:
    with open(path, "w") as f:
        f.write(f"# {title}\n# written by `make lock`; the make targets install with it "
                f"(pip -c). Not locked: moe_rl, torch and its build's own packages.\n")
        for name in sorted(pins):
            f.write(f"{name}=={pins[name]}\n")


def freeze(python: str, out: str, title: str) -> None:
    pins = {n: v for n, v in installed(python).items() if not UNLOCKED.match(n)}
    write_lock(out, title, pins)


def gpu(sglang_python: str, out: str) -> None:
    code = ("import importlib.metadata as m, json; d = m.distribution('sglang'); "
            "print(json.dumps([d.version, d.requires or []]))")
    version, requires = json.loads(subprocess.run(
        [sglang_python, "-c", code], check=True, capture_output=True, text=True,
        env={"PYTHONSAFEPATH": "1"}).stdout)
    pins = {"sglang": version}
    for req in requires:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*==\s*([^;,\s]+)\s*$", req)
        if m and normalise(m.group(1)) in GPU_PINNED_BY_SGLANG:
            pins[normalise(m.group(1))] = m.group(2)
    name, version = GPU_MEGATRON.split("==")
    pins[name] = version
    with open(out, "w") as f:
        f.write("# The GPU matrix of docs/install.md (Python 3.12, CUDA 13): SGLang, the torch and\n"
                "# transformers SGLang pins exactly (read from its metadata), megatron-core.\n"
                "# written by `make lock`; not run here (no GPU): checked against setup.py's "
                "ranges and the docs.\n")
        for n in sorted(pins):
            f.write(f"{n}=={pins[n]}\n")


def moved_packages(python: str, lock: str) -> list[str]:
    """PYTHON's packages at another version than LOCK ("name locked -> installed"), then those
    LOCK does not hold ("name version (new)")."""
    have, pins = installed(python), read_lock(lock)
    moved = [f"{n} {pins[n]} -> {have[n]}" for n in sorted(pins)
             if n in have and have[n] != pins[n]]
    added = [f"{n} {have[n]} (new)" for n in sorted(have)
             if n not in pins and not UNLOCKED.match(n)]
    return moved + added


def newer(python: str, lock: str) -> int:
    print("; ".join(moved_packages(python, lock)) or "none: every package at its locked version")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["freeze"] and len(argv) == 4:
        freeze(*argv[1:])
    elif argv[:1] == ["gpu"] and len(argv) == 3:
        gpu(*argv[1:])
    elif argv[:1] == ["newer"] and len(argv) == 3:
        return newer(*argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
