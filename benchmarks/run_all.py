"""Run every benchmark of the project in turn (``make bench``); each writes benchmarks/results/."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    """Run each benchmark script (a ``benchmarks/*.py`` with a ``__main__`` entry, except this
    one) in a fresh interpreter."""
    scripts = sorted(p for p in HERE.glob("*.py")
                     if p.name != "run_all.py" and "__main__" in p.read_text())
    failed = []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"== {script.name}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(script.name)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
