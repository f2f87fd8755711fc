"""Weight-sync memory and time on the trainer side, by model size: the whole-model exporter (the
policy gathered into one dict, then written or sent) against the streaming exporter (HF-named
tensors in buckets of ``cluster.weight_sync_bucket_mb``), for the disk path (checkpoint written
as the buckets stream, in shards) and the bucket stream that the distributed and tensor paths
send (sender side: the transfer itself is excluded). Peak extra resident memory of the process
during the sync (VmHWM reset before each), and wall time. Randomly initialised Qwen3-MoE-shaped
megatron-core models on CPU, float32, one process (no tensor/expert parallelism).

Usage: python benchmarks/weight_sync.py [--quick]
"""
from __future__ import annotations

import gc
import json
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
BUCKET_MB = 64


def hf_config(layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
            "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 16,
            "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "max_position_embeddings": 512, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def measure(fn) -> tuple[float, float]:
    """(peak extra resident MiB, seconds) of ``fn()``."""
    from benchmarks.memory import proc_status_bytes, reset_peak_rss
    gc.collect()
    base = reset_peak_rss()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return (proc_status_bytes("VmHWM") - base) / 2 ** 20, seconds


def run_one(layers: int, method: str) -> dict:
    import torch
    from moe_rl.weights.hf import (iter_hf_buckets, megatron_to_hf,
                                           save_hf_checkpoint)
    from moe_rl.trainer.model_builder import build_model
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    model, spec = build_model(hf_config(layers))
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    bucket = BUCKET_MB * 2 ** 20
    out = pathlib.Path(tempfile.mkdtemp(prefix="wsync_"))

    def whole_disk():
        save_hf_checkpoint(megatron_to_hf(model, spec), spec, str(out / "whole"))

    def streamed_disk():
        save_hf_checkpoint(iter_hf_buckets(model, spec, bucket), spec, str(out / "streamed"))

    def whole_send():   # the gathered dict, then its tensors handed on one by one
        tensors = megatron_to_hf(model, spec)
        sum(float(t.view(-1)[0]) for t in tensors.values())

    def streamed_send():
        for chunk, _ in iter_hf_buckets(model, spec, bucket):
            sum(float(t.view(-1)[0]) for _, t in chunk)

    row = {"layers": layers, "params_b": params / 1e9, "model_mib": params * 4 / 2 ** 20,
           "largest_tensor_mib": largest, "bucket_mib": BUCKET_MB}
    fn = {"whole_disk": whole_disk, "streamed_disk": streamed_disk, "whole_send": whole_send,
          "streamed_send": streamed_send}[method]
    with torch.no_grad():
        row[f"{method}_peak_mib"], row[f"{method}_s"] = measure(fn)
    shutil.rmtree(out, ignore_errors=True)
    return row


METHODS = ("whole_disk", "streamed_disk", "whole_send", "streamed_send")


def main(argv: list[str]) -> int:
    import subprocess
    sizes = [2, 6] if "--quick" in argv else [2, 14, 30]
    if argv and argv[0] == "--one":
        print(json.dumps(run_one(int(argv[1]), argv[2])))
        return 0
    rows = []
    for layers in sizes:   # one fresh process per measurement: no memory carried over
        row: dict = {}
        for method in METHODS:
            res = subprocess.run([sys.executable, __file__, "--one", str(layers), method],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            row.update(json.loads(res.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(row, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_sync.json").write_text(json.dumps(rows, indent=2))
    lines = ["# Weight sync: trainer-side peak extra memory and time (CPU, float32)", "",
             f"Bucket {BUCKET_MB} MiB. Bound of the streaming exporter: one bucket plus the "
             f"largest tensor (plus, on the disk path, the bucket's serialisation buffer).", "",
             "| params | model MiB | largest tensor MiB | whole→disk peak MiB (s) | "
             "streamed→disk peak MiB (s) | whole→send peak MiB (s) | "
             "streamed→send peak MiB (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['params_b']:.2f} B | {r['model_mib']:.0f} | {r['largest_tensor_mib']:.0f} | "
            f"{r['whole_disk_peak_mib']:.0f} ({r['whole_disk_s']:.1f}) | "
            f"{r['streamed_disk_peak_mib']:.0f} ({r['streamed_disk_s']:.1f}) | "
            f"{r['whole_send_peak_mib']:.0f} ({r['whole_send_s']:.1f}) | "
            f"{r['streamed_send_peak_mib']:.0f} ({r['streamed_send_s']:.1f}) |")
    (RESULTS / "weight_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
