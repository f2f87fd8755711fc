"""GPU validation of the paths CPU tests cannot reach: run it on a machine with CUDA
(`python -m benchmarks.gpu_check`). Writes benchmarks/results/gpu_check.{json,md}.

Checks, each reported pass / fail (with the figure) / skipped (with the reason):
1. megatron_cuda_local: the megatron-core model on CUDA (local spec) scores as transformers does
   (float32, replayed routing), max |Δ log-prob|; deepseek_cuda_local: the same for the tiny
   DeepSeek-V3 model (MLA, biased group-limited sigmoid router, shared experts).
2. megatron_cuda_te / deepseek_cuda_te: the same with Transformer Engine's spec, when TE is
   installed. Each also scores the sample twice in one packed row (THD with cu_seqlens).
3. triton_kernel: the Triton log-prob/entropy kernel equals the torch one on CUDA, and their time
   ratio at T=4096, V=151,936, H=1024 (bf16).
4. parallel_equivalence: TP=2 + SP, EP=2, CP=2 (padded and packed rows) and packed DP=2 steps
   equal DP=2 on padded rows (needs 2 GPUs; torchrun).
5. bf16_policy: bfloat16 and float16 training (megatron's loss scaler) with float32 master
   weights (distributed optimizer and megatron's Float16Optimizer) against float32, and the EMA
   policy on the master weights;
   bf16_dist_opt_resume: the distributed optimizer's checkpoint resumes exactly.
6. nccl_weight_sync: a broadcast over the weight-update group (built as SGLang builds it) into a
   second process (needs 2 GPUs: NCCL refuses two ranks on one device).
On a machine without CUDA it records that nothing ran (keeping a GPU run's results) and exits 0.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _tiny_model(path: str) -> str:
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    return write_tiny_model(ModelInitConfig(seed=3, num_hidden_layers=3, rope_theta=1e6), path)


def _tiny_deepseek(path: str) -> str:
    from moe_rl.config import load_config
    from moe_rl.models.tiny import write_tiny_model
    init = load_config(ROOT / "configs" / "deepseek_tiny_cpu.yaml",
                       [f"model.path={path}"]).model.init
    return write_tiny_model(init, path)


def check_megatron_cuda(path: str, use_te: bool) -> dict:
    """max |megatron - transformers| log-prob on CUDA with the engine's routing replayed."""
    import importlib.util

    import transformers
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer import model_builder
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.weights.hf import load_hf_into_megatron
    from moe_rl.trainer.replay import ReplayController
    from moe_rl.rollout_record import Sample, compact_routing
    if use_te and importlib.util.find_spec("transformer_engine") is None:
        return {"status": "skipped", "reason": "transformer_engine is not installed"}
    saved = importlib.util.find_spec
    if not use_te:   # force the local spec
        importlib.util.find_spec = lambda name, *a: None if name == "transformer_engine" \
            else saved(name, *a)
    try:
        model, spec = model_builder.build_model(path)
    finally:
        importlib.util.find_spec = saved
    load_hf_into_megatron(model, spec, path)
    model.eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = torch.randint(0, spec.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    picks = []   # the experts transformers chose (each router's third output), as the engine
    for module in hf.modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            module.register_forward_hook(lambda m, i, o: picks.append(o[2].detach()))
    with torch.no_grad():
        out = hf(input_ids=ids[None].cuda())
    routing = torch.stack(picks, 1).cpu()
    want = torch.log_softmax(out.logits[0].float(), -1)[15:-1].gather(
        1, ids[16:, None].cuda()).squeeze(1).cpu()
    sample = Sample(prompt_ids=ids[:16], response_ids=ids[16:],
                    rollout_logprobs=torch.zeros(32),
                    routing=compact_routing(routing[:-1], spec.moe_shape.num_experts))
    mb = pack_one([sample], [0], pad_token_id=0, num_experts=spec.moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk,
                           spec.moe_shape.num_experts)
    ctl.replay(mb.replay_indices())
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb)
    ctl.finish_forward()
    got = lp[0, 15:47].float().cpu()
    diff = float((got - want).abs().max())
    # the same sample twice in one packed row (THD with cu_seqlens)
    te = model_builder.uses_te_spec(model)
    packed = pack_one([sample, sample], [0, 1], pad_token_id=0,
                      num_experts=spec.moe_shape.num_experts, packed=True, slot_multiple=8)
    ctl.replay(packed.replay_indices())
    with torch.no_grad():
        lp2, _ = forward_logprobs(model, packed)
    ctl.finish_forward()
    ctl.close()
    got2 = packed.to_response_padded(lp2).float().cpu()
    packed_diff = float((got2 - want[None]).abs().max())
    ok = diff < 1e-3 and packed_diff < 1e-3
    return {"status": "pass" if ok else "fail", "max_abs_diff": diff,
            "packed_max_abs_diff": packed_diff, "te_spec": te}


