"""Long, ragged responses through the trainer: padded micro-batches (a fixed row count, every row
padded to the micro-batch's longest), token-budget micro-batches (``trainer.
max_tokens_per_micro_batch``) and packed rows (``trainer.pack_sequences``), on the same samples.

Response lengths are log-normal (median MEDIAN, sigma SIGMA) capped at MAX_LEN, after a prompt of
PROMPT tokens, on a Qwen3-MoE shape that runs on 2 CPU cores. Each arm runs one RL step of
:class:`PolicyTrainer` (π_old from the rollout, R3 replay, GSPO) in a fresh process, warmed up by
one step first; the figures are the padded-token fraction of the forwarded rows, trainer
tokens per second, one step's wall time and the process's peak resident memory. Times are
compared as ratios to the padded arm of the same run (these machines are shared and noisy).

Usage: python benchmarks/long_sequences.py [--samples N]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
MEDIAN, SIGMA, MAX_LEN, PROMPT = 600, 0.9, 8192, 64
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, moe_intermediate_size=128, num_experts=8,
             num_experts_per_tok=2, max_position_embeddings=MAX_LEN + PROMPT, seed=0)
# padded: the row cap alone (2 rows: 4 rows of 8k peak at 22 GiB here, the machine has 24);
# token budget and packed: rows of at most one longest sample
ARMS = {"padded": {"micro_batch_size": 2},
        "token_budget": {"micro_batch_size": None, "max_tokens_per_micro_batch": MAX_LEN},
        "packed": {"micro_batch_size": None, "max_tokens_per_micro_batch": MAX_LEN,
                   "pack_sequences": True}}


def response_lengths(n: int, seed: int = 0) -> list[int]:
    """``n`` log-normal response lengths (median MEDIAN, sigma SIGMA), in [8, MAX_LEN]; the
    longest is set to MAX_LEN so every run holds the tail's worst case."""
    import torch
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    out = [min(MAX_LEN, max(8, int(round(MEDIAN * math.exp(SIGMA * float(v)))))) for v in z]
    out[int(torch.argmax(z))] = MAX_LEN
    return out


