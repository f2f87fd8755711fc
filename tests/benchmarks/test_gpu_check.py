"""GPU-only checks (benchmarks/gpu_check.py) as tests: they run where CUDA is present and are
skipped on CPU machines (CI has none). On a lent GPU: `make test-all PYTEST_ARGS=-k gpu`."""
import pytest
import torch

from benchmarks import gpu_check

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gpu_check._tiny_model(str(tmp_path_factory.mktemp("gpu")))


@needs_cuda
def test_megatron_on_cuda_matches_transformers(tiny):
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    assert gpu_check.check_megatron_cuda(tiny, use_te=False)["status"] == "pass"
    te = gpu_check.check_megatron_cuda(tiny, use_te=True)
    assert te["status"] in ("pass", "skipped"), te


@needs_cuda
def test_deepseek_v3_on_cuda_matches_transformers(tmp_path):
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    path = gpu_check._tiny_deepseek(str(tmp_path / "deepseek"))
    assert gpu_check.check_megatron_cuda(path, use_te=False)["status"] == "pass"
    te = gpu_check.check_megatron_cuda(path, use_te=True)
    assert te["status"] in ("pass", "skipped"), te


@needs_cuda
def test_triton_kernel_matches_torch_on_cuda():
    res = gpu_check.check_triton_kernel()
    assert res["status"] in ("pass", "skipped"), res


@needs_two
def test_tp2_sp_ep2_and_context_parallel_2_gradients_equal_data_parallel(tiny):
    res = gpu_check.check_parallel(tiny)
    assert res["status"] == "pass", res


@needs_two
def test_nccl_weight_sync_into_a_second_process():
    assert gpu_check.check_nccl_sync()["status"] == "pass"


@pytest.mark.skipif(CUDA, reason="the CPU behaviour of the check")
def test_gpu_check_on_cpu_keeps_the_last_gpu_runs_results(tmp_path, monkeypatch):
    """Without CUDA the check records that nothing ran, but never over a GPU run's results
    (`make bench` on a CPU machine must not erase the committed H100 figures)."""
    import json
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    assert gpu_check.main() == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {
        "cuda": False, "note": "no CUDA device: nothing ran"}
    gpu_run = {"cuda": True, "device": "NVIDIA H100 80GB HBM3", "triton_kernel": {"status": "pass"}}
    (tmp_path / "gpu_check.json").write_text(json.dumps(gpu_run))
    assert gpu_check.main() == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == gpu_run


TINY_QWEN3_MOE = dict(gpu_check.QWEN3_30B_A3B, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, vocab_size=512, num_hidden_layers=2)


def test_the_parameter_count_behind_mfu_is_the_megatron_models(parallel_state):
    """moe_params' total equals the matrices of the GPTModel the trainer builds."""
    from moe_rl.trainer import model_builder
    model, _ = model_builder.build_model(TINY_QWEN3_MOE)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    total, active = gpu_check.moe_params(TINY_QWEN3_MOE)
    assert total == matrices
    h, e = 64, 8
    expert = 3 * h * 32
    assert total - active == 2 * (e - 2) * expert + 512 * h   # idle experts, the embedding
    assert gpu_check.moe_params(gpu_check.QWEN3_30B_A3B)[0] / 1e9 == pytest.approx(30.5, abs=0.1)


def test_training_flops_count_causal_attention_by_hand():
    hf = dict(TINY_QWEN3_MOE, num_hidden_layers=1)
    _, active = gpu_check.moe_params(hf)
    # one layer, S = 10: forward QK^T + AV average 2 * (S / 2) * 64 each; x3 for backward
    assert gpu_check.training_flops_per_token(hf, 10) == 6 * active + 3 * 2 * (2 * 5 * 64)


def test_the_throughput_measurement_runs_the_trainers_forward_and_backward(parallel_state):
    got = gpu_check.measure_trainer_throughput(TINY_QWEN3_MOE, torch.float32, seq_len=32,
                                               micro_batch=2, steps=1)
    assert got["tokens_per_s"] > 0 and got["layers"] == 2
    flops = gpu_check.training_flops_per_token(TINY_QWEN3_MOE, 32) * 64 / got["s_per_step"]
    assert got["tflops_per_s"] == pytest.approx(flops / 1e12)
