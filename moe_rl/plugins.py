"""Loading user code named in the configuration (``module:name``), with errors naming the key."""
from __future__ import annotations

import asyncio
import importlib
import io
import os
import queue
import sys
import threading


def import_user_module(module: str):
    """``module`` imported, from the directory moe-rl runs from too: that directory is on the
    import path of the run's Ray actors (and of ``python -m moe_rl.cli``), but not of the
    ``moe-rl`` console script's own process, which checks the configuration's user code first.
    It is added (last, so no installed package is shadowed) only when the module is found
    nowhere else."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != module.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError:
            sys.path.remove(here)
            raise


def load_named(spec: str, key: str, builtin: dict, form: str):
    """A built-in entry of ``builtin`` (an object, or a ``module:name`` string resolved in turn)
    or ``module:name`` imported; ValueError naming ``key`` otherwise (``form`` says what the
    key takes, e.g. "module:function")."""
    target = builtin.get(spec, spec)
    if not isinstance(target, str):
        return target
    if ":" not in target:
        raise ValueError(f"{key}: expected one of {sorted(builtin)} or {form}, got {spec!r}")
    module, name = target.split(":", 1)
    try:
        return getattr(import_user_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}: cannot load {spec!r}: {exc}") from None


class PluginTimeout(Exception):
    """User code (a reward function, an environment) did not return within its bound."""


class PluginExit(Exception):
    """User code raised what is not an Exception (``sys.exit``, KeyboardInterrupt, a
    BaseException): handed to the caller as an ordinary error, never as an exit."""


def reopen_std_streams() -> None:
    """User code that closed ``sys.stdout`` or ``sys.stderr`` (the process's file descriptors
    stay open beneath them) gets them back, so the run's next line is not its end."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None or stream.closed:
            try:
                setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                                    line_buffering=True, errors="replace"))
            except OSError:   # the descriptor itself was closed: nowhere to write
                setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))


def _start_daemon(fn, args, deliver) -> None:
    """Run ``fn(*args)`` on a daemon thread (one that never returns cannot hold up the
    process's exit) and hand ``deliver`` (ok, result-or-exception; a BaseException that is not
    an Exception comes as :class:`PluginExit`)."""

    def target():
        try:
            result = fn(*args)
        except Exception as exc:   # noqa: BLE001 - handed to the caller as it is
            deliver(False, exc)
            return
        except BaseException as exc:   # noqa: BLE001 - sys.exit in user code ends nothing
            deliver(False, PluginExit(f"{type(exc).__name__}({exc})"))
            return
        finally:
            reopen_std_streams()
        deliver(True, result)
    threading.Thread(target=target, daemon=True, name="plugin-call").start()


def call_bounded(fn, *args, timeout_s: float):
    """``fn(*args)``, or PluginTimeout when it has not returned after ``timeout_s`` seconds
    (the call is abandoned on its thread); its own exceptions are raised here."""
    box: queue.Queue = queue.Queue(maxsize=1)
    _start_daemon(fn, args, lambda ok, value: box.put((ok, value)))
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise PluginTimeout(f"did not return within {timeout_s:g} s") from None
    if not ok:
        raise value
    return value


async def call_bounded_async(fn, *args, timeout_s: float):
    """:func:`call_bounded` for a coroutine: the event loop runs on meanwhile."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(ok, value):
        def settle():
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:   # the loop is gone: nobody waits for this call any more
            pass
    _start_daemon(fn, args, deliver)
    try:
        return await asyncio.wait_for(fut, timeout_s)
    except asyncio.TimeoutError:
        raise PluginTimeout(f"did not return within {timeout_s:g} s") from None
