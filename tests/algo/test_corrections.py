"""Corrections, keep-sampling-mask scoring, n-pass pi_old and the metrics, against references."""
import dataclasses
import math

import pytest
import torch

from moe_rl import config as config_mod
from moe_rl.algo import (CORRECTIONS, CorrectionInputs, apply_corrections, average_pass_logprobs,
                         batch_metrics, collapse_guard, mismatch_metrics,
                         routing_agreement)
from moe_rl.algo.corrections import metropolis_chain
from moe_rl.config import CorrectionParams
from tests.helpers import kernel_on_logits

P = CorrectionParams(tis_c=2.0, mis_c=2.0, rs_low=0.5, rs_high=2.0, geo_low=0.999, geo_high=1.001,
                     icepop_low=0.5, icepop_high=5.0, opsm_delta=0.1)


def _inputs(log_ratios, lengths=None, adv=None, groups=None, lp=None, gen=None):
    """Sequences whose per-token log(pi_old/pi_roll) are given rows."""
    d = torch.tensor(log_ratios, dtype=torch.float64)
    B, T = d.shape
    mask = torch.ones(B, T, dtype=torch.bool)
    if lengths is not None:
        for i, n in enumerate(lengths):
            mask[i, n:] = False
    lp_roll = torch.zeros(B, T, dtype=torch.float64)  # exact: log(pi_old/pi_roll) == d
    return CorrectionInputs(lp_old=lp_roll + d, lp_roll=lp_roll, mask=mask,
                            advantages=None if adv is None else torch.tensor(adv, dtype=torch.float64),
                            group_ids=None if groups is None else torch.tensor(groups),
                            lp=lp, generator=gen)


def test_correction_names_match_config():
    assert tuple(CORRECTIONS) == tuple(config_mod.CORRECTIONS)


def test_hand_worked_rho_seq_3_masked_by_mis_and_truncated_by_tis():
    ln3 = math.log(3.0)
    x = _inputs([[ln3 / 2, ln3 / 2], [0.1, -0.1]])   # rho_seq = 3 and 1
    mis = apply_corrections(["seq_mis"], P, x)
    assert mis.keep[0].tolist() == [False, False] and mis.keep[1].all()
    assert mis.weights[0].tolist() == [0.0, 0.0]
    assert mis.weights[1].tolist() == pytest.approx([1.0, 1.0])
    assert mis.metrics["correction/seq_mis/masked_seq_frac"] == 0.5
    assert mis.metrics["correction/seq_mis/masked_token_frac"] == 0.5
    tis = apply_corrections(["seq_tis"], P, x)
    assert tis.keep.all()
    assert tis.weights[0].tolist() == pytest.approx([2.0, 2.0])
    assert tis.weights[1].tolist() == pytest.approx([1.0, 1.0])


def test_hand_worked_deepseek_mask_negative_advantage_only():
    # engine log-probs above the policy by 0.5 nats per token: per-token KL 0.5 > delta 0.1
    lp_roll = torch.zeros(2, 3, dtype=torch.float64) - 1.0
    lp = lp_roll - 0.5
    x = CorrectionInputs(lp_old=lp.clone(), lp_roll=lp_roll, mask=torch.ones(2, 3, dtype=torch.bool),
                         advantages=torch.tensor([-1.0, 1.0], dtype=torch.float64), lp=lp)
    res = apply_corrections(["opsm"], P, x)
    assert res.keep[0].tolist() == [False] * 3      # negative advantage, over delta: masked
    assert res.keep[1].tolist() == [True] * 3       # positive advantage: kept
    # under delta: kept
    small = CorrectionInputs(lp_old=lp_roll - 0.05, lp_roll=lp_roll,
                             mask=torch.ones(2, 3, dtype=torch.bool),
                             advantages=torch.tensor([-1.0, 1.0], dtype=torch.float64),
                             lp=lp_roll - 0.05)
    assert apply_corrections(["opsm"], P, small).keep.all()


def test_deepseek_mask_reference_is_selectable():
    lp_roll = torch.zeros(1, 2, dtype=torch.float64)
    lp_old = lp_roll - 1.0   # pi_old far from the engine
    lp = lp_old.clone()      # the policy equals pi_old
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mk = lambda: CorrectionInputs(lp_old=lp_old, lp_roll=lp_roll, mask=torch.ones(1, 2), advantages=adv, lp=lp)
    assert not apply_corrections(["opsm"], P, mk()).keep.any()   # engine reference: KL 1 > 0.1
    p2 = CorrectionParams(opsm_delta=0.1, opsm_reference="pi_old")
    assert apply_corrections(["opsm"], p2, mk()).keep.all()       # pi_old reference: KL 0


