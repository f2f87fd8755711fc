"""Stands in for ``python -m sglang.launch_server`` in the multi-node placement test: records the
command line and environment it was started with (and the test node it runs on), then serves the
CPU reference engine on the host and port it was given, with the SGLang flags that carry over."""
import argparse
import json
import os
import sys
import time


def main(argv: list[str]) -> None:
    if argv[:2] != ["-m", "sglang.launch_server"]:
        sys.exit(f"sglang shim: expected '-m sglang.launch_server ...', got {argv[:2]}")
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096)
    args, _ = p.parse_known_args(argv[2:])
    record = {"argv": argv, "pid": os.getpid(), "time": time.time(),
              "node_label": os.environ.get("MOE_RL_TEST_NODE"),
              "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",
                                                    "SGLANG_RETURN_ORIGINAL_LOGPROB")}}
    out = os.environ["MOE_RL_SHIM_DIR"]
    with open(os.path.join(out, f"server_{args.port}_{os.getpid()}.json"), "w") as fh:
        json.dump(record, fh)
    cmd = [sys.executable, "-m", "moe_rl.cli", "serve-reference", "--model", args.model_path,
           "--host", args.host, "--port", str(args.port),
           "--sampling-mask-max-tokens", str(args.sampling_mask_max_tokens)]
    cmd += ["--api-key", args.api_key] if args.api_key else []
    cmd += ["--enable-return-routed-experts"] if args.enable_return_routed_experts else []
    cmd += ["--enable-deterministic-inference"] if args.enable_deterministic_inference else []
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
