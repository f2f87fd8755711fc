"""Rotary settings from a HF config, in either transformers layout (>= 5: ``rope_parameters``;
older: a top-level ``rope_theta`` and ``rope_scaling``)."""
from __future__ import annotations

from moe_rl.errors import ConfigError


def rope_table(hf: dict) -> tuple[dict, dict]:
    """(rope_parameters, rope_scaling) of either transformers layout, checked to be mappings."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters: expected a mapping, got {params!r}")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected a mapping or null, got {scaling!r}")
    return dict(params or {}), dict(scaling or {})


def rope_settings(hf: dict) -> tuple[float, float]:
    """(rotary base theta, rotary fraction). Only the default rotary type is built; a scaled one
    (linear, dynamic, YaRN, llama3, ...) is refused naming the field, since a silently unscaled
    rotary is another model."""
    params, scaling = rope_table(hf)
    for field, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"{field}.rope_type: {kind!r} rotary scaling is not supported by the "
                             f"trainer's model builder (only 'default'); the engine would run a "
                             f"different position encoding")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(fraction)


def gpt_rotary(hf: dict) -> dict:
    """The GPTModel's rotary embedding for standard attention (RoPE at the config's base)."""
    theta, fraction = rope_settings(hf)
    if theta != int(theta):
        raise ValueError(f"rope_theta: megatron-core takes an integer rotary base, got {theta}")
    return dict(position_embedding_type="rope", rotary_base=int(theta), rotary_percent=fraction)


def check_tiny_partial_rotary(init) -> None:
    """model.init.glm.partial_rotary_factor of a tiny model: an even, non-zero number of each
    head's dimensions (GLM-4.5's and MiniMax-M2's)."""
    rotary = init.head_dim * init.glm.partial_rotary_factor
    if rotary != int(rotary) or int(rotary) % 2 or not rotary:
        raise ConfigError(f"model.init.glm.partial_rotary_factor: head_dim x it must be an even "
                          f"number of dimensions, got {init.head_dim} x "
                          f"{init.glm.partial_rotary_factor} = {rotary:g}")
