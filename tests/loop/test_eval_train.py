"""Evaluation, several weighted training sets, math-verify rewards and the reward service, each
through `moe-rl train` (and `moe-rl eval`) on the tiny model."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import init_tiny_model
from tests.helpers import ROOT, WALL_CLOCK, train_cli
from tests.helpers import train_tiny
from tests.helpers import RewardServer

pytestmark = pytest.mark.loop

DATA = ROOT / "configs" / "data"
TRAIN, HELD = DATA / "tiny_math_train.jsonl", DATA / "tiny_math_eval.jsonl"
EVAL_KEYS = ["data.source=toy", "data.path=null",
             f"data.sets=[{{path: {TRAIN}, name: math}}, {{path: {HELD}, name: extra, "
             f"weight: 0.5}}]",
             f"eval.sets=[{{path: {HELD}, name: held_out}}]", "eval.max_prompts=6",
             "eval.temperature=0", "eval.n=2", "eval.pass_k=[2]", "eval.interval=1",
             "eval.at_start=true"]


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _eval_cli(workdir, out, *source):
    """`moe-rl eval` (the console script) with the run's keys, its training data gone: an
    evaluation does not read it."""
    gone = f"data.sets=[{{path: {workdir / 'gone.jsonl'}, name: math}}]"
    res = subprocess.run([str(pathlib.Path(sys.executable).with_name("moe-rl")), "eval",
                          "--config", str(ROOT / "configs" / "tiny_math_cpu.yaml"), *source,
                          "--out", str(out), *EVAL_KEYS, gone], cwd=workdir,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def _train_with_evaluation(tmp_path):
    """Two steps of the tiny math model evaluated at the start and after every step; the
    finished process and its evaluation rows."""
    init_tiny_model(str(tmp_path / "model"), "tiny_math_cpu.yaml")
    res = train_cli(tmp_path, 2, *EVAL_KEYS, config="tiny_math_cpu.yaml")
    return res, [r for r in _rows(tmp_path / "run") if r.get("kind") == "eval"]


def test_eval_through_train_and_moe_rl_eval_of_its_checkpoint(tmp_path):
    res, evals = _train_with_evaluation(tmp_path)
    assert [r["step"] for r in evals] == [0, 1, 2]   # at start, every step (the end included)
    steps = [r for r in _rows(tmp_path / "run") if "kind" not in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:   # the throughput, and each training set's reward beside the batch's
        assert r["throughput/rollout_tokens_per_s"] >= r["throughput/tokens_per_s"] > 0
        sets = [r[f"reward/{name}/mean"] for name in ("math", "extra")
                if f"reward/{name}/mean" in r]
        assert sets and min(sets) - 1e-9 <= r["reward/mean"] <= max(sets) + 1e-9, r
    for r in evals:   # greedy: both samples of a prompt agree, so pass@2 = pass@1
        assert r["eval/held_out/pass@2"] == pytest.approx(r["eval/held_out/pass@1"])
        assert 0 <= r["eval/held_out/pass@1"] <= 1
        assert r["eval/held_out/response_len_mean"] > 0
        assert r["eval/held_out/reward_mean"] == pytest.approx(r["eval/held_out/pass@1"])
    assert "eval after 2 updates: held_out/reward_mean" in res.stdout
    assert "  eval: held_out pass@1" in res.stdout   # the run's summary
    from moe_rl.outputs.report import read_scalars
    tb = read_scalars(str(tmp_path / "run"))
    assert list(tb["eval/held_out/pass@1"][0]) == [0, 1, 2]
    # the same evaluation without training, on the last checkpoint: the same numbers (greedy
    # evaluation of the same weights)
    again = _eval_cli(tmp_path, tmp_path / "e.json", "--checkpoint",
                      str(tmp_path / "run" / "checkpoints"))
    for key in ("pass@1", "pass@2", "reward_mean", "response_len_mean", "truncated_frac"):
        assert again[f"eval/held_out/{key}"] == pytest.approx(evals[-1][f"eval/held_out/{key}"])


@pytest.mark.slow   # `make test-slow`: the run above and its checkpoint's evaluation stay in CI
def test_eval_of_the_export_and_through_a_resume(tmp_path):
    """`moe-rl eval` of the exported final policy gives the run's last evaluation; a resumed
    run evaluates at the same steps: the step-2 evaluation (its rows are dropped with the
    steps after the checkpoint) is repeated, with the same numbers, and the summary covers
    the whole run."""
    _, evals = _train_with_evaluation(tmp_path)
    final = _eval_cli(tmp_path, tmp_path / "e1.json", "--hf", str(tmp_path / "run" / "final_hf"))
    for key in ("pass@1", "pass@2", "reward_mean", "response_len_mean", "truncated_frac"):
        assert final[f"eval/held_out/{key}"] == pytest.approx(evals[-1][f"eval/held_out/{key}"])
    res = train_cli(tmp_path, 3, *EVAL_KEYS, config="tiny_math_cpu.yaml", resume=True)
    resumed = [r for r in _rows(tmp_path / "run") if r.get("kind") == "eval"]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert resumed[2]["eval/held_out/pass@1"] == evals[2]["eval/held_out/pass@1"]
    assert "run finished: 3 RL steps (steps 0-2) in " in res.stdout
    assert "resumed at step 2" in res.stdout
    assert f"  eval: held_out pass@1 {evals[0]['eval/held_out/pass@1']:.3f} (after 0 updates) " \
        f"-> {resumed[3]['eval/held_out/pass@1']:.3f} (after 3)" in res.stdout


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_reward_service_through_train(tmp_path):
    """Rewards from a service that fails its first request (retried) and answers every third
    one with garbage, every fifth with strings, booleans and numbers too large for a float, and
    every seventh past data.reward_service.max_answer_mb (each scored 0, counted): the steps'
    reward means are the service's answers. The trainer sizes its micro-batches by a token
    budget in this run."""
    answered: list[float] = []
    garbage: list[int] = []

    def behave(body, call):
        if call == 1:
            return 503, b"warming up"
        if call % 3 == 0:
            garbage.append(len(body["samples"]))
            return 200, b"<html>oops</html>"
        if call % 5 == 0:
            garbage.append(len(body["samples"]))
            bad = (['"0.5"', "true"] if call % 10 else ["1" + "0" * 400, "false"]) * 2
            return 200, ('{"rewards": [' + ", ".join(bad[:len(body["samples"])]) + "]}").encode()
        if call % 7 == 0:
            garbage.append(len(body["samples"]))
            return 200, json.dumps({"rewards": [1.0] * len(body["samples"]),
                                    "pad": "x" * 20_000}).encode()
        rewards = [len(s["response"]) / 10 + (s["metadata"]["stopped"] is True)
                   for s in body["samples"]]
        answered.extend(rewards)
        return 200, json.dumps({"rewards": rewards}).encode()
    srv = RewardServer(behave)
    try:
        _, rows = train_tiny(tmp_path, 2, 4, f"data.reward_service.url={srv.url}",
                              "data.reward_service.batch_size=2",
                              "data.reward_service.max_concurrency=2",
                              "data.reward_service.max_answer_mb=0.01",
                              # micro-batches by a token budget, no row cap
                              "trainer.micro_batch_size=null",
                              "trainer.max_tokens_per_micro_batch=40")
    finally:
        srv.close()
    assert rows[-1]["reward/errors"] == sum(garbage) > 0
    total = sum(r["reward/mean"] for r in rows) * 16   # 4 prompts x 4 samples a step
    assert total == pytest.approx(sum(answered), abs=1e-6)
    assert all(len(r["samples"]) <= 2 for r in srv.requests)
    assert all(r["timing/reward_s"] >= 0 for r in rows)


BATCHED_REWARDS = """
from moe_rl.rewards.functions import toy_reward

