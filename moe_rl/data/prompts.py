"""Prompt datasets (built-in toy task, JSONL, Parquet) with rows of prompt text or chat
messages, tokenisation with the chat template, per-row metadata for the reward, and a
deterministic, resumable shuffled sampler."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
import dataclasses

from moe_rl.config import DataConfig, DataSetConfig


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its text (as rendered), token ids, the reference answer (if any) and the row's
    ``data.metadata_keys`` columns."""
    text: str
    ids: list[int]
    answer: str | None
    metadata: dict = field(default_factory=dict)


def toy_problems(max_operand: int, size: int, seed: int) -> list[tuple[str, str]]:
    """The demo task: ``size`` additions "a+b=" with 0 <= a, b <= max_operand, and answers."""
    rng = random.Random(seed)
    return [(f"{a}+{b}=", str(a + b)) for a, b in
            ((rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(size))]


def _read_rows(cfg: DataConfig) -> list[dict]:
    if cfg.source == "jsonl":
        rows = []
        with open(cfg.path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"data.path: {cfg.path} line {n}: not UTF-8 text (byte "
                                     f"0x{raw[exc.start]:02x} at column {exc.start + 1})"
                                     ) from None
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"data.path: {cfg.path} line {n}: invalid JSON: "
                                         f"{exc}") from None
                    except RecursionError:
                        raise ValueError(f"data.path: {cfg.path} line {n}: JSON nested too "
                                         f"deeply to read") from None
        return rows
    import pyarrow.parquet as pq
    return pq.read_table(cfg.path).to_pylist()


def _ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def encode_prompt(tokenizer, text: str, chat_template: bool, system_prompt: str | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template when asked (after
    ``system_prompt`` as a system message, if any)."""
    if chat_template:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None
                    else []) + [{"role": "user", "content": text}]
        return encode_messages(tokenizer, messages, template_kwargs)[1]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_messages(tokenizer, messages: list[dict], template_kwargs: dict | None = None
                    ) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a chat through the tokenizer's chat template, ready for the
    assistant's turn."""
    kw = dict(template_kwargs or {})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **kw)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return text, _ids(ids)


ROLES = ("system", "user", "assistant", "tool")