def _reference_weights(name, d, mask):
    """Independent per-rule reference on python floats."""
    B, T = len(d), len(d[0])
    w = [[1.0] * T for _ in range(B)]
    keep = [[bool(mask[i][t]) for t in range(T)] for i in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                w[i][t] = 0.0
        toks = [d[i][t] for t in range(T) if mask[i][t]]
        s = sum(toks)
        rho_seq = math.exp(max(-20, min(20, s)))
        rho_geo = math.exp(s / len(toks))
        for t in range(T):
            if not mask[i][t]:
                continue
            rho = math.exp(d[i][t])
            if name == "token_tis":
                w[i][t] = min(rho, 2.0)
            elif name == "seq_tis":
                w[i][t] = min(rho_seq, 2.0)
            elif name == "seq_mis":
                w[i][t] = rho_seq if rho_seq <= 2.0 else 0.0
                keep[i][t] = rho_seq <= 2.0
            elif name == "seq_rs":
                keep[i][t] = 0.5 <= rho_seq <= 2.0
            elif name == "geo_rs":
                keep[i][t] = 0.999 <= rho_geo <= 1.001
            elif name == "icepop":
                keep[i][t] = 0.5 <= rho <= 5.0
                w[i][t] = rho if keep[i][t] else 0.0
            if not keep[i][t]:
                w[i][t] = 0.0
    return w, keep


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", "seq_mis", "seq_rs", "geo_rs", "icepop"])
def test_corrections_against_reference(name):
    g = torch.Generator().manual_seed(1)
    d = (torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.6)
    d[2] = 0.0002  # a near-on-policy sequence (kept by geo-RS)
    d[3, 0] = 3.0  # an extreme token
    lengths = [5, 4, 5, 3, 5, 2]
    x = _inputs(d.tolist(), lengths)
    res = apply_corrections([name], P, x)
    w_ref, keep_ref = _reference_weights(name, d.tolist(), x.mask.tolist())
    assert res.keep.tolist() == keep_ref
    assert torch.allclose(res.weights, torch.tensor(w_ref, dtype=torch.float64), atol=1e-12)


def test_icepop_boundaries_inclusive():
    x = _inputs([[math.log(0.5), math.log(5.0), math.log(0.49), math.log(5.1)]])
    res = apply_corrections(["icepop"], P, x)
    assert res.keep[0].tolist() == [True, True, False, False]
    assert res.weights[0].tolist() == pytest.approx([0.5, 5.0, 0.0, 0.0])


def test_composition_icepop_then_seq_mis():
    x = _inputs([[0.1, 3.0, 0.1], [0.2, 0.2, 0.2]])
    res = apply_corrections(["icepop", "seq_mis"], P, x)
    # seq 0: token 1 removed by IcePop (e^3 > 5); rho_seq = e^3.2 > 2: MIS masks the whole sequence
    assert not res.keep[0].any()
    # seq 1: rho_seq = e^0.6 = 1.82 <= 2: kept, weight rho_t * rho_seq
    assert res.keep[1].all()
    assert res.weights[1].tolist() == pytest.approx([math.exp(0.2) * math.exp(0.6)] * 3)
    assert res.metrics["correction/icepop/masked_token_frac"] == pytest.approx(1 / 6)
    assert res.metrics["correction/seq_mis/masked_seq_frac"] == pytest.approx(0.5)


def test_metropolis_seeded_and_accepts_all_when_equal():
    x = _inputs([[0.3, 0.3]] * 4, groups=[0, 0, 0, 0])
    res = apply_corrections(["metropolis"], P, x)
    assert res.keep.all()
    g = torch.Generator()
    d = (torch.randn(12, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).tolist()
    groups = [0] * 6 + [1] * 6
    runs = []
    for _ in range(2):
        g.manual_seed(42)
        runs.append(apply_corrections(["metropolis"], P, _inputs(d, groups=groups, gen=g)).keep)
    assert torch.equal(runs[0], runs[1])
    # the first sample of every group is always accepted
    assert runs[0][0].all() and runs[0][6].all()


def test_metropolis_acceptance_against_reference_walk():
    d = torch.randn(10, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    groups = [0] * 10
    got = apply_corrections(["metropolis"], P,
                            _inputs(d.tolist(), groups=groups,
                                    gen=torch.Generator().manual_seed(5))).keep[:, 0].tolist()
    # reference: same uniform stream, plain python walk
    g = torch.Generator().manual_seed(5)
    w = [math.exp(float(d[i].sum())) for i in range(10)]
    cur, ref = 0, [True] + [False] * 9
    for c in range(1, 10):
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        if u < min(1.0, w[c] / w[cur]):
            ref[c] = True
            cur = c
    assert got == ref


def test_snis_mean_one_per_group():
    d = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.3
    x = _inputs(d.tolist(), groups=[0, 0, 0, 1, 1, 1])
    res = apply_corrections(["seq_tis", "snis"], P, x)
    for g in (0, 1):
        seq_w = res.weights[3 * g:3 * g + 3, 0]
        assert float(seq_w.mean()) == pytest.approx(1.0, rel=1e-12)
        raw = [min(math.exp(float(d[i].sum())), 2.0) for i in range(3 * g, 3 * g + 3)]
        assert seq_w.tolist() == pytest.approx([r / (sum(raw) / 3) for r in raw])


def test_importance_metrics_reference():
    d = torch.randn(3, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 0.5
    res = apply_corrections(["token_tis"], P, _inputs(d.tolist()))
    w = [min(math.exp(v), 2.0) for row in d.tolist() for v in row]
    assert res.metrics["is/ess"] == pytest.approx(sum(w) ** 2 / (len(w) * sum(v * v for v in w)))
    assert res.metrics["is/mean"] == pytest.approx(sum(w) / len(w))
    assert res.metrics["is/max"] == pytest.approx(max(w))


def test_unknown_correction_and_missing_inputs():
    x = _inputs([[0.0]])
    with pytest.raises(ValueError, match="unknown correction"):
        apply_corrections(["tis"], P, x)
    with pytest.raises(ValueError, match="advantages"):
        apply_corrections(["opsm"], P, x)
    with pytest.raises(ValueError, match="group_ids"):
        apply_corrections(["snis"], P, x)
    with pytest.raises(ValueError, match="opsm_delta"):
        apply_corrections(["opsm"], CorrectionParams(),
                          _inputs([[0.0]], adv=[1.0]))


# ---------------------------------------------------------------- keep sampling mask

def _ragged(sets):
    offsets = [0]
    ids = []
    for s in sets:
        ids.extend(s)
        offsets.append(len(ids))
    return torch.tensor(offsets, dtype=torch.long), torch.tensor(ids, dtype=torch.int32)


def test_masked_logprob_entropy_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, generator=g, dtype=torch.float64) * 2
    targets = torch.tensor([3, 0, 8, 5])
    sets = [[3, 1, 7], [], [8], [5, 2, 0, 4]]
    offsets, ids = _ragged(sets)
    T = 0.7
    lp, ent = kernel_on_logits(logits, targets, offsets, ids, temperature=T)
    for r in range(4):
        vocab = sets[r] or list(range(9))
        z = [float(logits[r, v]) / T for v in vocab]
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        assert float(lp[r]) == pytest.approx(float(logits[r, targets[r]]) / T - lse, rel=1e-12)
        p = [math.exp(v - lse) for v in z]
        assert float(ent[r]) == pytest.approx(-sum(pi * math.log(pi) for pi in p), abs=1e-12)
    assert float(lp[2]) == pytest.approx(0.0) and float(ent[2]) == pytest.approx(0.0, abs=1e-12)


def test_masked_logprob_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    offsets, ids = _ragged([[1, 2], [0, 1, 2, 3, 4, 5], []])
    targets = torch.tensor([2, 4, 0])

    def f(z):
        lp, ent = kernel_on_logits(z, targets, offsets, ids, temperature=1.3)
        return lp.sum() + 0.5 * ent.sum()
    assert torch.autograd.gradcheck(f, (logits,))


def test_masked_logprob_errors():
    logits = torch.randn(2, 5)
    offsets, ids = _ragged([[1, 2], [3]])
    with pytest.raises(ValueError, match="row 1: target 4 is not in its kept set"):
        kernel_on_logits(logits, torch.tensor([1, 4]), offsets, ids)
    with pytest.raises(ValueError, match="kept_ids"):
        kernel_on_logits(logits, torch.tensor([1, 3]), *_ragged([[1], [7]]))
    with pytest.raises(ValueError, match="kept_offsets"):
        kernel_on_logits(logits, torch.tensor([1, 3]), torch.tensor([0, 1]), ids)


# ---------------------------------------------------------------- n-pass pi_old

def test_pass_averaging_in_probability_space():
    g = torch.Generator().manual_seed(4)
    passes = -torch.rand(3, 2, 4, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    lp_old, std, m = average_pass_logprobs(passes, mask)
    for i in range(2):
        for t in range(4):
            vals = [float(passes[j, i, t]) for j in range(3)]
            assert float(lp_old[i, t]) == pytest.approx(math.log(sum(math.exp(v) for v in vals) / 3))
            mu = sum(vals) / 3
            assert float(std[i, t]) == pytest.approx(math.sqrt(sum((v - mu) ** 2 for v in vals) / 3))
    assert m["pi_old/pass_std"] == pytest.approx(float(std[mask].mean()))
    one, std1, m1 = average_pass_logprobs(passes[:1], mask)
    assert torch.equal(one, passes[0]) and m1["pi_old/pass_std"] == 0
    same = passes[:1].expand(4, -1, -1)
    assert average_pass_logprobs(same, mask)[2]["pi_old/pass_std"] == 0


# ---------------------------------------------------------------- metrics

def test_mismatch_metrics_reference():
    g = torch.Generator().manual_seed(6)
    lr = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    lt = lr + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    lt[0, 0] = lr[0, 0] + 1.0   # an extreme token (ratio e)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    m = mismatch_metrics(lt, lr, mask)
    pairs = [(float(lt[i, t]), float(lr[i, t])) for i in range(3) for t in range(5) if mask[i, t]]
    n = len(pairs)
    d = [a - b for a, b in pairs]
    assert m["mismatch/k1"] == pytest.approx(sum(b - a for a, b in pairs) / n)
    assert m["mismatch/k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / n)
    assert m["mismatch/abs_diff_max"] == pytest.approx(max(abs(x) for x in d))
    assert m["mismatch/abs_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / n)
    assert m["mismatch/extreme_frac"] == pytest.approx(
        sum(1 for x in d if not 0.5 <= math.exp(x) <= 2) / n)
    pt = [math.exp(a) for a, _ in pairs]
    pr = [math.exp(b) for _, b in pairs]
    mt, mr = sum(pt) / n, sum(pr) / n
    cov = sum((x - mt) * (y - mr) for x, y in zip(pt, pr))
    pear = cov / math.sqrt(sum((x - mt) ** 2 for x in pt) * sum((y - mr) ** 2 for y in pr))
    assert m["mismatch/prob_pearson"] == pytest.approx(pear)
    assert m["ppl/token_pooled_train"] == pytest.approx(math.exp(-sum(a for a, _ in pairs) / n))
    assert m["ppl/token_pooled_rollout"] == pytest.approx(math.exp(-sum(b for _, b in pairs) / n))
    assert m["chi2/token"] == pytest.approx(sum(math.exp(2 * x) for x in d) / n - 1)
    seq = []
    for i in range(3):
        seq.append(math.exp(sum(float(lt[i, t] - lr[i, t]) for t in range(5) if mask[i, t])))
    assert m["chi2/seq"] == pytest.approx(sum(s * s for s in seq) / 3 - 1)


def test_routing_agreement_sets_not_order():
    eng = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]])
    tr = torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[1, 2], [0, 4]]])
    m = routing_agreement(tr, eng, layer_names=[1, 3])
    assert m["routing/agreement"] == pytest.approx(4 / 6)
    assert m["routing/agreement_layer_1"] == pytest.approx(2 / 3)
    assert m["routing/agreement_layer_3"] == pytest.approx(2 / 3)
    assert m["routing/token_differs_frac"] == pytest.approx(2 / 3)   # positions 1 and 2
    valid = torch.tensor([True, False, True])
    assert routing_agreement(tr, eng, valid)["routing/agreement"] == pytest.approx(3 / 4)
    assert routing_agreement(tr, eng, valid)["routing/token_differs_frac"] == 0.5


