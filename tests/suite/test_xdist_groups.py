"""The loop targets hand out single tests but keep a module marked `xdist_group` on one worker
(its servers made once). pytest-xdist 3.8 renames a grouped test through an attribute that
pytest 9 no longer reads, so there every grouped test went anywhere: setup.py holds pytest < 9
until that changes, and this test says when."""
import subprocess
import sys

GROUPED = '''
import os, pytest
pytestmark = pytest.mark.xdist_group("servers")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    print("WORKER", os.environ["PYTEST_XDIST_WORKER"])
'''
SPREAD = '''
import time, pytest
@pytest.mark.parametrize("i", range(6))
def test_spread(i):
    time.sleep(0.2)
'''


def test_a_grouped_module_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_spread.py").write_text(SPREAD)
    res = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", "-v", "-s", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    lines = res.stdout.splitlines()
    grouped = {line.split()[0] for line in lines if "test_grouped" in line and "PASSED" in line}
    spread = {line.split()[0] for line in lines if "test_spread" in line and "PASSED" in line}
    assert len(grouped) == 1, grouped         # e.g. {"[gw0]"}
    assert spread == {"[gw0]", "[gw1]"}, spread
