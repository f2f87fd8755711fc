"""The zero-mismatch run set (shared by the reference-engine and the real-SGLang loop tests):
the option factors, their pairwise covering set, each combination's overrides, `moe-rl train` of
one combination and the invariant every mismatch metric must hold on identical float32 engine
and trainer."""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.helpers import engine_base_port

ROOT = pathlib.Path(__file__).resolve().parents[2]


CONFIG = ROOT / "configs" / "tiny_cpu.yaml"


FACTORS = {
    "temperature": (1.0, 0.7),
    "sampling": ("full", "top_k", "top_k_top_p_min_p"),
    "mask": (False, True),
    "pi_old": ("trainer", "rollout", "engine_avg"),
    "replay": ("off", "r3"),
    "loss": ("ppo", "gspo"),
    "pack": (False, True),
}

# on SGLang: R2 too, and the weights synced from disk or over a process group
SGLANG_FACTORS = {**{k: v for k, v in FACTORS.items() if k != "pack"},
                  "replay": ("off", "r2", "r3"), "sync": ("disk", "distributed")}


SAMPLING = {"full": [], "top_k": ["rollout.sampling.top_k=5"],
            "top_k_top_p_min_p": ["rollout.sampling.top_k=6", "rollout.sampling.top_p=0.9", "rollout.sampling.min_p=0.05"]}


CORRECTIONS = ("seq_mis", "icepop", "geo_rs", "trm")


def refused(combo: dict) -> bool:
    """The keep-sampling-mask needs the engine's kept sets, which need a finite top_k."""
    return combo["mask"] and combo["sampling"] == "full"


def all_combos(factors: dict = FACTORS) -> list[dict]:
    keys = list(factors)
    return [dict(zip(keys, values)) for values in itertools.product(*factors.values())]


def _pairs(combo: dict) -> set:
    items = sorted(combo.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def covering_set(factors: dict = FACTORS) -> list[dict]:
    """Greedy pairwise cover of every pair of values that a valid combination can hold."""
    valid = [c for c in all_combos(factors) if not refused(c)]
    todo = set().union(*(_pairs(c) for c in valid))
    chosen = []
    while todo:
        best = max(valid, key=lambda c: len(_pairs(c) & todo))
        chosen.append(best)
        todo -= _pairs(best)
    return chosen


def every_value_and_both_masks(factors: dict = FACTORS) -> list[dict]:
    """The fewest runs that hold every value of every factor and score the kept sets of top-k
    and of top-k + top-p + min-p with the mask: as many runs as the factor with the most values,
    run i taking each factor's value i (cycling), the mask on wherever the sampling truncates."""
    n = max(len(values) for values in factors.values())
    combos = [{k: values[i % len(values)] for k, values in factors.items()} for i in range(n)]
    for combo in combos:
        combo["mask"] = combo["sampling"] != "full"
    return combos


def name(combo: dict) -> str:
    return "-".join(f"{v}" for v in combo.values())


def overrides(combo: dict) -> list[str]:
    out = [f"rollout.sampling.temperature={combo['temperature']}", *SAMPLING[combo["sampling"]],
           f"algorithm.keep_sampling_mask={str(combo['mask']).lower()}",
           f"algorithm.pi_old={combo['pi_old']}", f"algorithm.replay={combo['replay']}",
           f"algorithm.loss={combo['loss']}", f"algorithm.corrections=[{','.join(CORRECTIONS)}]",
           "algorithm.correction.trm_delta=1e-3", "algorithm.correction.trm_measure=k3",
           "rollout.weight_check.enabled=true"]
    if combo["pi_old"] == "engine_avg":
        out.append(f"algorithm.pi_old_passes={combo.get('passes', 2)}")
    if "sync" in combo:
        out.append(f"cluster.weight_sync={combo['sync']}")
    if combo.get("pack"):   # the step's samples packed in rows of 24 tokens
        out += ["trainer.pack_sequences=true", "trainer.max_tokens_per_micro_batch=24"]
    if combo["loss"] == "ppo":
        out += ["algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
                "algorithm.aggregation=token-mean"]
    if combo["loss"] == "gmpo":   # the GMPO paper's log-ratio range
        out += ["algorithm.clip_low=0.4", "algorithm.clip_high=0.4"]
    if combo.get("router_shift"):
        out.append("algorithm.router_shift.enabled=true")
    if combo.get("penalty"):   # Prime-RL's coefficient
        out.append("algorithm.rollout_penalty.coef=1e-3")
    if combo.get("advantage"):   # graded rewards, every sample logged: the test recomputes
        out += [f"algorithm.advantage={combo['advantage']}", "logging.samples_per_step=4",
                "data.reward=graded_reward:score"]
    if combo.get("mini_batches"):   # the later mini-batches' ratio is live
        out.append(f"trainer.mini_batches={combo['mini_batches']}")
    if combo.get("experts"):   # the default (auto) takes the grouped experts on CPU
        out.append(f"trainer.experts={combo['experts']}")
    return out


# a reward in {0, 1/6, ..., 1} that differs between most responses (the tiny model's answers
# all score 0 under the toy reward, and every advantage would be 0); a module of its own beside
# the run, so that no engine's interpreter gets the source tree on its path
GRADED_REWARD = """
def score(prompt, response, answer, metadata):
    return (sum(map(ord, response)) % 7) / 6
"""


def train_steps(model: pathlib.Path, run_dir: pathlib.Path, combo: dict,
                engine: tuple[str, ...] = (), steps: int = 1) -> list[dict]:
    """``steps`` RL steps of `moe-rl train` with ``combo`` (on the engine ``engine``'s
    overrides choose); returns each step's metrics."""
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(CONFIG),
           f"model.path={model}", f"logging.dir={run_dir}", f"trainer.steps={steps}",
           "trainer.warmup.steps=0", "trainer.checkpoint.export_hf=false",
           "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
           "rollout.max_new_tokens=3", f"rollout.servers.base_port={engine_base_port()}",
           "logging.progress=false", "logging.tensorboard=false", *overrides(combo), *engine]
    env = None
    if combo.get("advantage"):   # the reward module in the directory the run starts from,
        # through the console script a user types, with no PYTHONPATH: found as documented
        (run_dir.parent / "graded_reward.py").write_text(GRADED_REWARD)
        cmd = [str(pathlib.Path(sys.executable).parent / "moe-rl"), *cmd[3:]]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, f"{name(combo)}\n{res.stderr[-2500:]}"
    rows = [json.loads(row) for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps)), name(combo)
    return rows


