"""Peak-memory helpers shared by the benchmarks (Linux /proc on CPU)."""
from __future__ import annotations


def proc_status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the resident-set high-water mark; returns the current resident set (bytes)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return proc_status_bytes("VmRSS")