def check_messages(value, where: str) -> list[dict]:
    """A chat list of {role, content}: ValueError naming ``where`` (file, row, key) otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages, "
                         f"got {value!r:.80}")
    for i, m in enumerate(value):
        if (not isinstance(m, dict) or m.get("role") not in ROLES or
                not isinstance(m.get("content"), str)):
            raise ValueError(f"{where}[{i}]: expected {{role: one of {', '.join(ROLES)}, "
                             f"content: text}}, got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _check_text(text: str, where: str) -> str:
    """``text``, refused naming ``where`` when it holds a lone surrogate (JSON's "\\ud800"
    decodes to one; no tokenizer encodes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: not valid text: a lone surrogate "
                         f"{text[exc.start]!r} at character {exc.start}") from None
    return text


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens a prompt may hold (``tokens``) and what sets it, for the refusal."""
    tokens: int
    why: str


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` covers (its vocabulary's longest entry,
    added tokens included; a byte-level token's string has a character per byte, at least as
    many as the text characters it covers)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def _check_length(chars: int, limit: PromptLimit | None, longest: int, where: str) -> None:
    """Refuse a prompt of ``chars`` characters that is certainly longer than ``limit`` before
    tokenising it: no token covers more than ``longest`` characters (a 10 MB prompt would take
    seconds to tokenise, only to be refused)."""
    if limit is not None and chars > limit.tokens * longest:
        raise ValueError(f"{where}: {chars} characters, so at least {-(-chars // longest)} "
                         f"tokens (no token of the tokenizer covers more than {longest}): "
                         f"more than the {limit.tokens} prompt tokens {limit.why}")


def _record(cfg: DataConfig, tokenizer, row, n: int, limit: PromptLimit | None = None,
            longest: int = 1) -> PromptRecord:
    """Row ``n`` of ``cfg.path`` as a prompt record (ValueError naming file, row and key);
    ``limit``: refuse a row too long to fit before tokenising it."""
    where = f"row {n} of {cfg.path}"
    key = cfg.messages_key or cfg.prompt_key
    if not isinstance(row, dict) or key not in row:
        raise ValueError(f"data.{'messages_key' if cfg.messages_key else 'prompt_key'}: "
                         f"{where} has no {key!r} field")
    missing = [k for k in cfg.metadata_keys if k not in row]
    if missing:
        raise ValueError(f"data.metadata_keys: {where} has no {missing[0]!r} field")
    answer = row.get(cfg.answer_key)
    if answer is not None:
        answer = _check_text(str(answer), f"data.answer_key: {where}: {cfg.answer_key}")
    metadata = {k: row[k] for k in cfg.metadata_keys}
    if cfg.messages_key:
        messages = check_messages(row[key], f"data.messages_key: {where}: {key}")
        for i, m in enumerate(messages):
            _check_text(m["content"], f"data.messages_key: {where}: {key}[{i}].content")
        _check_length(sum(len(m["content"]) for m in messages), limit, longest,
                      f"data.messages_key: {where}")
        text, ids = encode_messages(tokenizer, messages, cfg.chat_template_kwargs)
        return PromptRecord(text, ids, answer, metadata)
    text = _check_text(str(row[key]), f"data.prompt_key: {where}: {key}")
    _check_length(len(text), limit, longest, f"data.prompt_key: {where}")
    return PromptRecord(text, encode_prompt(tokenizer, text, cfg.chat_template,
                                            cfg.system_prompt, cfg.chat_template_kwargs),
                        answer, metadata)


def set_source(cfg: DataConfig, entry: DataSetConfig) -> DataConfig:
    """``cfg`` reading the one file of ``entry`` (its keys, those it leaves null from ``cfg``)."""
    source = entry.source or ("parquet" if entry.path.endswith(".parquet") else "jsonl")
    keys = {k: getattr(entry, k) for k in ("prompt_key", "messages_key", "answer_key")
            if getattr(entry, k) is not None}
    return dataclasses.replace(cfg, source=source, path=entry.path, sets=[], **keys)


def load_prompt_sets(cfg: DataConfig, tokenizer, limit: PromptLimit | None = None
                     ) -> tuple[list[PromptRecord], list[int]]:
    """The prompts of every training set one after the other (``data.sets``, else the one
    configured source) and the number each set holds."""
    if not cfg.sets:
        prompts = load_prompts(cfg, tokenizer, limit)
        return prompts, [len(prompts)]
    parts = [load_prompts(set_source(cfg, entry), tokenizer, limit) for entry in cfg.sets]
    return [r for part in parts for r in part], [len(part) for part in parts]


def load_prompts(cfg: DataConfig, tokenizer, limit: PromptLimit | None = None
                 ) -> list[PromptRecord]:
    """All prompts of the configured source, tokenised; a bad row is refused naming the file,
    the row and the key, and with ``limit`` a row too long to fit before it is tokenised."""
    if cfg.source == "toy":
        records = [PromptRecord(text, encode_prompt(tokenizer, text, cfg.chat_template,
                                                    cfg.system_prompt,
                                                    cfg.chat_template_kwargs), answer)
                   for text, answer in toy_problems(cfg.toy_max_operand, cfg.toy_size,
                                                    cfg.shuffle_seed)]
    else:
        longest = longest_token_chars(tokenizer) if limit is not None else 1
        records = [_record(cfg, tokenizer, row, n, limit, longest)
                   for n, row in enumerate(_read_rows(cfg))]
    if not records:
        raise ValueError(f"data: no prompts in {cfg.path or 'the toy task'}")
    return records


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
