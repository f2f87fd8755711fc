"""How long a starting or restarted engine server may take to answer /health
(``rollout.servers.startup_timeout_s``, else ``rollout.servers.health_timeout_s``); the real SGLang's chaos run
(tests/loop/test_sglang.py) starts two servers side by side under a 60-s health timeout with a
300-s start-up wait."""
import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.orchestration.engine_host import startup_timeout


def test_a_start_waits_the_startup_timeout_else_the_health_timeout():
    cfg = load_config(None, ["rollout.servers.health_timeout_s=60"])
    assert startup_timeout(cfg.rollout.servers) == 60.0
    cfg = load_config(None, ["rollout.servers.health_timeout_s=60",
                             "rollout.servers.startup_timeout_s=300"])
    assert startup_timeout(cfg.rollout.servers) == 300.0


def test_a_zero_startup_timeout_is_refused():
    with pytest.raises(ConfigError, match="rollout.servers.startup_timeout_s"):
        load_config(None, ["rollout.servers.startup_timeout_s=0"])


HOST_WORK = """
import sys
from moe_rl.config import load_config
from moe_rl.engines.factory import engine_kind
from moe_rl.orchestration import engine_host
from moe_rl.orchestration.placement import PlannedProcess, engine_command
for engine in ("reference", "sglang"):
    cfg = load_config(None, [f"rollout.engine={engine}", "rollout.sglang.device=cpu"])
    proc = PlannedProcess(role="engine", index=0, node=0, gpus=[], host="127.0.0.1", port=30000)
    argv, env = engine_command(cfg, proc, "/models/m")
    engine_kind(cfg).server_process(argv, env, proc.host, proc.port, "/tmp/engine.log")
    assert "--port" in argv, argv
print(sorted(m for m in ("torch", "transformers", "moe_rl.rollout_record") if m in sys.modules))
"""


def test_the_engine_host_starts_a_server_without_importing_torch():
    """The Ray actor that launches each engine server (one per server on every run) builds
    the server's command and process without torch: a few seconds of CPU each on 2 cores."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", HOST_WORK], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout
