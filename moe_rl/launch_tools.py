"""Helpers for the Slurm launchers: expand a Slurm hostlist, wait until Ray sees every node/GPU.

``python -m moe_rl.launch_tools expand "gpu[01-03],cpu7"`` prints one host per line;
``python -m moe_rl.launch_tools wait --address H:P --nodes N --gpus G --timeout S`` polls Ray.
"""
from __future__ import annotations

import argparse
import re
import sys
import time


def expand_hostlist(spec: str) -> list[str]:
    """Expand Slurm's compressed hostlist syntax, e.g. ``gpu[01-03,07],login1``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                lo, hi = r.split("-")
                width = len(lo)
                hosts += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{prefix}{r}{suffix}")
    return hosts


def wait_for_cluster(address: str, nodes: int, gpus: int, timeout: float) -> None:
    """Poll Ray until ``nodes`` alive nodes and ``gpus`` GPUs are registered (no fixed sleeps)."""
    import ray
    deadline = time.monotonic() + timeout
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            have = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in alive)
            if len(alive) >= nodes and have >= gpus:
                print(f"ray cluster ready: {len(alive)} nodes, {have} GPUs")
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"ray cluster not ready after {timeout} s: {len(alive)}/{nodes} "
                                 f"nodes, {have}/{gpus} GPUs")
            time.sleep(2)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_rl.launch_tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("expand")
    e.add_argument("hostlist")
    w = sub.add_parser("wait")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.cmd == "expand":
        print("\n".join(expand_hostlist(args.hostlist)))
    else:
        wait_for_cluster(args.address, args.nodes, args.gpus, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
