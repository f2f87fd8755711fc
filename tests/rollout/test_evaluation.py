"""Evaluation (``eval.*``): the pass@k estimator against a float64 reference, the per-set metrics
on a hand-worked case, the schedule, the config's refusals; several training sets sampled by
weight (``data.sets``); held-out sets read with the training rows' readers."""
from __future__ import annotations

import json
from fractions import Fraction
from math import comb

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.data.mixture import MixtureSampler, make_sampler
from moe_rl.data.prompts import PromptSampler
from moe_rl.rollout.evaluation import eval_due, eval_ks, eval_sampling, pass_at_k, set_metrics


def test_pass_at_k_against_the_binomial_formula():
    """1 - C(n-c, k) / C(n, k) in exact rationals, for every n <= 20, c, k."""
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(comb(n - c, k), comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    # hand-worked: 4 samples, 1 right; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0   # n - c < k
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)            # pass@1 = c / n
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(3, 4, 1)


def test_set_metrics_by_hand():
    """Two prompts, n = 3 samples each, success = reward >= 1."""
    rewards = [[1.0, 0.0, 0.5], [1.0, 1.0, 0.0]]
    out = set_metrics("s", rewards, [2, 4, 6, 1, 1, 10], [False] * 5 + [True], 1.0, [2, 3])
    assert out["eval/s/reward_mean"] == pytest.approx(3.5 / 6)
    assert out["eval/s/pass@1"] == pytest.approx(3 / 6)
    # prompt 0: c = 1 -> pass@2 = 1 - C(2,2)/C(3,2) = 2/3; prompt 1: c = 2 -> 1
    assert out["eval/s/pass@2"] == pytest.approx((2 / 3 + 1) / 2)
    assert out["eval/s/pass@3"] == pytest.approx(1.0)
    assert out["eval/s/response_len_mean"] == pytest.approx(24 / 6)
    assert out["eval/s/truncated_frac"] == pytest.approx(1 / 6)
    assert set_metrics("s", rewards, [1] * 6, [False] * 6, 0.5, [])["eval/s/pass@1"] == \
        pytest.approx(4 / 6)


def test_the_evaluation_schedule_and_sampling():
    cfg = load_config("tiny_cpu.yaml", ["eval.sets=[{path: x.jsonl}]", "eval.interval=3",
                                        "trainer.steps=7", "eval.temperature=0",
                                        "eval.max_new_tokens=9", "eval.n=4"])
    assert [d for d in range(8) if eval_due(cfg.eval, cfg.trainer.steps, d)] == [3, 6, 7]
    cfg.eval.at_start = True
    assert [d for d in range(8) if eval_due(cfg.eval, cfg.trainer.steps, d)] == [0, 3, 6, 7]
    cfg.eval.interval = 0
    assert [d for d in range(8) if eval_due(cfg.eval, cfg.trainer.steps, d)] == [0, 7]   # always at the end
    s = eval_sampling(cfg.eval, cfg.rollout)
    assert (s.temperature, s.top_p, s.max_new_tokens) == (0.0, 1.0, 9)
    assert eval_ks(cfg.eval) == [4]
    cfg.eval.pass_k = [1, 2]
    assert eval_ks(cfg.eval) == [2]
    none = load_config("tiny_cpu.yaml")
    assert not any(eval_due(none.eval, none.trainer.steps, d) for d in range(30))   # no sets: never
    assert eval_sampling(none.eval, none.rollout).max_new_tokens == none.rollout.max_new_tokens


def test_eval_config_refusals():
    with pytest.raises(ConfigError, match=r"eval.pass_k: 8 is not in \[1, eval.n=4\]"):
        load_config("tiny_cpu.yaml", ["eval.n=4", "eval.pass_k=[2, 8]"])
    with pytest.raises(ConfigError, match=r"eval.sets\[1\].path: every set needs a file"):
        load_config("tiny_cpu.yaml", ["eval.sets=[{path: a.jsonl}, {name: b}]"])
    with pytest.raises(ConfigError, match="eval.sets: two sets are named 'a'"):
        load_config("tiny_cpu.yaml", ["eval.sets=[{path: x/a.jsonl}, {path: y/a.parquet}]"])
    with pytest.raises(ConfigError, match="eval.sets: .*multi-turn"):
        load_config("tiny_agentic_cpu.yaml", ["eval.sets=[{path: a.jsonl}]"])
    with pytest.raises(ConfigError, match=r"unknown config key 'eval.sets\[0\].prompt'"):
        load_config("tiny_cpu.yaml", ["eval.sets=[{path: a.jsonl, prompt: x}]"])
    with pytest.raises(ConfigError, match="data.sets: replaces data.source and data.path"):
        load_config("tiny_cpu.yaml", ["data.source=jsonl", "data.path=a.jsonl",
                                      "data.sets=[{path: b.jsonl}]"])
    cfg = load_config("tiny_cpu.yaml", ["eval.sets=[{path: rel/a.jsonl}]"])
    assert cfg.eval.sets[0].path.startswith("/")   # resolved like data.path


