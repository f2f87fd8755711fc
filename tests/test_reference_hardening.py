"""Hostile and careless input to the reference engine: one request, one file or one body never
hurts another request or the served weights (real server on 127.0.0.1)."""
import concurrent.futures
import os
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.rollout.reference_process import ServerProcess
from moe_rl.trainer.parallel import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("hard") / "model")
    write_tiny_model(ModelInitConfig(seed=7, max_position_embeddings=64), model)
    proc = ServerProcess(model, free_port()).start()
    yield proc, model
    proc.stop()


def _gen(url, body):
    if isinstance(body, bytes):   # raw JSON text (NaN is valid to Python's parser, not httpx's)
        return httpx.post(url + "/generate", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_one_bad_request_in_a_batch_fails_only_itself(served):
    proc, _ = served
    good = {"input_ids": [6, 7, 68], "sampling_params": {"max_new_tokens": 3,
                                                          "sampling_seed": 1}}
    bad = [b'{"input_ids": [6, 7], "sampling_params": {"temperature": NaN}}',
           {"input_ids": [6, 7], "sampling_params": {"sampling_seed": 2 ** 70}}]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_gen, proc.url, good) for _ in range(6)]
        futures += [pool.submit(_gen, proc.url, b) for b in bad]
        codes = [f.result().status_code for f in futures]
    assert codes[:6] == [200] * 6
    assert codes[6:] == [400, 400]


def test_non_finite_and_out_of_range_fields_are_named():
    from moe_rl.rollout.reference_engine import RequestError, parse_sampling_params
    for raw, field in (({"temperature": float("nan")}, "temperature"),
                       ({"top_p": float("inf")}, "top_p"),
                       ({"sampling_seed": 2 ** 70}, "sampling_seed"),
                       ({"sampling_seed": -1}, "sampling_seed")):
        with pytest.raises(RequestError, match=field):
            parse_sampling_params(raw, 4096, False)


def test_context_is_capped_naming_both_lengths(served):
    proc, _ = served
    r = _gen(proc.url, {"input_ids": [6] * 10, "sampling_params": {"max_new_tokens": 100,
                                                                    "ignore_eos": True}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "10 tokens" in msg and "max_new_tokens 100" in msg and "(64)" in msg


def test_weight_updates_are_atomic_and_local(served, tmp_path):
    proc, model = served
    body = {"input_ids": [6, 7, 68], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3},
            "return_logprob": True}
    before = _gen(proc.url, body).json()
    # a checkpoint missing one tensor is refused and the served weights stay
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop(sorted(tensors)[3])
    save_file(tensors, str(broken / "model.safetensors"))
    r = httpx.post(proc.url + "/update_weights_from_disk", timeout=60,
                   json={"model_path": str(broken), "weight_version": "9"})
    assert r.status_code == 400 and str(broken) in r.json()["message"]
    after = _gen(proc.url, body).json()
    assert after["meta_info"]["output_token_logprobs"] == \
        before["meta_info"]["output_token_logprobs"]
    assert httpx.get(proc.url + "/get_weight_version", timeout=5).json()["weight_version"] != "9"
    # a hub id is never downloaded; a non-JSON body is a 400, not a 500
    r = httpx.post(proc.url + "/update_weights_from_disk", timeout=60,
                   json={"model_path": "Qwen/Qwen3-30B-A3B"})
    assert r.status_code == 400 and "local directory" in r.json()["message"]
    r = httpx.post(proc.url + "/update_weights_from_disk", timeout=10, content=b"\xff not json")
    assert r.status_code == 400
    assert os.path.isdir(model)


def test_group_setup_cannot_take_rank_zero(served):
    proc, _ = served
    r = httpx.post(proc.url + "/init_weights_update_group", timeout=10, json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 0,
        "world_size": 2, "group_name": "g", "backend": "gloo"})
    assert r.status_code == 400 and "rank_offset" in r.json()["message"]
