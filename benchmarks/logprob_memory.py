"""Peak memory and time of the memory-bounded logprob/entropy kernel against a naive
``log_softmax`` over the full logits (forward + backward), as ratios within one run.

Each variant runs in a fresh subprocess. CPU: the peak is the process's resident-set high-water
mark (VmHWM, reset through /proc/self/clear_refs after the inputs are allocated) minus the
resident set at that moment. GPU: torch.cuda.max_memory_allocated above the inputs.
Usage: python benchmarks/logprob_memory.py [--tokens 4096] [--vocab 151936] [--hidden 1024]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.memory import proc_status_bytes, reset_peak_rss  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def run_variant(variant: str, tokens: int, vocab: int, hidden: int, chunk: int, device: str
                ) -> dict:
    """Run one variant in this process and return its peak extra memory (bytes) and time."""
    import torch
    from moe_rl_kernels.logprob import logprob_entropy
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=device)

    def naive():
        logits = (h @ w.t()).float()
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(1, t[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
        return lp, ent

    def kernel():
        return logprob_entropy(h, w, t, chunk_size=chunk)

    fn = naive if variant == "naive" else kernel
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = reset_peak_rss()
    start = time.perf_counter()
    lp, ent = fn()
    (lp.sum() + 0.1 * ent.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = proc_status_bytes("VmHWM") - base
    elapsed = time.perf_counter() - start
    return {"variant": variant, "peak_bytes": peak, "seconds": elapsed}


def main() -> int:
    """Measure both variants (``--repeats`` times each, fresh processes) and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.hidden,
                                     args.chunk, device)))
        return 0
    runs: dict[str, list[dict]] = {"naive": [], "kernel": []}
    for _ in range(args.repeats):
        for variant in ("naive", "kernel"):
            out = subprocess.run([sys.executable, __file__, "--variant", variant,
                                  "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                  "--hidden", str(args.hidden), "--chunk", str(args.chunk)],
                                 capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(variant, runs[variant][-1], flush=True)
    best = {v: {"peak_bytes": min(r["peak_bytes"] for r in rs),
                "seconds": min(r["seconds"] for r in rs)} for v, rs in runs.items()}
    result = {
        "device": device, "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
        "chunk": args.chunk, "repeats": args.repeats, "runs": runs, "best": best,
        "memory_ratio": best["kernel"]["peak_bytes"] / best["naive"]["peak_bytes"],
        "time_ratio": best["kernel"]["seconds"] / best["naive"]["seconds"],
        "goal": "memory_ratio <= 0.125 and time_ratio <= 1.5",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"logprob_memory_{device}.json").write_text(json.dumps(result, indent=2))
    gib = 1024 ** 3
    md = [f"# logprob_memory ({device})", "",
          f"T = {args.tokens}, V = {args.vocab}, H = {args.hidden}, chunk = {args.chunk}, "
          f"forward + backward of log-prob and entropy, float32; best of {args.repeats} fresh "
          "processes each.", "",
          "| variant | peak extra memory (GiB) | time (s) |", "|---|---|---|"]
    for v in ("naive", "kernel"):
        md.append(f"| {v} | {best[v]['peak_bytes'] / gib:.3f} | {best[v]['seconds']:.2f} |")
    md += ["", f"memory ratio kernel/naive = **{result['memory_ratio']:.3f}** (goal <= 0.125); "
           f"time ratio = **{result['time_ratio']:.2f}x** (goal <= 1.5x)."]
    (RESULTS / f"logprob_memory_{device}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
