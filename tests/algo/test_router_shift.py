"""RSPO (Zhang et al., arXiv 2510.23027): the router-shift weight against float64 references
written here and hand-worked cases (the floor, the stop-gradient), GMPO (Zhao et al., arXiv
2507.20673) against its sequence objective, the weight as a factor on every ratio loss, the
routers' log-scores read from megatron against transformers' own router logits, and both through
`moe-rl train` with the routers moving (R2/R3 off, two epochs)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from moe_rl.algo import (gmpo_loss, gspo_loss, ppo_clip_loss, router_log_scores,
                         router_shift_metrics, router_shift_weight)
from moe_rl.config import ConfigError, load_config
from tests.helpers import init_tiny_model
from tests.helpers import engine_base_port

F64 = torch.float64


def test_router_shift_weight_hand_worked():
    """Two MoE layers, top-2. Token 0: layer 0's experts moved by log 2 and 0, layer 1's not at
    all: d = (log 2 / 2 + 0) / 2, gamma = 2^(-1/4) = 0.8409. Token 1: every score moved by 3:
    exp(-3) = 0.0498, held at the floor 0.8. Token 2: unchanged, gamma = 1."""
    old = torch.zeros(1, 3, 2, 2, dtype=F64)
    new = old.clone()
    new[0, 0, 0, 0] = -math.log(2)
    new[0, 1] = 3.0
    gamma = router_shift_weight(old, new, floor=0.8)
    assert gamma.shape == (1, 3)
    assert gamma[0].tolist() == pytest.approx([2 ** -0.25, 0.8, 1.0], rel=1e-14)
    assert router_shift_weight(old, new, floor=0.0)[0, 1].item() == pytest.approx(math.exp(-3))
    m = router_shift_metrics(gamma, torch.tensor([[True, True, False]]), 0.8)
    assert m["router_shift/gamma_mean"] == pytest.approx((2 ** -0.25 + 0.8) / 2)
    assert m["router_shift/floor_frac"] == 0.5 and m["router_shift/shifted_frac"] == 1.0


def test_router_shift_weight_matches_a_float64_loop_and_carries_no_gradient():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(2, 5, 3, 4, generator=g, dtype=F64)
    new = (old + 0.3 * torch.randn(2, 5, 3, 4, generator=g, dtype=F64)).requires_grad_()
    gamma = router_shift_weight(old, new, floor=0.7)
    for b in range(2):
        for t in range(5):
            per_layer = [sum(abs(new[b, t, l, k].item() - old[b, t, l, k].item())
                             for k in range(4)) / 4 for l in range(3)]
            expect = max(math.exp(-sum(per_layer) / 3), 0.7)
            assert gamma[b, t].item() == pytest.approx(expect, rel=1e-13)
    assert not gamma.requires_grad   # stop-gradient: the weight is a constant of the loss
    with pytest.raises(ValueError, match="the same shape"):
        router_shift_weight(old, new[:, :4], 0.7)
    with pytest.raises(ValueError, match="floor"):
        router_shift_weight(old, new, 1.5)


def test_router_log_scores_softmax_and_sigmoid():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]], dtype=F64)
    soft = router_log_scores(logits, "softmax")
    z = sum(math.exp(v) for v in logits[0].tolist())
    assert soft[0].tolist() == pytest.approx([v - math.log(z) for v in logits[0].tolist()])
    sig = router_log_scores(logits, "sigmoid")
    assert sig[0].tolist() == pytest.approx([-math.log1p(math.exp(-v)) for v in logits[0].tolist()])
    assert router_log_scores(logits.to(torch.bfloat16), "softmax").dtype == torch.float32
    with pytest.raises(ValueError, match="score_function"):
        router_log_scores(logits, "sparsemixer")


def gmpo_reference(log_r, adv, lo, hi):
    """GMPO's sequence objective in float64 Python: -A exp(mean_t c_t), c_t the log-ratio clipped
    on the pessimistic side for the advantage's sign."""
    c = []
    for x in log_r:
        bounded = min(max(x, -lo), hi)
        c.append(min(x, bounded) if adv > 0 else max(x, bounded) if adv < 0 else 0.0)
    return -adv * math.exp(sum(c) / len(c)), c


