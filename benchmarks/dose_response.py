"""Dose-response study: does the engine/trainer mismatch cause collapse here?

One model, task, optimiser and set of seeds; the only thing that changes between doses is the
engine's numerics against the float32 trainer: float32 (the control: mismatch exactly 0),
bfloat16, FP8 (block-wise E4M3 weights, bfloat16 activations) and MXFP4 (4-bit E2M1 weights in
blocks of 32 with a power-of-two scale, bfloat16 activations); and float16 on both sides (the
FP16 paper's fix: engine and trainer in float16, the trainer with megatron's dynamic loss
scaler from 2^16). Every run is a real ``moe-rl train`` (Ray, the reference engine over HTTP)
from the same warmed-up model.

Phases (each written to benchmarks/results/dose_response.{md,json} and dose_response_*.png):
  1. the pre-registered outcomes (OUTCOMES, written into the report before any run);
  2. the learning-rate sweep on the control (arm ``none``): the largest rate whose every seed is
     stable (no collapse by the definition below, reward rising) is the study's rate;
  3. the dose table at step 0: every engine scores the SAME sequences (generated once by the
     float32 engine); routing agreement, tokens routed differently, mismatch/k3, extreme_frac;
  4. the arms at every dose, the control included (ARMS; SEEDS_MAIN seeds for ``none`` and
     ``r3``, SEEDS_OTHER for the others: at zero mismatch an arm can only act through what it does
     besides correcting, e.g. the EMA's smoothing), two runs at a time;
  5. at the edge of stability: the sweep's smallest rate at which the control was NOT stable,
     the control and MXFP4, arms ``none`` and ``r3``, SEEDS_MAIN seeds: does the mismatch make an
     unstable setting collapse sooner or more often?
  6. outcomes per run and paired bootstrap intervals over seeds (BOOT resamples).

Usage: python benchmarks/dose_response.py [--steps 40] [--report-only] [--add-arms A,B
[--rebaseline]] [--add-doses D,E]

``--add-arms`` runs only the named arms (at every dose, their seeds, the report's rate) into the
existing report: the warm-up is repeated, and one run of the report (the control's ``none``, seed
1) is repeated first and must reproduce its reward curve exactly, or nothing is added. Another
CPU may not reproduce it (its arithmetic differs); ``--rebaseline`` then runs the arms beside
`none` runs made again on that machine, into a report of their own
(dose_response_<arms>.{md,json}), compared only with those. ``--add-doses`` runs the named doses
(`none`, SEEDS_OTHER seeds) beside the control's and bfloat16's `none` made again here with the
same seeds, into dose_response_<doses>.{md,json}: each dose against the control and against
bfloat16.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
RUNS_DIR = RESULTS / "dose_response_runs"
CONFIG = ROOT / "configs" / "tiny_cpu.yaml"
MAX_OPERAND = 5
HELD_OUT = [(0, 3), (1, 4), (2, 5), (3, 1), (4, 2), (5, 0)]   # b+a of each is trained
WARMUP_STEPS, WARMUP_LR = 20, 3e-3
DOSES = {"control_fp32": ["rollout.engine_dtype=float32", "rollout.quantization=none"],
         "bf16": ["rollout.engine_dtype=bfloat16", "rollout.quantization=none"],
         "fp8": ["rollout.engine_dtype=bfloat16", "rollout.quantization=fp8"],
         "mxfp4": ["rollout.engine_dtype=bfloat16", "rollout.quantization=mxfp4"],
         # both sides in float16; the scaler from 2^16 (megatron's 2^32 skips the first ~17
         # optimizer steps while it comes down), growing and backing off as in any fp16 run
         "fp16": ["rollout.engine_dtype=float16", "rollout.quantization=none",
                  "model.dtype=float16", "trainer.loss_scale.initial=65536"]}
SERVE = {"control_fp32": ("float32", "none"), "bf16": ("bfloat16", "none"),
         "fp8": ("bfloat16", "fp8"), "mxfp4": ("bfloat16", "mxfp4"),
         "fp16": ("float16", "none")}   # step 0's table: the engine's side only
# PPO-clip, token-mean, 2 epochs x 2 mini-batches: the later mini-batches go off-policy, so the
# engine's log-probs matter beyond the first ratio
BASE = ["algorithm.loss=ppo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        "algorithm.aggregation=token-mean", "algorithm.pi_old=trainer", "trainer.epochs=2",
        "trainer.mini_batches=2", "trainer.micro_batch_size=32", "trainer.warmup.steps=0",
        "trainer.checkpoint.export_hf=false", "trainer.checkpoint.interval=0",
        "trainer.checkpoint.interval_minutes=600",
        "logging.progress=false", "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=8",
        "rollout.max_new_tokens=4"]
ARMS = {
    "none": ["algorithm.replay=off", "algorithm.corrections=[]"],
    "r3": ["algorithm.replay=r3", "algorithm.corrections=[]"],
    # the seeds recommend a sequence-level correction for MoE; seq-MIS (masked when the
    # sequence's importance ratio leaves [1/C, C], C = 2) is the one chosen here
    "r3_seq_mis": ["algorithm.replay=r3", "algorithm.corrections=[seq_mis]",
                   "algorithm.correction.mis_c=2.0"],
    "r3_ema": ["algorithm.replay=r3", "algorithm.corrections=[]", "trainer.ema.decay=0.9",
               "trainer.ema.policy=true"],
    "r3_trm": ["algorithm.replay=r3", "algorithm.corrections=[trm]",
               "algorithm.correction.trm_delta=0.5", "algorithm.correction.trm_measure=log_ratio"],
    "keep_mask_r3": ["algorithm.replay=r3", "algorithm.corrections=[]",
                     "algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=20"],
    "engine_avg4_r3": ["algorithm.replay=r3", "algorithm.corrections=[]",
                       "algorithm.pi_old=engine_avg", "algorithm.pi_old_passes=4"],
    # RSPO as its paper runs it: GMPO (log-ratio range 0.4) with the router-shift weight, no
    # routing replay (the method's alternative to it)
    "rspo": ["algorithm.replay=off", "algorithm.corrections=[]", "algorithm.loss=gmpo",
             "algorithm.clip_low=0.4", "algorithm.clip_high=0.4",
             "algorithm.aggregation=seq-mean-token-mean", "algorithm.router_shift.enabled=true"],
    # DPPO's binary-TV trust region as its authors recommend it: against the rollout's policy,
    # no routing replay (reported stable on Qwen3-30B-A3B without R3)
    "dppo_tv": ["algorithm.replay=off", "algorithm.corrections=[]", "algorithm.loss=dppo_tv",
                "algorithm.pi_old=rollout"],
    # QAE: arm none with the group's 0.4-quantile (the authors' K) as the baseline
    "qae": ["algorithm.replay=off", "algorithm.corrections=[]", "algorithm.advantage=qae",
            "algorithm.qae.k=0.4"],
    # CISPO: arm none with the clipped, detached weight in place of PPO's clip (the paper's
    # bounds: no floor, eps_high 0.28)
    "cispo": ["algorithm.replay=off", "algorithm.corrections=[]", "algorithm.loss=cispo"],
}
MAIN_ARMS = ("none", "r3")
EDGE_DOSES = ("control_fp32", "mxfp4")   # phase 5: the harshest dose against the control
SEEDS_MAIN, SEEDS_OTHER = 5, 3
LR_GRID = (3e-3, 1e-2)
SWEEP_SEEDS = 2
ENTROPY_FLOOR, FLOOR_REWARD = 0.02, 0.8
DROP, WINDOW, RECOVER = 0.2, 5, 10
BOOT = 10000
K3_ROUNDING = 1e-9   # k3 differences below this are float32 rounding (the control's k3 ~1e-14)
OUTCOMES = f"""Outcomes, decided before any run:
- **time to collapse**: the first RL step t at which the {WINDOW}-step mean reward falls more
  than {DROP} below its running maximum and stays so for the next {RECOVER} steps, or at which
  the {WINDOW}-step mean entropy is below {ENTROPY_FLOOR} nats/token while the {WINDOW}-step mean
  reward is below {FLOOR_REWARD} (a policy that collapsed onto answers it gets right is not
  counted). A run that never collapses is censored at the horizon (its time = the number of
  steps); a collapse must be seen with {RECOVER} steps left, so the last {RECOVER} steps can only
  confirm one.
