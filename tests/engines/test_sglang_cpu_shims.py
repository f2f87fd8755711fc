"""The import-time shims of the SGLang CPU environment (``moe-rl sglang-cpu-env``), each run in
that environment with it on and with it left out: a shim whose test fails 'off' is no longer
needed after an SGLang upgrade (drop it); one whose test fails 'on' no longer applies."""
import os
import subprocess

import pytest

from moe_rl.engines.sglang import cpu_environment
from moe_rl.engines.sglang.cpu_shims import CALL_MARKER
from moe_rl.errors import UserError
from tests.helpers import sglang_cpu_python


def in_sglang_env(code: str, off: str = "", cpu: bool = True, extra_env: dict | None = None,
                  cwd: str = "/"):
    """Run ``code`` in the SGLang CPU environment (shims named in ``off`` left out)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE",)}
    env.update({"MOE_RL_SGLANG_CPU_SHIMS_OFF": off, "PYTHONSAFEPATH": "1", **(extra_env or {})})
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return subprocess.run([sglang_cpu_python(), "-c", code], capture_output=True, text=True,
                          env={k: v for k, v in env.items() if v is not None}, timeout=300,
                          cwd=cwd)


@pytest.mark.sglang
def test_torchvision_imports_only_with_its_shim():
    code = "import torch, torchvision; print(hasattr(torch.ops.torchvision, 'nms'))"
    off = in_sglang_env(code, off="torchvision")
    assert off.returncode != 0 and "torchvision::nms does not exist" in off.stderr
    on = in_sglang_env(code)
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.strip() == "True"


@pytest.mark.sglang
def test_sglang_cpu_code_imports_only_with_the_stand_in_kernels_and_a_call_fails_loudly():
    module = "import sglang.kernels.ops.kvcache.cache_move"
    off = in_sglang_env(module, off="sgl_kernel")
    assert off.returncode != 0 and "No module named 'sgl_kernel'" in off.stderr
    on = in_sglang_env(module + "\nimport sgl_kernel\nsgl_kernel.copy_all_layer_kv_cache_cpu(1)")
    assert "KernelUnavailable" in on.stderr and on.returncode != 0
    assert f"{CALL_MARKER} sgl_kernel.copy_all_layer_kv_cache_cpu" in on.stderr
    # submodules stay missing, so SGLang's ImportError fallbacks apply
    sub = in_sglang_env("import sgl_kernel.scalar_type")
    assert sub.returncode != 0 and "sgl_kernel.scalar_type" in sub.stderr


@pytest.mark.sglang
def test_a_real_sgl_kernel_is_preferred_to_the_stand_in(tmp_path):
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    out = in_sglang_env("import sgl_kernel; print(sgl_kernel.REAL)",
                        extra_env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.sglang
def test_the_routed_experts_host_buffer_allocates_only_with_its_shim():
    code = ("from sglang.srt.state_capturer.base import BaseHostCache\n"
            "c = BaseHostCache(16, 3, 2, 'routed_experts', 'cpu')\n"
            "print(tuple(c.buffer.shape), int(c.buffer.abs().sum()))")
    off = in_sglang_env(code, off="host_alloc")
    assert off.returncode != 0 and "cuda" in off.stderr.lower()
    on = in_sglang_env(code)
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.strip().splitlines()[-1] == "(16, 3, 2) 0"


@pytest.mark.sglang
def test_no_shim_loads_without_the_cpu_engine():
    code = ("import sys, moe_rl_sglang_cpu_shims as m\n"
            "print(any(isinstance(f, m.CPUShimFinder) for f in sys.meta_path))")
    assert in_sglang_env(code, cpu=False).stdout.strip() == "False"
    assert in_sglang_env(code).stdout.strip() == "True"


def test_the_shims_are_refused_in_an_environment_with_a_cuda_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_environment, "environment_facts", lambda python: {
        "site": str(tmp_path), "python": [3, 11], "torch": "2.13.0+cu128", "cuda": "12.8"})
    with pytest.raises(UserError, match="CUDA build"):
        cpu_environment.install_shims("python")
    assert list(tmp_path.iterdir()) == []   # nothing written


@pytest.mark.sglang
def test_sglang_starts_from_the_checkout_root_with_or_without_the_launchers_environment():
    """`python -m sglang.launch_server` puts its working directory on sys.path; Ray actors
    inherit the driver's, the checkout root. transformers imports the PyPI package `kernels`,
    which moe_rl's `kernels/` hid while it held an `__init__.py` (the server died at import);
    it is a plain folder now, and the launcher's environment (PYTHONSAFEPATH=1) keeps the
    working directory off the path besides."""
    import pathlib
    from moe_rl.engines.sglang.launcher import sglang_env
    root = str(pathlib.Path(__file__).resolve().parents[2])
    code = "import transformers.models.qwen3_moe.modeling_qwen3_moe; print('imported')"
    for env in ({"PYTHONSAFEPATH": None}, sglang_env([], "cpu")):
        got = in_sglang_env(code, cwd=root, extra_env=env)
        assert got.returncode == 0 and got.stdout.strip() == "imported", got.stderr[-1500:]
