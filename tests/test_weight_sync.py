"""Weight sync over a process group (gloo on CPU) into the reference engine, and memory release
for colocated training, over real HTTP."""
import json
import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file

from moe_rl.config import ModelInitConfig, moe_facts_from_hf
from moe_rl.models.tiny import write_tiny_model
from moe_rl.rollout.decode import ModelLayout
from moe_rl.rollout.engine import HTTPRolloutEngine, SamplingConfig
from moe_rl.rollout.pool import EngineHTTPError, ServerPool
from moe_rl.rollout.reference_process import ServerProcess
from moe_rl.trainer.parallel import free_port
from moe_rl.weight_sync import broadcast_tensors, open_group, parse_dtype, update_request


@pytest.mark.multiproc
def test_broadcast_update_and_memory_release(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_tiny_model(ModelInitConfig(seed=1), a)
    write_tiny_model(ModelInitConfig(seed=2), b)
    facts = moe_facts_from_hf(json.load(open(f"{a}/config.json")))
    layout = ModelLayout(facts.num_layers, facts.moe_layers, facts.topk, facts.num_experts)
    procs = [ServerProcess(a, free_port()).start() for _ in range(2)]
    ref = ServerProcess(b, free_port()).start()   # serves b's weights from disk: the target
    try:
        eng = HTTPRolloutEngine(lambda: ServerPool([p.url for p in procs], max_retries=0),
                                layout, need_routing=True, need_mask=False)
        port = free_port()
        joined = {}
        t = threading.Thread(target=lambda: joined.update(
            group=open_group("gloo", "127.0.0.1", port, 0, 3, "w")))
        t.start()
        res = eng.init_weights_update_group("127.0.0.1", port, 1, "w", "gloo")
        t.join(60)
        assert all(r["success"] for r in res) and "group" in joined
        named = sorted(load_file(f"{b}/model.safetensors").items())
        body = update_request(named, 5, "w")
        sender = threading.Thread(target=broadcast_tensors, args=(joined["group"], named))
        sender.start()
        eng.update_weights_from_distributed(body)
        sender.join(60)
        assert eng.weight_versions() == ["5", "5"]
        prompt = [[6, 7, 68, 12, 72]]
        got = eng.generate(prompt, 1, SamplingConfig(max_new_tokens=4), seed=3)[0]
        want = HTTPRolloutEngine(lambda: ServerPool([ref.url]), layout, need_routing=True,
                                 need_mask=False).generate(prompt, 1,
                                                           SamplingConfig(max_new_tokens=4),
                                                           seed=3)[0]
        assert got.response_ids.tolist() == want.response_ids.tolist()
        assert torch.equal(got.rollout_logprobs, want.rollout_logprobs)
        assert got.weight_version == 5
        # colocated: released servers refuse generation, resumed ones serve the same weights
        eng.release_memory()
        r = httpx.post(procs[0].url + "/generate", json={"input_ids": [6, 7]}, timeout=30)
        assert r.status_code == 400 and "released" in r.json()["error"]
        eng.resume_memory()
        again = eng.generate(prompt, 1, SamplingConfig(max_new_tokens=4), seed=3)[0]
        assert torch.equal(again.rollout_logprobs, want.rollout_logprobs)
        # bad update bodies are refused with the field named
        with pytest.raises(EngineHTTPError, match="group_name"):
            eng.update_weights_from_distributed({**body, "group_name": "nope"})
    finally:
        for p in procs + [ref]:
            p.stop()


def test_request_bodies():
    named = [("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("y", torch.zeros(4))]
    body = update_request(named, 7, "g")
    assert body == {"names": ["x", "y"], "dtypes": ["bfloat16", "float32"],
                    "shapes": [[2, 3], [4]], "group_name": "g", "flush_cache": True,
                    "weight_version": "7"}
    assert parse_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtypes"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="backend"):
        open_group("mpi", "127.0.0.1", free_port(), 0, 1, "g")


def test_tensor_update_body_is_sglangs_serialisation():
    import base64
    import pickle
    from moe_rl.weight_sync import tensor_update_request
    named = [("model.norm.weight", torch.arange(4.0))]
    body = tensor_update_request(named, tp_size=2, version=3)
    assert body["weight_version"] == "3" and body["flush_cache"] is True
    assert len(body["serialized_named_tensors"]) == 2
    # bytes produced in this process (what SGLang's MultiprocessingSerializer.deserialize reads)
    back = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
    assert back[0][0] == "model.norm.weight" and torch.equal(back[0][1], named[0][1])


def test_tensor_sync_config_requirements():
    from moe_rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="cluster.weight_sync"):
        load_config(None, ["cluster.weight_sync=tensor"])
    cfg = load_config(None, ["cluster.weight_sync=tensor", "cluster.colocate=true",
                             "rollout.engine=sglang", "cluster.gpus_per_node=8"])
    assert cfg.cluster.weight_sync == "tensor"
