"""The zero-mismatch invariant, through the path a user takes: `moe-rl train` (Ray actors, the
reference engine over HTTP on 127.0.0.1) with a float32 engine and a float32 trainer on the same
weights. Whatever the temperature, the truncation, the keep-sampling-mask, the source of pi_old,
the replay mode, the loss and sequence packing, every log-prob compared describes one
distribution, so every mismatch metric is ~0, no correction removes anything, the first
mini-batch's ratio is 1, and the weight check's probe reads ~0 and never fires.

`make test` runs a covering set in which every pair of option values appears together at least
once; `make test-slow` runs the full product. A combination the configuration refuses is asserted
refused with its message."""
from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.trainer.parallel import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
SAMPLING = {"full": [], "top_k": ["rollout.top_k=5"],
            "top_k_top_p_min_p": ["rollout.top_k=6", "rollout.top_p=0.9", "rollout.min_p=0.05"]}
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


def name(combo: dict) -> str:
    return "-".join(f"{v}" for v in combo.values())


def overrides(combo: dict) -> list[str]:
    out = [f"rollout.temperature={combo['temperature']}", *SAMPLING[combo["sampling"]],
           f"algorithm.keep_sampling_mask={str(combo['mask']).lower()}",
           f"algorithm.pi_old={combo['pi_old']}", f"algorithm.replay={combo['replay']}",
           f"algorithm.loss={combo['loss']}", f"algorithm.corrections=[{','.join(CORRECTIONS)}]",
           "algorithm.correction.trm_delta=1e-3", "algorithm.correction.trm_measure=k3",
           "rollout.weight_check=true"]
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
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_mismatch") / "model"
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config", str(CONFIG),
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    return out


def train_steps(model: pathlib.Path, run_dir: pathlib.Path, combo: dict,
                engine: tuple[str, ...] = (), steps: int = 1) -> list[dict]:
    """``steps`` RL steps of `moe-rl train` with ``combo`` (on the engine ``engine``'s
    overrides choose); returns each step's metrics."""
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(CONFIG),
           f"model.path={model}", f"logging.dir={run_dir}", f"trainer.steps={steps}",
           "trainer.sft_warmup_steps=0", "trainer.export_hf=false",
           "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
           "rollout.max_new_tokens=3", f"rollout.base_port={free_port()}",
           "logging.progress=false", "logging.tensorboard=false", *overrides(combo), *engine]
    res = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
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


def test_covering_set_covers_every_valid_pair():
    chosen = covering_set()
    valid = [c for c in all_combos() if not refused(c)]
    assert set().union(*(_pairs(c) for c in chosen)) == set().union(*(_pairs(c) for c in valid))
    assert len(chosen) <= 12


@pytest.mark.parametrize("combo", [c for c in all_combos() if refused(c)][:2], ids=name)
def test_refused_combinations_name_the_reason(combo):
    with pytest.raises(ConfigError, match="keep_sampling_mask: needs a finite rollout.top_k"):
        load_config(CONFIG, overrides(combo))


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.multiproc
def test_zero_mismatch_covering_set(model_dir, tmp_path):
    combos = covering_set()
    results = run_all(model_dir, tmp_path, combos)
    for combo in combos:
        check_invariant(combo, results[name(combo)][0])


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.multiproc
def test_zero_mismatch_dppo_and_rspo(model_dir, tmp_path):
    """DPPO through `moe-rl train`, with R3 (binary TV, the keep-sampling-mask, pi_old from the
    rollout as its authors recommend) and without (binary KL, packed), and RSPO (GMPO with the
    router-shift weight) under R3: on identical float32 engine and trainer no token leaves the
    trust region, the divergence is ~0 and the router-shift weight is exactly 1."""
    combos = [{"temperature": 1.0, "sampling": "top_k", "mask": True, "pi_old": "rollout",
               "replay": "r3", "loss": "dppo_tv", "pack": False},
              {"temperature": 0.7, "sampling": "full", "mask": False, "pi_old": "trainer",
               "replay": "off", "loss": "dppo_kl", "pack": True},
              {"temperature": 0.7, "sampling": "top_k", "mask": True, "pi_old": "trainer",
               "replay": "r3", "loss": "gmpo", "pack": True, "router_shift": True}]
    results = run_all(model_dir, tmp_path, combos)
    for combo in combos:
        m = results[name(combo)][0]
        check_invariant(combo, m)
        if combo["loss"].startswith("dppo"):
            assert m["dppo/divergence_mean"] < 1e-6, (name(combo), m["dppo/divergence_mean"])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(3600)   # 120 runs of `moe-rl train`, two at a time: ~20 minutes here
def test_zero_mismatch_full_product(model_dir, tmp_path):
    combos = [c for c in all_combos() if not refused(c)]
    for combo in [c for c in all_combos() if refused(c)]:
        with pytest.raises(ConfigError, match="keep_sampling_mask: needs a finite rollout.top_k"):
            load_config(CONFIG, overrides(combo))
    results = run_all(model_dir, tmp_path, combos)
    for combo in combos:
        check_invariant(combo, results[name(combo)][0])
