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
        f"trainer.stop_grace_s), then checkpoint it, stop" in capsys.readouterr().err


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
