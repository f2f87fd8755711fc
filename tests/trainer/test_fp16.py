"""The trainer in float16 (``model.dtype: float16``): megatron-core's mixed-precision optimizer
with float32 master weights and its dynamic loss scaler (``trainer.loss_scale``). An fp16 step
learns; a step whose gradients overflow is skipped (weights and Adam untouched) and counted; a
scale at its minimum ends the run; resume restores the scaler and continues bit for bit."""
import copy

import pytest
import torch

from moe_rl.errors import LossScaleCollapsed
from moe_rl.trainer.policy import PolicyTrainer
from moe_rl.trainer.sharded_state import optimizer_step_count
from tests.helpers import engine_samples
from tests.trainer.mixed_precision import LOSSES, main_weights, make_cfg

pytestmark = pytest.mark.usefixtures("parallel_state")

SAFE = {"initial": 2.0 ** 10}   # a scale whose first steps do not overflow


def _fp16(path, algorithm=None, loss_scale=None, **trainer):
    return make_cfg(path, "float16", algorithm, loss_scale=loss_scale or SAFE, **trainer)


def _scaler(trainer):
    leaves = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [leaf.grad_scaler for leaf in leaves]


def test_fp16_policy_trains_with_float32_master_weights_and_the_configured_scaler(tiny):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    path, _ = tiny
    trainer = PolicyTrainer(_fp16(path, loss_scale={"initial": 2.0 ** 20, "min": 4.0,
                                                   "growth_interval": 7, "hysteresis": 3}), path)
    leaves = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    assert all(isinstance(leaf, Float16OptimizerWithFloat16Params) for leaf in leaves)
    for s in _scaler(trainer):
        assert isinstance(s, DynamicGradScaler)
        assert (float(s.scale), float(s.min_scale), s.growth_interval, s.hysteresis) == \
            (2.0 ** 20, 4.0, 7, 3)
    params = dict(trainer.model.module.named_parameters())
    assert all(p.dtype == torch.float16 for p in params.values())
    assert all(main_weights(p).dtype == torch.float32 and main_weights(p) is not p
               for p in params.values())


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_an_fp16_rl_step_learns(tiny, loss):
    """As the bf16 test: sequences with a positive advantage become likelier, those with a
    negative one less likely; the step was not skipped and the scale is reported."""
    path, hf_model = tiny
    trainer = PolicyTrainer(_fp16(path, algorithm=LOSSES[loss], lr=3e-3), path)
    samples = engine_samples(hf_model, n_groups=2, group_size=4, seed=7)
    for s in samples:
        s.reward = float(s.sample_id % 2)
    before, _ = trainer.prepare(copy.deepcopy(samples))
    m = trainer.train_step(copy.deepcopy(samples))
    assert m["train/skipped_steps"] == 0 and m["train/loss_scale"] == 2.0 ** 10
    after, _ = trainer.prepare(copy.deepcopy(samples))
    gain = ((after.lp_trainer - before.lp_trainer) * before.mask).sum(-1)
    assert (before.advantages != 0).all()
    assert (gain[before.advantages > 0] > 0).all() and (gain[before.advantages < 0] < 0).all(), \
        (gain, before.advantages)
    for p in trainer.model.module.parameters():   # the model's weights: its master weights, rounded
        assert torch.equal(p.detach(), main_weights(p).to(torch.float16))


def test_a_step_whose_gradients_overflow_is_skipped_and_counted(tiny):
    """Megatron's default initial scale (2^32) overflows float16's gradients (largest finite
    65504): the step leaves the weights and Adam as they were, counts itself in
    train/skipped_steps and halves the scale (hysteresis 1); the next step at a sane scale
    trains."""
    path, hf_model = tiny
    trainer = PolicyTrainer(_fp16(path, loss_scale={"initial": 2.0 ** 32, "hysteresis": 1}),
                            path)
    params = dict(trainer.model.module.named_parameters())
    before = {n: main_weights(p).detach().clone() for n, p in params.items()}
    m = trainer.train_step(engine_samples(hf_model, seed=1))
    assert m["train/skipped_steps"] == 1 and m["train/loss_scale"] == 2.0 ** 31
    assert m["grad_norm"] == 0.0   # no step: no norm
    assert all(torch.equal(main_weights(p), before[n]) for n, p in params.items())
    assert optimizer_step_count(trainer.optimizer) == 0
    for s in _scaler(trainer):
        s._scale.fill_(2.0 ** 10)
    m = trainer.train_step(engine_samples(hf_model, seed=2))
    assert m["train/skipped_steps"] == 0 and m["grad_norm"] > 0
    assert optimizer_step_count(trainer.optimizer) == 1
    assert any(not torch.equal(main_weights(p), before[n]) for n, p in params.items())


