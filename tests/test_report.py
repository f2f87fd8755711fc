"""The report command renders plots and a summary from a short real run's TensorBoard events."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from moe_rl.metrics_log import MetricsLogger
from moe_rl.report import degradation_step, make_report

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
