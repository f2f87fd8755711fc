"""StepProgress: lines on stdout when the console is not a terminal (every log_interval steps
and the last), a tqdm bar on stderr when it is, nothing when disabled; the ETA from the
measured step time."""
import re

from moe_rl.outputs.metrics_log import StepProgress, _duration, step_fields


def test_lines_when_not_a_terminal_every_interval_and_the_last(capsys):
    bar = StepProgress(7, "RL step", interval=3, first=1, tty=False)
    for k in range(6):
        bar.update({"reward": f"{0.1 * k:.3f}"})
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["RL step 3/7", "RL step 6/7",
                                                        "RL step 7/7"]
    assert re.fullmatch(r"RL step 3/7 \| reward 0\.100 \| \d+\.\d s/step \| ETA \d+s", lines[0])
    assert lines[-1].endswith("ETA 0s")


def test_a_bar_on_a_terminal_and_nothing_when_disabled(capsys):
    bar = StepProgress(2, "warm start", tty=True)
    bar.update({"loss": "1.000"})
    bar.close()
    out = capsys.readouterr()
    assert out.out == "" and "warm start" in out.err
    off = StepProgress(2, "warm start", enabled=False, tty=False)
    off.update({"loss": "1.000"})
    off.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_fields_and_durations():
    assert step_fields({"reward/mean": 0.5, "mismatch/k3": 1.234e-5, "routing/agreement": 1.0,
                        "grad_norm": 3.0}) == {"reward": "0.500", "k3": "1.23e-05",
                                               "agreement": "1.0000"}
    assert step_fields({"reward/mean": float("nan")}) == {}
    assert [_duration(s) for s in (0.4, 59, 61, 3600 + 120)] == ["0s", "59s", "1m01s", "1h02m"]