def test_batch_metrics_and_guard():
    m = batch_metrics(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]),
                      entropy=torch.ones(3, 3) * 2, kept_sizes=torch.tensor([0, 3, 5]))
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx(math.sqrt(((0.5) ** 2 * 2) / 3))
    assert m["response_len/mean"] == pytest.approx(2.0)
    assert m["entropy"] == 2.0 and m["sampling_mask/kept_mean"] == 4.0
    assert collapse_guard({"mismatch/k3": 0.2}, 0.1)
    assert not collapse_guard({"mismatch/k3": 0.05}, 0.1)
    assert not collapse_guard({"mismatch/k3": 5.0}, None)


def _chain_estimates(repeats: bool):
    """10^5 proposals from a known q over 6 states; target pi known in closed form."""
    states = torch.arange(6, dtype=torch.float64)
    q = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05], dtype=torch.float64)
    pi = torch.exp(-0.5 * (states - 3.5) ** 2)
    pi = pi / pi.sum()
    draws = torch.multinomial(q, 100_000, replacement=True,
                              generator=torch.Generator().manual_seed(0))
    log_w = (pi.log() - q.log())[draws]
    params = dataclasses.replace(P, metropolis_count_repeats=repeats)
    res = apply_corrections(["metropolis"], params, CorrectionInputs(
        lp_old=log_w[:, None].clone(), lp_roll=torch.zeros(len(draws), 1, dtype=torch.float64),
        mask=torch.ones(len(draws), 1, dtype=torch.bool),
        group_ids=torch.zeros(len(draws), dtype=torch.long),
        generator=torch.Generator().manual_seed(1)))
    w = res.weights[:, 0]
    f = states[draws]
    return float((w * f).sum() / w.sum()), float((pi * states).sum()), res


