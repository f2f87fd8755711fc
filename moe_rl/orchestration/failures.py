"""A run that lost one of its processes (a node died, an actor crashed): one line saying what
was lost, where the last complete checkpoint is and how to go on, instead of Ray's traceback."""
from __future__ import annotations

from moe_rl.errors import first_line


def last_line(exc: BaseException) -> str:
    """The last non-blank line of ``exc``'s message: for an actor whose ``__init__`` raised,
    Ray's message ends with that error ("RuntimeError: ...") under its traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else ""


class RunFailed(Exception):
    """The run cannot go on (``moe-rl train`` exits 1 with this message); a requeued or
    relaunched ``--resume`` continues from the checkpoint the message names."""


def lost_process(exc: BaseException) -> str | None:
    """``exc`` (or the cause a Ray task error carries) as "what was lost" when it says a Ray
    actor, worker, node or object went away; None for any other error (a bug keeps its
    traceback)."""
    from ray import exceptions as rx
    lost = (rx.RayActorError, rx.NodeDiedError, rx.ObjectLostError, rx.WorkerCrashedError)
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, lost):
            first = first_line(exc)
            said = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            if getattr(exc, "actor_init_failed", False):   # the error its __init__ raised
                said += f"; it said: {last_line(exc)}"
            return said
        exc = getattr(exc, "cause", None) if isinstance(exc, rx.RayTaskError) else None
        seen += 1
    return None
