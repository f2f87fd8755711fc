"""Helper for the Slurm launcher: wait until Ray reports every node and GPU.

``python -m moe_rl.launch_tools wait --address H:P --nodes N --gpus G --timeout S`` polls Ray.
"""
from __future__ import annotations

import argparse
import sys
import time


def wait_for_cluster(address: str, nodes: int, gpus: int, timeout: float) -> None:
    """Poll Ray until ``nodes`` alive nodes and ``gpus`` GPUs are registered (no fixed sleeps);
    SystemExit naming what is missing after ``timeout`` seconds."""
    import ray
    deadline = time.monotonic() + timeout
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            have = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in alive)
            if len(alive) >= nodes and have >= gpus:
                print(f"ray cluster ready: {len(alive)} nodes "
                      f"({', '.join(sorted(n['NodeManagerAddress'] for n in alive))}), {have} GPUs")
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
    w = sub.add_parser("wait", help="wait until Ray reports NODES nodes and GPUS GPUs")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    wait_for_cluster(args.address, args.nodes, args.gpus, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
