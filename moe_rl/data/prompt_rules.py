"""The rules a prompt set must keep before a run starts: every prompt fits the model's context
with the tokens generated after it, every warm-start answer fits after its prompt, and
characters the tokenizer cannot read are said (the prompt loader, :mod:`.prompts`, reads the
sets; :mod:`moe_rl.orchestration.run_inputs` applies these to them)."""
from __future__ import annotations

from moe_rl.data.prompts import PromptLimit, PromptRecord, longest_token_chars
from moe_rl.errors import ConfigError


def check_prompt_lengths(prompts: list[PromptRecord], where: str, context: int | None,
                         new_tokens: int, new_tokens_key: str) -> None:
    """Refuse a set holding a prompt that cannot fit the model's context with ``new_tokens``
    generated after it (the engine refuses such a request: one long row would end a run at the
    first step that draws it), naming the rows (0-based), their lengths and the limit."""
    if context is None:
        return
    room = context - new_tokens
    long_rows = [(n, f"{len(p.ids)} tokens") for n, p in enumerate(prompts)
                 if len(p.ids) > room]
    if long_rows:
        raise ConfigError(f"{where}: {len(long_rows)} prompt(s) too long for the model's context "
                          f"of {context} tokens (max_position_embeddings) with "
                          f"{new_tokens_key}={new_tokens} generated after them (at most {room} "
                          f"prompt tokens): {_rows(long_rows)}; drop or shorten them, or lower "
                          f"{new_tokens_key}")


def _rows(rows: list[tuple[int, str]]) -> str:
    """The first three (row, what) pairs in words, and how many more."""
    shown = ", ".join(f"row {n} ({what})" for n, what in rows[:3])
    return shown + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")


def check_answer_lengths(prompts, where: str, context: int | None, tokenizer) -> None:
    """The warm start trains on prompt + answer + end of text: each must fit the model's
    context (ConfigError naming the rows). An answer longer in characters than the context
    could hold in tokens is refused before it is tokenised."""
    if context is None:
        return
    longest = longest_token_chars(tokenizer)
    long_rows = []
    for n, p in enumerate(prompts):
        if p.answer is None:
            continue
        room = context - len(p.ids) - 1
        if len(p.answer) > max(room, 0) * longest:
            long_rows.append((n, f"{len(p.answer)} characters"))
            continue
        tokens = len(tokenizer(p.answer, add_special_tokens=False)["input_ids"])
        if tokens > room:
            long_rows.append((n, f"{tokens} tokens after a {len(p.ids)}-token prompt"))
    if long_rows:
        raise ConfigError(f"data.answer_key: {where}: {len(long_rows)} answer(s) too long for the "
                          f"warm start, which trains on prompt + answer + end of text within the "
                          f"model's context of {context} tokens (max_position_embeddings): "
                          f"{_rows(long_rows)}; shorten them or set trainer.warmup.steps=0")


def prompt_limit(context: int | None, new_tokens: int, new_tokens_key: str
                 ) -> PromptLimit | None:
    """The most tokens a prompt may hold with ``new_tokens`` generated after it (None without a
    known context): lets a row far too long be refused before it is tokenised."""
    if context is None:
        return None
    return PromptLimit(context - new_tokens, f"the model's context of {context} tokens "
                       f"(max_position_embeddings) leaves with {new_tokens_key}={new_tokens} "
                       f"generated after them; drop or shorten it, or lower {new_tokens_key}")


def unknown_characters(tok, sets: list[tuple[str, list[PromptRecord]]]) -> str | None:
    """A warning when the prompts of ``sets`` ((where, prompts) pairs) hold characters
    tokenizer ``tok`` maps to its unknown token (the tiny models' character tokenizer knows
    digits, ASCII letters and some signs only): how many prompts, the first one's row and the
    characters; None when there are none."""
    unk = getattr(tok, "unk_token_id", None)
    if unk is None:
        return None
    parts = []
    for where, prompts in sets:
        rows = [n for n, p in enumerate(prompts) if unk in p.ids]
        if rows:
            text = prompts[rows[0]].text
            chars = sorted({c for c in text if tok.encode(c, add_special_tokens=False) == [unk]})
            shown = " ".join(repr(c) for c in chars[:8])
            parts.append(f"{len(rows)} {where} prompt(s), first row {rows[0]} ({shown})")
    if not parts:
        return None
    return (f"warning: the tokenizer of model.path maps characters of {'; '.join(parts)} to "
            f"{tok.unk_token!r}: the model cannot read them (a tiny model's character tokenizer "
            f"knows ASCII letters, digits and common signs)")
