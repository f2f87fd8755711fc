"""``moe-rl serve-reference``: serve a HF MoE model on CPU with SGLang's HTTP protocol (its flags
are SGLang's where SGLang has one)."""
from __future__ import annotations

import argparse

from moe_rl.engines.reference.admission_limits import Limits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    parser.add_argument("--fd", type=int, default=None,
                        help="serve on this inherited, already bound socket instead of binding "
                             "--host/--port (how moe-rl train launches it: the port is held "
                             "from the moment it is chosen)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        default="float32",
                        help="the served weights' and the arithmetic's dtype (default float32)")
    parser.add_argument("--enable-fp32-lm-head", action="store_true",
                        help="the LM head's matmul in float32 (SGLang's flag): hidden states "
                             "and head weights cast to float32, float32 logits")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without one")
    parser.add_argument("--max-running-requests", "--max-batch-size", type=int, default=64,
                        dest="max_running_requests",
                        help="most requests in the running batch (SGLang's flag)")
    parser.add_argument("--max-total-tokens", type=int, default=1 << 18,
                        help="token budget of the running batch: each request reserves its "
                             "input + max_new_tokens; one needing more is refused (400)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer return_routed_experts (as SGLang, routing is omitted "
                             "without this flag)")
    parser.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                        help="largest top_k a return_sampling_mask request may use")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant results (SGLang's flag): every request is computed "
                             "alone, so its numbers never depend on what runs beside it")
    parser.add_argument("--quantization", choices=["fp8", "mxfp4"], default=None,
                        help="fp8: serve with FP8 numerics (E4M3 weights in 128x128 blocks, "
                             "activations per token in groups of 128, float32 accumulation; "
                             "re-quantised at every weight load), as SGLang's FP8 path; "
                             "mxfp4: 4-bit weights (E2M1 in blocks of 32 with a power-of-two "
                             "scale, re-quantised at every weight load), activations unchanged")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="no prefix cache (SGLang's flag): every request computes its whole "
                             "input, cached_tokens is always 0")
    parser.add_argument("--prefix-cache-tokens", type=int, default=1 << 16,
                        help="tokens the prefix cache holds before evicting the least recently "
                             "used sequences")
    parser.add_argument("--max-n", type=int, default=Limits.max_n,
                        help="largest sampling_params.n of a request")
    parser.add_argument("--max-batch-requests", type=int, default=Limits.max_batch_requests,
                        help="most sub-requests (inputs x n) in one /generate call")
    parser.add_argument("--max-request-tokens", type=int, default=Limits.max_request_tokens,
                        help="most tokens (input + max_new_tokens, summed over its sub-requests) "
                             "in one /generate call")
    parser.add_argument("--max-request-bytes", type=int, default=Limits.max_request_bytes,
                        help="largest request body in bytes")
    parser.add_argument("--weight-group-timeout", type=float, default=120.0,
                        help="seconds /init_weights_update_group waits for the group's other "
                             "members, in all; the setup lock is free again at this deadline")
    parser.add_argument("--sampling-backend", choices=["flashinfer", "pytorch"],
                        default="flashinfer",
                        help="kept-set rule of SGLang's sampler to follow (default: flashinfer, "
                             "SGLang's default on GPUs)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.engines.reference.server import serve
    serve(args.model, host=args.host, port=args.port, dtype=args.dtype, api_key=args.api_key,
          seed=args.seed, max_running_requests=args.max_running_requests,
          max_total_tokens=args.max_total_tokens,
          return_routed_experts=args.enable_return_routed_experts,
          sampling_mask_max_tokens=args.sampling_mask_max_tokens,
          sampling_backend=args.sampling_backend,
          deterministic_inference=args.enable_deterministic_inference,
          prefix_cache_tokens=0 if args.disable_radix_cache else args.prefix_cache_tokens,
          quantization=args.quantization or "none", fp32_lm_head=args.enable_fp32_lm_head,
          fd=args.fd, weight_group_timeout_s=args.weight_group_timeout,
          limits=Limits(max_n=args.max_n, max_batch_requests=args.max_batch_requests,
                        max_request_tokens=args.max_request_tokens,
                        max_request_bytes=args.max_request_bytes))
    return 0
