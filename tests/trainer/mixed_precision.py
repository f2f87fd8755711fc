"""What the mixed-precision trainer tests share (tests/trainer/test_bf16.py,
tests/trainer/test_fp16.py): the config, the losses a 16-bit step must learn with, and the float32
master copy megatron keeps for a 16-bit weight."""
from moe_rl.config import config_from_dict


def make_cfg(path, dtype="bfloat16", algorithm=None, lr=1e-3, **trainer):
    tree = {"model": {"path": path, "dtype": dtype},
            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
            "trainer": {"optim": {"lr": lr, "distributed": False},   # CUDA: Float16Optimizer too
                        "micro_batch_size": 2, "steps": 4, "seed": 3, **trainer},
            "algorithm": {"replay": "r3", "corrections": ["token_tis"], **(algorithm or {})}}
    return config_from_dict(tree)


LOSSES = {"ppo": {},
          "dppo_tv": {"loss": "dppo_tv"},
          "rspo": {"loss": "gmpo", "clip_low": 0.4, "clip_high": 0.4,
                   "aggregation": "seq-mean-token-mean", "router_shift": {"enabled": True}},
          "cispo": {"loss": "cispo", "rollout_penalty": {"coef": 1e-3}},
          "sapo": {"loss": "sapo"},
          "qae": {"advantage": "qae"}}


def main_weights(p):
    """The float32 master copy megatron's mixed-precision optimizer keeps for a bf16 weight."""
    main = getattr(p, "main_param", None)
    return p if main is None else main
