"""Named model presets of `moe-rl init-model --preset`, and the supervised warm-up that moves a
preset's routers away from their initialisation (on the project's arithmetic task)."""
from __future__ import annotations

import json
import os
import random

from moe_rl.config import ModelInitConfig
from moe_rl.data.prompts import toy_problems
from moe_rl.models.tiny import write_tiny_model

PRESETS = {
    # Qwen3-30B-A3B's MoE shape at CPU scale: 64 routed experts, top-8, GQA 4:1, every layer MoE
    "medium": {"init": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32, moe_intermediate_size=128,
                            num_experts=64, num_experts_per_tok=8, max_position_embeddings=128,
                            seed=0),
               "warmup_steps": 150, "out": "outputs/medium_moe"},
    # the CPU demo's model
    "tiny": {"init": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                          seed=0),
             "warmup_steps": 0, "out": "outputs/tiny_preset_moe"},
}
MARKER = "moe_rl_preset.json"


def preset_init(name: str) -> ModelInitConfig:
    """The ``model.init`` of preset ``name`` (ValueError naming the choices)."""
    if name not in PRESETS:
        raise ValueError(f"--preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return ModelInitConfig(**PRESETS[name]["init"])


def warm_up(model_dir: str, steps: int, seed: int = 0, batch_size: int = 64,
            lr: float = 1e-3, max_operand: int = 9) -> float:
    """``steps`` supervised steps (AdamW, float32) of the HF model in ``model_dir`` on the toy
    additions ("a+b=" -> "c<|endoftext|>", loss on the answer), saved in place. Returns the last
    loss."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                              dtype=torch.float32)
    model.train()
    problems = toy_problems(max_operand, 512, seed)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]   # noqa: E731
    rows = [(enc(p), enc(a) + [tok.eos_token_id]) for p, a in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    loss = torch.tensor(float("nan"))
    torch.manual_seed(seed)
    for _ in range(steps):
        picked = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        width = max(len(p) + len(a) for p, a in picked)
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for b, (p, a) in enumerate(picked):
            ids[b, :len(p) + len(a)] = torch.tensor(p + a)
            labels[b, len(p):len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tok.pad_token_id),
                     labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(model_dir)
    return float(loss.detach())


def write_preset(name: str, out_dir: str | None = None, warmup_steps: int | None = None) -> str:
    """Write preset ``name`` (initialised, then warmed up) to ``out_dir`` (default: the preset's
    folder under outputs/); a folder already holding that preset with those steps is reused."""
    init = preset_init(name)
    out = out_dir or PRESETS[name]["out"]
    steps = PRESETS[name]["warmup_steps"] if warmup_steps is None else warmup_steps
    want = {"preset": name, "init": PRESETS[name]["init"], "warmup_steps": steps}
    marker = os.path.join(out, MARKER)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as fh:
            have = json.load(fh)
        if {k: have.get(k) for k in want} == want:
            return out
    write_tiny_model(init, out)
    loss = warm_up(out, steps, seed=init.seed) if steps else None
    with open(marker, "w", encoding="utf-8") as fh:
        json.dump({**want, "final_loss": loss}, fh, indent=1)
    return out
