"""The placement plan: hand-worked layouts, refusals naming the keys, and `moe-rl plan`."""
import json
import pathlib
import subprocess
import sys

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.orchestration.placement import make_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU = ["rollout.engine=sglang", "cluster.gpus_per_node=8"]


def _layout(plan, role):
    return [(p.node, p.gpus) for p in plan.of(role)]


def test_qwen3_config_puts_engines_on_their_own_nodes():
    plan = make_plan(load_config(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"))
    assert _layout(plan, "trainer") == [(r // 8, [r % 8]) for r in range(16)]
    assert _layout(plan, "engine") == [(2, [0, 1, 2, 3]), (2, [4, 5, 6, 7]),
                                       (3, [0, 1, 2, 3]), (3, [4, 5, 6, 7])]
    e = plan.of("engine")[1]
    assert e.env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and "--base-gpu-id" in e.argv
    assert e.host == "<node 2 address>" and e.port == 30001     # second server of node 2
    g = plan.weight_update_group
    assert g["backend"] == "nccl" and g["world_size"] == 17
    assert g["ranks"][0] == {"rank": 0, "process": "trainer 0", "node": 0, "gpu": 0}
    assert g["ranks"][5] == {"rank": 5, "process": "engine 1 tp 0", "node": 2, "gpu": 4}
    assert plan.node_resources()[2]["GPU"] == 8.0


def test_servers_never_straddle_nodes_and_colocated_ones_share_trainer_gpus():
    # 3 trainer GPUs, then servers of 4 GPUs: the first would straddle node 0 -> node 1
    plan = make_plan(load_config(None, GPU + ["cluster.num_nodes=3", "cluster.trainer_workers=3",
                                              "rollout.num_servers=2",
                                              "rollout.sglang.tp_size=4"]))
    assert _layout(plan, "engine") == [(0, [3, 4, 5, 6]), (1, [0, 1, 2, 3])]
    plan = make_plan(load_config(None, GPU + ["cluster.num_nodes=1", "cluster.trainer_workers=2",
                                              "rollout.num_servers=2",
                                              "rollout.sglang.tp_size=3"]))
    assert _layout(plan, "engine") == [(0, [2, 3, 4]), (0, [5, 6, 7])]
    col = make_plan(load_config(None, GPU + ["cluster.colocate=true", "cluster.trainer_workers=4",
                                             "rollout.num_servers=2",
                                             "rollout.sglang.tp_size=2",
                                             "cluster.weight_sync=tensor"]))
    assert _layout(col, "engine") == [(0, [0, 1]), (0, [2, 3])]
    assert "--enable-memory-saver" in col.of("engine")[0].argv
    assert col.weight_update_group is None


def test_plans_that_do_not_fit_are_refused_naming_the_keys():
    with pytest.raises(ConfigError, match="rollout.num_servers.*cluster.num_nodes"):
        make_plan(load_config(None, GPU + ["cluster.trainer_workers=8", "rollout.num_servers=1"]))
    with pytest.raises(ConfigError, match="rollout.sglang.tp_size"):
        make_plan(load_config(None, GPU + ["rollout.sglang.tp_size=16"]))
    with pytest.raises(ConfigError, match="cluster.trainer_workers"):
        make_plan(load_config(None, GPU + ["cluster.trainer_workers=9",
                                           "rollout.prompts_per_step=9"]))
    with pytest.raises(ConfigError, match="cluster.colocate"):
        make_plan(load_config(None, GPU + ["cluster.colocate=true", "rollout.num_servers=2"]))


def test_cpu_runs_spread_over_nodes_and_bind_node_addresses():
    plan = make_plan(load_config(None, ["cluster.num_nodes=2", "cluster.trainer_workers=2",
                                        "rollout.num_servers=2",
                                        "rollout.prompts_per_step=8"]),
                     node_addresses=["10.0.0.1", "10.0.0.2"])
    assert _layout(plan, "trainer") == [(0, []), (1, [])]
    assert [(e.node, e.host) for e in plan.of("engine")] == [(0, "10.0.0.1"), (1, "10.0.0.2")]
    assert plan.weight_update_group is None
    single = make_plan(load_config(None, []), node_addresses=["10.0.0.1"])
    assert single.of("engine")[0].host == "127.0.0.1"     # one node: rollout.servers.host as given
    assert single.of("engine")[0].argv[3] == "serve-reference"


def test_moe_rl_plan_prints_json_and_refuses_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--config",
                          str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"), "--no-inputs",
                          "--json"], capture_output=True, text=True, check=True).stdout
    tree = json.loads(out)
    assert {p["role"] for p in tree["processes"]} == {"trainer", "engine", "rollout"}
    assert all({"role", "node", "gpus", "argv", "env"} <= set(p) for p in tree["processes"])
    text = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--no-inputs",
                           "--nodes", "1", "--gpus-per-node", "4", "rollout.engine=sglang",
                           "rollout.sglang.tp_size=2"], capture_output=True, text=True,
                          check=True).stdout
    assert "engine 0   node 0  gpus 1,2" in text
    bad = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--no-inputs",
                          "--gpus-per-node", "2", "rollout.engine=sglang",
                          "rollout.sglang.tp_size=2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "rollout.num_servers" in bad.stderr \
        and "Traceback" not in bad.stderr


def test_dp_attention_servers_on_one_node_get_port_ranges_that_do_not_overlap():
    """SGLang 0.5.23 under --enable-dp-attention on one node binds its port and port+233 ..
    port+239 (server_args.py:728,818-846): servers of one node spaced by 1 collide there; they
    are spaced by 240. Without DP attention the spacing stays 1."""
    dp = ["cluster.num_nodes=1", "cluster.trainer_workers=2", "rollout.num_servers=3",
          "rollout.sglang.tp_size=2", "rollout.servers.base_port=30000"]
    plan = make_plan(load_config(None, GPU + dp + [
        "rollout.sglang.extra_args=[--enable-dp-attention]", "rollout.sglang.dp_size=2"]))
    ports = [p.port for p in plan.processes if p.role == "engine"]
    assert ports == [30000, 30240, 30480]
    bound = [set([p, *range(p + 233, p + 240)]) for p in ports]
    assert all(not (bound[i] & bound[j]) for i in range(3) for j in range(i + 1, 3))
    plain = make_plan(load_config(None, GPU + dp))
    assert [p.port for p in plain.processes if p.role == "engine"] == [30000, 30001, 30002]
