"""`moe-rl doctor`: every check passes on a healthy CPU node and each one has a failing case."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from moe_rl.checks import node as node_checks
from moe_rl.cli import main
from moe_rl.config import load_config
from tests.helpers import sglang_cpu_python


def doctor(capsys, *argv) -> tuple[int, dict]:
    rc = main(["doctor", "--json", *argv])
    return rc, {f["check"]: f for f in json.loads(capsys.readouterr().out)}


def test_a_cpu_node_passes_every_check_through_the_console_script(tmp_path):
    """The console script as a user types it (no PYTHONPATH), from an empty folder."""
    script = shutil.which("moe-rl", path=os.path.dirname(sys.executable))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([script, "doctor", f"logging.dir={tmp_path}/run"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.strip().endswith("every check passed")
    for check in ("python", "torch", "megatron-core", "transformers", "engine", "collectives",
                  "disk", "ports"):
        assert f"] {check} " in got.stdout


CPU_NODE = pytest.mark.skipif(__import__("torch").cuda.is_available(),
                              reason="the failures of a CPU node")


@CPU_NODE
def test_a_gpu_config_on_a_cpu_node_fails_with_the_fixes(capsys):
    """torch without CUDA, no GPUs, no NCCL, and context parallel without Transformer Engine."""
    rc, found = doctor(capsys, "cluster.gpus_per_node=8", "trainer.parallel.context=2",
                       "cluster.trainer_workers=2")
    assert rc == 1
    assert found["torch"]["status"] == "fail" and "CUDA" in found["torch"]["fix"]
    assert found["gpus"]["status"] == "fail"
    assert "cluster.gpus_per_node=8" in found["gpus"]["detail"]
    assert found["collectives"]["status"] == "fail" and "NCCL" in found["collectives"]["detail"]
    assert found["transformer-engine"]["status"] == "fail"
    assert "transformer-engine" in found["transformer-engine"]["fix"] or "te]" in \
        found["transformer-engine"]["fix"]


@CPU_NODE
def test_the_text_report_names_each_failure_and_its_fix(capsys):
    assert main(["doctor", "cluster.gpus_per_node=2"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] gpus" in out and "fix: set cluster.gpus_per_node=0" in out
    assert out.strip().splitlines()[-1].startswith("3 check(s) failed: torch, gpus, collectives")


def test_an_old_python_fails():
    assert node_checks.check_python((3, 10, 12)).status == "fail"
    assert node_checks.check_python((3, 11, 0)).status == "ok"


def test_a_package_missing_or_outside_moe_rls_range_fails(monkeypatch):
    missing = node_checks.check_package("megatron-core", "no_such_module_xyz", "megatron-core",
                                        required=True)
    assert missing.status == "fail" and ">=0.16" in missing.fix
    real_version = node_checks.importlib.metadata.version
    monkeypatch.setattr(node_checks.importlib.metadata, "version",
                        lambda d: "0.15.2" if d == "megatron-core" else real_version(d))
    old = node_checks.check_package("megatron-core", "megatron.core", "megatron-core",
                                    required=True)
    assert old.status == "fail" and "0.15.2 is outside" in old.detail


def test_sglang_missing_from_the_configured_interpreter_fails(capsys):
    rc, found = doctor(capsys, "rollout.engine=sglang", "rollout.sglang.device=cpu",
                       f"rollout.sglang.python={sys.executable}")
    assert rc == 1 and found["engine"]["status"] == "fail"
    assert "import sglang" in found["engine"]["detail"]
    assert "rollout.sglang.python" in found["engine"]["fix"]


def test_a_flag_is_known_only_as_a_flag_of_its_own(capsys, tmp_path):
    """An SGLang whose launch_server lists --kv-cache-dtype but not --dtype: --dtype is
    missing (a substring match of the help text passed it)."""
    from moe_rl.engines.sglang.launcher import sglang_argv
    keys = ["rollout.engine=sglang", "rollout.sglang.device=cpu"]
    flags = [a for a in sglang_argv(load_config(None, keys), "M", "127.0.0.1", 1)
             if a.startswith("--") and a != "--dtype"]
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nif [ \"$1\" = -c ]; then echo 0.5.23; exit 0; fi\n"
                      f"echo 'usage: launch_server {' '.join(flags)} --kv-cache-dtype KV'\n")
    python.chmod(0o755)
    rc, found = doctor(capsys, *keys, f"rollout.sglang.python={python}")
    assert rc == 1 and found["engine"]["status"] == "fail", found["engine"]
    assert found["engine"]["detail"] == ("sglang 0.5.23's launch_server does not know --dtype, "
                                         "which this config passes")


@pytest.mark.sglang
def test_the_real_sglang_is_checked_for_the_flags_the_config_passes(capsys):
    """SGLang 0.5.23 from its CPU environment imports, is in range, and knows every flag this
    config passes but the one it never had."""
    python = sglang_cpu_python()
    rc, found = doctor(capsys, "rollout.engine=sglang", "rollout.sglang.device=cpu",
                       f"rollout.sglang.python={python}", "algorithm.replay=r3",
                       "rollout.sglang.extra_args=[--no-such-flag]")
    assert rc == 1 and found["engine"]["status"] == "fail"
    assert found["engine"]["detail"].startswith("sglang 0.5.23's launch_server does not know "
                                                "--no-such-flag, which")


def test_too_little_disk_for_the_checkpoints_fails(capsys, monkeypatch, tmp_path):
    from tests.helpers import write_tiny_qwen
    write_tiny_qwen(tmp_path / "model")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(node_checks.shutil, "disk_usage",
                        lambda p: usage._replace(free=1 << 20))
    rc, found = doctor(capsys, f"model.path={tmp_path}/model", f"logging.dir={tmp_path}/run/a")
    assert rc == 1 and found["disk"]["status"] == "fail"
    assert "trainer.checkpoint.keep" in found["disk"]["fix"]


@pytest.mark.parametrize("kind,status", [("ext4", "fail"), ("nfs4", "ok"), ("lustre", "ok"),
                                         ("mysteryfs", "warn")])
def test_a_multi_node_run_needs_logging_dir_on_a_shared_filesystem(tmp_path, kind, status):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"rootfs / ext4 rw 0 0\nserver:/export {tmp_path}/shared {kind} rw 0 0\n")
    (tmp_path / "shared").mkdir()
    cfg = load_config(None, ["cluster.num_nodes=2", f"logging.dir={tmp_path}/shared/runs/a"])
    found = node_checks.check_shared_filesystem(cfg.cluster, cfg.logging.dir, str(mounts))
    assert found.status == status and kind in found.detail
    one = load_config(None, ["cluster.num_nodes=1", f"logging.dir={tmp_path}/shared/runs/a"])
    assert node_checks.check_shared_filesystem(one.cluster, one.logging.dir,
                                              str(mounts)).status == "skip"


def test_busy_engine_ports_warn_and_no_free_port_fails(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, found = doctor(capsys, f"rollout.servers.base_port={port}")
        assert rc == 0 and found["ports"]["status"] == "warn" and str(port) in \
            found["ports"]["detail"]
    with socket.socket() as last:   # the last port, held here or by another program: busy
        try:
            last.bind(("127.0.0.1", 65535))
            last.listen()
        except OSError:
            pass
        rc, found = doctor(capsys, "rollout.servers.base_port=65535")
        assert rc == 1 and found["ports"]["status"] == "fail"


def test_a_model_missing_on_the_node_fails_where_the_run_names_it(tmp_path):
    """Through the console script: a config's (or an override's) model.path without a
    checkpoint fails with the fix; without either, the default's is not checked."""
    script = shutil.which("moe-rl", path=os.path.dirname(sys.executable))
    for args in (["--config", "tiny_cpu"], [f"model.path={tmp_path}/absent"]):
        got = subprocess.run([script, "doctor", f"logging.dir={tmp_path}/run", *args],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert got.returncode == 1, got.stdout + got.stderr
        assert "[FAIL] model " in got.stdout and "no checkpoint (config.json) on this node" \
            in got.stdout
        assert got.stdout.strip().endswith("1 check(s) failed: model")
    found = node_checks.check_model(load_config(None, []), named=False)
    assert found.status == "skip"


def test_without_a_config_a_gpu_node_is_checked_as_a_run_on_its_gpus(capsys, monkeypatch):
    """The defaults are a CPU run: on a node with GPUs, doctor checks a run on all of them
    (here a node whose torch has no CUDA build, so the GPU checks fail) and says so."""
    from moe_rl.commands import doctor as command
    monkeypatch.setattr(command, "node_gpus", lambda: 8)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("no --config: checking this node as a run on its 8 GPUs")
    assert "every check passed" not in out
    assert main(["doctor", "cluster.gpus_per_node=0"]) == 0   # told otherwise: a CPU run


@pytest.mark.parametrize("host,named", [("no-such-host.invalid", "does not resolve"),
                                        ("192.0.2.1", "is not an address of this node")])
def test_an_unresolvable_or_foreign_host_is_named_not_counted_as_busy_ports(capsys, host,
                                                                            named):
    """It was reported as '0 free of ports ...' (every bind failed)."""
    rc, found = doctor(capsys, f"rollout.servers.host={host}")
    assert rc == 1 and found["ports"]["status"] == "fail"
    assert f"rollout.servers.host {host!r} {named}" in found["ports"]["detail"], found["ports"]


@pytest.mark.parametrize("damage", ["garbage", "fifo"])
def test_a_damaged_safetensors_file_fails_the_disk_check_in_one_line(capsys, tmp_path, damage):
    """A bad header was a traceback; a FIFO where a safetensors file should be hung doctor."""
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    model = tmp_path / "model"
    write_tiny_model(ModelInitConfig(), str(model))
    os.unlink(model / "model.safetensors")
    if damage == "fifo":
        os.mkfifo(model / "model.safetensors")
    else:
        (model / "model.safetensors").write_bytes(b"\xff" * 64)
    rc, found = doctor(capsys, f"model.path={model}", f"logging.dir={tmp_path}/run")
    assert rc == 1 and found["disk"]["status"] == "fail"
    assert f"model.path: {model}/model.safetensors: " in found["disk"]["detail"], found["disk"]
