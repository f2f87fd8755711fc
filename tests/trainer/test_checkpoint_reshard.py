"""A trainer checkpoint written with expert parallel 2 / data parallel 2 loads with EP 1 / DP 1
and back, over gloo processes: every tensor of the state (weights, Adam's moments, EMA) comes back
exactly, and Adam's step count with it (multiproc); for Qwen3-MoE, for GLM-4.5 (attention
biases, shared experts beside the split ones, the expert bias, a dense first layer) and for
gpt-oss (sinks, the router's bias, each expert's biases split with it) and for MiniMax-M2
(the q/k norms over all heads); the one-rank leg computes its experts in megatron's loop and
the others in grouped GEMMs, so the checkpoint crosses expert paths too."""
import os

import pytest
import torch

from tests.helpers import engine_samples, start_ranks, write_tiny_qwen
from tests.hf_models import write_deepseek, write_gpt_oss, write_minimax_m2


def _worker(rank, world, port, model_dir, base, load_from, save_to, experts):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.parallel import ParallelSizes, destroy, init_distributed, \
        init_model_parallel
    from moe_rl.rollout_record import RolloutBatch
    init_distributed(rank=rank, world_size=world)
    init_model_parallel(ParallelSizes(expert=world))
    from moe_rl.trainer.policy import PolicyTrainer
    cfg = config_from_dict({"model": {"path": model_dir},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                            "trainer": {"optim": {"lr": 1e-2, "grad_clip": 0.0}, "parallel": {"expert": world},
                                        "ema": {"decay": 0.5}, "experts": experts},
                            "cluster": {"trainer_workers": world}})
    trainer = PolicyTrainer(cfg, model_dir)
    if load_from:
        trainer.load_checkpoint(os.path.join(base, load_from))
    else:   # two steps, so that weights, moments and EMA all differ from their start
        samples = RolloutBatch.load(os.path.join(base, "samples.st")).samples
        for _ in range(2):
            trainer.train_step(samples)   # the same rows on each rank: equal token counts
    trainer.save_checkpoint(os.path.join(base, save_to))
    destroy()


def _run(world, *args):
    from moe_rl.trainer.parallel import free_port
    start_ranks(_worker, (world, free_port(), *args), world)


def _plain(path):
    """Every tensor of a saved distributed checkpoint, whole, read by torch's own checkpoint
    reader in this one process (megatron-core 0.19.2's ``load_plain_tensors`` fails under
    torch 2.15, whose tensor metadata gained ``strides``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(os.path.join(path, "dist"))
    plain = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(plain, storage_reader=reader, no_dist=True)
    return plain


@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss", "minimax_m2"])
def test_ep2_dp2_checkpoint_loads_with_ep1_dp1_and_back(tmp_path, family):
    model_dir = tmp_path / family
    hf = {"qwen3_moe": lambda: write_tiny_qwen(model_dir, seed=41),
          "glm4_moe": lambda: write_deepseek(model_dir, seed=41, glm=True),
          "gpt_oss": lambda: write_gpt_oss(model_dir, seed=41),
          "minimax_m2": lambda: write_minimax_m2(model_dir, seed=41)}[family]()
    from moe_rl.rollout_record import RolloutBatch
    RolloutBatch(engine_samples(hf, n_groups=2, group_size=2, seed=42)).save(
        str(tmp_path / "samples.st"))
    args = (str(model_dir), str(tmp_path))
    # trained and saved by 2 ranks (experts split in two, grouped GEMMs); loaded by 1 rank
    # holding every expert (megatron's loop) and saved again; and back to 2 ranks
    _run(2, *args, None, "ep2", "grouped")
    _run(1, *args, "ep2", "ep1", "sequential")
    _run(2, *args, "ep1", "ep2b", "grouped")
    first, single, back = (_plain(tmp_path / d) for d in ("ep2", "ep1", "ep2b"))
    keys = set(first)
    assert keys == set(single) == set(back)
    for part in ("optim.exp_avg.", "optim.exp_avg_sq.", "ema."):
        assert any(k.startswith(part) and "experts" in k for k in keys), part
    for k in sorted(keys):
        assert torch.equal(first[k], single[k]) and torch.equal(first[k], back[k]), k
    assert any(float(first[k].abs().max()) > 0 for k in keys if "exp_avg_sq" in k)
    if family == "glm4_moe":
        for part in ("shared_experts.", "linear_qkv.bias", "router.expert_bias"):
            assert any(part in k and not k.startswith("optim.") for k in keys), part
    if family == "minimax_m2":   # the q/k norms over all heads, the expert bias
        for part in ("q_layernorm", "k_layernorm", "router.expert_bias"):
            assert any(part in k and not k.startswith("optim.") for k in keys), part
    if family == "gpt_oss":
        for part in ("softmax_offset", "router.bias", "linear_fc2.bias"):
            assert any(part in k and not k.startswith("optim.") for k in keys), part
    counts = [torch.load(tmp_path / d / f, weights_only=True)["adam_steps"]
              for d, f in (("ep2", "rank0.pt"), ("ep1", "rank0.pt"), ("ep2b", "rank1.pt"))]
    assert counts == [2, 2, 2]
