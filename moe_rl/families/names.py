"""HF tensor names more than one family uses."""
from __future__ import annotations


def gated_mlp_expert_names(prefix: str, block: str = "mlp", gate: str = "gate_proj",
                           up: str = "up_proj", down: str = "down_proj") -> dict:
    """One expert's rows of the megatron -> HF name table when each expert has its own gate /
    up / down projections under ``prefix + block + ".experts.{e}."`` (``{e}``: the expert's
    global index, filled by :mod:`moe_rl.weights.hf`)."""
    x = f"{prefix}{block}.experts.{{e}}."
    return {"linear_fc1.weight": ("cat", [f"{x}{gate}.weight", f"{x}{up}.weight"]),
            "linear_fc2.weight": ("copy", [f"{x}{down}.weight"])}