def test_metropolis_chain_average_matches_the_target_expectation():
    est, truth, res = _chain_estimates(repeats=True)
    assert est == pytest.approx(truth, rel=0.01)
    # the weights are chain step counts: they add up to the number of proposals
    assert float(res.weights.sum()) == 100_000
    # the accept-or-mask variant drops the repeats: biased toward low-weight states
    literal, _, lit = _chain_estimates(repeats=False)
    assert abs(literal - truth) / truth > 0.03, (literal, truth)   # measured: 3.293 vs 3.452
    assert set(lit.weights[lit.keep].unique().tolist()) == {1.0}


def test_metropolis_chain_counts_against_a_hand_walk():
    # weights 1, 4, 1, 2 (log space); uniforms drawn from the same seeded stream
    log_w = torch.tensor([0.0, math.log(4), 0.0, math.log(2)], dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    u = [float(torch.rand((), generator=g, dtype=torch.float64)) for _ in range(3)]
    counts = metropolis_chain(log_w, [0, 1, 2, 3], torch.Generator().manual_seed(11))
    # 1 is accepted (ratio 4); 2 is accepted iff u[1] < 1/4; 3 then from 1 iff u[2] < 1/2
    expect = [1.0, 1.0, 0.0, 0.0]
    cur = 1
    for cand, uu in ((2, u[1]), (3, u[2])):
        if uu < math.exp(float(log_w[cand] - log_w[cur])):
            cur = cand
        expect[cur] += 1
    assert counts.tolist() == expect
    assert sum(expect) == 4


@pytest.mark.parametrize("measure", ["log_ratio", "k2", "k3"])
def test_trust_region_masking_by_hand(measure):
    """Three sequences; log rho per token (lp_old - lp_roll): [0.05, -0.3], [0.2 | pad 5.0],
    [-0.01, 0.02]. The largest token divergence of each, in float64, against delta; the
    padded position never decides."""
    import math
    lr = [[0.05, -0.3], [0.2, 5.0], [-0.01, 0.02]]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    div = {"log_ratio": lambda x: abs(x), "k2": lambda x: 0.5 * x * x,
           "k3": lambda x: math.exp(x) - 1 - x}[measure]
    worst = [max(div(v) for v, m in zip(row, mrow) if m) for row, mrow in zip(lr, mask.tolist())]
    lp_roll = torch.full((3, 2), -1.0, dtype=torch.float64)
    lp_old = lp_roll + torch.tensor(lr, dtype=torch.float64)
    for delta in sorted(worst):   # exactly at a sequence's worst divergence: kept (<= delta)
        p = CorrectionParams(trm_delta=delta * (1 + 1e-9), trm_measure=measure)
        res = apply_corrections(["trm"], p, CorrectionInputs(lp_old, lp_roll, mask))
        want = [w <= delta * (1 + 1e-9) for w in worst]
        assert res.keep.any(-1).tolist() == want
        assert res.keep[~mask].sum() == 0
        assert res.metrics["correction/trm/masked_seq_frac"] == pytest.approx(
            want.count(False) / 3)
        assert res.metrics["correction/trm/masked_token_frac"] == pytest.approx(
            sum(int(mask[i].sum()) for i in range(3) if not want[i]) / 5)
    assert worst[1] == div(0.2)   # not the padded 5.0
    with pytest.raises(ValueError, match="trm_delta"):
        apply_corrections(["trm"], CorrectionParams(), CorrectionInputs(lp_old, lp_roll, mask))
