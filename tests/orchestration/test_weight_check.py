"""The engine self-check after every weight update (rollout.weight_check): its figures on a
hand-worked probe, and through `moe-rl train` with an engine whose weights go wrong after a
sync (one expert of every MoE layer overwritten, in the engine only, when the reference engine
is told its new version: a sitecustomize patch): a one-off corruption is caught in the same
step and redone from disk (disk and broadcast syncs), a lasting one stops the run naming the
version, and without the check the same run trains on silently."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moe_rl.orchestration.weight_check import probe_figures
from tests.helpers import init_tiny_model
from tests.helpers import engine_base_port
from moe_rl.rollout_record import Sample
from tests.helpers import ROOT

CORRUPT_ENGINE = '''
import importlib.util, os, sys


def corrupt_now(version):
    """Version 2 and later ("once": only the first time)."""
    if not (version is not None and str(version).isdigit() and int(version) >= 2):
        return False
    mark = os.environ["CORRUPT_MARK"]
    if os.environ["CORRUPT_MODE"] == "once" and os.path.exists(mark):
        return False
    open(mark, "a").close()
    return True


if importlib.util.find_spec("moe_rl_sglang_cpu_shims") is not None:
    # the real SGLang on CPU (its environment holds moe_rl's shims): after its scheduler
    # records the new version (disk and distributed updates alike), every expert of every
    # fused MoE layer gets a garbage down projection (w2): expert 0 alone moved the probe's k3
    # only to about the check's floor (1e-4), so a check at that floor passed now and then
    import torch
    from sglang.srt.managers.scheduler_components import weight_updater as _wu
    _record = _wu.SchedulerWeightUpdaterManager.record_weight_version_after_update

    def record(self, weight_version):
        _record(self, weight_version)
        if corrupt_now(weight_version):
            with torch.no_grad():
                gen = torch.Generator().manual_seed(0)
                for n, p in self.tp_worker.model_runner.model.named_parameters():
                    if n.endswith("experts.w2_weight"):
                        p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    _wu.SchedulerWeightUpdaterManager.record_weight_version_after_update = record
elif "serve-reference" in sys.argv:
    import torch
    from moe_rl.engines.reference import engine as reference

    def set_version(self, version):   # the server names the version after every update
        self.__dict__["weight_version"] = version
        if not corrupt_now(version):
            return
        with torch.no_grad():   # expert 0 of every MoE layer: its output projection garbage
            gen = torch.Generator().manual_seed(0)
            for n, p in self.model.named_parameters():
                if n.endswith("experts.down_proj"):
                    p[0].copy_(torch.randn(p[0].shape, generator=gen))
    reference.ReferenceEngine.weight_version = property(
        lambda self: self.__dict__.get("weight_version", "default"), set_version)
'''


def test_probe_figures_hand_worked():
    """Two samples, one server: k3 over every response token, the largest |difference|, and
    the share of (position, layer) expert choices that agree (order within top-k ignored)."""
    s1 = Sample([1, 2], [3, 4], [-1.0, -2.0], routing=torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=torch.uint8))
    s1.pass_logprobs = torch.tensor([[-1.0, -2.5]])
    s2 = Sample([1], [5], [-0.5], routing=torch.tensor([[[6, 7]]], dtype=torch.uint8))
    s2.pass_logprobs = torch.tensor([[-0.2]])
    trainer = [([-1.0, -2.0], [[[1, 0]], [[2, 5]], [[4, 5]]]), ([-0.5], [[[6, 3]]])]
    m = probe_figures([s1, s2], trainer)
    d = [0.0, 0.5, -0.3]
    assert m["weights/probe_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 3)
    assert m["weights/probe_max_abs_diff"] == pytest.approx(0.5)
    assert m["weights/probe_routing_agreement"] == pytest.approx(6 / 8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_check") / "model"
    init_tiny_model(str(out))
    return out


def _train(model, base, name: str, mode: str, check: bool, sync: str = "disk",
           engine: tuple[str, ...] = ()):
    work = base / name
    work.mkdir()
    (work / "sitecustomize.py").write_text(CORRUPT_ENGINE)
    env = dict(os.environ, PYTHONPATH=f"{work}:{os.environ.get('PYTHONPATH', '')}",
               CORRUPT_MODE=mode, CORRUPT_MARK=str(work / "corrupted"))
    res = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(ROOT / "configs" /
                                                                      "tiny_cpu.yaml"),
         f"model.path={model}", f"logging.dir={work / 'run'}", "trainer.steps=4",
         "trainer.warmup.steps=0", "trainer.checkpoint.export_hf=false", "logging.progress=false",
         "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
         f"rollout.servers.base_port={engine_base_port()}", f"cluster.weight_sync={sync}",
         f"rollout.weight_check.enabled={str(check).lower()}", *engine],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()] \
        if (work / "run" / "metrics.jsonl").exists() else []
    return res, rows


def _redone_once(res, rows):
    """A one-off corruption of version 2: caught when it loads (the sync after step 1),
    reloaded from disk, and the run goes on with the probe back at the start's ~0."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert "weight check: the engines disagree with the trainer after syncing version 2" \
        in res.stdout
    assert [r["weights/check_resyncs"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["weights/probe_k3"] < 1e-6 for r in rows)
    assert all(r["mismatch/k3"] < 1e-6 for r in rows)   # no batch sampled wrong


def _stops(res, rows):
    """A lasting one: the reload is wrong too, and the run stops in one line naming it."""
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: weight check: after syncing version 2 (disk) and "
                           "again after reloading it from disk, the engine"), last
    assert "the engine's weights are wrong" in last and len(rows) == 1