def test_mixture_sampler_is_proportional_deterministic_and_resumable():
    sizes, weights = [5, 20, 3], [1.0, 2.0, 1.0]
    a = MixtureSampler(sizes, weights, 4, seed=3)
    draws = [i for _ in range(50) for i in a.next_batch()]
    offsets = [0, 5, 25]
    counts = [sum(offsets[k] <= i < offsets[k] + sizes[k] for i in draws) for k in range(3)]
    assert counts == [50, 100, 50]   # exactly 1 : 2 : 1 over 200 draws
    for t in range(1, 201):          # and within one draw of the share at every prefix
        prefix = draws[:t]
        for k in range(3):
            got = sum(offsets[k] <= i < offsets[k] + sizes[k] for i in prefix)
            assert abs(got - t * weights[k] / 4) < 1 + 1e-9
    small = [i for i in draws if i < 5]   # a set's epoch covers all of its prompts
    assert sorted(small[:5]) == [0, 1, 2, 3, 4]
    b = MixtureSampler(sizes, weights, 4, seed=3)
    first = [b.next_batch() for _ in range(7)]
    state = json.loads(json.dumps(b.state_dict()))   # through a checkpoint's JSON
    rest = [b.next_batch() for _ in range(9)]
    c = MixtureSampler(sizes, weights, 4, seed=3)
    c.load_state_dict(state)
    assert [c.next_batch() for _ in range(9)] == rest
    assert [d for batch in first + rest for d in batch] == draws[:64]
    with pytest.raises(ValueError, match="data.sets: the checkpoint's prompt sampler has 1"):
        c.load_state_dict(PromptSampler(5, 2, 0).state_dict())


def test_make_sampler_keeps_the_single_source_sampler():
    cfg = load_config("tiny_cpu.yaml")
    assert isinstance(make_sampler(cfg, [10], 4), PromptSampler)
    cfg = load_config("tiny_cpu.yaml", ["data.source=toy", "data.sets=[{path: a.jsonl, "
                                        "weight: 3}, {path: b.jsonl}]"])
    assert isinstance(make_sampler(cfg, [10, 4], 4), MixtureSampler)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_data_sets_and_eval_sets_are_read_with_their_own_keys(tmp_path):
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration.run_inputs import load_run_inputs
    model = write_tiny_model(ModelInitConfig(), str(tmp_path / "model"))
    a = _write(tmp_path / "a.jsonl", [{"q": f"{i}+1=", "answer": str(i + 1)} for i in range(3)])
    b = _write(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "2+2="}],
                                       "sol": "4"}])
    held = _write(tmp_path / "held.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 5)
    cfg = load_config("tiny_cpu.yaml", [
        f"model.path={model}", f"data.sets=[{{path: {a}, prompt_key: q}}, {{path: {b}, "
        f"messages_key: messages, answer_key: sol, weight: 3}}]",
        f"eval.sets=[{{path: {held}, name: heldout}}]", "eval.max_prompts=2",
        "data.chat_template=true"])
    inp = load_run_inputs(cfg)
    assert inp.set_sizes == [3, 1]
    assert [p.answer for p in inp.prompts] == ["1", "2", "3", "4"]
    assert "<|im_start|>user\n2+2=" in inp.prompts[3].text
    assert [(name, len(ps)) for name, ps in inp.eval_sets] == [("heldout", 2)]
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"text": "no prompt"}])
    cfg.eval.sets[0].path = bad
    with pytest.raises(ConfigError, match=r"eval.sets\[0\]: .*prompt_key: row 1 of "
                                          r".*bad.jsonl has no 'prompt' field"):
        load_run_inputs(cfg)
    cfg.eval.sets[0].path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"eval.sets\[0\].path: .*missing.jsonl"):
        load_run_inputs(cfg)


