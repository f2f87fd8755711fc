"""What the configuration refuses for SGLang on CPU because SGLang itself fails there, run on
the real SGLang anyway: the refusal's claim is checked against the failure it names, so a
refusal an SGLang upgrade made needless shows here (then lift it)."""
from __future__ import annotations

import pytest

from moe_rl.config import config_from_dict, load_config
from moe_rl.config.fields import ConfigError
from moe_rl.engines.factory import engine_kind
from tests.helpers import GPT_OSS_INIT, engine_base_port, init_tiny_model, sglang_cpu_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.mark.parametrize("init,refusal,failure", [
    (GPT_OSS_INIT, "cannot serve models with attention sinks",
     "TorchNativeAttnBackend.forward_extend() got an unexpected keyword argument 'sinks'"),
    (("model.init.architecture=minimax_m2",), "cannot serve models whose q/k norm spans",
     "assert x1.is_cuda and x2.is_cuda")], ids=["gpt_oss", "minimax_m2"])
def test_sglang_on_cpu_fails_as_its_refusal_says(tmp_path, init, refusal, failure):
    """The tiny model of `moe-rl init-model`, started on SGLang's CPU path as moe_rl would
    start it: the server exits at its first forward with the failure the refusal names."""
    model = init_tiny_model(tmp_path / "model", "tiny_cpu.yaml", *init)
    python = sglang_cpu_python()
    on_cpu = {"engine": "sglang", "sglang": {"device": "cpu", "python": python}}
    with pytest.raises(ConfigError, match=refusal):
        load_config(None, [f"model.path={model}", "rollout.engine=sglang",
                           "rollout.sglang.device=cpu"])
    # the same server for the tiny Qwen3-MoE's configuration, pointed at the gpt-oss
    cfg = config_from_dict({"model": {"path": str(tmp_path / "absent")},
                            "cluster": {"gpus_per_node": 0}, "rollout": on_cpu})
    sglang, port = engine_kind(cfg), engine_base_port()
    argv, env = sglang.server_command("127.0.0.1", port, [], 0, str(model))
    log = tmp_path / "sglang.log"
    server = sglang.server_process(argv, env, "127.0.0.1", port, str(log))
    with pytest.raises(RuntimeError, match="exited with code"):
        server.start(300)
    server.stop()
    assert failure in log.read_text(errors="replace")
