"""How long `moe-rl` takes before it answers: `--help`, a sub-command's `--help`, `config
--no-inputs` (the resolved config), and `config` with the input checks (tokenizer, data,
reward), each the median of several runs of the console script in a fresh process; the time to
the first line of output is recorded beside the total. The figure that matters is the ratio to
a bare `python -c pass` measured in the same run (these machines are shared and noisy).

Usage: python benchmarks/cli_startup.py
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")


def timed(argv: list[str], cwd: str, repeats: int = 5) -> dict:
    """Median seconds to the first byte of stdout and to exit of ``argv``, over ``repeats``."""
    first, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.read(1)
        first.append(time.perf_counter() - start)
        proc.communicate()
        total.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}")
    return {"first_output_s": statistics.median(first), "total_s": statistics.median(total)}


def main() -> int:
    exe = os.path.join(os.path.dirname(sys.executable), "moe-rl")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([exe, "init-model", "--config", CONFIG, "--out", model], check=True,
                       stdout=subprocess.DEVNULL)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "moe-rl --help": [exe, "--help"],
            "moe-rl train --help": [exe, "train", "--help"],
            "moe-rl config --no-inputs": [exe, "config", "--config", CONFIG, "--no-inputs"],
            "moe-rl config (inputs checked)": [exe, "config", "--config", CONFIG,
                                               f"model.path={model}"],
        }
        res = {name: timed(argv, tmp) for name, argv in cases.items()}
    base = res["python -c pass"]["total_s"]
    for r in res.values():
        r["ratio_to_bare_python"] = r["total_s"] / base
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cli_startup.json").write_text(json.dumps(res, indent=2))
    lines = ["# moe-rl start-up (median of 5 fresh processes)", "",
             f"measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores", "",
             "| command | first output (s) | exit (s) | x bare python |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {r['first_output_s']:.2f} | {r['total_s']:.2f} | "
              f"{r['ratio_to_bare_python']:.1f} |" for name, r in res.items()]
    (RESULTS / "cli_startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