def test_gmpo_hand_worked():
    """log r = [0.5, -0.1], range 0.4: A > 0 clips the 0.5 to 0.4 (g = exp(0.15)); A < 0 keeps
    the 0.5 (raising a bad token's ratio is never clipped in its favour) and g = exp(0.2)."""
    lp_old = torch.tensor([[-1.0, -2.0]], dtype=F64)
    lp = (lp_old + torch.tensor([[0.5, -0.1]], dtype=F64)).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = gmpo_loss(lp, lp_old, torch.tensor([1.0], dtype=F64), mask, 0.4, 0.4)
    assert loss.mean().item() == pytest.approx(-math.exp(0.15), rel=1e-14)
    assert m["clip_frac"] == 0.5 and m["gmpo/seq_ratio_mean"] == pytest.approx(math.exp(0.15))
    loss.mean().backward()   # seq-mean-token-mean of one sequence: the clipped token is frozen
    assert lp.grad[0].tolist() == pytest.approx([0.0, -math.exp(0.15) / 2], rel=1e-14)
    loss, m = gmpo_loss(lp.detach(), lp_old, torch.tensor([-1.0], dtype=F64), mask, 0.4, 0.4)
    assert loss.mean().item() == pytest.approx(math.exp(0.2), rel=1e-14)
    assert m["clip_frac"] == 0.0


def test_gmpo_matches_the_sequence_objective_value_and_gradient():
    g = torch.Generator().manual_seed(7)
    B, T = 6, 9
    lp_old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    lp = (lp_old + 0.5 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.5, 0.7], dtype=F64)
    lengths = [9, 5, 7, 1, 9, 3]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    loss, _ = gmpo_loss(lp, lp_old, adv, mask, 0.3, 0.35)
    per_seq = (loss * mask).sum(-1) / mask.sum(-1)   # seq-mean-token-mean, before the batch mean
    per_seq.sum().backward()
    for i, n in enumerate(lengths):
        x = (lp.detach()[i, :n] - lp_old[i, :n]).tolist()
        value, c = gmpo_reference(x, adv[i].item(), 0.3, 0.35)
        assert per_seq[i].item() == pytest.approx(value, rel=1e-13, abs=1e-15)
        for t in range(n):   # d/d lp_t of -A exp(mean c): -A g / n where c_t = log r_t, else 0
            free = c[t] == x[t] and adv[i].item() != 0
            assert lp.grad[i, t].item() == pytest.approx(
                -adv[i].item() * math.exp(sum(c) / n) / n if free else 0.0, rel=1e-12,
                abs=1e-15), (i, t)
        assert lp.grad[i, n:].abs().sum().item() == 0.0


@pytest.mark.parametrize("loss_fn,kwargs", [(ppo_clip_loss, {"dual_clip_c": None}),
                                            (gspo_loss, {}), (gmpo_loss, {})],
                         ids=["ppo", "gspo", "gmpo"])
