"""The CPU reference engine as an engine kind: its server serves on the socket its parent bound
(``--fd``) and speaks SGLang's protocol, so the loop reaches it with SGLang's client, receiver
and senders."""
from __future__ import annotations

from moe_rl.engines.needs import requests_routing
from moe_rl.engines.reference.checks import check_config
from moe_rl.engines.reference.launcher import REFERENCE_ENV, reference_argv
from moe_rl.engines.sglang.kind import SGLangProtocolKind


class ReferenceKind(SGLangProtocolKind):
    """The reference engine: on CPU, one weight-group rank and one port a server."""

    inherits_socket = True

    def describe(self) -> str:
        return f"{self.cfg.rollout.engine_dtype} reference engine"

    def gpus_per_server(self) -> int:
        """None: it runs on CPU."""
        return 0

    def check_config(self) -> None:
        check_config(self.cfg)

    def server_command(self, host, port, gpus, index, model_path):
        """Server ``index`` is seeded ``trainer.seed + index``."""
        r = self.cfg.rollout
        return (reference_argv(model_path, host, port, dtype=r.engine_dtype,
                               seed=self.cfg.trainer.seed + index, api_key=r.servers.api_key,
                               return_routed_experts=requests_routing(self.cfg.algorithm, r),
                               sampling_mask_max_tokens=r.sampling.mask_max_tokens,
                               deterministic_inference=r.sglang.deterministic_inference,
                               # FP8 arrives as an FP8 checkpoint; MXFP4 is quantised at each load
                               quantization="mxfp4" if r.quantization == "mxfp4" else "none",
                               fp32_lm_head=self.cfg.model.fp32_output_layer),
                dict(REFERENCE_ENV))