def test_an_evaluation_reads_its_sets_and_not_the_training_data(tmp_path):
    """`moe-rl eval` loads the inputs with training=False: a training set that is gone, or one
    whose answers cannot fit the warm start, is not read; the eval sets still are."""
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration.run_inputs import load_run_inputs
    model = write_tiny_model(cfg_init := load_config("tiny_cpu.yaml").model.init,
                             str(tmp_path / "model"))
    held = _write(tmp_path / "held.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 3)
    long = _write(tmp_path / "long.jsonl", [{"prompt": "1+1=", "answer": "9" * 4000}])
    for train in ([f"data.sets=[{{path: {tmp_path / 'gone.jsonl'}}}]"],
                  ["data.source=jsonl", f"data.path={long}"]):
        cfg = load_config("tiny_cpu.yaml", [f"model.path={model}", *train,
                                            "trainer.warmup.steps=5",
                                            f"eval.sets=[{{path: {held}, name: held}}]"])
        with pytest.raises(ConfigError, match=r"data\.(sets\[0\]\.path|answer_key)"):
            load_run_inputs(cfg)
        inputs = load_run_inputs(cfg, training=False)
        assert inputs.prompts == [] and [(n, len(p)) for n, p in inputs.eval_sets] == [("held", 3)]
    assert cfg_init.max_position_embeddings < 4000


def test_the_worked_example_reads_its_shipped_data_from_the_repository_root(tmp_path,
                                                                             monkeypatch):
    """configs/tiny_math_cpu.yaml, as README runs it: chat rows with \\boxed{} answers that
    math-verify reads, a held-out set disjoint from the training rows, prompts that fit the
    model's positions with the response cap."""
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.rewards.math_answers import math_reward
    from moe_rl.orchestration.run_inputs import load_run_inputs
    from tests.helpers import ROOT
    monkeypatch.chdir(ROOT)
    cfg = load_config("configs/tiny_math_cpu.yaml")
    model = write_tiny_model(cfg.model.init, str(tmp_path / "model"))
    cfg = load_config("configs/tiny_math_cpu.yaml", [f"model.path={model}"])
    inp = load_run_inputs(cfg)
    ((name, held),) = inp.eval_sets
    assert name == "held_out" and len(held) == 48 and len(inp.prompts) > 400
    assert not {p.text for p in held} & {p.text for p in inp.prompts}
    longest = max(len(p.ids) for p in inp.prompts + held)
    assert longest + cfg.rollout.max_new_tokens <= cfg.model.init.max_position_embeddings
    assert all(p.metadata["operation"] in ("add", "sub") for p in inp.prompts)
    for p in held[:10]:
        assert math_reward("", p.answer, p.answer, {}) == 1.0
        assert math_reward("", "\\boxed{99}", p.answer, {}) == 0.0
    tok = inp.tokenizer   # the tiny tokenizer spells every character of an answer
    assert tok.decode(tok(held[0].answer, add_special_tokens=False)["input_ids"]) == \
        held[0].answer


def test_mixture_weights_near_the_float_limit_keep_their_proportions():
    """data.sets weights of 1e308 and 3e308 sum past the float limit: they must still draw 1:3
    (the shares became [0, 0] and nothing was drawn in proportion)."""
    from moe_rl.data.mixture import MixtureSampler
    huge = MixtureSampler([40, 40], [1e308, 1.7e308], batch_size=4, seed=0)
    plain = MixtureSampler([40, 40], [1.0, 1.7], batch_size=4, seed=0)
    assert huge.shares == pytest.approx([1 / 2.7, 1.7 / 2.7])
    assert huge.shares == pytest.approx(plain.shares)


def test_eval_out_is_checked_before_the_evaluation(tmp_path):
    """`moe-rl eval --out` on a path that cannot be written is refused first, one line, exit 2
    (it failed with a traceback after the whole evaluation)."""
    import subprocess
    import sys
    for out, named in ((tmp_path / "no_such_folder" / "e.json", "does not exist"),
                       (tmp_path, "is a directory")):
        res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "eval", "--config",
                              "tiny_math_cpu.yaml", "--hf", str(tmp_path / "not_even_a_model"),
                              "--out", str(out)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert res.returncode == 2 and f"--out {out}: " in res.stderr and named in res.stderr
        assert "Traceback" not in res.stderr and "not a Hugging Face model" not in res.stderr
