"""How long a starting or restarted engine server may take to answer /health
(``rollout.startup_timeout_s``, else ``rollout.health_timeout_s``); the real SGLang's chaos run
(tests/loop/test_sglang.py) starts two servers side by side under a 60-s health timeout with a
300-s start-up wait."""
import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.orchestration.workers import startup_timeout


def test_a_start_waits_the_startup_timeout_else_the_health_timeout():
    assert startup_timeout(load_config(None, ["rollout.health_timeout_s=60"])) == 60.0
    cfg = load_config(None, ["rollout.health_timeout_s=60", "rollout.startup_timeout_s=300"])
    assert startup_timeout(cfg) == 300.0


def test_a_zero_startup_timeout_is_refused():
    with pytest.raises(ConfigError, match="rollout.startup_timeout_s"):
        load_config(None, ["rollout.startup_timeout_s=0"])
