"""Prompt datasets (built-in toy task, JSONL, Parquet), tokenisation with the chat template, and a
deterministic, resumable shuffled sampler."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from moe_rl.config import DataConfig


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its text, token ids, and the reference answer (if any)."""
    text: str
    ids: list[int]
    answer: str | None


def toy_problems(max_operand: int, size: int, seed: int) -> list[tuple[str, str]]:
    """The demo task: ``size`` additions "a+b=" with 0 <= a, b <= max_operand, and answers."""
    rng = random.Random(seed)
    return [(f"{a}+{b}=", str(a + b)) for a, b in
            ((rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(size))]


def _read_rows(cfg: DataConfig) -> list[dict]:
    if cfg.source == "jsonl":
        rows = []
        with open(cfg.path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"data.path: {cfg.path} line {n}: invalid JSON: "
                                         f"{exc}") from None
        return rows
    import pyarrow.parquet as pq
    return pq.read_table(cfg.path).to_pylist()


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template when asked."""
    if chat_template:
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(cfg: DataConfig, tokenizer) -> list[PromptRecord]:
    """All prompts of the configured source, tokenised."""
    if cfg.source == "toy":
        pairs = toy_problems(cfg.toy_max_operand, cfg.toy_size, cfg.shuffle_seed)
    else:
        pairs = []
        for n, row in enumerate(_read_rows(cfg)):
            if not isinstance(row, dict) or cfg.prompt_key not in row:
                raise ValueError(f"data.prompt_key: row {n} of {cfg.path} has no "
                                 f"{cfg.prompt_key!r} field")
            answer = row.get(cfg.answer_key)
            pairs.append((str(row[cfg.prompt_key]), None if answer is None else str(answer)))
    if not pairs:
        raise ValueError(f"data: no prompts in {cfg.path or 'the toy task'}")
    return [PromptRecord(text, encode_prompt(tokenizer, text, cfg.chat_template), answer)
            for text, answer in pairs]


class PromptSampler:
    """Batches of prompts in a seeded shuffled order, reshuffled every epoch; its state
    (epoch, position) resumes exactly where it stopped."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < 1 or batch_size < 1:
            raise ValueError("PromptSampler: needs at least one prompt and batch_size >= 1")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` prompt indices (crossing epochs when needed)."""
        out = []
        while len(out) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.position:self.position + self.batch_size - len(out)]
            out += take
            self.position += len(take)
            if self.position >= self.n:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
