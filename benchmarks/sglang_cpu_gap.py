"""The real engine/trainer gap, and what moe_rl's client costs, measured with stock SGLang 0.5.23
serving on CPU (`rollout.sglang.device: cpu`) and the megatron-core trainer in float32, bfloat16
and float16 (16-bit policies with float32 master weights, as the GPU configs train).

1. Gap: ONE set of sequences (sampled once by SGLang in bfloat16) is scored by SGLang serving in
   float32, bfloat16 and float16, the 16-bit ones also with the LM head in float32
   (--enable-fp32-lm-head); the trainer in each precision (16-bit with and without its fp32
   head, model.fp32_output_layer) scores them with replay off and R3: routing agreement, tokens
   routed differently in at least one layer, mismatch/k1, k3, extreme_frac, abs_diff_max. The
   table shows the matched pairs, the float32 crosses, and each fp32 head on both sides and on
   one side only; the JSON holds every pair. Float32 server and trainer are the control (k3
   ~1e-14, agreement 1.0).
2. Throughput: on the float32 server, the requests moe_rl's rollout sends (one ``/generate``
   per sample, up to 16 tokens, routing and kept sets asked) sent raw with httpx all at once,
   against moe_rl's client (``generate_samples`` through the pool, decoding every answer into
   a Sample) with one torch thread, as in the loop's rollout actor (Ray gives it one CPU:
   OMP_NUM_THREADS=1), and with torch's default threads; generated tokens per second,
   alternated, the median of the rounds; goal: client / raw >= 0.9.

Writes benchmarks/results/sglang_cpu_gap.{json,md}. Needs the SGLang CPU environment
(`moe-rl sglang-cpu-env .venv-sglang`; `make bench` builds it): MOE_RL_SGLANG_PYTHON or
.venv-sglang/bin/python. Usage: python benchmarks/sglang_cpu_gap.py [--prompts 16]
[--samples 4] [--models tiny,medium] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/extreme_frac", "mismatch/abs_diff_max",
        "routing/agreement", "routing/token_differs_frac"]
# precisions: (dtype, LM head in float32) on either side
SIDES = (("float32", False), ("bfloat16", False), ("bfloat16", True), ("float16", False),
         ("float16", True))
PAIRS = [(e, t) for e in SIDES for t in SIDES   # the table's rows: matched, crosses, heads
         if e[0] == t[0] or not (e[1] or t[1])]


def sglang_python() -> str:
    python = os.environ.get("MOE_RL_SGLANG_PYTHON") or str(ROOT / ".venv-sglang/bin/python")
    if not os.access(python, os.X_OK):
        sys.exit("no SGLang CPU environment: run `moe-rl sglang-cpu-env .venv-sglang` or set "
                 "MOE_RL_SGLANG_PYTHON")
    return python


def label(side: tuple[str, bool]) -> str:
    return side[0] + (" + fp32 head" if side[1] else "")


def _cfg(model_dir: str, dtype: str = "float32", trainer_dtype: str = "float32",
         fp32_head: bool = False, **algo):
    from moe_rl.config import config_from_dict
    return config_from_dict({
        "model": {"path": model_dir, "dtype": trainer_dtype, "fp32_output_layer": fp32_head},
        "cluster": {"gpus_per_node": 0},
        "rollout": {"engine": "sglang", "engine_dtype": dtype, "n_samples_per_prompt": 4,
                    "max_new_tokens": 8, "sampling": {"top_k": 20}, "return_routing": True,
                    "sglang": {"device": "cpu", "python": sglang_python()}},
        "trainer": {"optim": {"lr": 3e-3}, "micro_batch_size": 16},
        "data": {"toy_max_operand": 9, "chat_template": False}, "algorithm": algo})


def _server(model_dir: str, dtype: str, log: str, fp32_head: bool = False):
    from moe_rl.engines.factory import engine_kind
    from moe_rl.trainer.parallel import free_port
    cfg = _cfg(model_dir, dtype, fp32_head=fp32_head, replay="r3", keep_sampling_mask=True)
    port = free_port()
    argv, env = engine_kind(cfg).server_command("127.0.0.1", port, [], 0, model_dir)
    return engine_kind(cfg).server_process(argv, env, "127.0.0.1", port, log).start(600)


def _engine(url: str, layout, mask: bool):
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.engines.sglang.pool import ServerPool
    return SGLangEngine(lambda: ServerPool([url]), layout, need_routing=True, need_mask=mask)


def gap(model_dir: str, layout, prompts, n_samples: int, work: str) -> dict:
    from benchmarks.mismatch_study import _rescore
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.rollout.trajectories import generate_samples
    from moe_rl.trainer.policy import PolicyTrainer
    out: dict = {}
    scored = {}
    order = [SIDES[1]] + [s for s in SIDES if s != SIDES[1]]   # sampled by bfloat16 first
    for side in order:
        proc = _server(model_dir, side[0], f"{work}/sglang_{label(side)}.log", side[1])
        try:
            if side == SIDES[1]:
                base = generate_samples(_engine(proc.url, layout, False), prompts, n_samples,
                                        SamplingConfig(max_new_tokens=8), seed=0)
            scored[side] = copy.deepcopy(base)
            out[label(side)] = {"engine_scoring_s": _rescore(proc.url, scored[side], layout),
                                "trainer": {label(t): {} for t in SIDES}}
        finally:
            proc.stop()
    for trainer_side in SIDES:
        for mode in ("off", "r3"):
            trainer = PolicyTrainer(_cfg(model_dir, trainer_dtype=trainer_side[0],
                                         fp32_head=trainer_side[1], replay=mode), model_dir)
            for side, samples in scored.items():
                m = trainer.prepare(copy.deepcopy(samples))[1]
                out[label(side)]["trainer"][label(trainer_side)][mode] = {
                    k: v for k, v in m.items()
                    if k in KEYS or k.startswith("routing/agreement_l")}
            trainer.replay.close()
    return out


def throughput(model_dir: str, layout, prompts, n_samples: int, rounds: int, work: str) -> dict:
    import httpx
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.rollout.trajectories import generate_samples
    sampling = SamplingConfig(temperature=1.0, top_k=20, max_new_tokens=16)
    proc = _server(model_dir, "float32", f"{work}/sglang_throughput.log")
    try:
        eng = _engine(proc.url, layout, True)
        bodies = [eng.generate_body(p, sampling, seed=k) for p in prompts
                  for k in range(n_samples)]

        async def raw() -> int:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                answers = await asyncio.gather(*(client.post(proc.url + "/generate", json=b)
                                                 for b in bodies))
            return sum(len(a.json()["output_ids"]) for a in answers)

        def client(threads: int) -> int:
            torch.set_num_threads(threads)
            try:
                samples = generate_samples(eng, prompts, n_samples, sampling, seed=0)
            finally:
                torch.set_num_threads(default_threads)
            return sum(s.response_len for s in samples)

        default_threads = torch.get_num_threads()
        asyncio.run(raw())   # warm-up
        runs = {"raw": [], "client": [], "client_all_threads": []}
        for _ in range(rounds):
            for name in runs:
                t0 = time.perf_counter()
                tokens = asyncio.run(raw()) if name == "raw" else \
                    client(1 if name == "client" else default_threads)
                runs[name].append(tokens / (time.perf_counter() - t0))
    finally:
        proc.stop()
    tps = {name: statistics.median(v) for name, v in runs.items()}
    return {"requests": len(bodies), "max_new_tokens": sampling.max_new_tokens, "rounds": rounds,
            "raw_tokens_per_s": tps["raw"], "client_tokens_per_s": tps["client"],
            "client_over_raw": tps["client"] / tps["raw"],
            "client_all_threads_tokens_per_s": tps["client_all_threads"],
            "client_all_threads_over_raw": tps["client_all_threads"] / tps["raw"],
            "torch_threads": default_threads, "runs": runs}


def markdown(results: list[dict], args) -> str:
    md = ["# sglang_cpu_gap", "",
          "Stock SGLang 0.5.23 serving on CPU (`rollout.sglang.device: cpu`, torch-native "
          "attention and MoE, 2 cores) against the megatron-core trainer in float32, bfloat16 "
          "and float16 (float32 master weights), the 16-bit ones also with the LM head in "
          "float32 (SGLang --enable-fp32-lm-head; the trainer's model.fp32_output_layer) on "
          "both sides or one, same weights; "
          f"{args.prompts} prompts x {args.samples} sequences of up to 8 new tokens, "
          "sampled once by SGLang in bfloat16 and scored by SGLang in each dtype. Every figure "
          "here comes from the real engine.", ""]
    for r in results:
        md += [f"## {r['model']} ({r['shape']})", "",
               "| SGLang dtype | trainer dtype | replay | routing agreement | tokens routed "
               "differently | k1 | k3 | extreme_frac | abs_diff_max |",
               "|---|---|---|---|---|---|---|---|---|"]
        for engine, trainer in PAIRS:
            for mode, m in r["gap"][label(engine)]["trainer"][label(trainer)].items():
                md.append(f"| {label(engine)} | {label(trainer)} | {mode} | "
                          f"{m['routing/agreement']:.4f} | "
                          f"{m['routing/token_differs_frac']:.3f} | "
                          f"{m['mismatch/k1']:.2e} | {m['mismatch/k3']:.2e} | "
                          f"{m['mismatch/extreme_frac']:.4f} | "
                          f"{m['mismatch/abs_diff_max']:.3f} |")
        t = r["throughput"]
        md += ["", f"Rollout throughput on the float32 server ({t['requests']} requests of up "
                   f"to {t['max_new_tokens']} tokens, routing and kept sets asked, median of "
                   f"{t['rounds']} alternated rounds): raw `/generate` "
                   f"{t['raw_tokens_per_s']:.0f} tok/s, moe_rl's client with one torch thread "
                   f"(as in the rollout actor) {t['client_tokens_per_s']:.0f} tok/s: "
                   f"**{t['client_over_raw']:.2f}x** (goal >= 0.9); with torch's "
                   f"{t['torch_threads']} default threads, competing with the server for the "
                   f"cores, {t['client_all_threads_tokens_per_s']:.0f} tok/s "
                   f"({t['client_all_threads_over_raw']:.2f}x).", ""]
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from benchmarks.mismatch_study import model_inputs
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            model, layout, prompts, shape = model_inputs(name, work, args.prompts)
            results.append({"model": name, "shape": shape,
                            "gap": gap(model, layout, prompts, args.samples, work),
                            "throughput": throughput(model, layout, prompts, args.samples,
                                                     args.rounds, work)})
            print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sglang_cpu_gap.json").write_text(json.dumps(results, indent=2))
    text = markdown(results, args)
    (RESULTS / "sglang_cpu_gap.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
