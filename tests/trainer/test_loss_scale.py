"""One float16 loss scale under expert parallelism (moe_rl/trainer/loss_scale.py): megatron's
dense and expert leaf optimizers each keep a loss scaler; an overflow in one expert gradient
only, on one rank of EP 2 over gloo, halves the one scale every leaf and rank reads (on
megatron's own per-leaf scalers the expert leaf's halved alone: its gradients were then
unscaled by a scale the loss never had)."""
import os

import pytest
import torch

from moe_rl.trainer.loss_scale import share_loss_scale
from tests.helpers import start_ranks, write_tiny_qwen


def _worker(rank, port, path, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.trainer.parallel import ParallelSizes, destroy, init_distributed, \
        init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.trainer.cpu_compat import cuda_factories_on_cpu
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(expert=2))
    from moe_rl.config import config_from_dict
    cfg = config_from_dict({
        "model": {"path": path, "dtype": "float16"}, "cluster": {"trainer_workers": 2},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
        "trainer": {"parallel": {"expert": 2}, "optim": {"distributed": False},
                    "loss_scale": {"initial": 2.0 ** 10, "hysteresis": 1}}})
    trainer = PolicyTrainer(cfg, path)
    leaves = trainer.optimizer.chained_optimizers
    params = dict(trainer.model.module.named_parameters())
    for p in params.values():
        p.main_grad.zero_()
    if rank == 0:   # one expert's gradient overflows, on this rank only
        params["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"].main_grad[0, 0] \
            = float("inf")
    with cuda_factories_on_cpu():
        ok, _, _ = trainer.optimizer.step()
    torch.save({"ok": ok, "leaves": len(leaves),
                "scales": [float(leaf.grad_scaler.scale) for leaf in leaves],
                "loss_scale": float(trainer.optimizer.get_loss_scale())},
               os.path.join(out_dir, f"rank{rank}.pt"))
    destroy()


@pytest.mark.multiproc
def test_an_overflow_in_one_expert_gradient_halves_the_one_scale_everywhere(tmp_path):
    from moe_rl.trainer.parallel import free_port
    path = tmp_path / "qwen"
    write_tiny_qwen(path, seed=4)
    start_ranks(_worker, (free_port(), str(path), str(tmp_path)), 2)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["leaves"] == 2   # dense and expert optimizers
        assert out["ok"] is False   # the step is skipped on both ranks
        assert out["scales"] == [2.0 ** 9, 2.0 ** 9] and out["loss_scale"] == 2.0 ** 9


def test_nothing_to_share_with_one_leaf_or_none():
    class Leaf:
        grad_scaler = None
    assert share_loss_scale(Leaf()) is False
    chained = type("Chained", (), {"chained_optimizers": [Leaf(), Leaf()]})()
    assert share_loss_scale(chained) is False
