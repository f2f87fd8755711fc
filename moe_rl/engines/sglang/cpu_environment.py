"""An SGLang environment that serves on CPU: a virtual environment with the CPU torch, stock
``sglang`` without its GPU dependencies, its light dependencies (``cpu_requirements.txt``) and
moe_rl's import-time fixes (:mod:`moe_rl.engines.sglang.cpu_shims`) loaded by a ``.pth`` file."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

from moe_rl.errors import UserError

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"   # SGLang's configs import it; PyPI has only a CUDA build
REQUIREMENTS = pathlib.Path(__file__).with_name("cpu_requirements.txt")
SHIM_SOURCE = pathlib.Path(__file__).with_name("cpu_shims.py")
SHIM_MODULE = "moe_rl_sglang_cpu_shims"
PTH_LINE = f"import {SHIM_MODULE}; {SHIM_MODULE}.install()\n"

FACTS = ("import json, sys, sysconfig\n"
         "try:\n    import torch; cuda = torch.version.cuda\nexcept ImportError:\n"
         "    torch = None; cuda = None\n"
         "print(json.dumps({'site': sysconfig.get_paths()['purelib'],"
         " 'python': sys.version_info[:2],"
         " 'torch': torch.__version__ if torch else None, 'cuda': cuda}))")


def _run(argv: list[str], what: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"sglang-cpu-env: {what} failed ({' '.join(argv[:6])} ...): "
                        f"{(done.stderr or done.stdout).strip()[-800:]}")
    return done.stdout


def environment_facts(python: str) -> dict:
    """site-packages, Python version, torch version and its CUDA version of ``python``."""
    return json.loads(_run([python, "-c", FACTS], "reading the environment").strip()
                      .splitlines()[-1])


def install_shims(python: str) -> pathlib.Path:
    """Copy the shims into ``python``'s site-packages with the ``.pth`` that installs them;
    refused for an environment whose torch is a CUDA build (the shims are for CPU-only
    environments, and would hide a missing GPU kernel). Returns the ``.pth`` path."""
    facts = environment_facts(python)
    if facts["cuda"]:
        raise UserError(f"sglang-cpu-env: {python}'s torch {facts['torch']} is a CUDA build; "
                        f"the CPU shims are for an environment without GPUs (install SGLang "
                        f"with its own dependencies on GPU machines)")
    site = pathlib.Path(facts["site"])
    shutil.copyfile(SHIM_SOURCE, site / f"{SHIM_MODULE}.py")
    pth = site / f"{SHIM_MODULE}.pth"
    pth.write_text(PTH_LINE)
    return pth


def prepare(venv: str, system_python: str = sys.executable) -> str:
    """Create or complete the SGLang CPU environment at ``venv``; returns its Python."""
    python = str(pathlib.Path(venv) / "bin" / "python")
    if not os.access(python, os.X_OK):
        _run([system_python, "-m", "venv", venv], "creating the virtual environment")
    pip = [python, "-m", "pip", "install", "--quiet"]
    facts = environment_facts(python)
    if tuple(facts["python"]) != (3, 11) and facts["torch"] is None:
        raise UserError(f"sglang-cpu-env: {venv} runs Python {facts['python'][0]}."
                        f"{facts['python'][1]}; the CPU torch {TORCH_VERSION} is built for 3.11")
    if facts["torch"] is None:
        _run(pip + [f"torch=={TORCH_VERSION}"], "installing the CPU torch")
    _run(pip + ["--no-deps", f"sglang=={SGLANG_VERSION}", f"torchvision=={TORCHVISION_VERSION}"],
         "installing SGLang without its GPU dependencies")
    _run(pip + ["-r", str(REQUIREMENTS)], "installing SGLang's light dependencies")
    install_shims(python)
    return python


def add_arguments(parser) -> None:
    parser.add_argument("venv", help="the environment's folder (created when missing)")
    parser.add_argument("--shims-only", action="store_true",
                        help="only (re)install the import-time shims into an existing "
                             "environment that has SGLang and a CPU torch")


def run(args) -> int:
    if args.shims_only:
        python = str(pathlib.Path(args.venv) / "bin" / "python")
        if not os.access(python, os.X_OK):
            raise UserError(f"sglang-cpu-env: {args.venv}: no bin/python there")
        pth = install_shims(python)
    else:
        python = prepare(args.venv)
        pth = pathlib.Path(environment_facts(python)["site"]) / f"{SHIM_MODULE}.pth"
    python = os.path.abspath(python)
    print(f"SGLang CPU environment ready: {python} (shims: {pth}); run with "
          f"rollout.engine=sglang rollout.sglang.device=cpu rollout.sglang.python={python}")
    return 0