def test_a_scale_at_its_minimum_that_still_overflows_ends_the_run(tiny):
    path, hf_model = tiny
    trainer = PolicyTrainer(_fp16(path, loss_scale={"initial": 2.0 ** 32, "min": 2.0 ** 31,
                                                    "hysteresis": 1}), path)
    params = dict(trainer.model.module.named_parameters())
    before = {n: main_weights(p).detach().clone() for n, p in params.items()}
    with pytest.raises(LossScaleCollapsed, match=r"trainer\.loss_scale\.min: .*minimum "
                                                  r"\(2\.14748e\+09\)"):
        trainer.train_step(engine_samples(hf_model, seed=1))
    assert all(torch.equal(main_weights(p), before[n]) for n, p in params.items())


def test_fp16_resume_restores_the_loss_scaler_and_continues_exactly(tiny, tmp_path):
    """Save after a skipped step and a trained one (scale halved, trackers moved), resume in a
    new trainer: the scaler's scale and trackers come back, and the next step's metrics and
    weights equal the uninterrupted run's bit for bit."""
    path, hf_model = tiny

    def cfg():
        return _fp16(path, loss_scale={"initial": 2.0 ** 32, "hysteresis": 1,
                                       "growth_interval": 3})
    batches = [engine_samples(hf_model, seed=10 + i) for i in range(3)]
    run = PolicyTrainer(cfg(), path)
    assert run.train_step(copy.deepcopy(batches[0]))["train/skipped_steps"] == 1
    for s in _scaler(run):
        s._scale.fill_(2.0 ** 10)
    assert run.train_step(copy.deepcopy(batches[1]))["train/skipped_steps"] == 0
    saved = [(float(s.scale), s._growth_tracker, s._hysteresis_tracker) for s in _scaler(run)]
    assert saved[0] == (2.0 ** 10, 1, 0)   # one clean step; hysteresis spent until growth
    run.save_checkpoint(str(tmp_path / "ckpt"))
    m1 = run.train_step(copy.deepcopy(batches[2]))
    resumed = PolicyTrainer(cfg(), path)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert [(float(s.scale), s._growth_tracker, s._hysteresis_tracker)
            for s in _scaler(resumed)] == saved
    m2 = resumed.train_step(copy.deepcopy(batches[2]))
    assert m1 == m2
    for a, b in zip(run.model.module.parameters(), resumed.model.module.parameters()):
        assert torch.equal(a, b) and torch.equal(main_weights(a), main_weights(b))


def test_a_checkpoint_before_adams_first_step_resumes(tiny, tmp_path):
    """Every step so far skipped (Adam holds no state, none is saved): the checkpoint loads,
    Adam starts afresh and the next step equals the uninterrupted run's (it once failed to load:
    the loader expected moments the save never had)."""
    path, hf_model = tiny

    def cfg():
        return _fp16(path, loss_scale={"initial": 2.0 ** 32, "hysteresis": 1})
    batches = [engine_samples(hf_model, seed=20 + i) for i in range(2)]
    run = PolicyTrainer(cfg(), path)
    assert run.train_step(copy.deepcopy(batches[0]))["train/skipped_steps"] == 1
    assert optimizer_step_count(run.optimizer) == 0
    run.save_checkpoint(str(tmp_path / "ckpt"))
    for s in _scaler(run):
        s._scale.fill_(2.0 ** 10)
    m1 = run.train_step(copy.deepcopy(batches[1]))
    resumed = PolicyTrainer(cfg(), path)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert [float(s.scale) for s in _scaler(resumed)] == [2.0 ** 31]
    for s in _scaler(resumed):
        s._scale.fill_(2.0 ** 10)
    m2 = resumed.train_step(copy.deepcopy(batches[1]))
    assert m1 == m2 and m1["train/skipped_steps"] == 0
    for a, b in zip(run.model.module.parameters(), resumed.model.module.parameters()):
        assert torch.equal(a, b) and torch.equal(main_weights(a), main_weights(b))
