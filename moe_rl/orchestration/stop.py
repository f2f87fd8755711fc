"""Clean stops of a run on a signal. SIGINT (Ctrl-C), SIGTERM (Slurm's preemption and
``scancel``) and SIGUSR1 (``sbatch --signal``) ask the loop to stop after the current step and
to checkpoint that step (nothing since the last save is lost).
The step and its checkpoint get ``trainer.checkpoint.stop_grace_s`` seconds; past them, or on a
second signal, the step is abandoned (nothing more is saved). During the run's start-up (engines
loading, the trainer built, the warm start) there is no step to finish: the first signal ends
it at once. The run then stops its engines and Ray and ``moe-rl`` prints one line: where the
last checkpoint is and the command that resumes."""
from __future__ import annotations

import signal
import sys
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Abandoned(BaseException):
    """The current step is given up (a second signal, or the grace period ran out). A
    BaseException, like KeyboardInterrupt, so that no ``except Exception`` swallows it."""


def abandoned_in(exc: BaseException) -> Abandoned | None:
    """The :class:`Abandoned` behind ``exc``, if any: raised while Ray's C code runs Python (in
    ``ray.get``), the handler's exception can come out wrapped, e.g. as a SystemError whose
    cause it is."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Abandoned):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class RunStopped(Exception):
    """The run stopped on a signal, cleanly: ``message`` says where the last checkpoint is and
    how to resume; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """While active (``with StopRequest(grace_s):`` in the main thread), the handled signals set
    :attr:`signum` instead of killing the process; the loop looks at it between steps. Outside
    the main thread (a library caller's worker thread) nothing is installed."""

    STARTUP = "during start-up"   # what an Abandoned raised before the first step says

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.starting = False   # the run's start-up: a signal abandons it at once
        self._previous: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_clock()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def stop_clock(self) -> None:
        """No more abandoning: the step (and its checkpoint) is over, or the run is stopping."""
        if self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def closing(self) -> None:
        """The run is stopping its engines and Ray: the grace no longer runs out and a further
        signal is only acknowledged (the stop is already bounded)."""
        self.stop_clock()
        self._closing = True

    _closing = False

    def _on_signal(self, signum, frame) -> None:
        if self._closing:
            print(f"{signal.Signals(signum).name}: already stopping the engines and Ray",
                  file=sys.stderr, flush=True)
            if self.signum is None:
                self.signum = signum
            return
        if self.signum is not None:
            raise Abandoned(f"a second {signal.Signals(signum).name}")
        self.signum = signum
        if self.starting:   # the start-up's waits see it (check_startup) and end it
            print(f"{self.name}: stopping the start-up (no step has run yet)", file=sys.stderr,
                  flush=True)
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)
            return
        print(f"{self.name}: finishing the current step (at most {self.grace_s:g} s, "
              f"trainer.checkpoint.stop_grace_s), then checkpoint it, stop; send it again to "
              f"abandon the step now",
              file=sys.stderr, flush=True)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def check_startup(self) -> None:
        """During the start-up, once a stop signal came: Abandoned (the start-up's waits call
        it between short waits; an exception raised by the handler inside Ray's C code can be
        lost there)."""
        if self.starting and self.signum is not None:
            raise Abandoned(self.STARTUP)

    def _on_alarm(self, signum, frame) -> None:
        raise Abandoned(f"the grace period of {self.grace_s:g} s "
                        f"(trainer.checkpoint.stop_grace_s) ran out")
