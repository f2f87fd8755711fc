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
