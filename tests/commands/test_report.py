"""The report command renders plots and a summary from a short real run's TensorBoard events."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from moe_rl.outputs.metrics_log import MetricsLogger
from moe_rl.outputs.report import degradation_step, make_report

PNG = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, rewards):
    log = MetricsLogger(str(path))
    for step, r in enumerate(rewards):
        log.log(step, {"reward/mean": r, "mismatch/k3": 0.01 * step, "grad_norm": 1.0 + step,
                       "is/ess": 0.9, "routing/agreement": 0.95, "mismatch/k1": float("nan")})
    log.close()
    return path


def test_degradation_rule():
    steps = np.arange(12)
    assert degradation_step(steps, np.linspace(0, 1, 12)) is None
    crash = np.array([0.1, 0.3, 0.5, 0.7, 0.8, 0.8, 0.8, 0.2, 0.1, 0.0, 0.0, 0.0])
    # 5-step means: .48 .62 .72 .66 .54 .38 -> .38 is .34 below the best (.72): window ends at 9
    assert degradation_step(steps, crash) == 9


def test_report_from_event_files(tmp_path):
    a = _fake_run(tmp_path / "stable", [0.1 * i for i in range(10)])
    b = _fake_run(tmp_path / "crash", [0.5, 0.6, 0.7, 0.8, 0.8, 0.8, 0.1, 0.0, 0.0, 0.0])
    md = make_report([str(a), str(b)], str(tmp_path / "out"))
    text = pathlib.Path(md).read_text()
    assert "## stable" in text and "## crash" in text
    assert "| reward/mean | 0 | 0.9 | 0 | 0.9 | 0.45 |" in text
    # means .68 .74 .64 .50: .50 is .24 below .74, window ending at step 7
    assert "degraded at step: never" in text and "degraded at step: 7" in text
    import matplotlib.image
    images = {}
    for panel in ("reward", "mismatch", "routing_agreement", "ess", "grad_norm"):
        data = (tmp_path / "out" / f"{panel}.png").read_bytes()
        assert data.startswith(PNG)
        images[panel] = matplotlib.image.imread(str(tmp_path / "out" / f"{panel}.png"))
    # real figures, each drawing its own data (no two panels alike)
    assert all(min(img.shape[:2]) >= 300 for img in images.values())
    names = list(images)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            assert images[x].shape != images[y].shape or \
                not np.array_equal(images[x], images[y]), (x, y)
    # non-finite values: null in JSONL, skipped in TensorBoard
    row = json.loads((a / "metrics.jsonl").read_text().splitlines()[0])
    assert row["mismatch/k1"] is None


@pytest.mark.loop
@pytest.mark.e2e
def test_report_command_on_a_real_run(trained_run, tmp_path):
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "report", str(trained_run / "run"),
                          "--out", str(tmp_path / "rep")], check=True, capture_output=True,
                         text=True, timeout=120)
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| routing/agreement |" in text and "| mismatch/k3 |" in text
    assert (tmp_path / "rep" / "reward.png").read_bytes().startswith(PNG)
    assert out.stdout.strip().endswith("report.md")


def _report_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_report_defaults_skips_empty_runs_and_refuses_missing_ones(tmp_path):
    a = _fake_run(tmp_path / "a", [0.1, 0.2, 0.3])
    b = _fake_run(tmp_path / "b", [0.3, 0.2, 0.1])
    empty = tmp_path / "empty"
    empty.mkdir()
    one = _report_cli(str(a), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip() == str(a / "report" / "report.md") and not (tmp_path / "report").exists()
    both = _report_cli(str(a), str(empty), str(b), cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    assert both.stdout.strip() == str(a / "report-vs-empty-b" / "report.md")
    assert f"{empty}: no TensorBoard scalars" in both.stderr and "skipped" in both.stderr
    text = (a / "report-vs-empty-b" / "report.md").read_text()
    assert "## a" in text and "## b" in text and "## empty" not in text
    gone = _report_cli(str(tmp_path / "nowhere"))
    assert gone.returncode == 2 and "no such directory" in gone.stderr and \
        "Traceback" not in gone.stderr and "deleted" not in gone.stderr
    nothing = _report_cli(str(empty))
    assert nothing.returncode == 2 and "holds TensorBoard scalars" in nothing.stderr
    bad = _report_cli(str(a), "--smooth", "1.5")
    assert bad.returncode == 2 and "--smooth" in bad.stderr


def test_mismatch_axes_are_logarithmic_so_float32_and_fp8_runs_both_show():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from moe_rl.outputs.report import _scale
    steps = np.arange(3)
    runs = {"f32": {"mismatch/k3": (steps, np.array([1e-14, 2e-14, 3e-14])),
                    "mismatch/k1": (steps, np.array([-1e-9, 0.0, 2e-9])),
                    "reward/mean": (steps, np.array([0.1, 0.2, 0.3]))},
            "fp8": {"mismatch/k3": (steps, np.array([1e-4, 2e-4, 3e-4]))}}
    scales = {}
    for tag in ("mismatch/k3", "mismatch/k1", "reward/mean"):
        fig, ax = plt.subplots()
        _scale(ax, tag, runs)
        scales[tag] = ax.get_yscale()
        plt.close(fig)
    assert scales == {"mismatch/k3": "log", "mismatch/k1": "symlog", "reward/mean": "linear"}


def test_an_always_zero_series_is_linear_and_a_wide_symlog_axis_has_few_ticks():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from moe_rl.outputs.report import _scale
    steps = np.arange(3)
    runs = {"a": {"mismatch/extreme_frac": (steps, np.zeros(3)),
                  "mismatch/k1": (steps, np.array([-1e-12, 0.0, 3e-2]))}}
    fig, (zero, wide) = plt.subplots(1, 2)
    _scale(zero, "mismatch/extreme_frac", runs)
    _scale(wide, "mismatch/k1", runs)
    wide.plot(steps, runs["a"]["mismatch/k1"][1])
    fig.canvas.draw()
    ticks = [t for t in wide.get_yticks() if wide.get_ylim()[0] <= t <= wide.get_ylim()[1]]
    plt.close(fig)
    assert zero.get_yscale() == "linear" and wide.get_yscale() == "symlog"
    assert 2 <= len(ticks) <= 10, ticks   # 11 decades, not a tick label on each


def test_plots_are_laid_out_in_rows_of_three(tmp_path):
    from matplotlib.image import imread
    run = tmp_path / "evals"
    log = MetricsLogger(str(run))
    for step in range(3):
        log.log(step, {"reward/mean": 0.1 * step, "mismatch/extreme_frac": 0.0,
                       **{f"eval/s{i}/pass@1": 0.1 * i for i in range(6)}})
    log.close()
    make_report([str(run)])
    height, width = imread(run / "report" / "eval.png").shape[:2]
    assert (width, height) == (1500, 700)   # 6 panels: 2 rows of 3, 500 x 350 each
    height, width = imread(run / "report" / "mismatch.png").shape[:2]
    assert (width, height) == (1500, 350)


def test_smoothing_matches_tensorboards_debiased_ema():
    from moe_rl.outputs.report import smooth
    rng = np.random.default_rng(0)
    v = rng.normal(size=40)
    for w in (0.0, 0.6, 0.9):
        ref = np.array([sum(w ** (i - j) * (1 - w) * v[j] for j in range(i + 1)) /
                        (1 - w ** (i + 1)) if w else v[i] for i in range(len(v))],
                       dtype=np.float64)
        np.testing.assert_allclose(smooth(v, w), ref, rtol=1e-12, atol=1e-12)
    assert np.std(np.diff(smooth(v, 0.9))) < np.std(np.diff(v))


def test_eval_metrics_get_their_own_panel(tmp_path):
    run = tmp_path / "with_eval"
    log = MetricsLogger(str(run))
    for step in range(4):
        log.log(step, {"reward/mean": 0.1 * step, "eval/accuracy": 0.2 + 0.1 * step})
    log.close()
    md = make_report([str(run)], smoothing=0.5)
    assert (run / "report" / "eval.png").read_bytes().startswith(PNG)
    assert "| eval/accuracy | 0.2 | 0.5 |" in pathlib.Path(md).read_text()
    plain = _fake_run(tmp_path / "plain", [0.1, 0.2])
    make_report([str(plain)])
    assert not (plain / "report" / "eval.png").exists()


def test_the_eval_plot_shows_success_and_reward_of_every_set_first():
    from moe_rl.outputs.report import eval_panel
    tags = ["eval/time_s"] + [f"eval/{s}/{m}" for s in ("a", "b") for m in
                              ("pass@1", "pass@8", "reward_mean", "response_len_mean",
                               "truncated_frac")]
    assert eval_panel(tags) == ["eval/a/pass@1", "eval/a/reward_mean", "eval/b/pass@1",
                                "eval/b/reward_mean", "eval/a/pass@8", "eval/b/pass@8"]
