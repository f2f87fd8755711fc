"""The rules a prompt set keeps before a run starts (moe_rl/data/prompt_rules.py), on
hand-worked sets: a 10-token context, a character tokenizer whose unknown token is id 0."""
import pytest

from moe_rl.data.prompt_rules import (check_answer_lengths, check_prompt_lengths, prompt_limit,
                                      unknown_characters)
from moe_rl.data.prompts import PromptRecord
from moe_rl.errors import ConfigError


class CharTokenizer:
    """One token per character; letters a-z are ids 1-26, anything else the unknown id 0."""
    unk_token_id, unk_token = 0, "<unk>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 96 if "a" <= c <= "z" else 0 for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def get_vocab(self):   # one entry of two characters: a token covers at most 2
        return {**{chr(96 + i): i for i in range(1, 27)}, "ab": 27}


def _prompt(text, answer=None):
    return PromptRecord(text=text, ids=CharTokenizer().encode(text), answer=answer)


def test_a_prompt_must_leave_room_for_the_tokens_generated_after_it():
    prompts = [_prompt("abcdef"), _prompt("abcdefg"), _prompt("ab")]
    check_prompt_lengths(prompts[::2], "data.path", 10, 4, "rollout.max_new_tokens")   # 6 <= 6
    with pytest.raises(ConfigError, match=r"data.path: 1 prompt\(s\) too long .*at most 6 "
                                          r"prompt tokens\): row 1 \(7 tokens\)"):
        check_prompt_lengths(prompts[:2], "data.path", 10, 4, "rollout.max_new_tokens")
    check_prompt_lengths(prompts, "data.path", None, 4, "rollout.max_new_tokens")   # unknown
    limit = prompt_limit(10, 4, "rollout.max_new_tokens")
    assert limit.tokens == 6 and "rollout.max_new_tokens=4" in limit.why
    assert prompt_limit(None, 4, "rollout.max_new_tokens") is None


def test_a_warm_start_answer_must_fit_after_its_prompt_and_the_end_of_text():
    tok = CharTokenizer()
    fits = [_prompt("abcd", answer="efghi")]   # 4 + 5 + 1 = 10
    check_answer_lengths(fits, "data.path", 10, tok)
    long = [_prompt("abcd", answer="efghij"), _prompt("ab", answer=None),
            _prompt("abcdefghij", answer="x" * 50)]   # 6 > 5 tokens; none; 50 > 0 x 2 chars
    with pytest.raises(ConfigError, match=r"2 answer\(s\) too long .* row 0 \(6 tokens after a "
                                          r"4-token prompt\), row 2 \(50 characters\)"):
        check_answer_lengths(long, "data.path", 10, tok)


def test_characters_the_tokenizer_cannot_read_are_said_per_set():
    tok = CharTokenizer()
    sets = [("training", [_prompt("abc"), _prompt("a+b"), _prompt("a=b")]),
            ("eval hard", [_prompt("xyz")])]
    said = unknown_characters(tok, sets)
    assert "2 training prompt(s), first row 1 ('+')" in said and "eval hard" not in said
    assert unknown_characters(tok, [("training", [_prompt("abc")])]) is None