def run_all(model: pathlib.Path, base: pathlib.Path, combos: list[dict],
            engine: tuple[str, ...] = (), steps: int = 1) -> dict[str, list[dict]]:
    """Two runs at a time (each mostly waits on process start-up)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name(c): pool.submit(train_steps, model, base / name(c), c, engine, steps)
                   for c in combos}
        return {k: f.result() for k, f in futures.items()}


def check_invariant(combo: dict, m: dict) -> None:
    label = name(combo)
    assert abs(m["mismatch/k1"]) < 1e-5, (label, m["mismatch/k1"])
    assert m["mismatch/k3"] < 1e-6, (label, m["mismatch/k3"])
    assert m["mismatch/extreme_frac"] == 0.0, label
    for corr in CORRECTIONS:
        assert m[f"correction/{corr}/masked_token_frac"] == 0.0, (label, corr)
        assert m[f"correction/{corr}/masked_seq_frac"] == 0.0, (label, corr)
    assert m["is/ess"] > 0.999, (label, m["is/ess"])
    assert m["ratio/first_minibatch_max_dev"] < 1e-5, (label, m["ratio/first_minibatch_max_dev"])
    if combo["loss"] == "sapo":   # no clip: the soft gate's weight is 1 on policy
        assert m["sapo/gate_mean"] > 0.999, (label, m["sapo/gate_mean"])
    else:
        assert m["clip_frac"] == 0.0, label
    assert m["weights/probe_k3"] < 1e-6 and m["weights/check_resyncs"] == 0.0, label
    assert m["weights/probe_max_abs_diff"] < 1e-4, (label, m["weights/probe_max_abs_diff"])
    if combo["replay"] != "off" or "weights/probe_routing_agreement" in m:
        assert m["weights/probe_routing_agreement"] == 1.0, label
    if combo["mask"]:
        assert 0.0 < m["mismatch/kept_mass_mean"] <= 1.0, label
    else:
        assert "mismatch/kept_mass_mean" not in m, label
    if combo["pi_old"] == "engine_avg":
        assert "pi_old/pass_std" in m, label
    if combo.get("router_shift"):   # one update per rollout: the routers never moved
        assert m["router_shift/gamma_mean"] == 1.0, (label, m["router_shift/gamma_mean"])
        assert m["router_shift/shifted_frac"] == 0.0, label