def test_the_weight_scales_the_ratio_before_clipping_and_aggregation(loss_fn, kwargs):
    """Each ratio loss with ``log_scale = log gamma`` equals the same loss on the ratio
    ``r * gamma`` (lp_old lowered by log gamma), in value and gradient, and no gradient reaches
    gamma."""
    g = torch.Generator().manual_seed(11)
    lp_old = torch.log(torch.rand(3, 6, generator=g, dtype=F64) * 0.9 + 0.05)
    lp = (lp_old + 0.2 * torch.randn(3, 6, generator=g, dtype=F64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    log_gamma = router_shift_weight(torch.zeros(3, 6, 2, 2, dtype=F64),
                                    0.3 * torch.randn(3, 6, 2, 2, generator=g, dtype=F64),
                                    floor=0.8).log().requires_grad_()
    clip = (0.2, 0.28)
    scaled, _ = loss_fn(lp, lp_old, adv, mask, *clip, log_scale=log_gamma, **kwargs)
    scaled.sum().backward()
    grad_scaled = lp.grad.clone()
    lp.grad = None
    shifted, _ = loss_fn(lp, lp_old - log_gamma.detach(), adv, mask, *clip, **kwargs)
    shifted.sum().backward()
    assert torch.allclose(scaled, shifted, rtol=1e-13, atol=1e-15)
    assert torch.allclose(grad_scaled, lp.grad, rtol=1e-13, atol=1e-15)
    assert log_gamma.grad is None
    assert not torch.equal(log_gamma, torch.zeros_like(log_gamma))   # the case is not trivial


def test_router_shift_config_checks(tmp_path):
    base = ["algorithm.router_shift.enabled=true"]
    for extra, match in [(["algorithm.loss=dppo_tv"], "scales the importance ratio"),
                         (["algorithm.loss=ppo", "algorithm.aggregation=token-mean",
                           "algorithm.entropy_control.method=kl_cov"], "kl_cov"),
                         (["algorithm.loss=gmpo", "algorithm.aggregation=token-mean"],
                          "GMPO's token form")]:
        with pytest.raises(ConfigError, match=match):
            load_config("tiny_cpu", base + extra)
    cfg = load_config("tiny_cpu", base + ["algorithm.loss=gmpo", "algorithm.clip_low=1.5"])
    assert cfg.algorithm.router_shift.floor == 0.8   # GMPO's range is in log space: 1.5 is fine


def test_router_scores_are_the_routers_log_softmax_as_transformers_computes_it(tmp_path):
    """The scores the controller reads from megatron's routers (at the experts they chose, then
    at given ones) equal log-softmax of transformers' own router logits for the same weights."""
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.trainer.model_builder import build_model
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.replay import ReplayController
    from moe_rl.rollout_record import Sample
    from moe_rl.weights.hf import load_hf_into_megatron
    from tests.hf_models import QWEN, write_hf_model
    init_distributed()
    init_model_parallel()
    path, hf = write_hf_model(tmp_path, QWEN, seed=4)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    ids = torch.randint(0, 48, (7,), generator=torch.Generator().manual_seed(5))
    mb = pack_one([Sample(prompt_ids=ids[:3], response_ids=ids[3:],
                          rollout_logprobs=-torch.ones(4))], [0], pad_token_id=0)
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_router_logits=True)
    expect = [torch.log_softmax(t.double().reshape(7, -1), -1) for t in out.router_logits]
    assert len(expect) == 2   # layers 0 and 2 are MoE
    ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    with pytest.raises(ValueError, match="say at which experts"):
        ctl.capture_scores(None)   # not recording: the experts must be given
    ctl.record()
    ctl.capture_scores(None)
    with torch.no_grad():
        forward_logprobs(model, mb)
    chosen, got = ctl.recorded(), ctl.router_scores()
    for layer in range(2):
        assert got[layer].dtype == torch.float32 and got[layer].shape == (7, 2)
        assert torch.allclose(got[layer].double(), expect[layer].gather(-1, chosen[layer].long()),
                              atol=1e-5)
    other = [(c + 3) % 8 for c in chosen]   # experts the routers did not choose
    ctl.replay(chosen)
    ctl.capture_scores(other)
    with torch.no_grad():
        forward_logprobs(model, mb)
    for layer, got_l in enumerate(ctl.router_scores()):
        assert torch.allclose(got_l.double(), expect[layer].gather(-1, other[layer].long()),
                              atol=1e-5)
    ctl.close()


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_rspo_through_moe_rl_train_with_the_routers_moving(tmp_path):
    """`moe-rl train` with GMPO and the router-shift weight, routing free (replay off: the
    weight is read at the experts pi_old chose), two epochs of two mini-batches: the routers move
    after the first optimizer step, so tokens get gamma < 1, never below the floor, while the
    first mini-batch's ratio is still 1."""
    model = tmp_path / "model"
    init_tiny_model(str(model))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", "tiny_cpu",
           f"model.path={model}", f"logging.dir={run}", "trainer.steps=2",
           "trainer.warmup.steps=0", "trainer.checkpoint.export_hf=false", "trainer.epochs=2",
           "trainer.mini_batches=2", "trainer.optim.lr=5e-3", "rollout.prompts_per_step=4",
           "rollout.n_samples_per_prompt=4", f"rollout.servers.base_port={engine_base_port()}",
           "algorithm.replay=off", "algorithm.loss=gmpo", "algorithm.clip_low=0.4",
           "algorithm.clip_high=0.4", "algorithm.router_shift.enabled=true",
           "algorithm.router_shift.floor=0.9", "logging.progress=false",
           "logging.tensorboard=false"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2500:]
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for m in rows:
        assert 0.9 <= m["router_shift/gamma_mean"] < 1.0, m["router_shift/gamma_mean"]
        assert 0.0 < m["router_shift/shifted_frac"] <= 0.75 + 1e-9   # 1st mini-batch: gamma 1
        assert m["ratio/first_minibatch_max_dev"] < 1e-5
        assert math.isfinite(m["loss"]) and "gmpo/seq_ratio_mean" in m
