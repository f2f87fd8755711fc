"""The reference engine against the real SGLang (on CPU), request for request: the same bodies
to both servers on the same float32 model, their answers compared for status, keys, JSON types,
shapes and, greedy, values. SGLang is the judge: the reference engine may omit what SGLang sends
(moe_rl reads none of it) but never send a key, a type or a value SGLang would not. The kept
sets SGLang returns are checked against the trainer's rule on transformers' float32 logits of the
same tokens, at several temperature / top-k / top-p / min-p settings."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from moe_rl.config import ModelInitConfig, config_from_dict
from moe_rl.engines.factory import engine_kind
from moe_rl.engines.reference.engine import kept_set
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.engines.sglang.decode import decode_routing
from moe_rl.models.tiny import write_tiny_model
from moe_rl.families.shape import MoEShape
from moe_rl.trainer.parallel import free_port
from tests.helpers import engine_base_port, sglang_cpu_python

pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("differential")]   # its servers made once

MASKED = {"return_logprob": True, "return_routed_experts": True, "return_sampling_mask": True,
          "sampling_logprobs_mode": "selected"}
GREEDY = {"temperature": 0.0, "top_k": 8}

# name -> (method, path, body): what moe_rl sends, greedy where an answer is compared
REQUESTS = {
    "turn": ("POST", "/generate", {"input_ids": [5, 6, 7, 8], **MASKED,
                                   "sampling_params": {**GREEDY, "max_new_tokens": 5}}),
    "turn_plain": ("POST", "/generate", {"input_ids": [9, 10, 11], "return_logprob": True,
                                         "sampling_params": {"temperature": 0.0,
                                                             "max_new_tokens": 4}}),
    "turn_from_offset": ("POST", "/generate", {
        "input_ids": [5, 6, 7, 8, 9, 10], "return_logprob": True, "return_routed_experts": True,
        "routed_experts_start_len": 3, "sampling_params": {**GREEDY, "max_new_tokens": 3}}),
    "stop_token": ("POST", "/generate", {
        "input_ids": [5, 6, 7], "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [1]}}),
    "routing_refetch": ("POST", "/generate", {
        "input_ids": [5, 6, 7, 8, 20, 21], "sampling_params": {"max_new_tokens": 0},
        "return_routed_experts": True, "routed_experts_start_len": 2}),
    "score": ("POST", "/generate", {"input_ids": [5, 6, 7, 8, 9, 10], "logprob_start_len": 3,
                                    "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": 0}}),
    "score_batch_listed": ("POST", "/generate", {
        "input_ids": [[5, 6, 7, 8, 9, 10], [5, 6, 7]], "logprob_start_len": [3, 1],
        "return_logprob": True, "token_ids_logprob": [[1, 2, 9], [3, 4]],
        "sampling_params": {"max_new_tokens": 0}}),
}
ERRORS = {
    "empty_input": {"input_ids": [], "sampling_params": {"max_new_tokens": 2}},
    "mask_without_finite_top_k": {"input_ids": [5, 6], "return_sampling_mask": True,
                                  "sampling_params": {"max_new_tokens": 2, "top_k": -1}},
}
# values that differ by nature: request ids, timings; cached_tokens compared apart
UNCOMPARED = {"id", "e2e_latency", "response_sent_to_client_ts"}


class Pair:
    """The reference engine and SGLang, each one server on the same model."""

    def __init__(self, base):
        self.model = str(base / "model")
        write_tiny_model(ModelInitConfig(seed=3), self.model)
        python = sglang_cpu_python()   # first: a failure here leaves no server behind
        # SGLang's CPU sampler is its torch sampler: the reference engine runs the same rule
        self.ref = ReferenceServer(self.model, free_port(), log_path=str(base / "ref.log"),
                                   extra_args=["--sampling-backend", "pytorch"]).start(120)
        cfg = config_from_dict({
            "model": {"path": self.model}, "cluster": {"gpus_per_node": 0},
            "rollout": {"engine": "sglang", "sampling": {"top_k": 8}, "return_routing": True,
                        "sglang": {"device": "cpu", "python": python}},
            "algorithm": {"replay": "r3", "keep_sampling_mask": True}})
        port = engine_base_port()   # SGLang binds it itself, after ~25 s of start-up
        sglang = engine_kind(cfg)
        argv, env = sglang.server_command("127.0.0.1", port, [], 0, self.model)
        try:
            self.sgl = sglang.server_process(argv, env, "127.0.0.1", port,
                                             str(base / "sglang.log")).start(300)
        except BaseException:
            self.ref.stop()
            raise
        self.moe_shape = MoEShape.from_hf(json.load(open(f"{self.model}/config.json")))

    def both(self, method: str, path: str, body) -> tuple[httpx.Response, httpx.Response]:
        return tuple(httpx.request(method, p.url + path, json=body, timeout=120)
                     for p in (self.ref, self.sgl))

    def stop(self):
        self.ref.stop()
        self.sgl.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    p = Pair(tmp_path_factory.mktemp("differential"))
    yield p
    p.stop()


def same_shape(ref, sgl, where: str) -> None:
    """``ref`` has SGLang's JSON type and, recursively, its list lengths and dict keys
    (a subset of SGLang's)."""
    if isinstance(sgl, float) and isinstance(ref, int) and not isinstance(ref, bool):
        ref = float(ref)
    assert type(ref) is type(sgl) or ref is None and sgl is None, \
        f"{where}: reference {type(ref).__name__}, SGLang {type(sgl).__name__}"
    if isinstance(sgl, list):
        assert len(ref) == len(sgl), f"{where}: length {len(ref)} vs SGLang's {len(sgl)}"
        for i, (a, b) in enumerate(zip(ref, sgl)):
            same_shape(a, b, f"{where}[{i}]")
    elif isinstance(sgl, dict):
        extra = set(ref) - set(sgl)
        assert not extra, f"{where}: keys SGLang does not send: {sorted(extra)}"
        for k in ref:
            if k not in UNCOMPARED:
                same_shape(ref[k], sgl[k], f"{where}.{k}")


def same_values(ref, sgl, where: str) -> None:
    """Equal ids, strings and structure; floats within float32 rounding (5e-6)."""
    if isinstance(sgl, float) or isinstance(ref, float):
        assert abs(float(ref) - float(sgl)) <= 5e-6, f"{where}: {ref} vs SGLang's {sgl}"
    elif isinstance(sgl, list):
        for i, (a, b) in enumerate(zip(ref, sgl)):
            same_values(a, b, f"{where}[{i}]")
    elif isinstance(sgl, dict):
        for k in ref:
            if k not in UNCOMPARED | {"cached_tokens", "text"}:
                same_values(ref[k], sgl[k], f"{where}.{k}")
    else:
        assert ref == sgl, f"{where}: {ref!r} vs SGLang's {sgl!r}"


def test_generation_and_scoring_answer_as_sglang(pair):
    for name, (method, path, body) in REQUESTS.items():
        ref, sgl = pair.both(method, path, body)
        assert ref.status_code == sgl.status_code == 200, (name, ref.text, sgl.text)
        a, b = ref.json(), sgl.json()
        same_shape(a, b, name)
        same_values(a, b, name)
        for one_ref, one_sgl in zip(a if isinstance(a, list) else [a],
                                    b if isinstance(b, list) else [b]):
            routed = one_sgl["meta_info"].get("routed_experts")
            if routed:   # base64 of the same int32 experts, decoded alike
                n = len(body["input_ids"]) + len(one_sgl["output_ids"]) - 1 \
                    - body.get("routed_experts_start_len", 0)
                assert torch.equal(decode_routing(one_ref["meta_info"]["routed_experts"], n,
                                                  pair.moe_shape),
                                   decode_routing(routed, n, pair.moe_shape)), name


def test_a_prefix_hit_is_reported_alike(pair):
    body = {"input_ids": [30, 31, 32, 33, 34, 35], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}}
    for p in (pair.ref, pair.sgl):
        httpx.post(p.url + "/flush_cache", timeout=30)
    first = [r.json()["meta_info"]["cached_tokens"] for r in pair.both("POST", "/generate", body)]
    again = [r.json()["meta_info"]["cached_tokens"] for r in pair.both("POST", "/generate", body)]
    assert first == [0, 0]
    assert again[0] == again[1] >= len(body["input_ids"]) - 1, again


