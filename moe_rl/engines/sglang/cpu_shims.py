"""Import-time fixes that let stock SGLang 0.5.23 serve on a CPU without GPUs.

This file runs inside SGLang's own environment, not moe_rl's: ``moe-rl sglang-cpu-env`` copies
it there as ``moe_rl_sglang_cpu_shims.py`` beside a ``.pth`` file that calls :func:`install` at
every interpreter start (so SGLang's spawned scheduler has the fixes too). It needs only the
standard library and torch. :func:`install` does nothing unless ``SGLANG_USE_CPU_ENGINE=1`` (the
variable that puts SGLang on its CPU engine, set by moe_rl only for ``rollout.sglang.device:
cpu``), so a GPU server started from the same environment never has them.
``MOE_RL_SGLANG_CPU_SHIMS_OFF=torchvision,sgl_kernel,host_alloc`` (any of them) leaves fixes out:
the tests use it to show that each is still needed after an SGLang upgrade.

Each fix applies as its module is imported, through a finder first on ``sys.meta_path``:

1. ``torchvision``: PyPI's torchvision 0.28.0 is a CUDA build whose operators do not load beside
   the CPU torch; ``torchvision/_meta_registrations.py`` (line 163) then fails registering a fake
   for ``torchvision::nms`` ("operator torchvision::nms does not exist"), and SGLang's configs
   package imports torchvision (``sglang/srt/configs/deepseek_ocr.py``, line 7). Defining the
   ``nms`` and ``qnms`` schemas before torchvision loads lets it import; no torchvision operator
   is called for a text model.
2. ``sgl_kernel``: PyPI's ``sglang-kernel`` / ``sgl-kernel`` wheels are CUDA-only with no sdist,
   while SGLang's CPU code imports kernel names at module level (e.g.
   ``sglang/kernels/ops/kvcache/cache_move.py``, line 10). Without AMX, SGLang takes its
   torch-native paths (``sglang/srt/utils/common.py``, ``cpu_has_amx_support``) and calls none
   of them. The stand-in module serves any top-level name (its submodules stay missing, so
   SGLang's ``except ImportError`` fallbacks apply); calling one raises :class:`KernelUnavailable`
   after writing ``MOE_RL_SGL_KERNEL_CALLED <name>`` to stderr, so a call fails loudly and shows
   in the server's log. A real ``sgl_kernel``, when one is installed, is always preferred.
3. ``host_alloc``, in ``sglang.srt.mem_cache.pool_host.common``: ``ALLOC_MEMORY_FUNCS`` (line 453)
   maps every device but npu/musa/xpu, "cpu" included, to ``alloc_with_host_register``, which pins
   memory through ``torch.cuda.cudart().cudaHostRegister`` and fails without CUDA; the
   routed-experts capturer (``sglang/srt/state_capturer/base.py``, ``BaseHostCache``, line 67)
   allocates through ``ALLOC_MEMORY_FUNCS["cpu"]`` under ``--enable-return-routed-experts``. The fix
   maps "cpu" to a plain allocation.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

POOL_HOST_COMMON = "sglang.srt.mem_cache.pool_host.common"
ACTIVATING_VARIABLE = "SGLANG_USE_CPU_ENGINE"
DISABLING_VARIABLE = "MOE_RL_SGLANG_CPU_SHIMS_OFF"   # comma-separated SHIMS to leave out
SHIMS = ("torchvision", "sgl_kernel", "host_alloc")
SHIM_OF_MODULE = {"torchvision": "torchvision", "sgl_kernel": "sgl_kernel",
                  POOL_HOST_COMMON: "host_alloc"}
CALL_MARKER = "MOE_RL_SGL_KERNEL_CALLED"


class KernelUnavailable(RuntimeError):
    """A kernel of the stand-in ``sgl_kernel`` was called."""


def define_torchvision_schemas() -> None:
    """Define ``torchvision::nms`` / ``torchvision::qnms`` (their upstream schemas) unless an
    operator library already did."""
    import torch
    if hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    define_torchvision_schemas.library = lib   # a Library drops its definitions when collected


class _Unavailable:
    """A kernel name of the stand-in: raises when called."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        sys.stderr.write(f"{CALL_MARKER} {self.name}\n")
        sys.stderr.flush()
        raise KernelUnavailable(f"{self.name}: this CPU environment has no SGLang kernels "
                                f"(moe_rl's stand-in sgl_kernel, see docs/engines.md); SGLang "
                                f"took a kernel path its torch-native CPU code does not need")

    def __repr__(self) -> str:
        return f"<unavailable kernel {self.name}>"


class _StandInModule(types.ModuleType):
    """``sgl_kernel``: any public name is an unavailable kernel. Not a package: its submodules
    (``sgl_kernel.scalar_type``, ...) fail to import as without the real one, so SGLang's
    ``except ImportError`` fallbacks apply."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module) -> None:
        module.MOE_RL_STAND_IN = True


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real module, then maps ``ALLOC_MEMORY_FUNCS["cpu"]`` to a plain allocation."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        self.real.exec_module(module)
        module.ALLOC_MEMORY_FUNCS["cpu"] = plain_allocation


def plain_allocation(dims, dtype, device, pin_memory=False, allocator=None,
                     registration_granularity_bytes=None):
    """``ALLOC_MEMORY_FUNCS``'s signature without pinning (nothing to pin for without CUDA)."""
    import torch
    return torch.empty(dims, dtype=dtype, device=device)


class CPUShimFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: applies each fix (of ``active``) as its module is imported."""

    def __init__(self, active: set[str]):
        self.active = active

    def find_spec(self, name, path, target=None):
        if SHIM_OF_MODULE.get(name) not in self.active:
            return None
        if name == "torchvision":
            define_torchvision_schemas()
            return None
        if name == "sgl_kernel":
            if _real_spec(name, path) is not None:
                return None
            return importlib.machinery.ModuleSpec(name, _StandInLoader())
        if name == POOL_HOST_COMMON:
            spec = _real_spec(name, path)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


def _real_spec(name, path):
    """The spec the other finders give ``name``."""
    for finder in sys.meta_path:
        if isinstance(finder, CPUShimFinder) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path)
        if spec is not None:
            return spec
    return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` when ``SGLANG_USE_CPU_ENGINE=1``; True when
    the fixes are active."""
    if os.environ.get(ACTIVATING_VARIABLE) != "1":
        return False
    off = {s.strip() for s in os.environ.get(DISABLING_VARIABLE, "").split(",") if s.strip()}
    if not any(isinstance(f, CPUShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CPUShimFinder(set(SHIMS) - off))
    return True
