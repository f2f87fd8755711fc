"""The MoE shape of a model: what validation, decoding, the rollout record and the trainer need to
know about its layers, experts and vocabulary. One type, read from a Hugging Face config; beside
it the trainer's :class:`ModelSpec` of a supported architecture."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from moe_rl.families import Family, family


@dataclass(frozen=True)
class MoEShape:
    """Layer count, the indices of the MoE layers, router top-k, routed experts, vocabulary and
    the ids that end a generation (``eos_token_id``)."""
    num_layers: int
    moe_layers: tuple[int, ...]
    topk: int
    num_experts: int
    vocab_size: int | None = None
    eos_ids: tuple[int, ...] = ()

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def from_hf(cls, hf: dict) -> "MoEShape":
        """From a Hugging Face ``config.json`` dict (Qwen3/Qwen2-MoE, Mixtral, DeepSeek-V3
        layer rules; no MoE layer when the config has no experts)."""
        n_layers = _size(hf, "num_hidden_layers", 0)
        experts = next((k for k in ("num_experts", "n_routed_experts", "num_local_experts")
                        if hf.get(k)), "num_experts")
        n_exp = _size(hf, experts, 0)
        topk = _size(hf, "num_experts_per_tok", 0)
        _size(hf, "vocab_size", None)
        if n_exp <= 0 or topk <= 0:
            moe: tuple[int, ...] = ()
        elif "first_k_dense_replace" in hf:  # DeepSeek-V3 style
            k = int(hf.get("first_k_dense_replace") or 0)
            freq = int(hf.get("moe_layer_freq") or 1)
            moe = tuple(i for i in range(n_layers) if i >= k and i % freq == 0)
        else:  # Qwen3-MoE / Qwen2-MoE style; Mixtral has neither key (every layer MoE)
            step = int(hf.get("decoder_sparse_step") or 1)
            dense = set(hf.get("mlp_only_layers") or [])
            moe = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        return cls(n_layers, moe, topk, n_exp, hf.get("vocab_size"), _ids(hf.get("eos_token_id")))

    @classmethod
    def from_model_dir(cls, path: str) -> "MoEShape":
        """From a checkpoint folder's ``config.json``, with every end id SGLang stops at: those
        of its ``generation_config.json``, the tokenizer's end token and the added tokens SGLang
        takes as turn ends (:func:`tokenizer_end_ids`)."""
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            shape = cls.from_hf(json.load(fh))
        more: tuple[int, ...] = ()
        gen = os.path.join(path, "generation_config.json")
        if os.path.exists(gen):
            with open(gen, encoding="utf-8") as fh:
                more = _ids(json.load(fh).get("eos_token_id"))
        more += tokenizer_end_ids(path)
        return dataclasses.replace(shape, eos_ids=tuple(dict.fromkeys(shape.eos_ids + more)))


# added tokens SGLang 0.5.23 stops at besides the end ids (attach_additional_stop_token_ids,
# srt/utils/hf_transformers/common.py): turn ends some checkpoints ship without end metadata
SGLANG_EXTRA_STOP_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


def tokenizer_end_ids(path: str) -> tuple[int, ...]:
    """The tokenizer's end token (``tokenizer_config.json``'s ``eos_token``) and the added
    tokens of :data:`SGLANG_EXTRA_STOP_TEXTS`, as ids of ``tokenizer.json`` (none without
    those files)."""
    try:
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as fh:
            tok = json.load(fh)
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            conf = json.load(fh)
    except (OSError, ValueError):
        return ()
    added = {t.get("content"): t.get("id") for t in tok.get("added_tokens") or []
             if isinstance(t, dict)}
    vocab = (tok.get("model") or {}).get("vocab")
    vocab = vocab if isinstance(vocab, dict) else {}
    eos = conf.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    found = [added.get(eos, vocab.get(eos))] if isinstance(eos, str) else []
    found += [added[text] for text in SGLANG_EXTRA_STOP_TEXTS if text in added]
    return _ids(found)


# the most a config.json field that sizes what is allocated may say: beyond every released
# model by far (a field of 10**12 layers took `moe-rl config` past 11 GB before it said anything)
SIZE_TOPS = {"num_hidden_layers": 4096, "num_experts": 65536, "n_routed_experts": 65536,
             "num_local_experts": 65536, "num_experts_per_tok": 1024, "vocab_size": 1 << 24}


def _size(hf: dict, key: str, default):
    """config.json's ``key`` as a size within :data:`SIZE_TOPS` (ValueError naming the field)."""
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SIZE_TOPS[key]:
        shown = (f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
                 if isinstance(value, int) and abs(value) >= 10 ** 18 else repr(value)[:40])
        raise ValueError(f"{key}: {shown}, expected an integer in [0, "
                         f"{SIZE_TOPS[key]:,}]")
    return value


def _ids(value) -> tuple[int, ...]:
    """``eos_token_id`` (an id, a list of ids or absent) as a tuple of ids."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


@dataclass(frozen=True)
class ModelSpec:
    """What the trainer and the weight mapping need to know about a model of a supported
    architecture."""
    arch: str
    hf_config: dict
    moe_shape: MoEShape
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool
    family: Family = field(compare=False, repr=False)   # resolved once, here


def quantisation_refusal(hf: dict) -> str | None:
    """Why a checkpoint of config.json ``hf`` is not read for training (None when it is): its
    weights quantised otherwise than in MXFP4 (read dequantised), e.g. a block-wise FP8
    release (DeepSeek-V3's, MiniMax-M2's), whose E4M3 values would load without their
    scales."""
    method = (hf.get("quantization_config") or {}).get("quant_method", "mxfp4")
    if method == "mxfp4":
        return None
    return (f"quantization_config: a checkpoint quantised with {method!r} is not read for "
            f"training (only MXFP4, dequantised); write a bfloat16 copy of it (without "
            f"quantization_config) and train from that")


def unquantised_config(hf: dict) -> dict:
    """The config.json of the model a checkpoint's values make: an MXFP4 checkpoint's (read
    dequantised, :mod:`moe_rl.weights.mxfp4_checkpoint`) without its ``quantization_config``;
    any other as it is."""
    if (hf.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        return hf
    return {k: v for k, v in hf.items() if k != "quantization_config"}


def model_spec(hf: dict) -> ModelSpec:
    """Check the architecture and collect its facts (of the unquantised model; a checkpoint
    quantised otherwise than in MXFP4 is refused, :func:`quantisation_refusal`)."""
    refusal = quantisation_refusal(hf)
    if refusal:
        raise ValueError(refusal)
    hf = unquantised_config(hf)
    fam = family(hf.get("model_type"))   # refuses an unsupported one
    return ModelSpec(fam.MODEL_TYPE, hf, MoEShape.from_hf(hf), int(hf["vocab_size"]),
                     int(hf["hidden_size"]), int(hf["num_hidden_layers"]),
                     bool(hf.get("tie_word_embeddings", False)), fam)
