"""Hostile input, round 2, against the reference engine's server (real process on 127.0.0.1):
weight-update sessions that cannot mix, announced tensors checked before allocation, admission
limits that keep /health quick, bounded group setup, disk updates that drain running requests,
one FP8 block layout, and a model the engine cannot run refused at start."""
import concurrent.futures
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port
from moe_rl.engines.sglang.weights import broadcast_tensors, close_group, open_group, update_request

pytestmark = pytest.mark.e2e

GROUP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    a, b = str(root / "a"), str(root / "b")
    write_tiny_model(ModelInitConfig(seed=1, max_position_embeddings=8192), a)
    write_tiny_model(ModelInitConfig(seed=2, max_position_embeddings=8192), b)
    return a, b


@pytest.fixture(scope="module")
def served(models):
    proc = ReferenceServer(models[0], free_port(), extra_args=(
        "--weight-group-timeout", str(GROUP_TIMEOUT_S), "--max-n", "64",
        "--max-batch-requests", "4096", "--max-request-tokens", str(8 << 20),
        "--max-request-bytes", str(8 << 20), "--max-running-requests", "4",
        "--enable-deterministic-inference")).start()
    yield proc
    proc.stop()


def _post(url, path, body, timeout=60):
    return httpx.post(url + path, json=body, timeout=timeout)


def _generate(url, seed=3, tokens=4):
    r = _post(url, "/generate", {"input_ids": [6, 7, 68, 12], "return_logprob": True,
                                 "sampling_params": {"max_new_tokens": tokens,
                                                     "sampling_seed": seed}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture()
def group(served):
    """A weight-update group between this process (rank 0) and the server."""
    port = free_port()
    joined = {}
    t = threading.Thread(target=lambda: joined.update(
        g=open_group("gloo", "127.0.0.1", port, 0, 2, "hostile", timeout_s=30)))
    t.start()
    r = _post(served.url, "/init_weights_update_group",
              {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
               "world_size": 2, "group_name": "hostile", "backend": "gloo"})
    t.join(30)
    assert r.status_code == 200, r.text
    yield joined["g"]
    _post(served.url, "/destroy_weights_update_group", {"group_name": "hostile"})
    close_group(joined["g"])


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_end_during_a_receive_waits_and_a_commit_takes_one_session_only(served, models, group):
    """The probe's sequence: /end_weight_update while bucket 1 is being received, then a new
    session that sends only the last bucket. End waits for the receive and drops the bucket;
    the new session cannot commit a set assembled from two sessions."""
    before = _generate(served.url)
    named = sorted(load_file(f"{models[1]}/model.safetensors").items())
    half = len(named) // 2
    assert _post(served.url, "/begin_weight_update", {}).status_code == 200
    answers, times = {}, {}

    def bucket_one():
        answers["bucket"] = _post(served.url, "/update_weights_from_distributed",
                                  update_request(named[:half], 7, "hostile", flush_cache=False))
    sender = threading.Thread(target=bucket_one)
    sender.start()
    time.sleep(1.0)   # the server is receiving: rank 0 has not sent yet

    def end():
        answers["end"] = _post(served.url, "/end_weight_update", {})
        times["end"] = time.monotonic()
    ender = threading.Thread(target=end)
    ender.start()
    time.sleep(1.0)
    assert "end" not in answers   # end waits for the receive
    times["sent"] = time.monotonic()
    broadcast_tensors(group, named[:half])
    sender.join(30)
    ender.join(30)
    assert answers["bucket"].status_code == 200, answers["bucket"].text
    assert times["end"] >= times["sent"]
    assert answers["end"].status_code == 400 and "never came" in answers["end"].text
    # a bucket for the closed session is refused before anything is received
    late = _post(served.url, "/update_weights_from_distributed",
                 update_request(named[half:], 7, "hostile", flush_cache=True), timeout=10)
    assert late.status_code == 400 and "outside a weight-update session" in late.text
    # a new session starts empty: its last bucket alone is not a complete update
    assert _post(served.url, "/begin_weight_update", {}).status_code == 200
    sender = threading.Thread(target=broadcast_tensors, args=(group, named[half:]))
    sender.start()
    last = _post(served.url, "/update_weights_from_distributed",
                 update_request(named[half:], 7, "hostile", flush_cache=True))
    sender.join(30)
    assert last.status_code == 400 and "missing" in last.text
    assert _post(served.url, "/end_weight_update", {}).status_code == 200
    after = _generate(served.url)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == \
        before["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("field,value,named", [
    ("shapes", [[10 ** 7, 10 ** 7]], "announced [10000000, 10000000]"),
    ("names", ["model.no_such.weight"], "'model.no_such.weight' is not a tensor"),
    ("dtypes", ["float64"], "announced 'float64'"),
    ("shapes", [[-1, 64]], "announced [-1, 64]"),
])
def test_announced_tensors_are_checked_before_any_allocation(served, models, group, field,
                                                             value, named):
    first = sorted(load_file(f"{models[0]}/model.safetensors").items())[:1]
    body = update_request(first, 1, "hostile", flush_cache=True)
    body[field] = value
    assert _post(served.url, "/begin_weight_update", {}).status_code == 200
    try:
        t0 = time.monotonic()
        r = _post(served.url, "/update_weights_from_distributed", body, timeout=10)
    finally:
        _post(served.url, "/end_weight_update", {})
    assert time.monotonic() - t0 < 5
    assert r.status_code == 400 and named in r.json()["message"], r.text


def test_group_fields_are_typed(served):
    for field, value in (("master_port", "abc"), ("world_size", 2.5), ("rank_offset", None),
                         ("master_port", 70000), ("group_name", 3)):
        body = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
                "world_size": 2, field: value}
        r = _post(served.url, "/init_weights_update_group", body, timeout=10)
        assert r.status_code == 400 and field in r.json()["message"], (field, r.text)


