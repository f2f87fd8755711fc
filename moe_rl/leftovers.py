"""What a killed process leaves behind, swept at the next start: the reference engines' scratch
directories (named after their owner's pid) and the Ray agents of a local Ray whose driver was
SIGKILLed (its raylet dies with the driver; the agents it started stay, orphaned)."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

ENGINE_SCRATCH_PREFIX = "moe_rl_engine_"
_SCRATCH_NAME = re.compile(re.escape(ENGINE_SCRATCH_PREFIX) + r"(\d+)_")
RAY_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def engine_scratch() -> tempfile.TemporaryDirectory:
    """A scratch directory for one engine process, named after its pid (removed at exit; if the
    process is killed, :func:`sweep_engine_scratch` removes it at a later start)."""
    return tempfile.TemporaryDirectory(prefix=f"{ENGINE_SCRATCH_PREFIX}{os.getpid()}_")


def sweep_engine_scratch(root: str | None = None) -> list[str]:
    """Remove the scratch directories under ``root`` (the temp dir) whose owner is dead and
    that belong to this user; returns the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        match = _SCRATCH_NAME.match(name)
        path = os.path.join(root, name)
        if not match or _alive(int(match.group(1))):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def orphaned_ray_agents() -> list:
    """This user's Ray agent processes whose raylet is gone (psutil processes)."""
    import psutil
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd = proc.info["cmdline"] or []
            if not cmd or cmd[0].strip() not in RAY_AGENT_TITLES or \
                    proc.info["uids"].real != os.getuid():
                continue
            parent = proc.parent()
            if parent is None or os.path.basename(parent.name()) != "raylet":
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def reap_orphaned_ray_agents(timeout: float = 5.0) -> int:
    """Terminate (then kill) the orphaned Ray agents of runs whose driver died; returns how
    many were found."""
    import psutil
    procs = orphaned_ray_agents()
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return len(procs)
