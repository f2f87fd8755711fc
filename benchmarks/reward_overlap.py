"""How much of a slow reward service's time generation hides: `moe-rl train` on the tiny config
with `data.reward_service` pointing at a service on 127.0.0.1 that takes LATENCY seconds per
request, one request per prompt group (batch_size = the group size) and one request in flight
at a time. Scored after the whole batch, a step would wait groups x LATENCY for its rewards;
scored per group as soon as it is generated, it waits only `timing/reward_s`. The figure is
that ratio, per step, in one run (these machines are shared and noisy), for two engine loads:
every request of the step admitted at once (`rollout.servers.concurrency` 64: all groups finish
in the same last decode steps, nothing can be hidden) and one group's requests at a time
(`rollout.servers.concurrency` = the group size, as an engine at capacity admits them in waves).

Usage: python benchmarks/reward_overlap.py
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
LATENCY, GROUPS, SAMPLES, STEPS = 0.25, 8, 8, 4


def serve() -> tuple[ThreadingHTTPServer, list[float]]:
    """The slow service: reward = response length / 10, LATENCY seconds per request."""
    served: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(LATENCY)
            served.append(time.time())
            out = json.dumps({"rewards": [len(s["response"]) / 10
                                          for s in body["samples"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, served


def run(concurrency: int) -> list[dict]:
    """The metrics rows of a STEPS-step run against the slow service."""
    from moe_rl.trainer.parallel import free_port
    httpd, _ = serve()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/reward"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                            CONFIG, "--out", f"{tmp}/model"], check=True, capture_output=True)
            res = subprocess.run(
                [sys.executable, "-m", "moe_rl.cli", "train", "--config", CONFIG,
                 f"model.path={tmp}/model", f"logging.dir={tmp}/run", f"trainer.steps={STEPS}",
                 "trainer.warmup.steps=0", "logging.progress=false",
                 "trainer.checkpoint.export_hf=false", f"rollout.servers.base_port={free_port()}",
                 f"rollout.prompts_per_step={GROUPS}", f"rollout.n_samples_per_prompt={SAMPLES}",
                 f"rollout.servers.concurrency={concurrency}", f"data.reward_service.url={url}",
                 f"data.reward_service.batch_size={SAMPLES}",
                 "data.reward_service.max_concurrency=1"],
                cwd=tmp, capture_output=True, text=True, env=dict(os.environ))
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-3000:])
            return [json.loads(x) for x in pathlib.Path(f"{tmp}/run/metrics.jsonl")
                    .read_text().splitlines()]
    finally:
        httpd.shutdown()


def main() -> int:
    after_batch = GROUPS * LATENCY   # what scoring after the whole batch would wait, at least
    out = {"latency_s": LATENCY, "groups": GROUPS, "samples_per_group": SAMPLES,
           "reward_wait_if_scored_after_batch_s": after_batch, "runs": {}}
    lines = ["# Reward scoring overlapped with generation", "",
             f"Service latency {LATENCY} s per request, {GROUPS} groups x {SAMPLES} samples, one "
             f"request per group, one in flight; {STEPS} steps of the tiny config. Scored after "
             f"the whole batch, a step would wait at least {after_batch:.2f} s.", "",
             "| engine admits | step | rollout s (generation + hidden scoring) | reward wait s "
             "| ratio to after-batch |", "|---|---|---|---|---|"]
    for concurrency, label in ((64, "every request at once"), (SAMPLES, "one group at a time")):
        rows = run(concurrency)
        waited = [r["timing/reward_s"] for r in rows]
        ratio = statistics.median(w / after_batch for w in waited)
        out["runs"][label] = {"rollout_concurrency": concurrency,
                              "rollout_s": [r["timing/rollout_s"] for r in rows],
                              "reward_wait_s": waited, "wait_ratio_median": ratio}
        for r, w in zip(rows, waited):
            lines.append(f"| {label} | {r['step']} | {r['timing/rollout_s']:.2f} | {w:.2f} | "
                         f"{w / after_batch:.2f} |")
        lines.append(f"| {label} | median | | | **{ratio:.2f}** |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reward_overlap.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / "reward_overlap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