- **final held-out reward**: greedy decoding (temperature 0) of the {len(HELD_OUT)} held-out
  additions after the last update (each is the commuted form of a trained one; the toy task has
  no other held-out set), `eval/held_out/reward_mean`.
- **mismatch/k3 over training**: the mean of `mismatch/k3` over the run's steps.
- Comparisons: paired by seed (the same seed means the same prompts and sampling seeds at
  step 0), bootstrap over seeds ({BOOT} resamples) of the mean difference, 95% percentile
  interval; a difference is called distinguishable from noise only when its interval excludes 0.
  Each dose's `none` against the control's `none`; each arm against `none` at its dose.
"""


# ---------------------------------------------------------------- outcomes (pure functions)

def moving_mean(xs: list[float], w: int) -> list[float]:
    """Trailing mean over up to ``w`` values (the first values average what exists)."""
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def time_to_collapse(reward: list[float], entropy: list[float]) -> int | None:
    """The first step of collapse (see OUTCOMES), or None if the run never collapses."""
    r, e = moving_mean(reward, WINDOW), moving_mean(entropy, WINDOW)
    best = float("-inf")
    for t in range(len(r)):
        best = max(best, r[t])
        if e[t] < ENTROPY_FLOOR and r[t] < FLOOR_REWARD:
            return t
        if t + RECOVER < len(r) and r[t] < best - DROP:
            # the running maximum up to t; the drop must last RECOVER more steps
            if all(r[u] < best - DROP for u in range(t, t + RECOVER + 1)):
                return t
    return None


def paired_bootstrap(a: list[float], b: list[float], n: int = BOOT, seed: int = 0
                     ) -> dict:
    """Mean of a - b over paired seeds and its 95% bootstrap interval (resampling seeds)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap: {len(a)} and {len(b)} values")
    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(d, k=len(d))) for _ in range(n))
    lo, hi = means[int(0.025 * n)], means[int(0.975 * n) - 1]
    return {"diff": statistics.fmean(d), "lo": lo, "hi": hi, "n": len(d),
            "distinguishable": lo > 0 or hi < 0}


# ---------------------------------------------------------------- inputs

