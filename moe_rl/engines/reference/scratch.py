"""The reference engine's scratch directories: one per engine process, named after its pid
and marked as moe_rl's; a later start removes those a killed process left (only this user's,
only marked ones, only of dead owners)."""
from __future__ import annotations

import os
import re
import tempfile

import psutil

from moe_rl.owned_dirs import claim, remove_owned

ENGINE_SCRATCH_PREFIX = "moe_rl_engine_"
_SCRATCH_NAME = re.compile(re.escape(ENGINE_SCRATCH_PREFIX) + r"(\d+)_")


def engine_scratch() -> tempfile.TemporaryDirectory:
    """A scratch directory for one engine process, named after its pid and marked as moe_rl's
    (removed at exit; if the process is killed, :func:`sweep_engine_scratch` removes it at a
    later start)."""
    scratch = tempfile.TemporaryDirectory(prefix=f"{ENGINE_SCRATCH_PREFIX}{os.getpid()}_")
    claim(scratch.name)
    return scratch


def sweep_engine_scratch(root: str | None = None) -> list[str]:
    """Remove the scratch directories under ``root`` (the temp dir) whose owner is dead, that
    belong to this user and that moe_rl marked; returns the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        match = _SCRATCH_NAME.match(name)
        path = os.path.join(root, name)
        if not match or psutil.pid_exists(int(match.group(1))):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        if remove_owned(path):
            removed.append(path)
    return removed
