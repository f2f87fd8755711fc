"""A run placed on a simulated multi-node GPU cluster: Ray's own multi-node test cluster
(``ray.cluster_utils.Cluster``: one raylet per node on this machine, each declaring GPUs),
``rollout.engine: sglang`` whose interpreter is a shim that records its command line and
environment and serves the reference engine. `moe-rl train` must place every process as
`moe-rl plan` says: engines on their nodes and GPUs, disjoint from each other and from the
trainer's GPUs, bound to their node's address, ports chosen there."""
import json
import pathlib
import stat
import subprocess
import sys

import pytest

from tests.helpers import init_tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPUS = 4


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "env_vars": {"MOE_RL_TEST_NODE": "head"}})
    labels = {}
    for name in ("a", "b"):
        node = c.add_node(num_cpus=3, num_gpus=GPUS, env_vars={"MOE_RL_TEST_NODE": name})
        labels[node.node_id] = name
    c.wait_for_nodes()
    yield c, labels
    c.shutdown()


def _shim(tmp_path, records) -> str:
    """An executable that stands in for SGLang's interpreter (Ray's workers start with their
    raylet's environment, so the records' folder is written into the script)."""
    path = tmp_path / "sglang-python"
    path.write_text(f"#!/bin/sh\nMOE_RL_SHIM_DIR={records} exec {sys.executable} "
                    f"{ROOT / 'tests' / 'sglang_shim.py'} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.multinode
@pytest.mark.e2e
def test_train_places_engines_on_their_nodes_and_gpus_as_planned(cluster, tmp_path):
    c, labels = cluster
    model = tmp_path / "model"
    init_tiny_model(str(model))
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    overrides = [f"model.path={model}", f"logging.dir={tmp_path / 'run'}",
                 "rollout.engine=sglang", f"rollout.sglang.python={_shim(tmp_path, shim_dir)}",
                 "rollout.sglang.tp_size=2", "rollout.num_servers=2",
                 "cluster.num_nodes=2", f"cluster.gpus_per_node={GPUS}",
                 "cluster.trainer_workers=2", "trainer.steps=2", "trainer.warmup.steps=1",
                 "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                 "logging.progress=false"]
    planned = json.loads(subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "plan", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), "--json", *overrides],
        check=True, capture_output=True, text=True).stdout)
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config",
                          str(ROOT / "configs" / "tiny_cpu.yaml"), *overrides,
                          f"cluster.ray_address={c.address}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    placed = json.loads((tmp_path / "run" / "plan.json").read_text())
    node_label = {n["node"]: labels[n["node_id"]] for n in placed["ray_nodes"]}
    assert sorted(node_label.values()) == ["a", "b"]   # plan node i: a Ray node of its own
    address = {n["node"]: n["address"] for n in placed["ray_nodes"]}
    records = [json.loads(p.read_text()) for p in sorted(shim_dir.glob("server_*.json"))]
    assert len(records) == 2   # one start each, no restart
    assert len({r["argv"][r["argv"].index("--port") + 1] for r in records}) == 2
    engines = [p for p in placed["processes"] if p["role"] == "engine"]
    offline = [p for p in planned["processes"] if p["role"] == "engine"]
    trainers = [p for p in placed["processes"] if p["role"] == "trainer"]
    assert [(p["node"], p["gpus"]) for p in trainers] == [(0, [0]), (0, [1])]
    assert [(p["node"], p["gpus"]) for p in engines] == [(0, [2, 3]), (1, [0, 1])]
    used = {(p["node"], g) for p in trainers for g in p["gpus"]}
    for e, off in zip(engines, offline):
        rec = next(r for r in records if r["argv"][r["argv"].index("--port") + 1]
                   == str(e["port"]))
        assert rec["node_label"] == node_label[e["node"]]              # on its planned node
        assert (e["node"], e["gpus"]) == (off["node"], off["gpus"])     # as `moe-rl plan` says
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, e["gpus"]))
        assert rec["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
        assert rec["argv"] == e["argv"][1:]                             # the planned argv
        assert e["host"] == address[e["node"]] and not e["host"].startswith("127.")
        argv = rec["argv"]
        assert argv[argv.index("--host") + 1] == e["host"]
        assert argv[argv.index("--base-gpu-id") + 1] == "0"
        # the offline plan differs only in the node address placeholder and the port taken
        norm = [a for a in off["argv"][1:] if a not in (off["host"], str(off["port"]))]
        assert norm == [a for a in argv if a not in (e["host"], str(e["port"]))]
        gpus = {(e["node"], g) for g in e["gpus"]}
        assert not gpus & used                                          # disjoint
        used |= gpus
