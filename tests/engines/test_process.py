"""The engine server supervisor: a server that dies at start says why (its log's last error
line) in one line, through `moe-rl train` too, not Ray's traceback."""
import os
import subprocess
import sys

import pytest

from moe_rl.engines.process import ServerExited, ServerProcess, last_error_line
from tests.helpers import ROOT, init_tiny_model

IMPORT_ERROR = "ImportError: cannot import name 'CUDAProperties' from 'kernels'"
DIES = ("import sys; print('Traceback (most recent call last):', file=sys.stderr); "
        f"print({IMPORT_ERROR!r}, file=sys.stderr); print('  ', file=sys.stderr); sys.exit(1)")


class Dies(ServerProcess):
    def command(self, fd=None):
        return [sys.executable, "-c", DIES], dict(os.environ)


def test_the_last_error_line_of_a_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File \"x\", line 1\n"
                   "ValueError: first\nduring handling...\nRuntimeError: the last one\n\n")
    assert last_error_line(str(log)) == "RuntimeError: the last one"
    log.write_text("INFO a\nkilled\n")
    assert last_error_line(str(log)) == "killed"      # no error line: the last line
    assert last_error_line(str(tmp_path / "absent.log")) == "" == last_error_line(None)


def test_a_server_dying_at_start_names_its_error(tmp_path):
    from moe_rl.trainer.parallel import free_port
    server = Dies(free_port(), log_path=str(tmp_path / "engine.log"))
    with pytest.raises(ServerExited) as err:
        server.start(timeout=60)
    assert f"exited with code 1: {IMPORT_ERROR}" in str(err.value)
    assert str(tmp_path / "engine.log") in str(err.value)


@pytest.mark.loop
@pytest.mark.e2e
def test_moe_rl_train_prints_the_engines_error_in_one_line(tmp_path):
    """An SGLang interpreter that dies at import, as SGLang did on 2026-12-03: the console's
    last line is the server's ImportError; no Ray traceback."""
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n{DIES}\n")
    python.chmod(0o755)
    init_tiny_model(tmp_path / "model")
    got = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
         f"logging.dir={tmp_path / 'run'}", "rollout.engine=sglang",
         "rollout.sglang.device=cpu", f"rollout.sglang.python={python}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert got.returncode == 1, got.stderr[-3000:]
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: engine server on port") and IMPORT_ERROR in last
    assert "Traceback" not in got.stderr and "RayTaskError" not in got.stderr
