"""The shapes SGLang's block-wise FP8 path accepts (read in SGLang 0.5.23,
``layers/quantization/fp8.py``): with 128x128 weight blocks, every partition of a merged linear
(QKV, gate_up) must be a multiple of the block's output size, at every TP size; a row-parallel
input partition (o_proj, down_proj) too when TP > 1; and each expert's intermediate partition
(``moe_intermediate_size / (tp_size / ep_size)``) always. A model that breaks one of these makes
SGLang refuse to load; moe_rl says so at config time, with the numbers."""
from __future__ import annotations

from moe_rl.families import family

BLOCK = 128


def _partitions(hf: dict, tp: int, ep: int) -> list[tuple[str, int, bool]]:
    """(what, size per partition, whether SGLang checks it at this TP) for every FP8 linear
    family of the model ``hf`` (a HF config.json dict)."""
    out = []
    fam = family(hf.get("model_type"))
    heads = int(hf.get("num_attention_heads") or 0)
    head_dim = fam.fp8_head_dim(hf, heads) if heads else None
    if head_dim is not None:   # (MLA's projections are not merged this way)
        kv = int(hf.get("num_key_value_heads") or heads)
        out += [("the query partition of the merged QKV projection (num_attention_heads / "
                 "tp_size x head_dim)", heads // tp * head_dim, True),
                ("the key/value partition of the merged QKV projection (num_key_value_heads / "
                 "tp_size x head_dim, at least one head)", max(1, kv // tp) * head_dim, True),
                ("o_proj's input partition (num_attention_heads x head_dim / tp_size)",
                 heads * head_dim // tp, tp > 1)]
    experts = int(hf.get("num_experts") or hf.get("n_routed_experts")
                  or hf.get("num_local_experts") or 0)
    moe_inter = fam.fp8_moe_intermediate(hf)
    if experts and moe_inter:
        moe_tp = max(1, tp // ep)
        out.append((f"each expert's intermediate partition (moe_intermediate_size {moe_inter} / "
                    f"(tp_size / ep_size) = {moe_tp})", moe_inter // moe_tp, True))
    if fam.fp8_dense_mlp(hf, experts) and hf.get("intermediate_size"):
        inter = int(hf["intermediate_size"])
        out.append((f"the dense MLP's gate/up partition (intermediate_size {inter} / tp_size)",
                    inter // tp, True))
    shared = (int(hf.get("n_shared_experts") or 0) * moe_inter or
        int(hf.get("shared_expert_intermediate_size") or 0))
    if experts and shared:
        out.append((f"the shared experts' gate/up partition ({shared} / tp_size)",
                    shared // tp, True))
    return out


def fp8_shape_errors(hf: dict, tp: int = 1, ep: int = 1) -> list[str]:
    """What SGLang's block-wise FP8 loader would refuse for model ``hf`` at ``--tp-size tp
    --ep-size ep`` (empty: it loads)."""
    return [f"{what} is {size}, not a multiple of the {BLOCK}-wide FP8 weight block"
            for what, size, checked in _partitions(hf, tp, ep) if checked and size % BLOCK]
