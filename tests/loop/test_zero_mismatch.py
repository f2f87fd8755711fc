"""The zero-mismatch invariant, through the path a user takes: `moe-rl train` (Ray actors, the
reference engine over HTTP on 127.0.0.1) with a float32 engine and a float32 trainer on the same
weights. Whatever the temperature, the truncation, the keep-sampling-mask, the source of pi_old,
the replay mode, the loss and sequence packing, every log-prob compared describes one
distribution, so every mismatch metric is ~0, no correction removes anything, the first
mini-batch's ratio is 1, and the weight check's probe reads ~0 and never fires.

`make test-loop` runs three runs that hold every value of every option and score both kept sets
with the mask; `make test-slow` runs a covering set in which every pair of option values appears
together at least once, and the full product. A combination the
configuration refuses is asserted refused with its message."""
from __future__ import annotations

import json
import math

import pytest

from moe_rl.config import ConfigError, load_config
from tests.helpers import GLM_INIT, GPT_OSS_INIT, init_tiny_model
from tests.hf_models import as_mxfp4_release
from tests.loop.zero_mismatch import (CONFIG, FACTORS, SGLANG_FACTORS, _pairs, all_combos,
                                      check_invariant, covering_set, every_value_and_both_masks,
                                      name, overrides, refused, run_all, train_steps)


# the runs `make test-loop` runs (the covering set: `make test-slow`); the R3 one on the tiny
# GLM-4.5 of `moe-rl init-model` (attention biases, q/k norm, partial rotary, DeepSeek-V3's
# router, shared experts, a dense first layer), the last under R3 too (the first holds R3 off)
# on its tiny gpt-oss (sinks, sliding windows, YaRN, biases, the clamped SwiGLU; MXFP4 experts)
CI_RUNS = [dict(c, family="glm4_moe") if c["replay"] == "r3" else c
           for c in every_value_and_both_masks()]
CI_RUNS[-1] = dict(CI_RUNS[-1], replay="r3", family="gpt_oss")
CI_RUNS.append(dict(CI_RUNS[1], family="minimax_m2"))   # its q/k norm over all heads
# megatron's loop over the experts (every other run: the grouped experts, the default) on the
# tiny GLM-4.5 and gpt-oss (shared experts; expert biases and the clamped SwiGLU)
CI_RUNS += [dict(CI_RUNS[0], family="glm4_moe", experts="sequential"),
            dict(CI_RUNS[-2], experts="sequential")]