def _unchecked(res, rows):
    """Without the check the same engine trains on: the steps after version 2 sample from
    weights the trainer never had."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert rows[0]["mismatch/k3"] < 1e-6
    assert min(r["mismatch/k3"] for r in rows[2:]) > 1e-4   # past the check's floor
    assert not any(k.startswith("weights/") for k in rows[0])


def _broadcast_redone(res, rows):
    """The broadcast sync (gloo on CPU) goes wrong the same way: redone from disk, run goes
    on."""
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["weights/check_resyncs"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["mismatch/k3"] < 1e-6 for r in rows)


# run name: (corruption, weight check on, weight sync, overrides), what must hold ("once"
# samples at temperature 0.7 without the sampling mask: both sides score the probe at 1)
WRONG_UPDATES = {"once": (("once", True, "disk", ("rollout.sampling.temperature=0.7",)), _redone_once),
                 "always": (("always", True), _stops),
                 "unchecked": (("always", False), _unchecked),
                 "distributed": (("once", True, "distributed"), _broadcast_redone)}


@pytest.mark.loop
@pytest.mark.e2e
# one run each (xdist spreads them); in `make test-slow`: the run without the check (the
# control), the broadcast sync's (the chaos run on SGLang redoes failed broadcasts from disk)
# and the one-off corruption (every line it runs is run by the persistent one's)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("unchecked", "distributed", "once") else n
                                  for n in WRONG_UPDATES])
def test_a_wrong_engine_update_is_redone_or_stops_the_run(model, tmp_path, name):
    args, holds = WRONG_UPDATES[name]
    res, rows = _train(model, tmp_path, name, *args)
    # a lasting corruption under the check stops the run; every other run finishes
    assert res.returncode == (1 if name == "always" else 0), res.stderr[-3000:]
    holds(res, rows)


@pytest.mark.sglang
@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.alone   # which checks see the one-off corruption depends on the timing
@pytest.mark.slow    # `make test-slow`: two real-SGLang runs at once; the runs above hold the check
def test_a_wrong_update_of_the_real_sglang_is_redone_or_stops_the_run(model, tmp_path):
    """The same on the real SGLang serving on CPU, corrupted inside its scheduler after it
    records the new version: a one-off corruption of a broadcast (gloo) update is caught and
    redone from disk, a lasting one of a disk update stops the run naming the version."""
    from tests.helpers import on_sglang
    runs = {"sglang_once": ("once", True, "distributed", on_sglang()),
            "sglang_always": ("always", True, "disk", on_sglang())}
    with ThreadPoolExecutor(2) as pool:
        done = {k: pool.submit(_train, model, tmp_path, k, *v) for k, v in runs.items()}
        (once, once_rows), (always, always_rows) = (done[k].result() for k in runs)
    assert once.returncode == 0, once.stderr[-3000:]
    assert "weight check: the engines disagree with the trainer after syncing version 2" \
        in once.stdout
    assert [r["weights/check_resyncs"] for r in once_rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["mismatch/k3"] < 1e-6 for r in once_rows)
    assert always.returncode == 1 and "Traceback" not in always.stderr, always.stderr[-3000:]
    last = always.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: weight check: after syncing version 2 (disk) and "
                           "again after reloading it from disk, the engine"), last
    assert len(always_rows) == 1