def write_data(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """train.jsonl (every a+b with a, b <= MAX_OPERAND but the held-out ones) and held_out.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    train = [p for p in pairs if p not in HELD_OUT]
    paths = out / "train.jsonl", out / "held_out.jsonl"
    for path, rows in zip(paths, (train, HELD_OUT)):
        path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                for a, b in rows))
    return paths


def data_overrides(train: pathlib.Path, held: pathlib.Path) -> list[str]:
    return ["data.source=jsonl", f"data.path={train}", "data.reward=toy",
            f"eval.sets=[{{path: {held}, name: held_out}}]", "eval.temperature=0",
            "eval.n=1", "eval.interval=0", "eval.at_start=false"]


def warm_model(work: pathlib.Path, train: pathlib.Path) -> str:
    """The tiny demo model, warmed up by WARMUP_STEPS supervised steps on the training set (the
    one starting point of every run)."""
    from transformers import AutoTokenizer
    from moe_rl.config import load_config
    from moe_rl.data.prompts import PromptSampler, load_prompts
    from moe_rl.orchestration.warm_start import sft_samples
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    base = work / "init"
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config", str(CONFIG),
                    "--out", str(base)], check=True, capture_output=True)
    cfg = load_config(str(CONFIG), [f"model.path={base}", "data.source=jsonl",
                                    f"data.path={train}", "data.reward=toy"])
    init_distributed()
    init_model_parallel()
    tok = AutoTokenizer.from_pretrained(str(base))
    prompts = load_prompts(cfg.data, tok)
    trainer = PolicyTrainer(cfg, str(base))
    sampler = PromptSampler(len(prompts), 32, 0)
    for _ in range(WARMUP_STEPS):
        trainer.sft_step(sft_samples(prompts, sampler.next_batch(), tok), WARMUP_LR)
    out = str(work / "warm")
    trainer.export_hf(out)
    trainer.replay.close()
    return out


# ---------------------------------------------------------------- phase 3: step-0 dose table

def dose_table(model: str, train: pathlib.Path) -> dict:
    """Every engine scores the same sequences (generated once by the float32 engine); the
    trainer (float32, routing its own way) compares: one row per dose."""
    from transformers import AutoTokenizer
    from benchmarks.mismatch_study import _rescore
    from moe_rl.config import load_config
    from moe_rl.data.prompts import load_prompts
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.reference.launcher import ReferenceServer
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.families.shape import MoEShape
    from moe_rl.rollout.trajectories import generate_samples
    from moe_rl.trainer.parallel import free_port
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.weights.fp8 import write_fp8_checkpoint
    hf = json.loads(pathlib.Path(model, "config.json").read_text())
    layout = MoEShape.from_hf(hf)
    tok = AutoTokenizer.from_pretrained(model)
    cfg = load_config(str(CONFIG), [f"model.path={model}", "data.source=jsonl",
                                    f"data.path={train}", "data.reward=toy",
                                    "algorithm.replay=off"])
    prompts = [p.ids for p in load_prompts(cfg.data, tok)]

    def server(dose: str):
        dtype, quant = SERVE[dose]
        path = write_fp8_checkpoint(model, model + "_fp8") if quant == "fp8" else model
        return ReferenceServer(path, free_port(), dtype=dtype,
                               quantization="mxfp4" if quant == "mxfp4" else "none").start(600)

    proc = server("control_fp32")
    try:
        eng = SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                           need_mask=False)
        base = generate_samples(eng, prompts, 4, SamplingConfig(max_new_tokens=4), seed=0)
    finally:
        proc.stop()
    trainer = PolicyTrainer(cfg, model)
    out = {"sequences": len(base)}
    for dose in DOSES:
        proc = server(dose)
        try:
            samples = copy.deepcopy(base)
            _rescore(proc.url, samples, layout)
        finally:
            proc.stop()
        m = trainer.prepare(samples)[1]
        out[dose] = {k: m[k] for k in ("routing/agreement", "routing/token_differs_frac",
                                       "mismatch/k3", "mismatch/extreme_frac")}
    trainer.replay.close()
    return out


# ---------------------------------------------------------------- phases 2 and 4: runs

def train_run(model: str, data: list[str], label: str, overrides: list[str], steps: int,
              lr: float, seed: int) -> dict:
    """One ``moe-rl train`` run; returns its per-step series and outcomes."""
    from moe_rl.trainer.parallel import free_port
    run_dir = RUNS_DIR / label
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(CONFIG),
           f"model.path={model}", f"logging.dir={run_dir}", f"trainer.steps={steps}",
           f"trainer.optim.lr={lr}", f"trainer.seed={seed}",
           f"rollout.servers.base_port={free_port()}",
           *BASE, *data, *overrides]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"{label}: exit {res.returncode}\n{res.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for name in ("checkpoints", "weights", "fp8_start", "logs"):   # keep config.yaml, tb/,
        shutil.rmtree(run_dir / name, ignore_errors=True)              # metrics.jsonl
    train = [r for r in rows if r.get("kind") != "eval"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    reward = [r["reward/mean"] for r in train]
    entropy = [r["entropy"] for r in train]
    k3 = [r["mismatch/k3"] for r in train]
    t = time_to_collapse(reward, entropy)
    return {"label": label, "seed": seed, "lr": lr, "wall_s": time.perf_counter() - t0,
            "reward": reward, "entropy": entropy, "k3": k3,
            "agreement": [r.get("routing/agreement") for r in train],
            "collapse_step": t, "time_to_collapse": steps if t is None else t,
            "held_out_reward": evals[-1]["eval/held_out/reward_mean"] if evals else None,
            "k3_mean": statistics.fmean(k3)}


def run_all(jobs: list[tuple], model: str, data: list[str], steps: int) -> dict[str, dict]:
    """Every (label, overrides, lr, seed) job, two at a time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job[0]: pool.submit(train_run, model, data, job[0], job[1], steps, job[2],
                                       job[3]) for job in jobs}
        out = {}
        for label, fut in futures.items():
            out[label] = fut.result()
            r = out[label]
            print(f"  {label}: collapse {r['collapse_step']}, held-out "
                  f"{r['held_out_reward']}, reward last 5 "
                  f"{statistics.fmean(r['reward'][-5:]):.3f}, {r['wall_s']:.0f} s", flush=True)
        return out


def stable(runs: list[dict]) -> bool:
    """The sweep's criterion: no run collapses and every run's reward rises (last 5 steps'
    mean above the first 5 steps')."""
    return all(r["collapse_step"] is None and
               statistics.fmean(r["reward"][-5:]) > statistics.fmean(r["reward"][:5])
               for r in runs)


def seeds_of(dose: str, arm: str, n_main: int, n_other: int) -> list[int]:
    return list(range(1, (n_main if arm in MAIN_ARMS else n_other) + 1))


def study_jobs(lr: float, n_main: int, n_other: int) -> list[tuple]:
    jobs = []
    for dose, dose_ov in DOSES.items():
        for arm, arm_ov in ARMS.items():
            for seed in seeds_of(dose, arm, n_main, n_other):
                jobs.append((f"{dose}__{arm}__s{seed}", dose_ov + arm_ov, lr, seed))
    return jobs


