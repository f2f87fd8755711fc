"""What a family module holds unless it says otherwise (:func:`moe_rl.families.with_defaults`
fills in the names it leaves out): a new trait or hook is added here once, with the value
most families take, and only the families that differ say so in their own module."""
from __future__ import annotations

OTHER_MODEL_TYPES: tuple[str, ...] = ()
MULTI_LATENT_ATTENTION = False
ATTENTION_SINKS = False
QK_NORM_ACROSS_HEADS = False
TINY = False


def hf_attention_names(prefix: str) -> dict:
    """Rows of the megatron -> HF name table beyond the shared attention ones: none."""
    return {}


def engine_fused_key(hf: dict, name: str) -> str | None:
    """SGLang loads each tensor on its own (none waits for another in the same update
    call)."""
    return None


def fp8_head_dim(hf: dict, heads: int) -> int | None:
    """The head dimension of the merged QKV projection SGLang's FP8 loader checks."""
    return int(hf.get("head_dim") or hf["hidden_size"] // heads)


def fp8_moe_intermediate(hf: dict) -> int:
    """One expert's width (``moe_intermediate_size``, else ``intermediate_size``)."""
    return int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0)


def fp8_dense_mlp(hf: dict, experts: int) -> bool:
    """Whether the model has dense MLP layers (their gate/up partition is checked): none."""
    return False


DEFAULTS = ("OTHER_MODEL_TYPES", "MULTI_LATENT_ATTENTION", "ATTENTION_SINKS",
            "QK_NORM_ACROSS_HEADS", "TINY", "hf_attention_names", "engine_fused_key",
            "fp8_head_dim", "fp8_moe_intermediate", "fp8_dense_mlp")