@pytest.mark.parametrize("peer", ["store_without_rank0", "silent_socket"])
def test_group_setup_is_bounded_by_its_timeout(served, peer):
    """An /init_weights_update_group nobody answers (a store with no rank 0; a port that accepts
    and never answers, on which torch's store client waits forever) holds the setup lock until
    the group timeout, not longer; a real setup goes through right after."""
    import socket
    from torch.distributed import TCPStore
    if peer == "silent_socket":
        store = socket.socket()
        store.bind(("127.0.0.1", 0))
        store.listen(16)
        port = store.getsockname()[1]
    else:
        port = free_port()
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": "stranger", "backend": "gloo"}
    out = {}

    def stranger():
        t0 = time.monotonic()
        out["r"] = _post(served.url, "/init_weights_update_group", body)
        out["s"] = time.monotonic() - t0
    t = threading.Thread(target=stranger)
    t.start()
    time.sleep(0.5)
    busy = _post(served.url, "/init_weights_update_group", {**body, "group_name": "other"})
    assert busy.status_code == 400 and "in progress" in busy.text
    t.join(60)
    assert out["r"].status_code == 400 and "could not join" in out["r"].text
    assert out["s"] < GROUP_TIMEOUT_S + 1.5, out["s"]
    port = free_port()   # the lock is free: the trainer's setup is accepted at once
    joined = {}
    t = threading.Thread(target=lambda: joined.update(
        g=open_group("gloo", "127.0.0.1", port, 0, 2, "after", timeout_s=30)))
    t.start()
    r = _post(served.url, "/init_weights_update_group",
              {**body, "master_port": port, "group_name": "after"})
    t.join(30)
    assert r.status_code == 200, r.text
    _post(served.url, "/destroy_weights_update_group", {"group_name": "after"})
    close_group(joined["g"])
    if peer == "silent_socket":
        store.close()