def make_samples(lengths: list[int], vocab: int, num_experts: int, moe_layers: int, topk: int):
    """Samples of random tokens with the given response lengths, rollout log-probs near the
    uniform distribution's and a valid random route for every routed position."""
    import torch
    from moe_rl.rollout_record import Sample, compact_routing
    g = torch.Generator().manual_seed(1)
    out = []
    for i, r in enumerate(lengths):
        ids = torch.randint(0, vocab, (PROMPT + r,), generator=g)
        routing = torch.rand(PROMPT + r - 1, moe_layers, num_experts, generator=g).topk(
            topk, dim=-1).indices
        out.append(Sample(prompt_ids=ids[:PROMPT], response_ids=ids[PROMPT:],
                          rollout_logprobs=torch.full((r,), -math.log(vocab)),
                          routing=compact_routing(routing, num_experts),
                          reward=float(i % 2), group_id=i // 2, sample_id=i))
    return out


def padded_fraction(trainer, samples) -> tuple[float, int, int]:
    """(padded fraction, forwarded positions, micro-batches) of the trainer's own plan."""
    mbs = trainer.forwarder.micro_batches(samples, list(range(len(samples))))
    forwarded = sum(mb.shape[0] * mb.shape[1] for mb in mbs)
    real = sum(s.prompt_len + s.response_len for s in samples)
    return 1.0 - real / forwarded, forwarded, len(mbs)


def arrival_order_padded_fraction(lengths: list[int], rows: int) -> float:
    """The padded fraction of ``rows``-row micro-batches taken in arrival order (unsorted)."""
    forwarded = sum(len(lengths[i:i + rows]) * max(lengths[i:i + rows])
                    for i in range(0, len(lengths), rows))
    return 1.0 - sum(lengths) / forwarded


def markdown(report: dict) -> str:
    """benchmarks/results/long_sequences.md from the run's ``report``."""
    lines = [
        "# Long sequences: padded vs token-budget vs packed micro-batches",
        "",
        f"`python benchmarks/long_sequences.py` (one RL step of PolicyTrainer, R3, GSPO, pi_old "
        f"from the rollout; each arm in its own process after a warm-up step; 2 CPU cores). "
        f"{report['samples']} samples, prompt {report['prompt']} tokens, response lengths "
        f"log-normal (median {report['median']}, sigma {report['sigma']}, capped at "
        f"{report['max_len']}, the longest set to the cap): mean "
        f"{report['response_len_mean']:.0f}. Model: Qwen3-MoE, hidden "
        f"{report['model']['hidden_size']}, {report['model']['num_hidden_layers']} layers, "
        f"{report['model']['num_experts']} experts top-{report['model']['num_experts_per_tok']}.",
        "",
        "| arm | keys | micro-batches | padded fraction | step (s) | step vs padded | "
        "tokens/s | peak RSS (GiB) |",
        "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        keys = ", ".join(f"{k}={v}" for k, v in report["arms"][r["arm"]].items())
        lines.append(f"| {r['arm']} | {keys} | {r['micro_batches']} | {r['padded_frac']:.3f} | "
                     f"{r['step_s']:.1f} | {r['step_ratio_vs_padded']:.2f}x | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_rss_gib']:.1f} |")
    lines += ["",
              f"Padded rows are planned longest first; taken in arrival order instead, the same "
              f"samples in micro-batches of {report['arms']['padded']['micro_batch_size']} rows "
              f"would forward a padded fraction of {report['arrival_order_padded_frac']:.3f}.",
              "The loss is the same in every arm (rounding aside): "
              + ", ".join(f"{r['arm']} {r['loss']:.7f}" for r in report["rows"]) + ".",
              "On CPU a packed row attends slot by slot (moe_rl/trainer/local_attention.py), as "
              "Transformer Engine's THD attention does on GPU: the attention cost of a row is the "
              "sum of its slots' squared lengths, not the row's."]
    return "\n".join(lines) + "\n"


def run_arm(model_dir: str, arm: str, n: int) -> dict:
    """One arm in this process: a warm-up step, then the timed step."""
    import copy
    import torch
    from benchmarks.memory import proc_status_bytes, reset_peak_rss
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    torch.set_num_threads(2)
    init_distributed()
    init_model_parallel()
    cfg = config_from_dict({"model": {"path": model_dir},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": MAX_LEN},
                            "trainer": {"optim": {"lr": 1e-5}, "seed": 0, **ARMS[arm]},
                            "algorithm": {"replay": "r3", "pi_old": "rollout", "loss": "gspo",
                                          "aggregation": "seq-mean-token-mean"}})
    trainer = PolicyTrainer(cfg, model_dir)
    f = trainer.spec.moe_shape
    samples = make_samples(response_lengths(n), trainer.spec.vocab_size, f.num_experts,
                           len(f.moe_layers), f.topk)
    frac, forwarded, n_mb = padded_fraction(trainer, samples)
    trainer.train_step(copy.deepcopy(samples[:4]))   # warm-up (allocator, threads)
    base = reset_peak_rss()
    start = time.perf_counter()
    metrics = trainer.train_step(copy.deepcopy(samples))
    wall = time.perf_counter() - start
    tokens = sum(s.prompt_len + s.response_len for s in samples)
    return {"arm": arm, "padded_frac": frac, "forwarded_positions": forwarded,
            "micro_batches": n_mb, "tokens": tokens, "step_s": wall,
            "tokens_per_s": tokens / wall,
            "peak_rss_gib": proc_status_bytes("VmHWM") / 2**30,
            "peak_over_start_gib": (proc_status_bytes("VmHWM") - base) / 2**30,
            "loss": metrics["loss"]}


def write_model(out: str) -> str:
    from moe_rl.config.init_model import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    return write_tiny_model(ModelInitConfig(**MODEL), out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:   # the child process of one arm
        print(json.dumps(run_arm(args.model, args.arm, args.samples)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(str(pathlib.Path(tmp) / "model"))
        for arm in ARMS:
            res = subprocess.run([sys.executable, "-m", "benchmarks.long_sequences", "--arm",
                                  arm, "--model", model, "--samples", str(args.samples)],
                                 cwd=ROOT, capture_output=True, text=True)
            if res.returncode:
                print(res.stderr[-3000:])
                return 1
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["step_ratio_vs_padded"] = r["step_s"] / base["step_s"]
    lengths = response_lengths(args.samples)
    report = {"samples": args.samples, "median": MEDIAN, "sigma": SIGMA, "max_len": MAX_LEN,
              "prompt": PROMPT, "model": MODEL, "arms": ARMS,
              "response_len_mean": sum(lengths) / len(lengths), "rows": rows,
              "arrival_order_padded_frac": arrival_order_padded_fraction(
                  [PROMPT + n for n in lengths], ARMS["padded"]["micro_batch_size"])}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_sequences.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "long_sequences.md").write_text(markdown(report))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
