"""The engine server process supervisor: bind a port and hold it, start a server process on it,
wait for its /health, restart it after a crash, stop it (terminate, then kill). Every engine's
launcher builds on :class:`ServerProcess`."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from abc import ABC, abstractmethod

import httpx

BIND_FAILED = b"error while attempting to bind on address"   # uvicorn's words (Errno 98)
LOG_TAIL_BYTES = 65536   # how much of a dead server's log is read for its last error
# the line a Python traceback ends with ("ImportError: cannot import name ..."), or a logged error
ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)\b|.*\bERROR\b)")


class ServerExited(RuntimeError):
    """An engine server process ended before it answered /health; the message carries its log's
    last error line (the cause, which was only in the log)."""


def last_error_line(log_path: str | None) -> str:
    """The last error line of the end of ``log_path`` (the last non-empty line when none looks
    like an error; "" without a log)."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - LOG_TAIL_BYTES))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ERROR_LINE.match(ln)]
    return (errors or lines or [""])[-1][:500]

def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port) (OSError when the port is taken). It listens at
    once: two sockets merely bound with SO_REUSEADDR could share a port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bind_first_free(host: str, first: int) -> socket.socket:
    """A listening socket on the first port from ``first`` up that ``host`` can bind, held
    (so no concurrent chooser on this address can take the same port)."""
    for port in range(first, 65536):
        try:
            return bind_port(host, port)
        except OSError:
            continue
    raise RuntimeError(f"rollout.servers.base_port: no free port from {first} up on {host}")


class ServerProcess(ABC):
    """One engine server subprocess on ``host:port``, restartable after a crash. With
    ``inherits_socket`` the parent binds the port and hands the socket to the child (``--fd``),
    so no other process can take it between choosing the port and serving on it, and /health
    never answers for a stranger; otherwise the server binds it itself (the port is released just
    before launch)."""

    inherits_socket = True

    def __init__(self, port: int, host: str = "127.0.0.1", api_key: str | None = None,
                 log_path: str | None = None):
        self.port, self.host, self.api_key, self.log_path = port, host, api_key, log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @abstractmethod
    def command(self, fd: int | None = None) -> tuple[list[str], dict]:
        """(argv, environment) of the server process (serving on inherited socket ``fd``)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 120.0, sock: socket.socket | None = None
              ) -> "ServerProcess":
        """Launch the server and wait until /health answers (RuntimeError on timeout/exit);
        ``sock``: the server's port, already bound and held by the caller (closed here)."""
        if sock is None:
            try:
                sock = bind_port(self.host, self.port)
            except OSError as exc:
                raise RuntimeError(f"server port {self.port} on {self.host} is taken: "
                                   f"{exc}") from exc
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            if self.inherits_socket:
                cmd, env = self.command(sock.fileno())
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             pass_fds=(sock.fileno(),))
            else:   # a server that binds by itself: the port is released just before launch
                sock.close()
                cmd, env = self.command()
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            sock.close()
            if log is not subprocess.DEVNULL:
                log.close()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until it answers 200. A server that binds its port itself and finds it
        taken is stopped at once (SGLang does not exit then: uvicorn's exit waits for the
        engine's other threads), not waited for until ``timeout``."""
        deadline = time.monotonic() + timeout
        proc = self.proc
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        log_start = os.path.getsize(self.log_path) if self.log_path and os.path.exists(
            self.log_path) else 0
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:   # stop() from another thread too
                why = last_error_line(self.log_path)
                raise ServerExited(f"engine server on port {self.port} exited with code "
                                   f"{proc.returncode}" + (f": {why}" if why else "")
                                   + f" (log: {self.log_path})")
            if not self.inherits_socket and self._bind_failed(log_start):
                self.stop()
                raise RuntimeError(f"engine server on port {self.port}: another process took "
                                   f"the port between its release and the server's own bind "
                                   f"(log: {self.log_path}); keep rollout.servers.base_port below "
                                   f"this node's ephemeral port range "
                                   f"(/proc/sys/net/ipv4/ip_local_port_range)")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine server on port {self.port} not healthy after {timeout} s")

    def _bind_failed(self, log_start: int) -> bool:
        """Whether the server's log, from byte ``log_start`` on, holds uvicorn's error for a
        port it could not bind."""
        if not self.log_path:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_start)
                return BIND_FAILED in f.read()
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout: float = 120.0) -> None:
        """Stop (if needed) and start again."""
        self.stop()
        self.restarts += 1
        self.start(timeout)

    def stop(self) -> None:
        """Terminate the process (kill after 10 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class CommandServer(ServerProcess):
    """A server started from a given command line and environment (the placement plan's);
    ``inherits_socket``: the engine serves on a socket it inherits (``--fd`` appended)."""

    def __init__(self, argv: list[str], env: dict[str, str], host: str, port: int, *,
                 inherits_socket: bool, api_key: str | None = None,
                 log_path: str | None = None):
        super().__init__(port, host=host, api_key=api_key, log_path=log_path)
        self.argv, self.env, self.inherits_socket = list(argv), dict(env), inherits_socket

    def command(self, fd: int | None = None) -> tuple[list[str], dict]:
        return (self.argv + (["--fd", str(fd)] if fd is not None else []),
            dict(os.environ, **self.env))