def _health_latencies(url, stop: threading.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        out.append(time.monotonic() - t0)
        time.sleep(0.05)
    return out


def test_a_huge_n_is_refused_at_once_and_health_stays_quick(served):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stop = threading.Event()
        lat = pool.submit(_health_latencies, served.url, stop)
        r = _post(served.url, "/generate", {"input_ids": [6, 7],
                                            "sampling_params": {"n": 1_000_000}})
        stop.set()
        assert max(lat.result()) < 1.0
    assert r.status_code == 400 and "sampling_params.n" in r.text and "--max-n" in r.text
    for body, limit in (
            ({"input_ids": [[6, 7]] * 100, "sampling_params": {"n": 64}}, "--max-batch-requests"),
            ({"input_ids": [[6] * 10] * 20, "sampling_params": {"n": 64, "max_new_tokens": 8000}},
             "--max-request-tokens")):
        r = _post(served.url, "/generate", body)
        assert r.status_code == 400 and limit in r.text, r.text
    big = httpx.post(served.url + "/generate", content=b"[" + b"1," * (5 << 20) + b"1]",
                     headers={"content-type": "application/json"}, timeout=60)
    assert big.status_code == 400 and "--max-request-bytes" in big.text


def test_health_answers_while_the_largest_admitted_request_is_taken(served):
    """A call at every limit (~8 MB of input ids, 4096 sub-requests) is admitted (its
    sub-requests queue) while /health keeps answering; the call is then abandoned (its
    connection closed as soon as the server shows it queued: no fixed wait, which a slower
    machine or a traced server outlasts)."""
    import socket
    import urllib.parse
    ids = [6 + (i % 60) for i in range(1900)]
    body = json.dumps({"input_ids": [ids] * 1024,
                       "sampling_params": {"n": 4, "max_new_tokens": 1}}).encode()
    assert len(body) < 8 << 20
    where = urllib.parse.urlsplit(served.url)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lat = pool.submit(_health_latencies, served.url, stop)
        time.sleep(0.2)
        call = socket.create_connection((where.hostname, where.port))
        call.sendall(b"POST /generate HTTP/1.1\r\nHost: %s\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n" % (where.netloc.encode(), len(body))
                     + body)
        queued = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not queued:
            state = httpx.get(served.url + "/get_server_info", timeout=30).json()
            queued = state["internal_states"][0]["num_waiting_reqs"] + \
                state["internal_states"][0]["num_running_reqs"]
            time.sleep(0.1)
        call.close()   # abandoned
        stop.set()
        assert len(lat.result()) > 1   # every /health during the call answered 200
    assert queued > 0   # the call was admitted (its sub-requests queued)


def test_a_call_is_parsed_off_the_event_loop(models, monkeypatch):
    """/health answers while a /generate body is still being parsed (no clock involved: the
    parse waits until /health has answered; a parse on the event loop would wait in vain)."""
    from fastapi.testclient import TestClient
    from moe_rl.engines.reference import server
    from moe_rl.engines.reference.engine import ReferenceEngine
    parsing, health_answered, seen = threading.Event(), threading.Event(), []

    def parse_after_health(raw):
        parsing.set()
        seen.append(health_answered.wait(20))
        return json.loads(raw)
    monkeypatch.setattr(server, "_read_json", parse_after_health)
    app = server.build_app(ReferenceEngine(models[0]))
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.post, "/generate", json={
            "input_ids": [6, 7, 68], "sampling_params": {"max_new_tokens": 1}})
        assert parsing.wait(60)
        assert client.get("/health").status_code == 200
        health_answered.set()
        assert call.result().status_code == 200
    assert seen == [True]


def test_a_bad_item_in_a_batch_fails_that_request_only(served):
    good = {"input_ids": [6, 7, 68], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1}}
    bad = [{"input_ids": [[6, 7], [8, 9]], "return_logprob": True,
            "token_ids_logprob": [[6, 7], 5]},
           {"input_ids": [[6, 7], [8, 9]], "return_logprob": True,
            "token_ids_logprob": [[6, 7], [10 ** 9]]},
           {"input_ids": [[6, 7], [8, "x"]]}]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_post, served.url, "/generate", good) for _ in range(200)]
        bad_f = [pool.submit(_post, served.url, "/generate", b) for b in bad]
        codes = [f.result().status_code for f in futures]
        bad_answers = [f.result() for f in bad_f]
    assert codes == [200] * 200
    assert [r.status_code for r in bad_answers] == [400, 400, 400]
    assert "token_ids_logprob[1]" in bad_answers[0].text
    assert "input_ids" in bad_answers[2].text


