"""Prompt data (toy, JSONL, Parquet, chat template, resumable order) and reward functions."""
import json
import textwrap

import pytest

from moe_rl.config import DataConfig
from moe_rl.data.prompts import PromptSampler, load_prompts, toy_problems
from moe_rl.models.tiny import build_tokenizer
from moe_rl.rewards.functions import RewardFunction, load_reward, toy_reward
from moe_rl.rewards.math_answers import (extract_answer, math_reward, normalise_answer,
                                         regex_math_reward)
from tests.helpers import train_tiny

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


# hand-worked: (response, reference answer, equal?)
MATH_PAIRS = [
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
    ("\\boxed{3}", "-3", False),
    ("\\boxed{3/6}", "1/2", True),
    ("The answer is 0.5", "\\frac{1}{2}", True),
    ("\\boxed{x+1}", "x+1", True),
    ("\\boxed{x+2}", "x+1", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("the answer is 10.", "10", True),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", True),             # sets: order does not matter
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", False),
    ("\\boxed{3, 5}", "5, 3", True),
    ("first \\boxed{1} then \\boxed{2}", "\\{1,2\\}", True),    # several boxes form a set
    ("first \\boxed{1} then \\boxed{2}", "2", False),
    ("\\boxed{(0, 1]}", "(0,1]", True),                       # intervals: open / closed ends
    ("\\boxed{[0, 1)}", "(0,1]", False),
    ("\\boxed{5\\text{ cm}}", "5", True),                      # units stripped
    ("\\boxed{50\\%}", "0.5", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{1/3}", "0.333", False),                          # 3 digits are not 1/3
    ("\\boxed{0.3333333}", "1/3", True),                       # rounded at 6 digits
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{-\\infty}", "\\infty", False),
    ("The final answer is $\\boxed{12}$", "12", True),
    ("\\boxed{1000}", "1,000", True),
    ("\\boxed{1.5}", "3/2", True),
    ("\\boxed{y=2x}", "2x", True),                             # the right-hand side counts
    ("\\boxed{\\pi}", "3.14", False),
    ("\\boxed{Paris}", "paris", True),                         # no math: the regex rule decides
    ("\\boxed{London}", "Paris", False),
]


@pytest.mark.parametrize("response,answer,ok", MATH_PAIRS)
def test_math_reward_cases(response, answer, ok):
    assert len(MATH_PAIRS) >= 30
    assert math_reward("", response, answer, {}) == (1.0 if ok else 0.0)
    assert math_reward("", response, None, {}) == 0.0


def test_math_reward_falls_back_to_the_regex_rule_only_without_a_parse():
    # math-verify finds nothing in a text answer: the regex rule's verdict is the reward
    assert math_reward("", "\\boxed{Paris}", "paris", {}) == regex_math_reward(
        "\\boxed{Paris}", "paris") == 1.0
    # where math-verify parses both, its verdict wins over the regex (last box vs all boxes)
    assert regex_math_reward("first \\boxed{1} then \\boxed{2}", "2") == 1.0
    assert math_reward("", "first \\boxed{1} then \\boxed{2}", "2", {}) == 0.0


def test_math_reward_runs_off_the_main_thread_within_its_time_limit():
    """The reward runs on a worker thread, bounded by data.reward_timeout_s (math-verify's own
    limit uses signals, which only the main thread may set)."""
    fn = RewardFunction("math", timeout_s=30)
    assert score_one(fn, "", "\\boxed{\\frac{3}{4}}", "0.75", {}) == 1.0
    assert score_one(fn, "", "\\boxed{7}", "8", {}) == 0.0
    assert fn.errors == 0 and fn.timeouts == 0


def score_one(fn, prompt, response, answer, metadata):
    """One sample's reward through the path the rollout takes."""
    import asyncio
    return asyncio.run(fn.score([{"prompt": prompt, "response": response, "label": answer,
                                  "metadata": metadata}]))[0]


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
    assert score_one(RewardFunction("my_rewards:good"), "", "abcd", None, {}) == \
        pytest.approx(0.4)
    fn = RewardFunction("my_rewards:bad")
    assert score_one(fn, "", "boom", None, {}) == 0.0
    assert score_one(fn, "", "nan", None, {}) == 0.0
    assert score_one(fn, "", "other", None, {}) == 0.0
    assert fn.errors == 3 and "user bug" in fn.first_error
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("nonexistent_module_xyz:f")
    with pytest.raises(ValueError, match="data.reward"):
        load_reward("toys")


HANGING_REWARDS = """
import sys
import threading
import time
calls = 0

def never(prompt, response, answer, metadata):
    threading.Event().wait()

def every_fifth_hangs(prompt, response, answer, metadata):
    global calls
    calls += 1   # a group's samples are scored concurrently: which ones hang varies, not how many
    if calls % 5 == 0:
        threading.Event().wait()
    return float(len(response) % 2)

async def async_blocks_or_exits(prompt, response, answer, metadata):
    global calls
    calls += 1
    if calls > 32:
        raise KeyError("answer_field")   # the third step's batch: every sample fails
    if calls % 5 == 0:
        time.sleep(3600)   # blocks (no await): must hold neither the rollout nor the bound
    if calls % 7 == 0:
        sys.exit(3)        # must be counted as an error, never end the run
    if calls % 11 == 0:
        return (-1) ** calls * 1.7e308   # finite but extreme: clipped and counted
    return float(len(response) % 2)

def hangs_at_length_4_and_9(prompt, response, answer, metadata):
    if len(response) % 5 == 4:
        threading.Event().wait()
    return float(len(response) % 2)
"""


def test_a_reward_call_past_its_timeout_loses_the_sample(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace
    import torch
    import asyncio
    from moe_rl.rewards.functions import score_samples
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RewardFunction("hanging_rewards:never", timeout_s=0.3)
    t0 = time.monotonic()
    assert score_one(fn, "", "x", None, {}) is None
    assert time.monotonic() - t0 < 2 and fn.timeouts == 1 and fn.errors == 0
    assert "did not return within 0.3 s" in fn.first_error
    fifth = RewardFunction("hanging_rewards:hangs_at_length_4_and_9", timeout_s=0.3)
    samples = [SimpleNamespace(metadata={}, response_ids=torch.tensor([6] * k), reward=None)
               for k in range(10)]
    kept = asyncio.run(score_samples(samples, TOK, [], fifth))
    assert len(kept) == 8 and fifth.timeouts == 2
    assert [s.reward for s in kept] == [float(len(TOK.decode([6] * k)) % 2)
                                        for k in range(10) if (k + 1) % 5]


def test_an_async_reward_that_blocks_or_exits_is_bounded_and_counted(tmp_path, monkeypatch):
    """An ``async def`` reward calling time.sleep holds its own thread only: the bound fires;
    sys.exit, KeyboardInterrupt and a bare BaseException inside a reward are errors."""
    import asyncio
    import time
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARDS)
    (tmp_path / "exiting_rewards.py").write_text("""
import sys

async def exits(prompt, response, answer, metadata):
    sys.exit(3)

def interrupts(prompt, response, answer, metadata):
    raise KeyboardInterrupt

def base(samples):
    raise BaseException("bare")
""")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RewardFunction("hanging_rewards:async_blocks_or_exits", timeout_s=0.3)
    t0 = time.monotonic()
    got = asyncio.run(fn.score([{"prompt": "", "response": "ab", "label": None,
                                 "metadata": {}}] * 10))
    assert time.monotonic() - t0 < 3
    assert got.count(None) == 2 and fn.timeouts == 2 and fn.errors == 1
    for name, kind in (("exits", "SystemExit"), ("interrupts", "KeyboardInterrupt"),
                       ("base", "BaseException")):
        fn = RewardFunction(f"exiting_rewards:{name}", timeout_s=5)
        assert asyncio.run(fn.score(items_of(2))) == [0.0, 0.0] and fn.errors == 2
        assert kind in fn.first_error


def items_of(n):
    return [{"prompt": "", "response": "x", "label": None, "metadata": {}} for _ in range(n)]


@pytest.mark.loop   # a real run (`moe-rl train`): make test-loop
@pytest.mark.e2e
def test_a_hanging_reward_through_moe_rl_train(tmp_path):
    """`moe-rl train` with an ``async def`` reward that blocks (time.sleep, no await) on every
    fifth call, calls sys.exit on every seventh and returns -+1.7e308 on every eleventh: the
    first are dropped and counted (reward/timeouts), the others counted (reward/errors,
    reward/clipped), the log names each once, the steps finish. On the third step it raises on
    every sample: the run stops after data.max_failed_reward_batches in one line naming the
    reward and its error, exit 1, no traceback, nothing of that step written."""
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARDS)
    res, rows = train_tiny(tmp_path, 3, 4, "data.reward=hanging_rewards:async_blocks_or_exits",
                           "data.reward_timeout_s=1", exit_code=1)
    assert [r["reward/timeouts"] for r in rows] == [3.0, 6.0]   # 16 calls a step
    assert [r["reward/errors"] for r in rows] == [2.0, 4.0]
    assert [r["reward/clipped"] for r in rows] == [1.0, 2.0]   # calls 11 and 22
    assert res.stdout.count("did not return within the time allowed (data.reward_timeout_s=1)") == 1
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: data.reward: hanging_rewards:async_blocks_or_exits "
                           "failed on every sample of 1 batch(es)") and "KeyError" in last, last


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


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_messages_rows_system_prompt_template_kwargs_and_metadata(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    path = _jsonl(tmp_path / "m.jsonl", [{"messages": chat, "answer": 3, "level": "easy"}])
    (rec,) = load_prompts(DataConfig(source="jsonl", path=path, messages_key="messages",
                                     metadata_keys=["level"]), TOK)
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n" \
           "<|im_start|>assistant\n"
    assert rec.text == want and TOK.decode(rec.ids) == want
    assert rec.ids == list(TOK.apply_chat_template(chat, add_generation_prompt=True,
                                                   tokenize=True)["input_ids"])
    assert rec.answer == "3" and rec.metadata == {"level": "easy"}
    # string rows: the system prompt goes first
    path = _jsonl(tmp_path / "s.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    (rec,) = load_prompts(DataConfig(source="jsonl", path=path, system_prompt="Be brief."), TOK)
    assert TOK.decode(rec.ids) == want and rec.text == "1+2=" and rec.metadata == {}
    # chat_template_kwargs reach the template
    import copy
    tok = copy.deepcopy(TOK)
    tok.chat_template = TOK.chat_template + \
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    (rec,) = load_prompts(DataConfig(source="jsonl", path=path,
                                     chat_template_kwargs={"enable_thinking": False}), tok)
    assert tok.decode(rec.ids).endswith("<|im_start|>assistant\n/no_think")


@pytest.mark.parametrize("row,cfg,message", [
    ({"messages": "hi"}, {"messages_key": "messages"},
     r"data.messages_key: row 0 of .*m.jsonl: messages: expected a non-empty list"),
    ({"messages": []}, {"messages_key": "messages"}, r"messages: expected a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, {"messages_key": "messages"},
     r"data.messages_key: row 0 of .*: messages\[0\]: expected \{role: one of system"),
    ({"messages": [{"role": "user", "content": 5}]}, {"messages_key": "messages"},
     r"messages\[0\]: expected \{role"),
    ({"prompt": "x"}, {"messages_key": "messages"}, r"data.messages_key: row 0 of .* no 'messages'"),
    ({"prompt": "x"}, {"metadata_keys": ["level"]}, r"data.metadata_keys: row 0 of .* no 'level'"),
])
def test_bad_rows_name_the_file_row_and_key(tmp_path, row, cfg, message):
    path = _jsonl(tmp_path / "m.jsonl", [row])
    with pytest.raises(ValueError, match=message):
        load_prompts(DataConfig(source="jsonl", path=path, **cfg), TOK)


def test_row_format_settings_are_checked_with_the_config():
    from moe_rl.config import ConfigError, load_config
    base = ["data.source=jsonl", "data.path=x.jsonl"]
    for overrides, message in [
            (base + ["data.messages_key=messages", "data.chat_template=false"],
             "data.chat_template: messages rows"),
            (base + ["data.messages_key=messages", "data.system_prompt=hi"],
             "data.system_prompt: messages rows carry"),
            (base + ["data.chat_template=false", "data.system_prompt=hi"],
             "data.system_prompt: applies through the chat template"),
            (base + ["data.chat_template=false", "data.chat_template_kwargs={a: 1}"],
             "data.chat_template_kwargs: applies"),
            (["data.metadata_keys=[level]"], "data.metadata_keys: the toy task has no rows"),
            (base + ["data.chat_template_kwargs=[1]"], "data.chat_template_kwargs: expected a "
                                                       "mapping")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    cfg = load_config(None, base + ["data.chat_template_kwargs={enable_thinking: false}",
                                    "data.metadata_keys=level,source"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.data.metadata_keys == ["level", "source"]


CHAT_REWARDS = """
def graded(prompt, response, answer, metadata):
    # the rendered chat reaches the reward, and the row's metadata beside the run's
    assert prompt.startswith("<|im_start|>system\\nAdd.<|im_end|>"), prompt
    assert metadata["level"] in ("easy", "hard") and "prompt_index" in metadata, metadata
    return 1.0 if metadata["level"] == "easy" else 0.0
"""


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_messages_rows_and_metadata_through_moe_rl_train(tmp_path):
    """`moe-rl train` on chat-message rows with a per-row column handed to the reward: every
    reward call gets the rendered chat and the row's metadata (no reward errors), and the
    rewards follow the column (half the rows are easy: reward_mean 0.5 with every prompt)."""
    (tmp_path / "chat_rewards.py").write_text(CHAT_REWARDS)
    rows = [{"messages": [{"role": "system", "content": "Add."},
                          {"role": "user", "content": f"{a}+{a}="}],
             "answer": 2 * a, "level": "easy" if a % 2 else "hard"} for a in range(4)]
    data = _jsonl(tmp_path / "chat.jsonl", rows)
    _, (row,) = train_tiny(tmp_path, 1, 2, "data.source=jsonl", f"data.path={data}",
                            "data.messages_key=messages", "data.chat_template=true",
                            "data.metadata_keys=[level]", "data.reward=chat_rewards:graded")
    assert row["reward/errors"] == 0.0
    assert row["reward/mean"] == pytest.approx(0.5)


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


def test_reward_signature_is_checked_when_loaded(tmp_path, monkeypatch):
    (tmp_path / "sig_rewards.py").write_text(textwrap.dedent("""
        def extra_default(prompt, response, answer, metadata, scale=1.0):
            return scale
        def anything(*args, **kwargs):
            return 1.0
        class Scorer:
            def __call__(self, prompt, response, answer, metadata):
                return 0.5
        scorer = Scorer()
        def three(prompt, response, answer):
            return 0.0
        def keyword_only(prompt, response, *, answer, metadata):
            return 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for ok in ("extra_default", "anything", "scorer", "toy", "math"):
        name = ok if ok in ("toy", "math") else f"sig_rewards:{ok}"
        assert callable(load_reward(name)[0])
    for bad in ("three", "keyword_only"):
        with pytest.raises(ValueError, match=r"data.reward: 'sig_rewards:%s' takes \(" % bad):
            load_reward(f"sig_rewards:{bad}")