def edge_jobs(lr: float, n: int) -> list[tuple]:
    return [(f"edge__{dose}__{arm}__s{seed}", DOSES[dose] + ARMS[arm], lr, seed)
            for dose in EDGE_DOSES for arm in MAIN_ARMS for seed in range(1, n + 1)]


def edge_summary(runs: dict[str, dict], n: int) -> dict:
    """Phase 5's groups and its paired comparisons: MXFP4 vs the control without correction,
    R3 vs none at MXFP4."""
    seeds = range(1, n + 1)

    def pick(dose, arm):
        return [runs[f"edge__{dose}__{arm}__s{s}"] for s in seeds]
    groups = [{"dose": dose, "arm": arm, "seeds": n,
               "collapsed": sum(r["collapse_step"] is not None for r in pick(dose, arm)),
               "time_to_collapse": statistics.fmean(r["time_to_collapse"]
                                                    for r in pick(dose, arm)),
               "held_out_reward": statistics.fmean(r["held_out_reward"] for r in pick(dose, arm)),
               "k3_mean": statistics.fmean(r["k3_mean"] for r in pick(dose, arm))}
              for dose in EDGE_DOSES for arm in MAIN_ARMS]
    comparisons = []
    for (d, a), (rd, ra) in ((("mxfp4", "none"), ("control_fp32", "none")),
                             (("mxfp4", "r3"), ("mxfp4", "none"))):
        row = {"what": f"{d}/{a} - {rd}/{ra}", "seeds": n}
        for key in ("time_to_collapse", "held_out_reward", "k3_mean"):
            row[key] = paired_bootstrap([r[key] for r in pick(d, a)],
                                        [r[key] for r in pick(rd, ra)])
        comparisons.append(row)
    return {"groups": groups, "comparisons": comparisons}


# ---------------------------------------------------------------- analysis and report

def compare(runs: dict[str, dict], n_main: int, n_other: int,
            arms: tuple[str, ...] = tuple(ARMS)) -> list[dict]:
    """Paired bootstrap of each outcome: each dose's none vs the control's none, each arm of
    ``arms`` vs none at its dose (paired by seed)."""
    out = []

    def series(dose, arm, seeds, key):
        return [runs[f"{dose}__{arm}__s{s}"][key] for s in seeds]
    pairs = [(d, "none", "control_fp32", "none") for d in DOSES if d != "control_fp32"]
    pairs += [(d, a, d, "none") for d in DOSES for a in arms if a != "none"]
    for dose, arm, ref_dose, ref_arm in pairs:
        seeds = seeds_of(dose, arm, n_main, n_other)
        if f"{dose}__{arm}__s{seeds[0]}" not in runs:   # an arm the report has not run
            continue
        row = {"what": f"{dose}/{arm} - {ref_dose}/{ref_arm}", "seeds": len(seeds)}
        for key in ("time_to_collapse", "held_out_reward", "k3_mean"):
            row[key] = paired_bootstrap(series(dose, arm, seeds, key),
                                        series(ref_dose, ref_arm, seeds, key))
        out.append(row)
    return out


def group_stats(runs: dict[str, dict], n_main: int, n_other: int,
                arms: tuple[str, ...] = tuple(ARMS)) -> list[dict]:
    rows = []
    for dose in DOSES:
        for arm in arms:
            labels = [f"{dose}__{arm}__s{s}" for s in seeds_of(dose, arm, n_main, n_other)]
            if labels[0] not in runs:
                continue
            rs = [runs[lab] for lab in labels]
            rows.append({"dose": dose, "arm": arm, "seeds": len(rs),
                         "collapsed": sum(r["collapse_step"] is not None for r in rs),
                         "time_to_collapse": statistics.fmean(r["time_to_collapse"] for r in rs),
                         "held_out_reward": statistics.fmean(r["held_out_reward"] for r in rs),
                         "reward_last5": statistics.fmean(statistics.fmean(r["reward"][-5:])
                                                          for r in rs),
                         "k3_mean": statistics.fmean(r["k3_mean"] for r in rs),
                         "agreement_mean": statistics.fmean(
                             statistics.fmean(a for a in r["agreement"] if a is not None)
                             for r in rs)})
    return rows


