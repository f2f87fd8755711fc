"""The training step on the real megatron model: metrics, modes, micro-batch invariance,
checkpoint resume bit-identical, HF export."""
import copy
import math

import pytest
import torch

from moe_rl.config import config_from_dict
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.policy import PolicyTrainer
from moe_rl.trainer.replay_plan import Route
from tests.helpers import engine_samples


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def make_cfg(path, **algo):
    tree = {"model": {"path": path},
            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
            "trainer": {"optim": {"lr": 1e-3}, "micro_batch_size": 2, "steps": 4, "seed": 3},
            "algorithm": {"replay": "r3", **algo}}
    return config_from_dict(tree)


def test_train_step_metrics_and_learning(tiny):
    path, hf_model = tiny
    trainer = PolicyTrainer(make_cfg(path, corrections=["icepop", "seq_mis"]), path)
    samples = engine_samples(hf_model, n_groups=2, group_size=2, seed=1)
    before = [p.detach().clone() for p in trainer.model.module.parameters()]
    m = trainer.train_step(samples)
    for key in ("mismatch/k1", "mismatch/k3", "routing/agreement", "routing/agreement_layer_0",
                "routing/agreement_layer_2", "is/ess", "grad_norm", "lr", "loss", "clip_frac",
                "entropy", "reward/mean", "correction/seq_mis/masked_seq_frac"):
        assert key in m and math.isfinite(m[key]), key
    # the engine here is transformers in float32 with the same weights: tiny mismatch
    assert abs(m["mismatch/k1"]) < 1e-4 and m["routing/agreement"] == 1.0
    assert m["grad_norm"] > 0
    after = list(trainer.model.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_kl_term_matches_a_float64_reference(tiny):
    """The KL term logged (and added to the loss) is the mean k3 of the frozen reference against
    pi_theta over the kept tokens: 0 before any update, positive and equal to the float64 value
    of the prepared log-probs after one."""
    path, hf_model = tiny
    cfg = make_cfg(path, kl={"coef": 0.1, "off_policy_corrected": True})
    cfg.trainer.optim.lr = 1e-2
    trainer = PolicyTrainer(cfg, path)
    first = trainer.train_step(engine_samples(hf_model, seed=2))
    assert first["kl/ref"] == pytest.approx(0.0, abs=1e-7)   # policy == reference
    samples = engine_samples(hf_model, seed=3)
    batch, _ = trainer.prepare(samples)
    keep = batch.mask & batch.keep
    d = (batch.lp_ref - batch.lp_trainer).double()[keep]
    want = float((d.exp() - d - 1).mean())   # ratio pi_theta/pi_old = 1 in the first pass
    m = trainer.train_step(samples)
    assert want > 1e-6 and m["kl/ref"] == pytest.approx(want, rel=1e-3)


def test_sft_step_restores_the_schedule_lr(tiny):
    path, hf_model = tiny
    trainer = PolicyTrainer(make_cfg(path), path)
    before = [g["lr"] for g in trainer.optimizer.param_groups]
    m = trainer.sft_step(engine_samples(hf_model, seed=4), lr=0.5)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == before
    assert m["sft/loss"] > 0 and m["sft/grad_norm"] > 0


def test_collapse_guard_skips_update(tiny):
    path, hf_model = tiny
    cfg = make_cfg(path, collapse_guard_k3=1e-3)
    trainer = PolicyTrainer(cfg, path)
    noisy = engine_samples(hf_model, seed=3, noise=1.0)
    before = [p.detach().clone() for p in trainer.model.module.parameters()]
    m = trainer.train_step(noisy)
    assert m["mismatch/k3"] > 1e-3 and m["guard/skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.module.parameters()))


def test_micro_batch_split_gives_same_update(tiny):
    """One micro-batch, one per sample, a token budget of two of the longest rows (rows cap
    off), and packed rows of that budget: the same loss, gradient norm and accumulated gradient
    within float32 rounding."""
    path, hf_model = tiny
    samples = engine_samples(hf_model, n_groups=2, group_size=2, seed=4)
    longest = max(s.prompt_len + s.response_len for s in samples)
    grads, metrics = [], []
    splits = ((4, None, False), (1, None, False), (None, 2 * longest, False),
              (None, 2 * longest, True))
    for mbs, budget, packed in splits:
        cfg = make_cfg(path)
        cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_micro_batch = mbs, budget
        cfg.trainer.pack_sequences = packed
        cfg.trainer.optim.grad_clip = 0.0
        trainer = PolicyTrainer(cfg, path)
        metrics.append(trainer.train_step(copy.deepcopy(samples)))
        # the accumulated gradient of the mini-batch (Adam's update would amplify rounding)
        grads.append([p.main_grad.detach().clone() for p in trainer.model.module.parameters()])
    for other in range(1, len(splits)):
        assert metrics[0]["loss"] == pytest.approx(metrics[other]["loss"], rel=1e-5)
        assert metrics[0]["grad_norm"] == pytest.approx(metrics[other]["grad_norm"], rel=1e-5)
        for a, b in zip(grads[0], grads[other]):
            assert torch.allclose(a, b, atol=1e-7, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("ema_policy", [False, True])
def test_resume_is_bit_identical(tiny, tmp_path, ema_policy):
    path, hf_model = tiny

    def cfg():
        c = make_cfg(path, corrections=["metropolis"])
        if ema_policy:   # the EMA policy, smoothing from step 1: checkpointed and resumed
            c.trainer.ema.decay, c.trainer.ema.policy, c.trainer.ema.start_step = 0.5, True, 1
        return c
    batches = [engine_samples(hf_model, seed=10 + i) for i in range(3)]
    run = PolicyTrainer(cfg(), path)
    run.train_step(copy.deepcopy(batches[0]))
    run.save_checkpoint(str(tmp_path / "ckpt"))
    m1 = run.train_step(copy.deepcopy(batches[1]))
    resumed = PolicyTrainer(cfg(), path)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    m2 = resumed.train_step(copy.deepcopy(batches[1]))
    assert m1 == m2
    for a, b in zip(run.model.module.parameters(), resumed.model.module.parameters()):
        assert torch.equal(a, b)


def test_a_save_starts_no_process_of_multiprocessing(tiny, tmp_path):
    """megatron's write results pass through a plain in-process queue: a save leaves no
    spawned multiprocessing Manager behind (one per trainer process, ~2 s to start)."""
    import queue
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    path, _ = tiny
    filesystem_async._results_queue = None    # as in a new trainer process
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    PolicyTrainer(make_cfg(path), path).save_checkpoint(str(tmp_path / "ckpt"))
    after = {c.pid for c in psutil.Process().children(recursive=True)}
    assert type(filesystem_async._results_queue) is queue.Queue
    assert after <= before, [psutil.Process(p).cmdline() for p in after - before]


def test_export_hf_matches_trained_weights(tiny, tmp_path):
    import transformers
    path, hf_model = tiny
    trainer = PolicyTrainer(make_cfg(path), path)
    trainer.train_step(engine_samples(hf_model, seed=5))
    out = tmp_path / "export"
    trainer.export_hf(str(out))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 48, (1, 7))
    mb_samples = engine_samples(exported, n_groups=1, group_size=1, seed=6)
    m = trainer.prepare(mb_samples)[1]
    assert abs(m["mismatch/k1"]) < 1e-4   # the engine now serves the trained weights
    with torch.no_grad():
        assert not torch.allclose(exported(ids).logits, hf_model(ids).logits)


def test_export_hf_of_a_held_version_writes_that_version(tiny, tmp_path):
    """With ``rollout.max_staleness`` the trainer holds the version it trained from: an export
    asked for it (a server restarted mid-batch is restored so) writes those weights and says
    so; a version no longer held writes the current weights, labelled with their own."""
    import safetensors.torch
    path, hf_model = tiny
    cfg = make_cfg(path)
    cfg.rollout.max_staleness = 1
    trainer = PolicyTrainer(cfg, path)
    samples = engine_samples(hf_model, seed=5)
    for s in samples:
        s.reward = float(s.sample_id % 2)   # the update moves the weights
    assert trainer.export_hf(str(tmp_path / "v0_before"), version=0) == 0
    trainer.train_step(samples)
    assert trainer.export_hf(str(tmp_path / "v0"), version=0) == 0
    assert trainer.export_hf(str(tmp_path / "now"), version=7) == 1
    assert trainer.export_hf(str(tmp_path / "v1"), version=1) == 1
    load = lambda d: {k: v for f in sorted((tmp_path / d).glob("*.safetensors"))   # noqa: E731
                      for k, v in safetensors.torch.load_file(f).items()}
    v0_before, v0, now, v1 = load("v0_before"), load("v0"), load("now"), load("v1")
    assert all(torch.equal(v0_before[k], v0[k]) for k in v0)
    assert all(torch.equal(now[k], v1[k]) for k in v1)
    assert any(not torch.equal(v0[k], v1[k]) for k in v1)
    with pytest.raises(ValueError, match="use_ema"):
        trainer.export_hf(str(tmp_path / "ema"), use_ema=True, version=0)


def _all_negative(samples):
    for s in samples:   # every sample below its group's mean: some with A < 0 in every group
        s.reward = float(s.sample_id % 2)
    return samples


def test_deepseek_mask_fires_on_live_logprobs_after_an_update(tiny):
    """opsm with opsm_reference=pi_old and pi_old=trainer: before any update pi_theta = pi_old,
    so nothing is masked in the first mini-batch; after one large update pi_theta has drifted and
    the mask fires on the negative-advantage sequences of the later mini-batches (evaluated
    once in preparation, as before, its statistic was always 0)."""
    path, hf_model = tiny
    cfg = make_cfg(path, corrections=["opsm"],
                   correction={"opsm_delta": 1e-4, "opsm_reference": "pi_old"})
    cfg.trainer.optim.lr, cfg.trainer.mini_batches, cfg.trainer.epochs = 5e-2, 2, 2
    trainer = PolicyTrainer(cfg, path)
    m = trainer.train_step(_all_negative(engine_samples(hf_model, n_groups=2, group_size=2,
                                                        seed=4)))
    assert m["ratio/first_minibatch_max_dev"] < 1e-5
    assert m["correction/opsm/masked_seq_frac"] > 0


def test_bypass_mode_corrections_act_on_pi_theta_over_pi_roll(tiny):
    """pi_old=rollout: rho = pi_old/pi_roll = 1, so corrections evaluated on it never act; in
    bypass they run on pi_theta/pi_roll in the loss and do (noisy engine log-probs here)."""
    path, hf_model = tiny
    samples = engine_samples(hf_model, n_groups=2, group_size=2, seed=5, noise=0.5)
    trainer = PolicyTrainer(make_cfg(path, pi_old="rollout", corrections=["icepop"],
                                     correction={"icepop_low": 0.9, "icepop_high": 1.1}), path)
    m = trainer.train_step(samples)
    assert m["correction/icepop/masked_token_frac"] > 0.2
    exact = engine_samples(hf_model, n_groups=2, group_size=2, seed=5)
    trainer = PolicyTrainer(make_cfg(path, pi_old="rollout", corrections=["icepop"],
                                     correction={"icepop_low": 0.9, "icepop_high": 1.1}), path)
    assert trainer.train_step(exact)["correction/icepop/masked_token_frac"] == 0.0


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_covariance_selection_is_made_over_the_whole_mini_batch(tiny, method):
    """round(r N) tokens of the whole batch, not of each micro-batch: one micro-batch or four give
    the same selection, loss and update (per micro-batch, four would each pick one token)."""
    path, hf_model = tiny
    out = []
    for mbs in (4, 1):
        cfg = make_cfg(path, loss="ppo", entropy_control={
            "method": method, "clip_cov_ratio": 0.01, "clip_cov_low": -100.0,
            "clip_cov_high": 100.0, "kl_cov_ratio": 0.01, "kl_cov_coef": 1.0})
        cfg.trainer.micro_batch_size = mbs
        trainer = PolicyTrainer(cfg, path)
        samples = engine_samples(hf_model, n_groups=2, group_size=2, seed=7)
        m = trainer.train_step(samples)
        n_tok = sum(int(s.response_len) for s in samples)
        assert m[f"{method}/frac"] == pytest.approx(1 / n_tok)
        out.append((m["loss"], m["grad_norm"]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-4, abs=1e-7)
    assert out[0][1] == pytest.approx(out[1][1], rel=1e-4)


def test_r2_replays_per_sample_what_the_pi_old_pass_recorded(tiny):
    """R2 with mini_batches 2 and epochs 2 (it raised KeyError when keyed by the pi_old pass's
    micro-batch plan): every update forward replays, for each of its samples, exactly the
    expert ids that sample's routers chose in the pi_old pass."""
    path, hf_model = tiny
    cfg = make_cfg(path, replay="r2")
    cfg.trainer.mini_batches, cfg.trainer.epochs, cfg.trainer.micro_batch_size = 2, 2, 3
    trainer = PolicyTrainer(cfg, path)
    samples = engine_samples(hf_model, n_groups=2, group_size=3, seed=8)
    recorded, replayed = {}, []
    original_forward = trainer.forwarder.forward

    def spy(model, replay, mb, mode, **kw):
        out = original_forward(model, replay, mb, mode, **kw)
        if model is trainer.model and mode is Route.RECORD:
            rows = replay.recorded()
            B, S = mb.input_ids.shape
            for b, i in enumerate(mb.sample_indices):
                n = samples[i].routed_positions
                recorded[i] = torch.stack([t.reshape(S, B, -1)[:n, b] for t in rows], 1)
        if model is trainer.model and mode is Route.REPLAY:
            replayed.append(mb)
        return out

    trainer.forwarder.forward = spy
    trainer.train_step(samples)
    assert set(recorded) == set(range(6))
    assert len(replayed) >= 4   # 2 epochs x 2 mini-batches
    for mb in replayed:
        for b, i in enumerate(mb.sample_indices):
            n = samples[i].routed_positions
            assert torch.equal(mb.routing[b, :n].long(), recorded[i].long())
    # and the forwards with it reproduce the pi_old pass's log-probs before any update
    trainer2 = PolicyTrainer(cfg, path)
    m = trainer2.train_step(samples)
    assert m["ratio/first_minibatch_max_dev"] < 1e-6


def test_ema_follows_the_polyak_formula_and_is_what_gets_exported(tiny, tmp_path):
    from safetensors.torch import load_file
    path, hf_model = tiny
    cfg = make_cfg(path)
    cfg.trainer.ema.decay, cfg.trainer.mini_batches, cfg.trainer.optim.lr = 0.6, 2, 1e-2
    trainer = PolicyTrainer(cfg, path)
    params = dict(trainer.model.module.named_parameters())
    expected = {n: p.detach().double().clone() for n, p in params.items()}
    step = trainer.optimizer.step

    def stepped():
        out = step()
        for n, p in params.items():   # e_k = d e_{k-1} + (1 - d) p_k, in float64
            expected[n] = 0.6 * expected[n] + 0.4 * p.detach().double()
        return out

    trainer.optimizer.step = stepped
    trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=9))
    trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=10))
    for n, want in expected.items():
        assert torch.allclose(trainer.ema[n].double(), want, atol=1e-6), n
    trainer.export_hf(str(tmp_path / "ema"), use_ema=True)
    trainer.export_hf(str(tmp_path / "raw"))
    ema = load_file(str(tmp_path / "ema" / "model.safetensors"))
    raw = load_file(str(tmp_path / "raw" / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    mcore = [n for n in expected if n.endswith("embedding.word_embeddings.weight")][0]
    assert torch.allclose(ema[emb].double(), expected[mcore], atol=1e-6)
    assert not torch.allclose(ema[emb], raw[emb])


def test_ema_policy_replaces_the_weights_from_its_start_step(tiny):
    """trainer.ema.policy: after each optimizer step the weights become the EMA, e_k = d e_{k-1}
    + (1 - d) p_k (p_k the weights the optimizer step produced, from e_{k-1}), in float64; before
    ema_start_step (RL step 1 here) d is 0, the weights stay raw. The optimizer continues from
    the EMA: a step that changes nothing (learning rate 0) leaves the EMA weights in place."""
    path, hf_model = tiny
    cfg = make_cfg(path)
    cfg.trainer.ema.decay, cfg.trainer.ema.policy, cfg.trainer.ema.start_step = 0.6, True, 1
    cfg.trainer.mini_batches, cfg.trainer.optim.lr = 2, 1e-2
    trainer = PolicyTrainer(cfg, path)
    params = dict(trainer.model.module.named_parameters())
    expected = {n: p.detach().double().clone() for n, p in params.items()}
    step, seen = trainer.optimizer.step, []

    def stepped():
        before = {n: p.detach().double().clone() for n, p in params.items()}
        out = step()
        d = 0.6 if trainer.step >= 1 else 0.0
        for n, p in params.items():
            assert torch.allclose(before[n], expected[n], atol=1e-6), n   # from e_{k-1}
            expected[n] = d * expected[n] + (1 - d) * p.detach().double()
        seen.append(d)
        return out

    trainer.optimizer.step = stepped
    trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=9))
    raw_after_first = {n: p.detach().clone() for n, p in params.items()}
    trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=10))
    assert seen == [0.0, 0.0, 0.6, 0.6]
    moved = 0
    for n, want in expected.items():
        assert torch.allclose(params[n].double(), want, atol=1e-6), n
        assert torch.allclose(trainer.ema[n].double(), want, atol=1e-6), n
        moved += not torch.equal(params[n], raw_after_first[n])
    assert moved > 0
    trainer.optimizer.step = step
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    kept = {n: p.detach().clone() for n, p in params.items()}
    from moe_rl.trainer.cpu_compat import cuda_factories_on_cpu
    with cuda_factories_on_cpu():   # as the update calls it
        step()
    assert all(torch.equal(params[n], kept[n]) for n in params)
