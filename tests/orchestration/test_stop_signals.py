"""StopRequest on its own (no Ray): a first signal is recorded (not fatal), each of SIGINT,
SIGTERM and SIGUSR1 asks for a checkpoint of the step, the grace period and a second signal abandon the step,
and the previous handlers come back afterwards."""
import os
import signal
import time

import pytest

from moe_rl.orchestration.stop import Abandoned, RunStopped, StopRequest


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_first_signal_is_recorded_then_the_grace_period_abandons(sig, capsys):
    before = signal.getsignal(sig)
    with StopRequest(grace_s=0.3) as stop:
        os.kill(os.getpid(), sig)
        time.sleep(0.05)
        assert stop.signum == sig
        start = time.monotonic()
        with pytest.raises(Abandoned, match="grace period of 0.3 s"):
            while time.monotonic() - start < 5:
                time.sleep(0.01)
        assert 0.2 < time.monotonic() - start < 2
    assert signal.getsignal(sig) is before
    assert f"{signal.Signals(sig).name}: finishing the current step (at most 0.3 s, " \
        f"trainer.checkpoint.stop_grace_s), then checkpoint it, stop" in capsys.readouterr().err


def test_second_signal_abandons_at_once_and_stop_clock_disarms_the_grace():
    with StopRequest(grace_s=60) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        with pytest.raises(Abandoned, match="a second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    with StopRequest(grace_s=0.2) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        stop.stop_clock()   # the step is over: the grace no longer runs out
        time.sleep(0.4)
        assert stop.signum == signal.SIGTERM


def test_a_signal_during_the_start_up_is_seen_by_its_next_wait(capsys):
    """Start-up: the handler only records the signal (an exception raised inside Ray's C code
    can be lost); the start-up's wait raises Abandoned at its next check. Before the signal,
    and once the start-up is over, the check passes."""
    with StopRequest(grace_s=60) as stop:
        stop.starting = True
        stop.check_startup()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT
        with pytest.raises(Abandoned, match="during start-up"):
            stop.check_startup()
        stop.starting = False
        stop.check_startup()
    assert "SIGINT: stopping the start-up (no step has run yet)" in capsys.readouterr().err


def test_exit_code_is_128_plus_the_signal():
    assert RunStopped("x", signal.SIGTERM).exit_code == 143
    assert RunStopped("x", signal.SIGINT).exit_code == 130


def test_signals_while_closing_are_acknowledged_not_raised(capsys):
    with StopRequest(grace_s=0.1) as stop:
        stop.closing()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)   # no grace clock either
    assert stop.signum == signal.SIGINT
    assert capsys.readouterr().err.count("already stopping the engines and Ray") == 2


def test_an_abandon_wrapped_by_other_code_is_found():
    from moe_rl.orchestration.stop import abandoned_in
    try:
        try:
            raise Abandoned("a second SIGINT")
        except Abandoned as inner:
            raise SystemError("returned a result with an exception set") from inner
    except SystemError as outer:
        assert str(abandoned_in(outer)) == "a second SIGINT"
    assert abandoned_in(ValueError("plain")) is None


def test_a_run_shuts_its_own_ray_down_while_further_signals_are_only_acknowledged(
        monkeypatch, capsys):
    """A second SIGTERM during the stop cut Ray's shutdown at exit (an atexit traceback, two
    Ray agents left): the run shuts down the Ray it started inside its own exit, while the
    closing handler still answers signals; a Ray the caller started is left up."""
    import contextlib
    from types import SimpleNamespace

    from moe_rl.orchestration import run as run_module
    seen = []

    def shutdown():   # a second SIGTERM arrives in the middle of Ray's shutdown
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        seen.append(signal.getsignal(signal.SIGTERM))
    monkeypatch.setattr(run_module.ray, "shutdown", shutdown)
    before = signal.getsignal(signal.SIGTERM)
    for own in (True, False):
        run = run_module.Run.__new__(run_module.Run)
        run.stop, run.engines, run._own_ray = StopRequest(grace_s=5), None, own
        run.logger = SimpleNamespace(close=lambda: None)
        run.reservation = SimpleNamespace(release=lambda: None)
        run._exit = contextlib.ExitStack()
        run._exit.enter_context(run.stop)
        os.kill(os.getpid(), signal.SIGTERM)   # the first: stop after the step
        time.sleep(0.05)
        run.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGTERM) is before
    assert len(seen) == 1 and getattr(seen[0], "__func__", None) is StopRequest._on_signal
    assert "SIGTERM: already stopping the engines and Ray" in capsys.readouterr().err