# Qwen3-30B-A3B's layer shape (its config.json); the layer count is what fits one GPU
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                 "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False, "num_hidden_layers": 48}
# NVIDIA's dense bf16/fp16 tensor-core peak (no sparsity), TFLOP/s, SXM parts
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}


def moe_params(hf: dict) -> tuple[int, int]:
    """(total, active per token) matmul parameters of a Qwen3-MoE shape; the input embedding
    (a lookup) counts in total only."""
    h, L, hd = hf["hidden_size"], hf["num_hidden_layers"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h
    expert = 3 * h * hf["moe_intermediate_size"]
    router = h * hf["num_experts"]
    head = hf["vocab_size"] * h
    total = L * (attn + router + hf["num_experts"] * expert) + 2 * head
    active = L * (attn + router + hf["num_experts_per_tok"] * expert) + head
    return total, active


def training_flops_per_token(hf: dict, seq_len: int) -> float:
    """Model FLOPs of one trained token: 6 x active matmul parameters, plus causal attention's
    QK^T and AV (2 x S x heads x head_dim per layer forward on average, x3 with backward)."""
    _, active = moe_params(hf)
    d_attn = hf["num_attention_heads"] * hf["head_dim"]
    return 6.0 * active + 6.0 * hf["num_hidden_layers"] * seq_len * d_attn


def measure_trainer_throughput(hf: dict, dtype: torch.dtype, *, seq_len: int, micro_batch: int,
                               steps: int, response_len: int | None = None,
                               profile: bool = False, experts: str = "auto",
                               fast: bool = True) -> dict:
    """Tokens/s of the trainer's forward (moe_rl.trainer.forward, megatron GPTModel + the
    log-prob kernel) and backward on random-initialised weights, ``steps`` timed after one
    warm-up; the optimizer step is not included. ``profile``: also the ten kernels that take
    the most GPU time in one more step (torch.profiler). ``experts``: trainer.experts;
    ``fast``: False keeps megatron's local attention and dispatcher (the 2026-12-03 baseline)."""
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer import model_builder
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.rollout_record import Sample
    model, spec = model_builder.build_model(hf, dtype=dtype, experts=experts, sdpa=fast,
                                            sort_dispatch=fast)
    model.train()
    response_len = response_len or seq_len // 2
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(0, spec.vocab_size, (seq_len - response_len,),
                                               generator=g),
                      response_ids=torch.randint(0, spec.vocab_size, (response_len,),
                                                 generator=g),
                      rollout_logprobs=torch.zeros(response_len)) for _ in range(micro_batch)]
    mb = pack_one(samples, list(range(micro_batch)), pad_token_id=0)
    cuda = torch.cuda.is_available()

    def step():
        lp, _ = forward_logprobs(model, mb)
        lp.float().sum().backward()
        for p in model.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None

    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens = micro_batch * seq_len
    total, active = moe_params(hf)
    out = {"layers": hf["num_hidden_layers"], "params_total_b": total / 1e9,
           "params_active_b": active / 1e9, "seq_len": seq_len, "micro_batch": micro_batch,
           "experts": model.expert_path[0], "attention": model.attention_path[0],
           "dispatch": model.dispatch_path[0],
           "s_per_step": seconds, "tokens_per_s": tokens / seconds,
           "tflops_per_s": training_flops_per_token(hf, seq_len) * tokens / seconds / 1e12}
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if profile and cuda:
        out["top_kernels_ms"] = _profile_step(step)
    del model
    return out