def plots(runs: dict[str, dict], groups: list[dict], steps: int, edge: dict | None = None
          ) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    files = []
    fig, ax = plt.subplots(figsize=(10, 4))
    arms = list(ARMS)
    for i, dose in enumerate(DOSES):
        for j, arm in enumerate(arms):
            vals = [r["time_to_collapse"] for lab, r in runs.items()
                    if lab.startswith(f"{dose}__{arm}__")]
            if vals:
                x = i * (len(arms) + 1) + j
                ax.scatter([x] * len(vals), vals, s=12, color=f"C{j}",
                           label=arm if i == 0 or dose == "bf16" and arm not in MAIN_ARMS
                           else None)
                ax.plot([x - 0.3, x + 0.3], [statistics.fmean(vals)] * 2, color=f"C{j}")
    ticks = [i * (len(arms) + 1) + len(arms) / 2 for i in range(len(DOSES))]
    names = list(DOSES)
    if edge:   # phase 5's runs to the right, at their own learning rate
        x0 = len(DOSES) * (len(arms) + 1)
        for i, dose in enumerate(EDGE_DOSES):
            for j, arm in enumerate(MAIN_ARMS):
                vals = [r["time_to_collapse"] for lab, r in edge["runs"].items()
                        if lab.startswith(f"edge__{dose}__{arm}__")]
                x = x0 + i * 3 + j
                ax.scatter([x] * len(vals), vals, s=12, color=f"C{arms.index(arm)}")
                ax.plot([x - 0.3, x + 0.3], [statistics.fmean(vals)] * 2,
                        color=f"C{arms.index(arm)}")
            ticks.append(x0 + i * 3 + 0.5)
            names.append(f"{dose}\nlr {edge['lr']:g}")
    ax.set_xticks(ticks)
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylabel(f"time to collapse (steps; {steps} = none)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, ncol=4)
    fig.tight_layout()
    files.append("dose_response_collapse.png")
    fig.savefig(RESULTS / files[-1], dpi=110)
    plt.close(fig)
    for key, name in (("reward", "reward/mean"), ("k3", "mismatch/k3")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, arm in zip(axes, MAIN_ARMS):
            for i, dose in enumerate(DOSES):
                curves = np.array([r[key] for lab, r in runs.items()
                                   if lab.startswith(f"{dose}__{arm}__")])
                if not len(curves):
                    continue
                m, s = curves.mean(0), curves.std(0)
                x = np.arange(len(m))
                ax.plot(x, m, color=f"C{i}", label=dose)
                ax.fill_between(x, m - s, m + s, color=f"C{i}", alpha=0.2)
            ax.set_title(f"{arm}: {name} (mean ± std over seeds)")
            ax.set_xlabel("RL step")
            if key == "k3":
                ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"dose_response_{key}.png")
        fig.savefig(RESULTS / files[-1], dpi=110)
        plt.close(fig)
    return files


def fmt_ci(c: dict, digits: int = 3) -> str:
    mark = " **distinguishable**" if c["distinguishable"] else ""
    return f"{c['diff']:+.{digits}g} [{c['lo']:+.{digits}g}, {c['hi']:+.{digits}g}]{mark}"


def markdown(report: dict) -> str:
    lines = ["# Dose-response study: engine/trainer mismatch and collapse", "",
             f"`python benchmarks/dose_response.py` ({report['wall_min']:.0f} minutes on 2 "
             f"cores). The tiny demo model (2 layers, 8 experts, top-2) warmed up by "
             f"{WARMUP_STEPS} supervised steps, then `moe-rl train` from it: additions a+b "
             f"(a, b <= {MAX_OPERAND}), {len(HELD_OUT)} held out; {report['steps']} RL steps of "
             f"8 prompts x 8 samples, float32 trainer. Common overrides: `{' '.join(BASE)}`.",
             *[f"Arms {', '.join(f'`{a}`' for a in add['arms'])} were added later by "
               f"`--add-arms` ({add['wall_min']:.0f} minutes): the same warm-up, rate and seeds; "
               f"`{add['reproduced']}` was run again first and reproduced its reward curve "
               f"exactly." for add in report.get("added", [])],
             "", OUTCOMES, "## 1. The control and the learning rate", "",
             "Sweep on the control (float32 engine, arm `none`), seeds "
             f"{list(range(1, report['sweep_seeds'] + 1))}:", "",
             "| lr | collapsed | reward first 5 | reward last 5 | final entropy | held-out |",
             "|---|---|---|---|---|---|"]
    for lr, rs in report["sweep"].items():
        lines.append(
            f"| {lr} | {sum(r['collapse_step'] is not None for r in rs)}/{len(rs)} | "
            f"{statistics.fmean(statistics.fmean(r['reward'][:5]) for r in rs):.3f} | "
            f"{statistics.fmean(statistics.fmean(r['reward'][-5:]) for r in rs):.3f} | "
            f"{statistics.fmean(r['entropy'][-1] for r in rs):.3f} | "
            f"{statistics.fmean(r['held_out_reward'] for r in rs):.3f} |")
    lines += ["", f"Chosen: **lr {report['lr']}** ({report['lr_reason']}).", "",
              "## 2. The doses at step 0 (the same sequences scored by every engine)", "",
              f"{report['dose_table']['sequences']} sequences generated once by the float32 "
              f"engine; the trainer routes on its own (replay off).", "",
              "| dose | routing agreement | tokens routed differently | mismatch/k3 | "
              "extreme_frac |", "|---|---|---|---|---|"]
    for dose in (d for d in DOSES if d in report["dose_table"]):
        d = report["dose_table"][dose]
        lines.append(f"| {dose} | {d['routing/agreement']:.4f} | "
                     f"{d['routing/token_differs_frac']:.4f} | {d['mismatch/k3']:.2e} | "
                     f"{d['mismatch/extreme_frac']:.4f} |")
    lines += ["", "## 3. Arms at every dose", "", *arm_tables(report)]
    edge = report.get("edge")
    if edge:
        lines += ["", f"## 4. At the edge of stability (lr {edge['lr']})", "",
                  f"The sweep's smallest rate at which the control was not stable; the control "
                  f"and MXFP4, `none` and `r3`, {edge['seeds']} seeds each.", "",
                  "| dose | arm | seeds | collapsed | mean time to collapse | held-out reward | "
                  "mean k3 |", "|---|---|---|---|---|---|---|"]
        for g in edge["groups"]:
            lines.append(f"| {g['dose']} | {g['arm']} | {g['seeds']} | {g['collapsed']} | "
                         f"{g['time_to_collapse']:.1f} | {g['held_out_reward']:.3f} | "
                         f"{g['k3_mean']:.2e} |")
        lines += ["", "| comparison | seeds | time to collapse | held-out reward | mean k3 |",
                  "|---|---|---|---|---|"]
        for c in edge["comparisons"]:
            lines.append(f"| {c['what']} | {c['seeds']} | {fmt_ci(c['time_to_collapse'])} | "
                         f"{fmt_ci(c['held_out_reward'])} | {fmt_ci(c['k3_mean'])} |")
    lines += ["", "## What was and was not shown", "", *report["findings"], "",
              *[f"![{f}]({f})" for f in report["plots"]], "",
              f"The seed-1 run of every dose and arm (TensorBoard events, config) is kept in "
              f"`benchmarks/results/{RUNS_DIR.name}/`; overlay any of them with `moe-rl report "
              f"DIR DIR ...`. Every run's curves are in `dose_response.json`."]
    return "\n".join(lines) + "\n"


def arm_tables(report: dict) -> list[str]:
    """The arms' outcomes per dose and their paired differences, as markdown lines."""
    lines = ["| dose | arm | seeds | collapsed | mean time to collapse | held-out reward | "
             "reward last 5 | mean k3 | mean agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for g in report["groups"]:
        lines.append(f"| {g['dose']} | {g['arm']} | {g['seeds']} | {g['collapsed']} | "
                     f"{g['time_to_collapse']:.1f} | {g['held_out_reward']:.3f} | "
                     f"{g['reward_last5']:.3f} | {g['k3_mean']:.2e} | "
                     f"{g['agreement_mean']:.4f} |")
    lines += ["", "Paired differences (mean [95% bootstrap interval] over seeds):", "",
              "| comparison | seeds | time to collapse | held-out reward | mean k3 |",
              "|---|---|---|---|---|"]
    for c in report["comparisons"]:
        lines.append(f"| {c['what']} | {c['seeds']} | {fmt_ci(c['time_to_collapse'])} | "
                     f"{fmt_ci(c['held_out_reward'])} | {fmt_ci(c['k3_mean'])} |")
    return lines


def rebaselined_markdown(sub: dict) -> str:
    """The report of arms run beside their own `none` runs (see :func:`add_arms`)."""
    check = sub["recheck"]
    return "\n".join([
        f"# Dose-response study: arms {', '.join(f'`{a}`' for a in sub['arms'][1:])}", "",
        f"`python benchmarks/dose_response.py --add-arms {','.join(sub['arms'][1:])} "
        f"--rebaseline` ({sub['wall_min']:.0f} minutes on 2 cores, {sub['date']}). The design, "
        f"doses, seeds, rate ({sub['lr']}) and outcomes of [the study](dose_response.md); on "
        f"this machine its run `{check['label']}` did not reproduce (reward of the last 5 steps "
        f"{check['here']:.3f} against the report's {check['report']:.3f}), so these arms are "
        f"compared with `none` runs made again beside them, never with the report's.", "",
        *arm_tables(sub), ""]) + "\n"


def is_dose_comparison(what: str) -> bool:
    """Whether a comparison's label is a dose's ``none`` against the control's ``none``."""
    left, right = what.split(" - ")
    return left.endswith("/none") and right == "control_fp32/none"


def findings(report: dict) -> list[str]:
    """Plain statements computed from the comparisons (no hand-written conclusions)."""
    out = []
    control = [r for lab, r in report["runs"].items() if lab.startswith("control_fp32__")]
    out.append(
        f"- Control (float32 engine, mismatch/k3 ~1e-14) at lr {report['lr']}: "
        f"{sum(r['collapse_step'] is not None for r in control)}/{len(control)} runs collapsed; "
        f"reward {statistics.fmean(statistics.fmean(r['reward'][:5]) for r in control):.3f} "
        f"(first 5 steps) -> "
        f"{statistics.fmean(statistics.fmean(r['reward'][-5:]) for r in control):.3f} "
        f"(last 5); lowest 5-step entropy of any run "
        f"{min(min(moving_mean(r['entropy'], WINDOW)) for r in control):.3f} "
        f"(floor {ENTROPY_FLOOR}). Chosen as {report['lr_reason']}.")
    by = {c["what"]: c for c in report["comparisons"]}
    for dose in DOSES:
        if dose == "control_fp32":
            continue
        c = by.get(f"{dose}/none - control_fp32/none")
        if c is None:   # a dose this report did not run
            continue
        g = next(x for x in report["groups"] if x["dose"] == dose and x["arm"] == "none")
        shown = [k for k in ("time_to_collapse", "held_out_reward") if c[k]["distinguishable"]]
        out.append(f"- {dose}, no correction: {g['collapsed']}/{g['seeds']} runs collapsed; "
                   f"against the control, time to collapse {fmt_ci(c['time_to_collapse'])}, "
                   f"held-out reward {fmt_ci(c['held_out_reward'])}: "
                   + ("an effect distinguishable from seed noise on " + ", ".join(shown)
                      if shown else "no effect distinguishable from seed noise") + ".")
    arm_effects = [c for c in report["comparisons"] if not is_dose_comparison(c["what"])
                   and any(c[k]["distinguishable"] for k in ("time_to_collapse",
                                                             "held_out_reward"))]
    if arm_effects:
        out.append("- Arms with an outcome distinguishable from `none` at their dose: "
                   + "; ".join(f"{c['what']} (collapse {fmt_ci(c['time_to_collapse'])}, "
                               f"held-out {fmt_ci(c['held_out_reward'])})"
                               for c in arm_effects) + ".")
    else:
        out.append("- No arm's time to collapse or held-out reward is distinguishable from "
                   "`none` at its dose.")
    held = [c["what"] for c in report["comparisons"] if c["held_out_reward"]["distinguishable"]]
    if held:
        better = [w for w in held if not is_dose_comparison(w)]
        contrary = [w for w in held if is_dose_comparison(w)
                    and by[w]["held_out_reward"]["diff"] > 0]
        out.append(
            f"- Caution on the held-out calls ({', '.join(held)}): the held-out reward is the "
            f"mean of {len(HELD_OUT)} greedy answers of one model per run, so it moves in coarse "
            f"steps, and a percentile bootstrap over {SEEDS_OTHER} to {SEEDS_MAIN} seeds is "
            f"anti-conservative (with {SEEDS_OTHER} seeds it has at most 10 distinct resampled "
            f"means). "
            + (f"{', '.join(contrary)} point the opposite way to the hypothesis (more mismatch, "
               f"higher held-out reward). " if contrary else "")
            + (f"For {', '.join(better)}, set the held-out figures beside the training reward's "
               f"last-5 means in the table above. " if better else "")
            + "None of them is taken as shown without more seeds and a larger held-out set.")
    k3_effects = [c["what"] for c in report["comparisons"] if c["k3_mean"]["distinguishable"]
                  and abs(c["k3_mean"]["diff"]) > K3_ROUNDING]
    out.append("- mismatch/k3 over training differs distinguishably (and by more than float32 "
               f"rounding, {K3_ROUNDING:g}) in: "
               + (", ".join(k3_effects) if k3_effects else "none of the comparisons") + ".")
    edge = report.get("edge")
    if edge:
        g = {(x["dose"], x["arm"]): x for x in edge["groups"]}
        c = edge["comparisons"]
        out.append(
            f"- At the edge (lr {edge['lr']}): the control collapsed in "
            f"{g['control_fp32', 'none']['collapsed']}/{edge['seeds']} runs, MXFP4 without "
            f"correction in {g['mxfp4', 'none']['collapsed']}/{edge['seeds']}, MXFP4 with R3 in "
            f"{g['mxfp4', 'r3']['collapsed']}/{edge['seeds']}; MXFP4 - control, time to "
            f"collapse {fmt_ci(c[0]['time_to_collapse'])}; R3 - none at MXFP4, "
            f"{fmt_ci(c[1]['time_to_collapse'])}.")
    out.append(f"- Not shown: anything beyond this tiny model and task, {report['steps']} steps "
               f"and these seeds; with {SEEDS_OTHER} seeds an interval is wide, and an arm "
               f"without a distinguishable difference may still have an effect too small to "
               f"see here.")
    return out


def keep_for_report() -> None:
    """Of the run directories, keep the seed-1 run of every dose and arm (its TensorBoard
    events and config, what `moe-rl report` overlays); every run's curves are in the JSON."""
    for run_dir in RUNS_DIR.iterdir():
        if run_dir.name.startswith("sweep_") or not run_dir.name.endswith("__s1"):
            shutil.rmtree(run_dir)
        else:
            for name in ("metrics.jsonl", "plan.json"):
                (run_dir / name).unlink(missing_ok=True)


def rerender(report: dict) -> None:
    """Groups, comparisons, findings, plots and the report files from ``report["runs"]``."""
    n_main, n_other = SEEDS_MAIN, SEEDS_OTHER
    report["groups"] = group_stats(report["runs"], n_main, n_other)
    report["comparisons"] = compare(report["runs"], n_main, n_other)
    report["findings"] = findings(report)
    report["plots"] = plots(report["runs"], report["groups"], report["steps"], report.get("edge"))
    (RESULTS / "dose_response.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "dose_response.md").write_text(markdown(report))


def add_arms(arms: list[str], rebaseline: bool = False) -> int:
    """Run ``arms`` into the existing report (see the module's usage); with ``rebaseline``,
    where the report's run does not reproduce, into a report of their own beside `none` runs
    made again here."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--add-arms: unknown arm(s) {unknown}; known: {list(ARMS)}")
    report = json.loads((RESULTS / "dose_response.json").read_text())
    steps, lr = report["steps"], report["lr"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        train, held = write_data(work / "data")
        data = data_overrides(train, held)
        model = warm_model(work, train)
        check = "control_fp32__none__s1"
        again = run_all([(f"recheck__{check}", DOSES["control_fp32"] + ARMS["none"], lr, 1)],
                        model, data, steps)[f"recheck__{check}"]
        shutil.rmtree(RUNS_DIR / f"recheck__{check}", ignore_errors=True)
        jobs = [j for j in study_jobs(lr, SEEDS_MAIN, SEEDS_OTHER)
                if j[0].split("__")[1] in arms]
        if again["reward"] != report["runs"][check]["reward"]:
            if not rebaseline:
                raise SystemExit(f"--add-arms: {check} did not reproduce the report's reward "
                                 f"curve on this machine; run the whole study, or add "
                                 f"--rebaseline")
            recheck = {"label": check, "here": statistics.fmean(again["reward"][-5:]),
                       "report": statistics.fmean(report["runs"][check]["reward"][-5:])}
            return rebaselined(arms, jobs, model, data, report, recheck, start)
        report["runs"].update(run_all(jobs, model, data, steps))
    keep_for_report()
    report.setdefault("added", []).append(
        {"arms": arms, "wall_min": (time.perf_counter() - start) / 60,
         "reproduced": check})
    rerender(report)
    print(markdown(report))
    return 0


def rebaselined(arms: list[str], jobs: list[tuple], model: str, data: list[str], report: dict,
                recheck: dict, start: float) -> int:
    """``jobs`` (the arms) and the `none` runs of every dose, into
    dose_response_<arms>.{md,json}."""
    steps, lr = report["steps"], report["lr"]
    base = [(f"rebaseline__{j[0]}", *j[1:]) for j in study_jobs(lr, SEEDS_MAIN, SEEDS_OTHER)
            if j[0].split("__")[1] == "none"]
    runs = run_all(jobs + base, model, data, steps)
    for label, _, _, _ in base:   # the report's own `none` runs keep their directories
        runs[label.removeprefix("rebaseline__")] = runs.pop(label)
        shutil.rmtree(RUNS_DIR / label, ignore_errors=True)
    keep_for_report()
    own = ("none", *arms)
    sub = {"steps": steps, "lr": lr, "arms": list(own), "recheck": recheck, "runs": runs,
           "date": time.strftime("%Y-%m-%d"), "wall_min": (time.perf_counter() - start) / 60,
           "groups": group_stats(runs, SEEDS_MAIN, SEEDS_OTHER, own),
           "comparisons": compare(runs, SEEDS_MAIN, SEEDS_OTHER, own)}
    name = "dose_response_" + "_".join(arms)
    (RESULTS / f"{name}.json").write_text(json.dumps(sub, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(rebaselined_markdown(sub))
    print(rebaselined_markdown(sub))
    return 0


def add_doses(doses: list[str]) -> int:
    """``doses``' `none` runs beside the control's and bfloat16's made again with the same
    seeds (SEEDS_OTHER), at the report's rate, into dose_response_<doses>.{md,json}."""
    unknown = [d for d in doses if d not in DOSES]
    if unknown:
        raise SystemExit(f"--add-doses: unknown dose(s) {unknown}; known: {list(DOSES)}")
    report = json.loads((RESULTS / "dose_response.json").read_text())
    steps, lr, n = report["steps"], report["lr"], SEEDS_OTHER
    start = time.perf_counter()
    shown = list(dict.fromkeys(["control_fp32", "bf16", *doses]))
    jobs = [(f"doses__{dose}__none__s{seed}", DOSES[dose] + ARMS["none"], lr, seed)
            for dose in shown for seed in range(1, n + 1)]   # beside the report's run folders
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        train, held = write_data(work / "data")
        data = data_overrides(train, held)
        model = warm_model(work, train)
        runs = run_all(jobs, model, data, steps)
    for label in list(runs):
        shutil.rmtree(RUNS_DIR / label, ignore_errors=True)
        runs[label.removeprefix("doses__")] = runs.pop(label)
    comparisons = compare(runs, n, n, ("none",))
    for dose in doses:
        if dose != "bf16":
            comparisons.append({"what": f"{dose}/none - bf16/none", "seeds": n, **{
                key: paired_bootstrap([runs[f"{dose}__none__s{s}"][key] for s in range(1, n + 1)],
                                      [runs[f"bf16__none__s{s}"][key] for s in range(1, n + 1)])
                for key in ("time_to_collapse", "held_out_reward", "k3_mean")}})
    sub = {"steps": steps, "lr": lr, "doses": shown, "runs": runs,
           "date": time.strftime("%Y-%m-%d"), "wall_min": (time.perf_counter() - start) / 60,
           "groups": group_stats(runs, n, n, ("none",)), "comparisons": comparisons}
    name = "dose_response_" + "_".join(doses)
    text = "\n".join([
        f"# Dose-response study: dose {', '.join(f'`{d}`' for d in doses)}", "",
        f"`python benchmarks/dose_response.py --add-doses {','.join(doses)}` "
        f"({sub['wall_min']:.0f} minutes on 2 cores, {sub['date']}). The design, rate "
        f"({lr}), steps ({steps}) and outcomes of [the study](dose_response.md), arm `none`, "
        f"{n} seeds; the control's and bfloat16's `none` runs made again here with the same "
        f"seeds, so every row below comes from this machine. Doses: "
        + "; ".join(f"`{d}`: {' '.join(DOSES[d])}" for d in shown) + ".", "",
        *arm_tables(sub), ""]) + "\n"
    (RESULTS / f"{name}.json").write_text(json.dumps(sub, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--report-only", action="store_true",
                    help="re-render the report and plots from dose_response.json")
    ap.add_argument("--add-arms", default="",
                    help="comma-separated arms to run into the existing report")
    ap.add_argument("--rebaseline", action="store_true",
                    help="with --add-arms, where the report's run does not reproduce: the arms "
                         "and `none` again, into a report of their own")
    ap.add_argument("--add-doses", default="",
                    help="comma-separated doses to run (arm none) beside the control and "
                         "bfloat16 made again, into a report of their own")
    args = ap.parse_args()
    if args.add_doses:
        return add_doses([d for d in args.add_doses.split(",") if d])
    if args.add_arms:
        return add_arms([a for a in args.add_arms.split(",") if a], args.rebaseline)
    if args.report_only:
        report = json.loads((RESULTS / "dose_response.json").read_text())
        report["findings"] = findings(report)
        report["plots"] = plots(report["runs"], report["groups"], report["steps"],
                                report.get("edge"))
        (RESULTS / "dose_response.json").write_text(json.dumps(report, indent=1) + "\n")
        (RESULTS / "dose_response.md").write_text(markdown(report))
        return 0
    steps, n_main, n_other = args.steps, SEEDS_MAIN, SEEDS_OTHER
    lrs, sweep_seeds = LR_GRID, SWEEP_SEEDS
    start = time.perf_counter()
    if RUNS_DIR.exists():
        shutil.rmtree(RUNS_DIR)
    RUNS_DIR.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        train, held = write_data(work / "data")
        data = data_overrides(train, held)
        print("warm-up model", flush=True)
        model = warm_model(work, train)
        print("phase 2: learning-rate sweep on the control", flush=True)
        sweep = {}
        for lr in lrs:
            jobs = [(f"sweep_lr{lr:g}__s{s}", DOSES["control_fp32"] + ARMS["none"], lr, s)
                    for s in range(1, sweep_seeds + 1)]
            sweep[lr] = list(run_all(jobs, model, data, steps).values())
        stable_lrs = [lr for lr in lrs if stable(sweep[lr])]
        if stable_lrs:
            lr = max(stable_lrs)
            reason = (f"the largest rate of {list(lrs)} at which every sweep seed of the "
                      f"control is stable: no collapse, reward rising")
        else:
            lr = min(lrs)
            reason = (f"no rate of {list(lrs)} kept every sweep seed of the control stable; "
                      f"the smallest is used, and the control is NOT shown stable")
        print(f"lr {lr}: {reason}", flush=True)
        print("phase 3: step-0 dose table", flush=True)
        table = dose_table(model, train)
        print("phase 4: arms x doses x seeds", flush=True)
        runs = run_all(study_jobs(lr, n_main, n_other), model, data, steps)
        unstable = [x for x in lrs if x not in stable_lrs]
        edge = None
        if unstable:
            print("phase 5: at the edge of stability", flush=True)
            edge_lr = min(unstable)
            edge_runs = run_all(edge_jobs(edge_lr, n_main), model, data, steps)
            edge = {"lr": edge_lr, "seeds": n_main, **edge_summary(edge_runs, n_main),
                    "runs": edge_runs}
    report = {"steps": steps, "lr": lr, "lr_reason": reason, "sweep_seeds": sweep_seeds,
              "sweep": {str(k): v for k, v in sweep.items()}, "dose_table": table,
              "groups": group_stats(runs, n_main, n_other),
              "comparisons": compare(runs, n_main, n_other), "runs": runs, "edge": edge,
              "wall_min": (time.perf_counter() - start) / 60}
    report["findings"] = findings(report)
    report["plots"] = plots(runs, report["groups"], steps, edge)
    keep_for_report()
    (RESULTS / "dose_response.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "dose_response.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