# R2 (the trainer replays the routing of its own pi_old pass) on the same two families, on the
# reference engine (`make test-slow`; on the real SGLang: tests/loop/test_sglang.py)
FAMILY_R2 = [dict(c, replay="r2") for c in CI_RUNS if c.get("family")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_mismatch") / "model"
    init_tiny_model(str(out), str(CONFIG))
    return out


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    """family -> model directory: the tiny Qwen3-MoE, GLM-4.5, gpt-oss (in the form of
    gpt-oss's release: experts in MXFP4, read dequantised, served from a bfloat16 copy) and
    MiniMax-M2."""
    glm = init_tiny_model(tmp_path_factory.mktemp("zero_mismatch_glm") / "model", CONFIG,
                          *GLM_INIT)
    gpt_oss = init_tiny_model(tmp_path_factory.mktemp("zero_mismatch_gpt_oss") / "model",
                              CONFIG, *GPT_OSS_INIT)
    as_mxfp4_release(gpt_oss)
    minimax = init_tiny_model(tmp_path_factory.mktemp("zero_mismatch_minimax") / "model",
                              CONFIG, "model.init.architecture=minimax_m2")
    return {"qwen3_moe": model_dir, "glm4_moe": glm, "gpt_oss": gpt_oss, "minimax_m2": minimax}


@pytest.mark.parametrize("factors", [FACTORS, SGLANG_FACTORS], ids=["reference", "sglang"])
def test_the_ci_runs_hold_every_value_and_both_masks_in_three(factors):
    combos = every_value_and_both_masks(factors)
    assert len(combos) == 3 and not any(refused(c) for c in combos)
    assert all(any(c[k] == v for c in combos) for k, values in factors.items() for v in values)
    for sampling in ("top_k", "top_k_top_p_min_p"):
        assert any(c["mask"] and c["sampling"] == sampling for c in combos), sampling


def test_covering_set_covers_every_valid_pair():
    chosen = covering_set()
    valid = [c for c in all_combos() if not refused(c)]
    assert set().union(*(_pairs(c) for c in chosen)) == set().union(*(_pairs(c) for c in valid))
    assert len(chosen) <= 12


@pytest.mark.parametrize("combo", [c for c in all_combos() if refused(c)][:2], ids=name)
def test_refused_combinations_name_the_reason(combo):
    with pytest.raises(ConfigError, match="keep_sampling_mask: needs a finite rollout.sampling.top_k"):
        load_config(CONFIG, overrides(combo))


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.multiproc
@pytest.mark.parametrize("combo", CI_RUNS + [pytest.param(c, marks=pytest.mark.slow)
                                             for c in covering_set() + FAMILY_R2
                                             if c not in CI_RUNS],
                         ids=name)   # one run each: xdist spreads them
def test_zero_mismatch_covering_set(models, tmp_path, combo):
    model = models[combo.get("family", "qwen3_moe")]
    check_invariant(combo, train_steps(model, tmp_path / name(combo), combo)[0])
    if combo.get("family") == "gpt_oss":   # the engines served the release's bfloat16 copy
        served = json.loads((tmp_path / name(combo) / "bf16_start" / "config.json").read_text())
        assert "quantization_config" not in served and served["dtype"] == "bfloat16"


# `make test-slow`: the DPPO and RSPO runs (tests/algo/test_dppo.py holds binary TV and KL to a
# float64 sum, tests/trainer/test_bf16.py trains DPPO-TV and RSPO, and
# tests/algo/test_router_shift.py runs RSPO through `moe-rl train`)
DPPO_AND_RSPO = [pytest.param({"temperature": 1.0, "sampling": "top_k", "mask": True,
                               "pi_old": "rollout", "replay": "r3", "loss": "dppo_tv",
                               "pack": False}, marks=pytest.mark.slow),
                 pytest.param({"temperature": 0.7, "sampling": "full", "mask": False,
                               "pi_old": "trainer", "replay": "off", "loss": "dppo_kl",
                               "pack": True}, marks=pytest.mark.slow),
                 pytest.param({"temperature": 0.7, "sampling": "top_k", "mask": True,
                               "pi_old": "trainer", "replay": "r3", "loss": "gmpo", "pack": True,
                               "router_shift": True}, marks=pytest.mark.slow),
                 {"temperature": 1.0, "sampling": "top_k_top_p_min_p", "mask": True,
                  "pi_old": "engine_avg", "replay": "r3", "loss": "cispo", "pack": False,
                  "penalty": True, "mini_batches": 2, "advantage": "qae"},
                 {"temperature": 0.7, "sampling": "full", "mask": False, "pi_old": "rollout",
                  "replay": "off", "loss": "sapo", "pack": True, "mini_batches": 2}]


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.multiproc
@pytest.mark.parametrize("combo", DPPO_AND_RSPO, ids=name)
def test_zero_mismatch_dppo_and_rspo(models, tmp_path, combo):
    """DPPO through `moe-rl train`, with R3 (binary TV, the keep-sampling-mask, pi_old from the
    rollout as its authors recommend) and without (binary KL, packed), RSPO (GMPO with the
    router-shift weight) under R3, CISPO with the penalty on the gap to the engine's policy
    (R3, the mask, pi_old from two engine passes) and SAPO (packed, pi_old from the rollout),
    both over two mini-batches so the second one's ratio is live (CISPO's on QAE's advantages
    of graded rewards, each checked against its group's rewards): on identical float32 engine
    and trainer no token leaves the trust region, the divergence is ~0, the router-shift weight
    is exactly 1, CISPO clips no weight, SAPO's gate stays open, and the penalty sees only the
    first update's movement."""
    m = train_steps(models[combo.get("family", "qwen3_moe")], tmp_path / name(combo), combo)[0]
    check_invariant(combo, m)
    if combo["loss"].startswith("dppo"):
        assert m["dppo/divergence_mean"] < 1e-6, (name(combo), m["dppo/divergence_mean"])
    if combo["loss"] == "cispo":   # 1 on the first mini-batch; moved by |d| on the second,
        # d = lp - lp_roll, whose root mean square the penalty's metric bounds (clip_frac is 0)
        gap = math.sqrt(m["rollout_penalty/sq_gap_mean"])
        assert 0 < abs(m["cispo/weight_mean"] - 1.0) <= 1.5 * gap, (m["cispo/weight_mean"], gap)
    if combo.get("penalty"):   # 0 on the first mini-batch, the update's movement on the second
        assert 0.0 < m["rollout_penalty/sq_gap_mean"] < 1e-2, m["rollout_penalty/sq_gap_mean"]
    if combo.get("advantage") == "qae":
        check_qae_advantages(tmp_path / name(combo), m)


def check_qae_advantages(run_dir, m):
    """Each logged sample's advantage is (R - Q_0.4) / (std + 1e-6) of its group's rewards
    (groups of two: Q_0.4 = lo + 0.4 (hi - lo)), and advantage/zero_frac is their share of 0."""
    rows = [json.loads(r) for r in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4, rows
    zeros = 0
    for row in rows:
        group = sorted(r["reward"] for r in rows if r["group_id"] == row["group_id"])
        lo, hi = group
        std = abs(hi - lo) / math.sqrt(2)
        want = (row["reward"] - (lo + 0.4 * (hi - lo))) / (std + 1e-6)
        assert row["advantage"] == pytest.approx(want, rel=1e-5, abs=1e-6), (row, group)
        zeros += want == 0
    assert m["advantage/zero_frac"] == zeros / 4


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(7200)   # 240 runs of `moe-rl train`, two at a time: ~70 minutes on 2 cores
def test_zero_mismatch_full_product(model_dir, tmp_path):
    combos = [c for c in all_combos() if not refused(c)]
    for combo in [c for c in all_combos() if refused(c)]:
        with pytest.raises(ConfigError, match="keep_sampling_mask: needs a finite rollout.sampling.top_k"):
            load_config(CONFIG, overrides(combo))
    results = run_all(model_dir, tmp_path, combos)
    for combo in combos:
        check_invariant(combo, results[name(combo)][0])