def _profile_step(step) -> list:
    """[(kernel, GPU ms, calls)] of the ten kernels taking most GPU time in one ``step()``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, getattr(e, "self_device_time_total", 0) / 1e3, e.count)
            for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:10]


def check_trainer_throughput(dtype_name: str, layers: int | None = None,
                             micro_batch: int = 2, profile: bool = False,
                             experts: str = "auto", fast: bool = True) -> dict:
    """The trainer's tokens/s and MFU on a Qwen3-30B-A3B-shaped model: by default the most
    layers whose weights and gradients take at most 45% of this GPU's memory (the rest holds
    the activations of 2 x 2048 tokens under megatron's local, unfused attention)."""
    import gc
    dtype = getattr(torch, dtype_name)
    memory = torch.cuda.get_device_properties(0).total_memory
    one = dict(QWEN3_30B_A3B, num_hidden_layers=1)
    per_layer = moe_params(one)[0] - moe_params(dict(one, num_hidden_layers=0))[0]
    fixed = moe_params(dict(one, num_hidden_layers=0))[0]
    layers = layers or int(min(48, max(1, (memory * 0.45 / 4 - fixed) // per_layer)))
    try:
        out = measure_trainer_throughput(dict(QWEN3_30B_A3B, num_hidden_layers=layers), dtype,
                                         seq_len=2048, micro_batch=micro_batch, steps=3,
                                         profile=profile, experts=experts, fast=fast)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    out["dtype"] = dtype_name
    out["mfu"] = out["tflops_per_s"] / peak if peak else None
    out["peak_tflops"] = peak
    out["status"] = "pass"
    return out


def check_grouped_experts_cuda(path: str) -> dict:
    """The tiny model's grouped experts and dispatcher by sort against megatron's loop and
    dispatcher on CUDA in bfloat16 (log-probs and gradients within bfloat16's rounding: cuBLAS
    and CUTLASS sum in other orders), and the host synchronisations of one MoE layer on CUDA
    for each configuration (benchmarks/trainer_ops.py's counters; none expected with
    grouped+sort)."""
    from benchmarks.trainer_ops import CONFIGS, moe_layer_ops
    from moe_rl.rollout_record import Sample
    from moe_rl.trainer import model_builder
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.trainer.packing import pack_one
    from moe_rl.weights.hf import load_hf_into_megatron
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(0, 64, (40,), generator=g),
                      response_ids=torch.randint(0, 64, (24,), generator=g),
                      rollout_logprobs=torch.zeros(24)) for _ in range(4)]
    out = {}
    for experts, sort in (("sequential", False), ("grouped", True)):
        model, spec = model_builder.build_model(path, dtype=torch.bfloat16, experts=experts,
                                                sort_dispatch=sort)
        load_hf_into_megatron(model, spec, path)
        mb = pack_one(samples, list(range(4)), pad_token_id=0)
        lp, _ = forward_logprobs(model, mb)
        lp.float().sum().backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        out[experts] = (lp.float(), grads, model.expert_path[0], model.dispatch_path[0])
    (lp0, g0, *paths0), (lp1, g1, *paths1) = out["sequential"], out["grouped"]
    worst = max(((g0[n] - g1[n]).abs().max() / g0[n].abs().max().clamp_min(1e-6)).item()
                for n in g0)
    syncs = {config: moe_layer_ops(config, 128)["syncs"] for config in CONFIGS}
    ok = (paths1 == ["grouped", "sort"] and torch.allclose(lp0, lp1, atol=0.05)
          and worst < 0.05 and syncs["grouped+sort"] == 0)
    return {"status": "pass" if ok else "fail", "paths": [paths0, paths1],
            "max_abs_logprob_diff": (lp0 - lp1).abs().max().item(),
            "worst_relative_grad_diff": worst, "host_syncs_per_moe_layer_e128": syncs}


def check_varlen_attention() -> dict:
    """A packed row (three slots) through torch's variable-length attention against the
    slot-by-slot path, in bfloat16 on CUDA: outputs and gradients within bfloat16's rounding,
    and the one call taken (a torch whose signature moe_rl does not know keeps the slots)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from moe_rl.trainer.sdpa_attention import SDPAttention
    cfg = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8,
                            num_query_groups=2, kv_channels=64, attention_dropout=0.0,
                            hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    varlen, slots = (SDPAttention(cfg, 1, AttnMaskType.causal, "self") for _ in range(2))
    slots._varlen = None
    cu = torch.tensor([0, 300, 800, 1200], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=500, max_seqlen_kv=500)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1200, h, 64, generator=g, device="cuda", dtype=torch.bfloat16)
           for h in (8, 2, 2)]
    outs = []
    for module in (varlen, slots):
        args = [t.clone().requires_grad_() for t in qkv]
        out = module(*args, None, packed_seq_params=params)
        out.float().square().sum().backward()
        outs.append([out.float()] + [a.grad.float() for a in args])
    took = varlen._varlen is not None and varlen._varlen_fits(qkv[0], qkv[2])
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                for a, b in zip(*outs))
    return {"status": "pass" if took and worst < 0.02 else "fail", "varlen_taken": took,
            "worst_relative_diff": worst}


def check_doctor() -> dict:
    """`moe-rl doctor` on this node for a one-node run on its GPUs (the reference engine) and
    for the same run with SGLang (it has to import in this environment)."""
    out = {}
    gpus = torch.cuda.device_count()
    for name, extra in (("reference", []), ("sglang", ["rollout.engine=sglang"])):
        got = subprocess.run([sys.executable, "-m", "moe_rl.cli", "doctor", "--json",
                              f"cluster.gpus_per_node={gpus}", *extra], capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
        try:
            found = json.loads(got.stdout)
        except ValueError:
            return {"status": "fail", "reason": (got.stdout + got.stderr)[-2000:]}
        out[name] = {f["check"]: f"{f['status']}: {f['detail']}" for f in found}
        out[name + "_exit"] = got.returncode
    out["status"] = "pass" if out["reference_exit"] == 0 else "fail"
    return out


def check_triton_kernel() -> dict:
    from moe_rl_kernels.logprob import logprob_entropy, triton_available
    if not triton_available():
        return {"status": "skipped", "reason": "triton is not importable"}
    g = torch.Generator(device="cuda").manual_seed(0)
    T, V, H = 4096, 151_936, 1024
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    out = {}
    for backend in ("torch", "triton"):
        logprob_entropy(h, w, t, backend=backend)   # warm-up / compile
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            lp, ent = logprob_entropy(h, w, t, backend=backend)
        torch.cuda.synchronize()
        out[backend] = (lp, ent, (time.perf_counter() - start) / 5)
    dlp = float((out["torch"][0] - out["triton"][0]).abs().max())
    dent = float((out["torch"][1] - out["triton"][1]).abs().max())
    return {"status": "pass" if max(dlp, dent) < 1e-2 else "fail", "max_abs_diff_logprob": dlp,
            "max_abs_diff_entropy": dent, "torch_s": out["torch"][2],
            "triton_s": out["triton"][2], "triton_over_torch": out["triton"][2] / out["torch"][2]}


def check_bf16_policy(path: str) -> dict:
    """The GPU configs' precisions on CUDA: a bfloat16 and a float16 policy (megatron's dynamic
    loss scaler from 2^16; its scale and skipped steps recorded) with float32 master weights
    (the distributed optimizer and megatron's Float16Optimizer), three RL steps each, against
    the same steps in float32; and the EMA policy (decay 0.99, lr 1e-4, 20 steps) moving the bf16
    master weights as float32 moves the weights."""
    import copy

    import transformers
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.cpu_compat import cuda_factories_on_cpu
    from tests.helpers import engine_samples
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.trainer.state import main_weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = [engine_samples(hf, n_groups=2, group_size=4, seed=s, max_resp=8) for s in range(3)]

    def trainer(dtype, dist_opt, **extra):
        return PolicyTrainer(config_from_dict({
            "model": {"path": path, "dtype": dtype}, "cluster": {"gpus_per_node": 1},
            "rollout": {"n_samples_per_prompt": 4},
            "trainer": {"optim": {"lr": 1e-4, "distributed": dist_opt}, "seed": 1,
                        "micro_batch_size": 4, **extra},
            "algorithm": {"replay": "r3", "corrections": ["token_tis"]}}), path)
    out: dict = {}
    for name, dtype, dist_opt in (("f32", "float32", False), ("bf16_dist_opt", "bfloat16", True),
                                  ("bf16", "bfloat16", False), ("fp16_dist_opt", "float16", True),
                                  ("fp16", "float16", False)):
        scaled = {"loss_scale": {"initial": 65536.0}} if dtype == "float16" else {}
        t = trainer(dtype, dist_opt, **scaled)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ms = [t.train_step(copy.deepcopy(b)) for b in batches]
        torch.cuda.synchronize()
        out[name] = {"k3_step1": ms[0]["mismatch/k3"], "grad_norm": [m["grad_norm"] for m in ms],
                     "loss": [m["loss"] for m in ms],
                     "s_per_step": (time.perf_counter() - start) / 3,
                     "param_dtypes": sorted({str(p.dtype) for p in t.model.module.parameters()})}
        if dtype == "float16":
            out[name]["loss_scale"] = [m["train/loss_scale"] for m in ms]
            out[name]["skipped_steps"] = sum(m["train/skipped_steps"] for m in ms)
        del t
    moves = {}
    for dtype in ("bfloat16", "float32"):
        t = trainer(dtype, False, ema={"decay": 0.99, "policy": True})
        params = dict(t.model.module.named_parameters())
        start_w = {n: main_weights(p).detach().double().clone() for n, p in params.items()}
        for _ in range(20):
            t.optimizer.zero_grad()
            for i, (_, p) in enumerate(sorted(params.items())):
                idx = torch.arange(p.numel(), device=p.device, dtype=torch.float64)
                p.main_grad.copy_((torch.sin(idx * 0.37 + i) * 1e-2).reshape(p.shape).float())
            with cuda_factories_on_cpu():   # nothing on CUDA; lets the check run on CPU too
                t.optimizer.step()
            t.state.ema_update()
        moves[dtype] = {n: main_weights(p).detach().double() - start_w[n]
                        for n, p in params.items()}
        del t
    f32 = moves["float32"]
    total = sum(float(d.norm() ** 2) for d in f32.values()) ** 0.5
    err = sum(float((moves["bfloat16"][n] - f32[n]).norm() ** 2) for n in f32) ** 0.5
    out["ema_policy_bf16_vs_f32_rel_diff"] = err / total
    finite = all(all(map(lambda v: v == v and abs(v) < 1e4, r["grad_norm"] + r["loss"]))
                 for k, r in out.items() if isinstance(r, dict))
    close = all(abs(out[k]["grad_norm"][0] - out["f32"]["grad_norm"][0])
                <= 0.05 * out["f32"]["grad_norm"][0]
                for k in ("bf16", "bf16_dist_opt", "fp16", "fp16_dist_opt"))
    ok = finite and close and out["ema_policy_bf16_vs_f32_rel_diff"] < 5e-3
    return {"status": "pass" if ok else "fail", **out}


def check_dist_opt_resume(path: str) -> dict:
    """megatron's distributed optimizer (GPUs only) on a bfloat16 policy: save after one RL step,
    resume in a new trainer, the next step's metrics and weights equal the uninterrupted run's;
    the Adam step count survives."""
    import copy

    import transformers
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.trainer.sharded_state import optimizer_step_count
    from tests.helpers import engine_samples
    from megatron.core.optimizer import distrib_optimizer
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        return {"status": "skipped", "reason": "megatron-core resumes its distributed optimizer "
                "only with Transformer Engine or Apex (moe_rl refuses the resume otherwise)"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = [engine_samples(hf, n_groups=2, group_size=4, seed=10 + s, max_resp=8)
               for s in range(2)]

    def cfg():
        return config_from_dict({
            "model": {"path": path, "dtype": "bfloat16"}, "cluster": {"gpus_per_node": 1},
            "rollout": {"n_samples_per_prompt": 4},
            "trainer": {"optim": {"lr": 1e-3, "distributed": True}, "seed": 1,
                        "micro_batch_size": 4, "ema": {"decay": 0.9}},
            "algorithm": {"replay": "r3"}})
    ckpt = tempfile.mkdtemp(prefix="gpu_check_ckpt_")
    run = PolicyTrainer(cfg(), path)
    run.train_step(copy.deepcopy(batches[0]))
    run.save_checkpoint(ckpt)
    m1 = run.train_step(copy.deepcopy(batches[1]))
    resumed = PolicyTrainer(cfg(), path)
    resumed.load_checkpoint(ckpt)
    steps = optimizer_step_count(resumed.optimizer)
    m2 = resumed.train_step(copy.deepcopy(batches[1]))
    same = all(torch.equal(a, b) for a, b in zip(run.model.module.parameters(),
                                                  resumed.model.module.parameters()))
    diff = {k: abs(m1[k] - m2[k]) for k in m1 if isinstance(m1[k], float) and m1[k] != m2.get(k)}
    ok = same and not diff and steps == 1
    return {"status": "pass" if ok else "fail", "weights_equal": same, "adam_steps": steps,
            "metric_diffs": dict(list(diff.items())[:8])}


def check_parallel(path: str) -> dict:
    if torch.cuda.device_count() < 2:
        return {"status": "skipped", "reason": f"{torch.cuda.device_count()} GPU(s); TP/EP/CP=2 "
                                               f"need 2"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(ROOT / "benchmarks" / "gpu_check.py"), "--parallel-worker", path],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    if res.returncode:
        return {"status": "fail", "reason": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def parallel_worker(path: str) -> None:
    """torchrun worker: one RL step's gradient norm under TP=2+SP, EP=2, CP=2 (padded rows and
    packed THD rows) and packed rows on DP=2, against DP=2 on padded rows."""
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.parallel import ParallelSizes, destroy, init_distributed, \
        init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    init_distributed()
    rank = torch.distributed.get_rank()
    torch.cuda.set_device(rank)
    from moe_rl.rollout_record import Sample
    g = torch.Generator().manual_seed(1)
    samples = [Sample(prompt_ids=torch.randint(0, 90, (6,), generator=g),
                      response_ids=torch.randint(0, 90, (10,), generator=g),
                      rollout_logprobs=-torch.ones(10), reward=float(i % 2), group_id=i // 2,
                      sample_id=i) for i in range(4)]
    results = {}
    runs = (("tp1", 1, 1, False, 1, False), ("tp2_sp", 2, 1, True, 1, False),
            ("ep2", 1, 2, False, 1, False), ("cp2", 1, 1, False, 2, False),
            ("cp2_packed", 1, 1, False, 2, True), ("tp1_packed", 1, 1, False, 1, True))
    for name, tp, ep, sp, cp, packed in runs:
        init_model_parallel(ParallelSizes(tp, 1, ep, cp))
        cfg = config_from_dict({"model": {"path": path}, "cluster": {"gpus_per_node": 2},
                                "rollout": {"n_samples_per_prompt": 2},
                                "trainer": {"parallel": {"tensor": tp, "expert": ep,
                                                         "context": cp, "sequence": sp},
                                            "optim": {"lr": 1e-3}, "seed": 1,
                                            "pack_sequences": packed,
                                            "max_tokens_per_micro_batch": 64},
                                "algorithm": {"replay": "off", "pi_old": "rollout"}})
        trainer = PolicyTrainer(cfg, path)
        shard = samples if tp * cp > 1 else samples[rank * 2:(rank + 1) * 2]
        m = trainer.train_step(shard)
        results[name] = m["grad_norm"]
        del trainer
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    ok = all(abs(results[k] - results["tp1"]) <= 1e-3 * max(1.0, results["tp1"])
             for k in results)
    if rank == 0:
        print(json.dumps({"status": "pass" if ok else "fail", "grad_norm": results}))
    destroy()


def check_nccl_sync() -> dict:
    if torch.cuda.device_count() < 2:
        return {"status": "skipped", "reason": "NCCL needs a second GPU for the engine's rank"}
    from moe_rl.trainer.parallel import free_port
    from moe_rl.engines.sglang.weights import broadcast_tensors, open_group
    port = free_port()
    child = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                              "--nccl-receiver", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"))
    torch.cuda.set_device(0)
    group = open_group("nccl", "127.0.0.1", port, 0, 2, "moe_rl_weights", timeout_s=120)
    sent = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    start = time.perf_counter()
    broadcast_tensors(group, [("w", sent)])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    out, _ = child.communicate(timeout=120)
    ok = child.returncode == 0 and out.strip().endswith(str(float(sent.sum())))
    return {"status": "pass" if ok else "fail", "seconds_4MiB": elapsed}


def check_unopened_shares_freed() -> dict:
    """A tensor-sync payload no server opened is given back: after
    ``release_unopened`` and the bucket's deletion, the memory it held is free again (without
    it torch keeps the block until the process exits)."""
    from moe_rl.weights.serialize import release_unopened, share_named_tensors
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    bucket = [("w", torch.ones(64 << 20, device="cuda"))]   # 256 MiB
    shared = share_named_tensors(bucket)
    release_unopened(shared)
    del bucket
    torch.cuda.ipc_collect()
    freed = torch.cuda.memory_allocated() - before
    kept = [("w", torch.ones(64 << 20, device="cuda"))]
    share_named_tensors(kept)   # the old behaviour: never opened, never released
    del kept
    torch.cuda.ipc_collect()
    leaked = torch.cuda.memory_allocated() - before
    ok = freed == 0 and leaked >= (256 << 20)
    return {"status": "pass" if ok else "fail", "bytes_left_released": freed,
            "bytes_left_unreleased": leaked}


def nccl_receiver(port: int) -> None:
    from moe_rl.engines.sglang.weights import open_group, receive_tensors
    torch.cuda.set_device(0)
    group = open_group("nccl", "127.0.0.1", port, 1, 2, "moe_rl_weights", timeout_s=120)
    got = receive_tensors(group, ["w"], ["float32"], [[1 << 20]], device="cuda")
    print(float(got["w"].sum()))


def write_report(report: dict) -> None:
    """benchmarks/results/gpu_check.{json,md}."""
    (RESULTS / "gpu_check.json").write_text(json.dumps(report, indent=2))
    lines = ["# GPU check", "", f"CUDA: {report['cuda']}" + (f", {report.get('device')} x "
                                                             f"{report.get('gpus')}"
                                                             if report["cuda"] else ""), ""]
    for name, value in report.items():
        if isinstance(value, dict):
            lines.append(f"- {name}: {value.get('status')} "
                         f"{json.dumps({k: v for k, v in value.items() if k != 'status'})[:300]}")
    if "note" in report:
        lines.append(f"- {report['note']}")
    runs = {k: v for k, v in report.items() if k.startswith("trainer_throughput")
            and isinstance(v, dict) and "tokens_per_s" in v}
    if runs:
        lines += ["", "## Trainer throughput (forward + backward, Qwen3-30B-A3B layer shape, "
                  "random weights, megatron local spec)", "",
                  "| run | experts | attention | dispatch | dtype | layers | params total / "
                  "active (B) | tokens a step | s/step | tokens/s | TFLOP/s | MFU | peak GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, v in runs.items():
            mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") else "n/a"
            lines.append(f"| {k} | {v.get('experts', 'sequential')} | "
                         f"{v.get('attention', 'local')} | {v.get('dispatch', 'megatron')} | "
                         f"{v['dtype']} | "
                         f"{v['layers']} | {v['params_total_b']:.1f} / "
                         f"{v['params_active_b']:.2f} | {v['seq_len'] * v['micro_batch']} | "
                         f"{v['s_per_step']:.2f} | {v['tokens_per_s']:.0f} | "
                         f"{v['tflops_per_s']:.1f} | {mfu} | {v.get('peak_memory_gib', 0):.0f} |")
    (RESULTS / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    report: dict = {"cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        report["note"] = "no CUDA device: nothing ran"
        previous = RESULTS / "gpu_check.json"
        if previous.is_file() and json.loads(previous.read_text()).get("cuda"):
            print("no CUDA device: nothing ran; the results of the last GPU run are kept in",
                  previous)
            return 0
    else:
        from moe_rl.trainer.parallel import init_distributed, init_model_parallel
        report["device"] = torch.cuda.get_device_name(0)
        report["gpus"] = torch.cuda.device_count()
        from moe_rl.trainer.parallel import free_port
        path = _tiny_model(tempfile.mkdtemp(prefix="gpu_check_"))
        deepseek = _tiny_deepseek(tempfile.mkdtemp(prefix="gpu_check_deepseek_"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        init_distributed(rank=0, world_size=1)
        init_model_parallel()
        checks = {"doctor": check_doctor,
                  "megatron_cuda_local": lambda: check_megatron_cuda(path, use_te=False),
                  "megatron_cuda_te": lambda: check_megatron_cuda(path, use_te=True),
                  "deepseek_cuda_local": lambda: check_megatron_cuda(deepseek, use_te=False),
                  "deepseek_cuda_te": lambda: check_megatron_cuda(deepseek, use_te=True),
                  "triton_kernel": check_triton_kernel,
                  "bf16_policy": lambda: check_bf16_policy(path),
                  "bf16_dist_opt_resume": lambda: check_dist_opt_resume(path),
                  "parallel_equivalence": lambda: check_parallel(path),
                  "grouped_experts_cuda": lambda: check_grouped_experts_cuda(path),
                  "varlen_attention_cuda": check_varlen_attention,
                  # the matrix: expert path x attention and dispatch x shape (the loop,
                  # megatron's SequentialMLP, local attention and dispatcher: the 1.7 % MFU
                  # of 2026-12-03; grouped GEMMs, torch._grouped_mm, SDPA, dispatch by sort)
                  "trainer_throughput_bf16": lambda: check_trainer_throughput(
                      "bfloat16", profile=True, experts="grouped"),
                  "trainer_throughput_bf16_grouped_local_attention":
                      lambda: check_trainer_throughput("bfloat16", experts="grouped",
                                                       fast=False),
                  "trainer_throughput_bf16_loop": lambda: check_trainer_throughput(
                      "bfloat16", experts="sequential", fast=False),
                  "trainer_throughput_fp16": lambda: check_trainer_throughput(
                      "float16", experts="grouped"),
                  # 4x the tokens a step on 8 layers
                  "trainer_throughput_bf16_8_layers_16k_tokens": lambda: check_trainer_throughput(
                      "bfloat16", layers=8, micro_batch=8, experts="grouped"),
                  "trainer_throughput_bf16_8_layers_16k_tokens_loop":
                      lambda: check_trainer_throughput("bfloat16", layers=8, micro_batch=8,
                                                       experts="sequential", fast=False),
                  "nccl_weight_sync": check_nccl_sync,
                  "tensor_sync_unopened_freed": check_unopened_shares_freed}
        for name, fn in checks.items():
            try:
                report[name] = fn()
            except Exception:   # record the failure and go on with the other checks
                report[name] = {"status": "fail", "reason": traceback.format_exc()[-2000:]}
            print(name, json.dumps(report[name])[:300], flush=True)
            write_report(report)   # what ran is kept if a later check hangs
    write_report(report)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--parallel-worker":
        parallel_worker(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--nccl-receiver":
        nccl_receiver(int(sys.argv[2]))
    else:
        sys.exit(main())
