"""Prompt data (toy, JSONL, Parquet, chat template, resumable order) and reward functions."""
import json
import textwrap

import pytest

from moe_rl.config import DataConfig
from moe_rl.data.prompts import PromptSampler, load_prompts, toy_problems
from moe_rl.models.tiny import build_tokenizer
from moe_rl.rewards.functions import (RewardFunction, extract_answer, load_reward, math_reward,
                                      normalise_answer, toy_reward)

TOK = build_tokenizer()


def test_toy_problems_deterministic_and_correct():
    a = toy_problems(9, 50, seed=3)
    assert a == toy_problems(9, 50, seed=3) and a != toy_problems(9, 50, seed=4)
    for q, ans in a:
        x, y = q[:-1].split("+")
        assert int(x) + int(y) == int(ans) and 0 <= int(x) <= 9


def test_toy_reward_cases():
    assert toy_reward("3+4=", "7", "7", {"stopped": True}) == 1.0
    assert toy_reward("3+4=", "7", "7", {"stopped": False}) == 0.5
    assert toy_reward("3+4=", "7+1", "7", {}) == 0.5
    assert toy_reward("3+4=", "71", "7", {"stopped": True}) == 0.2   # a wrong number, stopped
    assert toy_reward("3+4=", "8", "7", {"stopped": True}) == 0.2
    assert toy_reward("3+4=", "8", "7", {"stopped": False}) == 0.1
    assert toy_reward("3+4=", "8+", "7", {"stopped": True}) == 0.1
    assert toy_reward("3+4=", "x", "7", {}) == 0.0
    assert toy_reward("3+4=", "7", None, {}) == 0.0


@pytest.mark.parametrize("response,answer,ok", [
    ("so the answer is \\boxed{42}.", "42", True),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", True),
    ("The answer is 1,234.", "1234", True),
    ("answer: $5$", "5", True),
    ("we get 2.0 in the end", "2", True),
    ("x = 3 and then y = 7", "7", True),
    ("\\boxed{7}", "8", False),
    ("no number here", "3", False),
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{3/6}", "1/2", True),
    ("The answer is 0.5", "\\frac{1}{2}", True),
    ("\\boxed{x+1}", "x+1", True),
    ("\\boxed{x+2}", "x+1", False),
    ("first \\boxed{1} then \\boxed{2}", "2", True),
    ("the answer is 10.", "10", True),
])
def test_math_reward_cases(response, answer, ok):
    assert math_reward("", response, answer, {}) == (1.0 if ok else 0.0)


def test_answer_helpers():
    assert extract_answer("a \\boxed{{1}{2}} b") == "{1}{2}"
    assert normalise_answer("3/4") == normalise_answer("0.75")
    assert normalise_answer("Foo") == "foo"


def test_user_reward_failures_score_zero_and_are_counted(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(textwrap.dedent("""
        def good(prompt, response, answer, metadata):
            return len(response) / 10
        def bad(prompt, response, answer, metadata):
            if response == "boom":
                raise RuntimeError("user bug")
            return float("nan") if response == "nan" else "x"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert RewardFunction("my_rewards:good")("", "abcd", None, {}) == pytest.approx(0.4)
    fn = RewardFunction("my_rewards:bad")
    assert fn("", "boom", None, {}) == 0.0 and fn("", "nan", None, {}) == 0.0
    assert fn("", "other", None, {}) == 0.0
    assert fn.errors == 3 and "user bug" in fn.first_error
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("nonexistent_module_xyz:f")
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("toys")


def test_jsonl_and_parquet_with_chat_template(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": 8}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": r["prompt"], "answer": str(r["answer"])}
                                         for r in rows]), tmp_path / "d.parquet")
    for source, path in (("jsonl", jl), ("parquet", tmp_path / "d.parquet")):
        recs = load_prompts(DataConfig(source=source, path=str(path), chat_template=True), TOK)
        assert [r.answer for r in recs] == ["3", "8"]
        text = TOK.decode(recs[0].ids)
        assert text.startswith("<|im_start|>user\n1+2=") and text.endswith("<|im_start|>assistant\n")
    plain = load_prompts(DataConfig(source="jsonl", path=str(jl), chat_template=False), TOK)
    assert TOK.decode(plain[1].ids) == "4+4="
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="data.prompt_key: row 0"):
        load_prompts(DataConfig(source="jsonl", path=str(bad)), TOK)


def test_sampler_order_resumes_exactly():
    a = PromptSampler(10, 4, seed=7)
    first = [a.next_batch() for _ in range(3)]          # crosses an epoch boundary
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(4)]
    b = PromptSampler(10, 4, seed=7)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(4)] == rest
    c = PromptSampler(10, 4, seed=7)
    assert [c.next_batch() for _ in range(3)] == first  # deterministic from the seed