@pytest.mark.parametrize("path", ["/generate", "/init_weights_update_group"])
def test_unreadable_bodies_are_a_400_naming_the_body(served, path):
    """Not JSON, or nested 200,000 deep (a RecursionError in the parser): 400 in SGLang's
    ErrorResponse shape naming the body; the server serves on."""
    deep = b"[" * 200_000 + b"]" * 200_000
    for raw, named in ((b"{input_ids: [1,", "body: not valid JSON"),
                       (deep, "body: JSON nested too deeply to read"),
                       (b'{"input_ids": [5], "sampling_params": ' + deep + b"}",
                        "body: JSON nested too deeply to read")):
        r = httpx.post(served.url + path, content=raw, timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert r.json() == {"object": "error", "message": named, "type": "Bad Request",
                            "param": None, "code": 400}
    _generate(served.url)


def test_a_disk_update_waits_for_running_requests(served, models):
    """No answer mixes two weight versions: requests running when /update_weights_from_disk
    arrives finish on the old weights (deterministic inference: the same tokens as alone), the
    update lands after them, and later requests see the new weights."""
    body = {"input_ids": [6, 7, 68, 12], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    bodies = [{**body, "sampling_params": {**body["sampling_params"], "sampling_seed": s}}
              for s in range(6)]
    alone = [_post(served.url, "/generate", b).json() for b in bodies]
    version = alone[0]["meta_info"]["weight_version"]
    done = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        def run(b):
            r = _post(served.url, "/generate", b).json()
            done.setdefault("last", time.monotonic())
            done["last"] = max(done["last"], time.monotonic())
            return r
        running = [pool.submit(run, b) for b in bodies]
        time.sleep(0.3)
        upd = _post(served.url, "/update_weights_from_disk",
                    {"model_path": models[1], "weight_version": "disk-b"})
        updated_at = time.monotonic()
        answers = [f.result() for f in running]
    assert upd.status_code == 200, upd.text
    assert updated_at >= done["last"]
    for got, want in zip(answers, alone):
        assert got["meta_info"]["weight_version"] == version
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == \
            want["meta_info"]["output_token_logprobs"]
    later = _post(served.url, "/generate", bodies[0]).json()
    assert later["meta_info"]["weight_version"] == "disk-b"
    assert later["meta_info"]["output_token_logprobs"] != \
        alone[0]["meta_info"]["output_token_logprobs"]
    back = _post(served.url, "/update_weights_from_disk",
                 {"model_path": models[0], "weight_version": version})
    assert back.status_code == 200


def test_online_fp8_and_the_fp8_checkpoint_serve_the_same(tmp_path):
    """One block layout on both FP8 paths: the experts' gate and up projections (fused in the
    model, 64 rows each here, not a multiple of 128) are cut into blocks per HF weight."""
    from moe_rl.weights.fp8 import write_fp8_checkpoint
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=4), model)
    fp8 = write_fp8_checkpoint(model, str(tmp_path / "fp8"))
    reqs = [Request([6, 7, 68 + i], SamplingParams(max_new_tokens=6, sampling_seed=i), f"r{i}",
                    return_logprob=True) for i in range(8)]
    online = ReferenceEngine(model, quantization="fp8").run(reqs)
    served = ReferenceEngine(fp8).run(reqs)
    for a, b in zip(online, served):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_a_model_the_engine_cannot_run_is_refused_at_start(tmp_path):
    """An expert size of 33 (its grouped matmul needs 16-byte strides): refused when the
    server starts, in one line, exit 2; not a server whose every answer is a 500."""
    model = str(tmp_path / "odd")
    write_tiny_model(ModelInitConfig(seed=1, moe_intermediate_size=33), model)
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "serve-reference", "--model",
                          model, "--port", str(free_port())], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "cannot run this model" in res.stderr and model in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.startswith("moe-rl")]) == 1


def test_a_sender_that_vanishes_mid_update_gets_a_json_400(served, models):
    """Rank 0 leaves the group while the server waits for its broadcast: a JSON 400 with
    success false (as SGLang answers a failed update), never a plain-text 500; the served
    weights are unchanged and the server goes on serving."""
    before = _generate(served.url)
    port = free_port()
    joined = {}
    t = threading.Thread(target=lambda: joined.update(
        g=open_group("gloo", "127.0.0.1", port, 0, 2, "vanishing", timeout_s=30)))
    t.start()
    assert _post(served.url, "/init_weights_update_group",
                 {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                  "world_size": 2, "group_name": "vanishing", "backend": "gloo"}
                 ).status_code == 200
    t.join(30)
    named = sorted(load_file(f"{models[1]}/model.safetensors").items())
    assert _post(served.url, "/begin_weight_update", {}).status_code == 200
    answers = {}
    receiver = threading.Thread(target=lambda: answers.update(r=_post(
        served.url, "/update_weights_from_distributed",
        update_request(named, 8, "vanishing", flush_cache=True), timeout=120)))
    receiver.start()
    time.sleep(1.0)   # the server waits in the broadcast
    close_group(joined["g"])   # the sender goes away without sending
    receiver.join(120)
    r = answers["r"]
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and "the broadcast failed" in r.json()["message"]
    assert "the served weights are unchanged" in r.json()["message"]
    _post(served.url, "/end_weight_update", {})
    _post(served.url, "/destroy_weights_update_group", {"group_name": "vanishing"})
    after = _generate(served.url)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
