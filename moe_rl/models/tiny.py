"""The tiny Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss or MiniMax-M2 model and character-level
tokenizer of the CPU demo, built locally and deterministically (same config -> byte-identical
files); nothing is downloaded."""
from __future__ import annotations

import os
import string

from moe_rl.config import ConfigError, ModelInitConfig, init_hf_fields
from moe_rl.families import family
from moe_rl.families.shape import MoEShape
from moe_rl.config.memory_estimate import param_counts

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
CHARSET = (string.digits + string.ascii_letters + " +-*/=().,:;!?'\"#%&<>[]_\n" + "\\{}")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast with Qwen-style chat special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   eos_token="<|endoftext|>", unk_token="<|unk|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def padded_vocab_size(n: int, multiple: int = 8) -> int:
    """The model's vocabulary: the tokenizer's size rounded up to a multiple of 8."""
    return -(-n // multiple) * multiple


def _hf_config(init: ModelInitConfig, tokenizer):
    """The transformers config of the ``init`` shape."""
    import transformers
    fields = init_hf_fields(init)
    fields.pop("seed")
    arch = fields.pop("model_type")
    common = dict(vocab_size=padded_vocab_size(len(tokenizer)), bos_token_id=None,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return family(arch).tiny_hf_config(transformers, common, fields, init)


def tiny_config_fields(init: ModelInitConfig) -> dict:
    """The config.json fields of the tiny model of ``init`` (what :func:`write_tiny_model`
    writes), without writing it."""
    return _hf_config(init, build_tokenizer()).to_dict()


# the most parameters init-model builds (4 GiB in float32): it writes test models; a larger one
# comes from a released checkpoint (moe-rl check-model reads it)
TINY_MAX_PARAMS = 1 << 30


def check_tiny_size(hf_fields: dict) -> None:
    """ConfigError naming the key when the model ``hf_fields`` describe is past the sizes moe_rl
    reads (config.json's tops) or past :data:`TINY_MAX_PARAMS`, before anything is allocated
    (a huge shape ended in an allocation traceback after minutes of growing memory)."""
    try:
        MoEShape.from_hf(hf_fields)
    except ValueError as exc:
        raise ConfigError(f"model.init: {exc}") from None
    total = param_counts(hf_fields).total
    if total > TINY_MAX_PARAMS:
        raise ConfigError(f"model.init: this shape has {total:,} parameters; init-model writes "
                          f"test models of at most {TINY_MAX_PARAMS:,} (lower hidden_size, "
                          f"num_hidden_layers, num_experts or moe_intermediate_size; a larger "
                          f"model comes from a released checkpoint)")


def write_tiny_model(init: ModelInitConfig, out_dir: str) -> str:
    """Write config.json, model.safetensors and the tokenizer of the tiny model of ``init``
    (Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss or MiniMax-M2) to ``out_dir``, deterministically
    from ``init.seed``. Returns ``out_dir``."""
    import torch
    import transformers
    tokenizer = build_tokenizer()
    cfg = _hf_config(init, tokenizer)
    check_tiny_size(cfg.to_dict())
    gen = torch.Generator().manual_seed(init.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init.seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():   # explicit seeded init: independent of transformers' init order
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * init.deepseek.expert_bias_std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