def test_errors_answer_as_sglang(pair):
    for name, body in ERRORS.items():
        ref, sgl = pair.both("POST", "/generate", body)
        assert ref.status_code == sgl.status_code == 400, (name, ref.text, sgl.text)
        for r in (ref, sgl):
            assert isinstance(r.json()["error"]["message"], str), (name, r.text)


DEEP = b"[" * 200_000 + b"]" * 200_000   # past any JSON parser's depth
UNREADABLE = {"not_json": b"{input_ids: [1,", "nested_too_deep": DEEP,
              "deep_field": b'{"input_ids": [5, 6], "sampling_params": ' + DEEP + b"}"}


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_disk"])
def test_unreadable_bodies_answer_as_sglang(pair, path):
    """A body that is not JSON or is nested past the parser's depth: 400 in SGLang's
    ErrorResponse shape from both (not a 500, not a dropped connection), and both still serve."""
    for name, raw in UNREADABLE.items():
        ref, sgl = (httpx.post(p.url + path, content=raw, timeout=120,
                               headers={"Content-Type": "application/json"})
                    for p in (pair.ref, pair.sgl))
        assert ref.status_code == sgl.status_code == 400, (name, ref.text, sgl.text[:300])
        same_shape(ref.json(), sgl.json(), name)
        assert isinstance(ref.json()["message"], str) and ref.json()["code"] == 400
    for p in (pair.ref, pair.sgl):
        assert httpx.get(p.url + "/health", timeout=30).status_code == 200