async def toy_batched(samples):
    return [toy_reward(s["prompt"], s["response"], s["label"], s["metadata"]) for s in samples]

def contains(samples):
    return [float(s["label"] in s["response"]) for s in samples]
"""


@pytest.mark.slow   # 60 s: in `make test-slow`; evaluation through `moe-rl train` stays in CI
def test_evaluation_leaves_training_untouched_in_the_asynchronous_pipeline(tmp_path):
    """The same run with and without evaluation (rollout.max_staleness=1: each evaluation waits
    for the weight version it names) trains on the same samples: evaluation draws nothing from
    the training sampler and changes no engine state the rollouts see. Training rewards from an
    async batched function, evaluation rewards from eval.reward (a plain batched one)."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(2)))
    runs = {}
    for name, extra in (("plain", []), ("eval", [f"eval.sets=[{{path: {held}}}]",
                                                 "eval.interval=1", "eval.at_start=true",
                                                 "eval.n=3", "eval.temperature=1.0",
                                                 "eval.reward=batched_rewards:contains"])):
        work = tmp_path / name
        work.mkdir()
        (work / "batched_rewards.py").write_text(BATCHED_REWARDS)
        _, rows = train_tiny(work, 3, 4, "rollout.max_staleness=1",
                              "data.reward=batched_rewards:toy_batched", *extra)
        runs[name] = rows
    evals = [r for r in runs["eval"] if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
    assert all(0 <= r["eval/held/pass@1"] <= r["eval/held/pass@3"] <= 1 for r in evals)
    # eval.reward (0 or 1) scored the evaluation, not the training's toy reward (0.1 steps)
    assert all(r["eval/held/reward_mean"] == pytest.approx(r["eval/held/pass@1"])
               for r in evals)
    assert all(r["reward/errors"] == 0 for r in runs["eval"] if "kind" not in r)
    # float32 engine = trainer: routing agrees at each sample's own version (stale or not)
    assert all(r["routing/agreement"] >= 0.999 for r in runs["plain"])
    assert any("staleness/routing_agreement" in r for r in runs["plain"])
    train = {name: [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
                    for r in rows if "kind" not in r] for name, rows in runs.items()}
    assert len(train["eval"]) == len(train["plain"]) == 3
    for with_eval, plain in zip(train["eval"], train["plain"]):
        same = [k for k in plain if k.startswith(("reward/", "rollout/", "response"))]
        assert len(same) > 5 and {k: with_eval[k] for k in same} == {k: plain[k] for k in same}
        # the rest up to the engine's batch-dependent float32 rounding (a few 1e-7)
        assert with_eval == pytest.approx(plain, rel=1e-4, abs=1e-5)


def test_a_run_with_one_evaluation_and_one_step_summarises_them_once(tmp_path):
    """eval.at_start=false, one step: the summary gives the one evaluation and the one step's
    reward, without a "before -> after" of a thing with itself."""
    init_tiny_model(str(tmp_path / "model"), "tiny_math_cpu.yaml")
    res = train_cli(tmp_path, 1, *EVAL_KEYS, "eval.at_start=false", config="tiny_math_cpu.yaml")
    evals = [r for r in _rows(tmp_path / "run") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [1]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("  eval: "))
    assert line == f"  eval: held_out pass@1 {evals[0]['eval/held_out/pass@1']:.3f} (after 1 " \
        f"updates)"
    finished = next(ln for ln in res.stdout.splitlines() if ln.startswith("run finished: "))
    assert "mean reward " in finished and "rise" not in finished and "first 1" not in finished
