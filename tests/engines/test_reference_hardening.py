"""Hostile and careless input to the reference engine: one request, one file or one body never
hurts another request or the served weights (real server on 127.0.0.1)."""
import concurrent.futures
import json
import os
import shutil
import socket
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("hard") / "model")
    write_tiny_model(ModelInitConfig(seed=7, max_position_embeddings=8192), model)
    proc = ReferenceServer(model, free_port(), max_total_tokens=6000).start()
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
    from moe_rl.engines.reference.engine import RequestError, parse_sampling_params
    for raw, field in (({"temperature": float("nan")}, "temperature"),
                       ({"top_p": float("inf")}, "top_p"),
                       ({"sampling_seed": 2 ** 70}, "sampling_seed"),
                       ({"sampling_seed": -1}, "sampling_seed")):
        with pytest.raises(RequestError, match=field):
            parse_sampling_params(raw, 4096, False)


def test_context_is_capped_naming_both_lengths(served):
    proc, _ = served
    r = _gen(proc.url, {"input_ids": [6] * 10, "sampling_params": {"max_new_tokens": 9000,
                                                                    "ignore_eos": True}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "10 tokens" in msg and "max_new_tokens 9000" in msg and "(8192)" in msg


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
    assert httpx.get(proc.url + "/get_model_info", timeout=5).json()["weight_version"] != "9"
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


def _engine_state(url):
    return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]


def _wait_state(url, want: dict, timeout=20.0):
    """Poll /get_server_info until its counts equal ``want`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _engine_state(url)
        if all(state[k] == v for k, v in want.items()):
            return state
        time.sleep(0.05)
    raise AssertionError(f"server state {state} never reached {want}")


def _open_long_request(url, max_new_tokens=4000):
    """A long /generate sent on a raw socket, so the test can hang up on it."""
    host, port = url.rsplit("//", 1)[1].split(":")
    body = json.dumps({"input_ids": [6, 7, 8], "sampling_params": {
        "max_new_tokens": max_new_tokens, "ignore_eos": True}}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_continuous_batching_admission_and_client_gone(served):
    """A short request finishes while a long one runs; the token budget queues the next long one;
    hanging up stops a request's work; one needing more than the budget is refused."""
    proc, _ = served
    a = _open_long_request(proc.url)
    _wait_state(proc.url, {"num_running_reqs": 1})
    short = _gen(proc.url, {"input_ids": [6, 7], "sampling_params": {"max_new_tokens": 2,
                                                                      "ignore_eos": True}})
    assert short.status_code == 200 and len(short.json()["output_ids"]) == 2
    assert _engine_state(proc.url)["num_running_reqs"] == 1   # the long one still runs
    b = _open_long_request(proc.url)   # 2 x 4003 tokens > the budget of 6000: B waits
    _wait_state(proc.url, {"num_running_reqs": 1, "num_waiting_reqs": 1})
    a.close()                          # client gone: A stops, B is admitted
    _wait_state(proc.url, {"num_running_reqs": 1, "num_waiting_reqs": 0})
    b.close()
    assert _wait_state(proc.url, {"num_running_reqs": 0})["tokens_in_flight"] == 0
    r = _gen(proc.url, {"input_ids": [6] * 10, "sampling_params": {"max_new_tokens": 7000,
                                                                    "ignore_eos": True}})
    assert r.status_code == 400 and "--max-total-tokens 6000" in r.json()["error"]["message"]


def test_rows_joining_mid_flight_get_what_they_get_alone(tmp_path):
    """Continuous batching changes no result: requests that join a running batch at different
    iterations produce the tokens, log-probs and routing they produce alone."""
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=3), model)
    engine = ReferenceEngine(model)

    def req(k):
        return Request(input_ids=[6, 7, 8, 9, 10][:k + 2], rid=f"r{k}",
                       params=SamplingParams(max_new_tokens=5 + 2 * k, sampling_seed=k, top_k=20,
                                             ignore_eos=True),
                       return_logprob=True, return_routed_experts=True,
                       return_sampling_mask=True)
    alone = [engine.run([req(k)])[0] for k in range(4)]
    got = dict(engine.step([(req(0), 0)]))
    got.update(engine.step([(req(1), 1)]))
    got.update(engine.step([]))
    got.update(engine.step([(req(2), 2), (req(3), 3)]))
    while engine.running:
        got.update(engine.step([]))
    assert engine.tokens_in_flight() == 0
    for k in range(4):
        a, b = alone[k], got[k]
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["routed_experts"] == b["meta_info"]["routed_experts"]
        assert a["meta_info"]["output_token_sampling_mask"] == \
            b["meta_info"]["output_token_sampling_mask"]
        for (x, _, _), (y, _, _) in zip(a["meta_info"]["output_token_logprobs"],
                                        b["meta_info"]["output_token_logprobs"]):
            assert abs(x - y) < 1e-5


def test_deterministic_inference_is_batch_invariant_bit_for_bit(tmp_path):
    """--enable-deterministic-inference: a request's tokens, log-probs and routing are exactly
    those it gets alone, whatever joins it; without it, co-batching moves log-probs by rounding."""
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=5), model)

    def req(k):
        return Request(input_ids=[6, 7, 8, 9, 10, 11][:k + 2], rid=f"r{k}",
                       params=SamplingParams(max_new_tokens=6, sampling_seed=k, top_k=20,
                                             ignore_eos=True),
                       return_logprob=True, return_routed_experts=True)
    det = ReferenceEngine(model, deterministic_inference=True)
    alone = det.run([req(0)])[0]
    together = det.run([req(3), req(0), req(4)])[1]
    assert together["output_ids"] == alone["output_ids"]
    assert together["meta_info"]["output_token_logprobs"] == \
        alone["meta_info"]["output_token_logprobs"]
    assert together["meta_info"]["routed_experts"] == alone["meta_info"]["routed_experts"]


def test_batch_shapes_and_request_ids_must_agree(served):
    proc, _ = served
    for body, field in (({"input_ids": [[5, 6], 7]}, "input_ids"),
                        ({"input_ids": [[5, 6], [7], [8]], "rid": "x"}, "rid"),
                        ({"input_ids": [[5, 6], [7], [8]], "rid": ["a"]}, "rid"),
                        ({"input_ids": [5, 6], "rid": ["a", "b"]}, "rid"),
                        ({"input_ids": [5, 6], "rid": 7}, "rid")):
        r = _gen(proc.url, body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), body
    ok = _gen(proc.url, {"input_ids": [[5, 6], [7], [8]], "rid": ["a", "b", "c"],
                         "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in ok.json()] == ["a", "b", "c"]


def test_taken_ports_are_skipped_and_never_served_by_a_stranger(served):
    """A busy port is skipped when a server's port is chosen (and held); a server told to use a
    port another process holds refuses to start (naming the port) instead of trusting a
    stranger's /health."""
    from moe_rl.engines.process import bind_first_free, bind_port
    proc, model = served
    taken = proc.port   # the running server holds it (it answers /health 200)
    with bind_first_free("127.0.0.1", taken) as held:
        first = held.getsockname()[1]
        assert first > taken
        with bind_first_free("127.0.0.1", taken) as second:   # held: the next one free
            assert second.getsockname()[1] > first
    with pytest.raises(RuntimeError, match=f"server port {taken} on 127.0.0.1 is taken"):
        ReferenceServer(model, taken).start(timeout=30)
    with pytest.raises(RuntimeError, match="no free port from 65535 up"):
        with bind_port("127.0.0.1", 65535):
            bind_first_free("127.0.0.1", 65535)