def test_control_endpoints_answer_as_sglang(pair):
    ref, sgl = pair.both("GET", "/health", None)
    assert ref.status_code == sgl.status_code == 200 and ref.content == sgl.content == b""
    ref, sgl = pair.both("POST", "/flush_cache", {})
    assert ref.status_code == sgl.status_code == 200 and ref.text == sgl.text
    ref, sgl = pair.both("POST", "/update_weights_from_disk",
                         {"model_path": pair.model, "weight_version": "7"})
    assert ref.status_code == sgl.status_code == 200
    assert set(ref.json()) == set(sgl.json()) and ref.json()["success"] is True
    for path in ("/model_info", "/get_model_info"):   # the latter deprecated by SGLang
        ref, sgl = pair.both("GET", path, None)
        same_shape(ref.json(), sgl.json(), path)
        assert ref.json()["weight_version"] == sgl.json()["weight_version"] == "7"
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        ref, sgl = pair.both("POST", path, {})
        assert ref.status_code == sgl.status_code == 200 and ref.json() is sgl.json() is None
    ref, sgl = pair.both("GET", "/get_weight_version", None)   # SGLang has no such route
    assert ref.status_code == sgl.status_code == 404


def test_sglangs_routed_experts_are_the_routers_top_k_in_float32(pair):
    """The experts SGLang reports for every position it ran (prompt and generated tokens but
    the last), every layer, equal the top-k of transformers' float32 router logits on the same
    tokens (the loop tests show the megatron trainer's own router agreeing: agreement 1.0)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(pair.model,
                                                              dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"input_ids": prompt, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}}
    meta = httpx.post(pair.sgl.url + "/generate", json=body, timeout=120).json()
    ids = prompt + meta["output_ids"]
    got = decode_routing(meta["meta_info"]["routed_experts"], len(ids) - 1, pair.moe_shape)
    with torch.no_grad():
        out = model(torch.tensor([ids[:-1]]), output_router_logits=True)
    k = pair.moe_shape.topk
    want = torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], 1)
    assert torch.equal(got.long().sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("T, top_k, top_p, min_p", [(1.0, 8, 1.0, 0.0), (0.7, 5, 1.0, 0.0),
                                                    (1.0, 12, 0.8, 0.0), (1.3, 20, 0.9, 0.05),
                                                    (0.8, 6, 0.95, 0.1)])
def test_sglangs_kept_sets_are_the_trainers_rule_on_the_same_logits(pair, T, top_k, top_p, min_p):
    """SGLang's own ``return_sampling_mask`` at each position of a sampled response equals the
    kept set of the torch sampler's rule (top-p on the full distribution, then k tokens, then
    min-p) on transformers' float32 logits of the same tokens; its selected log-prob is the
    sampled token's on that set."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(pair.model,
                                                              dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8, 9]
    body = {"input_ids": prompt, **MASKED, "sampling_params": {
        "temperature": T, "top_k": top_k, "top_p": top_p, "min_p": min_p,
        "max_new_tokens": 6, "ignore_eos": True}}
    meta = httpx.post(pair.sgl.url + "/generate", json=body, timeout=120).json()
    out = [t for _, t, _ in meta["meta_info"]["output_token_logprobs"]]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].double()
    for j, tok in enumerate(out):
        probs = torch.softmax(logits[j] / T, -1)
        want = kept_set(probs, top_k, top_p, min_p, backend="pytorch")
        got = meta["meta_info"]["output_token_sampling_mask"][j]
        assert sorted(got) == sorted(want.tolist()), (j, got, want.tolist())
        kept_lp = torch.log(probs[want] / probs[want].sum())
        lp = float(kept_lp[want.tolist().index(tok)])
        assert abs(meta["meta_info"]["output_token_sampling_logprobs"][j] - lp) < 1e-5, j
