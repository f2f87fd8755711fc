"""docs/install.md's GPU version matrix against what it rests on: SGLang 0.5.23's own package
metadata (its exact torch and transformers pins, its CUDA 13 kernels) and moe_rl's ranges."""
from __future__ import annotations

import json
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from moe_rl.config.supported_versions import in_range, supported_range
from tests.helpers import ROOT, sglang_cpu_python


def matrix() -> dict[str, str]:
    """piece -> version, from the table in docs/install.md."""
    text = (ROOT / "docs" / "install.md").read_text()
    start = text.index("| piece | version |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    return {row.split("|")[1].strip(): row.split("|")[2].strip() for row in rows}


def test_the_matrix_lies_inside_moe_rls_ranges():
    m = matrix()
    for dist, extra in (("torch", None), ("transformers", None), ("megatron-core", None),
                        ("sglang", "sglang")):
        version = m["SGLang" if dist == "sglang" else dist]
        assert in_range(version, supported_range(dist, extra)), (dist, version)


@pytest.mark.sglang
def test_the_matrix_holds_sglangs_own_pins():
    """SGLang's installed metadata (the environment `moe-rl sglang-cpu-env` builds, which
    installs the pinned release without its dependencies): the version, torch and transformers
    pinned exactly to the matrix's, its kernels built for the matrix's CUDA."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps([m.version('sglang'), m.requires('sglang')]))")
    res = subprocess.run([sglang_cpu_python(), "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    version, requires = json.loads(res.stdout.strip().splitlines()[-1])
    reqs = {canonicalize_name(r.name): r for r in map(Requirement, requires)
            if r.marker is None or r.marker.evaluate({"extra": ""})}
    m = matrix()
    assert version == m["SGLang"]
    assert str(reqs["torch"].specifier) == f"=={m['torch']}"
    assert str(reqs["transformers"].specifier) == f"=={m['transformers']}"
    cuda = f"cu{m['CUDA']}"
    assert cuda in reqs["flashinfer-python"].extras, reqs["flashinfer-python"]
    assert str(reqs["cuda-python"].specifier) == f">={m['CUDA']}.0", reqs["cuda-python"]
