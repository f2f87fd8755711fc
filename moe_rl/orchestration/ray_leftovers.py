"""What a SIGKILLed moe_rl driver leaves of a local Ray, swept at the next start: the Ray agents
of its session (its raylet dies with the driver; the agents it started stay, orphaned). Only what
can be shown to be a dead moe_rl run's is touched: another program's Ray, or a live run's, never."""
from __future__ import annotations

import json
import os
import re

import psutil

RAY_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
RUN_MARKER = "moe_rl_driver.json"   # in a local Ray's session folder: the run that started it
_SESSION = re.compile(r"(.*/session_[^/]+)/logs/")
_RAYLET_SOCKET = re.compile(r"--raylet_socket_name=(.*/session_[^/]+)/sockets/")


def mark_ray_session(session_dir: str, run_dir: str) -> None:
    """Record in a local Ray's session folder that this process (a moe_rl run) started it: the
    sweep stops that session's agents only once this process is gone."""
    with open(os.path.join(session_dir, RUN_MARKER), "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "run_dir": run_dir}, fh)


def _session_of(proc) -> str | None:
    """The Ray session folder a Ray process writes its logs into."""
    for f in proc.open_files():
        match = _SESSION.match(f.path)
        if match:
            return match.group(1)
    return None


def _live_raylet_sessions() -> set[str]:
    """The session folders of the raylets running on this machine (from their socket paths)."""
    sessions = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.info["name"] != "raylet":
                continue
            for arg in proc.info["cmdline"] or []:
                match = _RAYLET_SOCKET.match(arg)
                if match:
                    sessions.add(match.group(1))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sessions


def orphaned_ray_agents() -> list[tuple[object, dict]]:
    """This user's Ray agent processes that can be shown to be left by a killed moe_rl run:
    their session folder holds the run's marker, the run's driver is gone, and no raylet of
    that session is running. Returns (psutil process, the marker: driver pid, run_dir)."""
    found, live = [], None
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd = proc.info["cmdline"] or []
            if (not cmd or cmd[0].strip() not in RAY_AGENT_TITLES or
                    proc.info["uids"].real != os.getuid()):
                continue
            parent = proc.parent()
            if parent is not None and os.path.basename(parent.name()) == "raylet":
                continue
            session = _session_of(proc)
            marker = os.path.join(session, RUN_MARKER) if session else ""
            if not os.path.isfile(marker):
                continue   # not started by a moe_rl run: never ours to stop
            with open(marker, encoding="utf-8") as fh:
                owner = json.load(fh)
            if psutil.pid_exists(int(owner["pid"])):
                continue
            live = _live_raylet_sessions() if live is None else live
            if session in live:
                continue
            found.append((proc, {**owner, "session": session}))
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, ValueError, KeyError):
            continue
    return found


def reap_orphaned_ray_agents(timeout: float = 5.0) -> list[str]:
    """Terminate (then kill) the Ray agents left by killed moe_rl runs; returns one line per
    killed run saying what was stopped."""
    found = orphaned_ray_agents()
    procs = [p for p, _ in found]
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
    runs: dict[str, list] = {}
    for proc, owner in found:
        runs.setdefault(owner["session"], [owner]).append(proc.pid)
    return [f"stopped {len(v) - 1} Ray agent process(es) (pids {', '.join(map(str, v[1:]))}) "
            f"left by the killed run {v[0]['run_dir']} (driver pid {v[0]['pid']}, Ray session "
            f"{os.path.basename(session)})" for session, v in runs.items()]
