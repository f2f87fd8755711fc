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
5. bf16_policy: bfloat16 training with float32 master weights (distributed optimizer and
   megatron's Float16Optimizer) against float32, and the EMA policy on the master weights;
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
    from moe_rl.packing import pack_one
    from moe_rl.trainer import model_builder
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.weights.hf import load_hf_into_megatron
    from moe_rl.trainer.replay import ReplayController
    from moe_rl.types import Sample, compact_routing
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
                    routing=compact_routing(routing[:-1], spec.facts.num_experts))
    mb = pack_one([sample], [0], pad_token_id=0, num_experts=spec.facts.num_experts)
    ctl = ReplayController(model, spec.facts.moe_layers, spec.facts.topk,
                           spec.facts.num_experts)
    ctl.replay(mb.replay_indices())
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb)
    ctl.finish_forward()
    got = lp[0, 15:47].float().cpu()
    diff = float((got - want).abs().max())
    # the same sample twice in one packed row (THD with cu_seqlens)
    te = model_builder.uses_te_spec(model)
    packed = pack_one([sample, sample], [0, 1], pad_token_id=0,
                      num_experts=spec.facts.num_experts, packed=True, slot_multiple=8)
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


def check_triton_kernel() -> dict:
    from moe_rl_kernels import logprob_entropy, triton_available
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
    """The GPU configs' precision on CUDA: a bfloat16 policy with float32 master weights (the
    distributed optimizer and megatron's Float16Optimizer), three RL steps each, against the
    same steps in float32; and the EMA policy (decay 0.99, lr 1e-4, 20 steps) moving the bf16
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
            "trainer": {"lr": 1e-4, "seed": 1, "micro_batch_size": 4,
                        "distributed_optimizer": dist_opt, **extra},
            "algorithm": {"replay": "r3", "corrections": ["token_tis"]}}), path)
    out: dict = {}
    for name, dtype, dist_opt in (("f32", "float32", False), ("bf16_dist_opt", "bfloat16", True),
                                  ("bf16", "bfloat16", False)):
        t = trainer(dtype, dist_opt)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ms = [t.train_step(copy.deepcopy(b)) for b in batches]
        torch.cuda.synchronize()
        out[name] = {"k3_step1": ms[0]["mismatch/k3"], "grad_norm": [m["grad_norm"] for m in ms],
                     "loss": [m["loss"] for m in ms], "s_per_step": (time.perf_counter() - start) / 3,
                     "param_dtypes": sorted({str(p.dtype) for p in t.model.module.parameters()})}
        del t
    moves = {}
    for dtype in ("bfloat16", "float32"):
        t = trainer(dtype, False, ema_decay=0.99, ema_policy=True)
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
        moves[dtype] = {n: main_weights(p).detach().double() - start_w[n] for n, p in params.items()}
        del t
    f32 = moves["float32"]
    total = sum(float(d.norm() ** 2) for d in f32.values()) ** 0.5
    err = sum(float((moves["bfloat16"][n] - f32[n]).norm() ** 2) for n in f32) ** 0.5
    out["ema_policy_bf16_vs_f32_rel_diff"] = err / total
    finite = all(all(map(lambda v: v == v and abs(v) < 1e4, r["grad_norm"] + r["loss"]))
                 for k, r in out.items() if isinstance(r, dict))
    close = all(abs(out[k]["grad_norm"][0] - out["f32"]["grad_norm"][0])
                <= 0.05 * out["f32"]["grad_norm"][0] for k in ("bf16", "bf16_dist_opt"))
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = [engine_samples(hf, n_groups=2, group_size=4, seed=10 + s, max_resp=8)
               for s in range(2)]

    def cfg():
        return config_from_dict({
            "model": {"path": path, "dtype": "bfloat16"}, "cluster": {"gpus_per_node": 1},
            "rollout": {"n_samples_per_prompt": 4},
            "trainer": {"lr": 1e-3, "seed": 1, "micro_batch_size": 4, "ema_decay": 0.9,
                        "distributed_optimizer": True},
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
    from moe_rl.types import Sample
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
                                "trainer": {"tensor_parallel": tp, "expert_parallel": ep,
                                            "context_parallel": cp, "sequence_parallel": sp,
                                            "lr": 1e-3, "seed": 1, "pack_sequences": packed,
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


def nccl_receiver(port: int) -> None:
    from moe_rl.engines.sglang.weights import open_group, receive_tensors
    torch.cuda.set_device(0)
    group = open_group("nccl", "127.0.0.1", port, 1, 2, "moe_rl_weights", timeout_s=120)
    got = receive_tensors(group, ["w"], ["float32"], [[1 << 20]], device="cuda")
    print(float(got["w"].sum()))


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
        checks = {"megatron_cuda_local": lambda: check_megatron_cuda(path, use_te=False),
                  "megatron_cuda_te": lambda: check_megatron_cuda(path, use_te=True),
                  "deepseek_cuda_local": lambda: check_megatron_cuda(deepseek, use_te=False),
                  "deepseek_cuda_te": lambda: check_megatron_cuda(deepseek, use_te=True),
                  "triton_kernel": check_triton_kernel,
                  "bf16_policy": lambda: check_bf16_policy(path),
                  "bf16_dist_opt_resume": lambda: check_dist_opt_resume(path),
                  "parallel_equivalence": lambda: check_parallel(path),
                  "nccl_weight_sync": check_nccl_sync}
        for name, fn in checks.items():
            try:
                report[name] = fn()
            except Exception:   # record the failure and go on with the other checks
                report[name] = {"status": "fail", "reason": traceback.format_exc()[-2000:]}
            print(name, json.dumps(report[name])[:300], flush=True)
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
    (RESULTS / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--parallel-worker":
        parallel_worker(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--nccl-receiver":
        nccl_receiver(int(sys.argv[2]))
    else:
        sys.exit(main())
