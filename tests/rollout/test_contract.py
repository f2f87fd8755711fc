"""SGLang-protocol client against the CPU reference engine over real HTTP on 127.0.0.1, golden
responses, kept sets, routing consistency, errors, weight updates, n-pass scoring, launcher."""
import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import torch

from moe_rl.config import ModelInitConfig
from moe_rl.config import config_from_dict
from moe_rl.models.tiny import write_tiny_model
from moe_rl.families.shape import MoEShape
from moe_rl.engines.base import ResponseError, SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine
from moe_rl.engines.sglang.decode import decode_routing
from moe_rl.rollout.trajectories import generate_samples
from tests.helpers import sample_from_response
from moe_rl.engines.sglang.pool import EngineHTTPError, ServerPool
from moe_rl.engines.reference.engine import kept_set
from moe_rl.engines.reference.kind import ReferenceKind
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.engines.sglang.launcher import sglang_argv, sglang_env
from moe_rl.trainer.parallel import free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_model")
    write_tiny_model(ModelInitConfig(seed=5), str(out))
    return str(out)


@pytest.fixture(scope="module")
def layout(tiny_dir):
    facts = MoEShape.from_hf(json.load(open(f"{tiny_dir}/config.json")))
    return facts


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "ref.log"
    proc = ReferenceServer(tiny_dir, free_port(), api_key="k3y", log_path=str(log)).start()
    yield proc
    proc.stop()


def sglang_command(cfg, port: int, model_path: str | None = None, gpus: list[int] = ()):
    """(argv, environment moe_rl sets) of one SGLang server, as the engine host starts it."""
    return (sglang_argv(cfg, model_path or cfg.model.path, cfg.rollout.servers.host, port),
            sglang_env(list(gpus), cfg.rollout.sglang.device))


def engine_for(urls, layout, need_mask=True, api_key="k3y"):
    return SGLangEngine(lambda: ServerPool(urls, api_key=api_key, max_retries=2,
                                                backoff=0.05),
                             layout, need_routing=True, need_mask=need_mask)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def test_generate_decodes_to_valid_samples_with_kept_sets(server, layout, hf_model):
    eng = engine_for([server.url], layout)
    prompts = [[6, 7, 68, 12, 72], [9, 68, 9, 72]]
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, top_k=12, min_p=0.01, max_new_tokens=6)
    samples = generate_samples(eng, prompts, 3, sampling, seed=11)
    assert len(samples) == 6 and [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        s.validate(96, None)
        assert s.routing.shape == (s.prompt_len + s.response_len - 1, 2, 2)
        assert s.routing.dtype == torch.uint8
        ids = torch.cat([s.prompt_ids, s.response_ids]).long()[None]
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()
        for j in range(s.response_len):
            z = logits[s.prompt_len - 1 + j]
            probs = torch.softmax(z / 0.8, -1)
            expect = kept_set(probs, 12, 0.9, 0.01)
            got = s.kept_set(j)
            assert int(s.response_ids[j]) in got.tolist()
            assert sorted(got.tolist()) == sorted(expect.tolist())
            assert len(got) <= 12
            # with the mask on, the rollout log-prob is the token's on the renormalised kept set
            # at T (output_token_sampling_logprobs); the kept set's mass is recorded beside it
            full = torch.log_softmax(z.double() / 0.8, -1)
            kept_mass = torch.logsumexp(full[expect], 0)
            assert float(s.rollout_logprobs[j]) == pytest.approx(
                float(full[s.response_ids[j]] - kept_mass), abs=1e-4)
            assert float(s.kept_logmass[j]) == pytest.approx(float(kept_mass), abs=1e-4)
    # seeded: the same seeds give the same samples
    again = generate_samples(eng, prompts, 3, sampling, seed=11)
    assert [s.response_ids.tolist() for s in again] == [s.response_ids.tolist() for s in samples]


def test_independent_kept_set_rule():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # top-p 0.7: mass above token 1 is 0.5 <= 0.7 (kept, the crossing token); above 2 is 0.8
    assert kept_set(probs, -1, 0.7, 0.0).tolist() == [0, 1]
    assert kept_set(probs, 1, 1.0, 0.0).tolist() == [0]
    assert kept_set(probs, -1, 1.0, 0.25).tolist() == [0, 1, 2]   # min-p: >= 0.125


def test_scored_routing_matches_generation_routing(server, layout):
    eng = engine_for([server.url], layout, need_mask=False)
    s = generate_samples(eng, [[6, 7, 68, 12, 72]], 1, SamplingConfig(max_new_tokens=5), seed=3)[0]
    ids = s.prompt_ids.tolist() + s.response_ids.tolist()
    r = httpx.post(server.url + "/generate", headers={"Authorization": "Bearer k3y"},
                   json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                         "return_routed_experts": True}, timeout=60).json()
    scored = decode_routing(r["meta_info"]["routed_experts"], len(ids) - 1, layout)
    assert torch.equal(scored, s.routing)   # float32, same weights: exact


@pytest.mark.parametrize("chunk", [None, 1], ids=["one_call", "calls_of_one"])
def test_n_pass_scoring_matches_independent_logprobs(server, layout, hf_model, chunk,
                                                     monkeypatch):
    """(calls_of_one: a scoring batch larger than SCORE_BATCH_MAX goes as several calls.)"""
    from moe_rl.engines.sglang.pool import ServerPool
    sizes = []
    if chunk is not None:
        monkeypatch.setattr("moe_rl.engines.sglang.client.SCORE_BATCH_MAX", chunk)
        request = ServerPool.request

        async def counted(self, path, body, **kw):
            if isinstance(body.get("input_ids", [None])[0], list):
                sizes.append(len(body["input_ids"]))
            return await request(self, path, body, **kw)
        monkeypatch.setattr(ServerPool, "request", counted)
    eng = engine_for([server.url], layout, need_mask=False)
    samples = generate_samples(eng, [[6, 7, 68, 12, 72], [9, 9]], 2, SamplingConfig(max_new_tokens=4),
                           seed=5)
    eng.score(samples, 3)
    for s in samples:
        assert s.pass_logprobs.shape == (3, s.response_len)
        ids = torch.cat([s.prompt_ids, s.response_ids]).long()[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
        want = logp[s.prompt_len - 1:-1].gather(1, s.response_ids.long()[:, None]).squeeze(1)
        for j in range(3):
            assert torch.allclose(s.pass_logprobs[j], want, atol=1e-4)
        # temperature 1: the generation log-probs equal the scoring ones
        assert torch.allclose(s.rollout_logprobs, want, atol=1e-4)
    if chunk is not None:
        assert set(sizes) == {1} and len(sizes) >= 3 * len(samples)


def test_golden_response_decodes_exactly():
    layout = MoEShape(num_layers=3, moe_layers=(1, 2), topk=2, num_experts=8)
    P, R = 3, 2
    rows = np.zeros((P + R - 1, 3, 2), dtype="<i4")
    rows[:, 1] = [[0, 5], [1, 2], [7, 3], [4, 6]]
    rows[:, 2] = [[2, 3], [6, 1], [0, 4], [5, 7]]
    golden = {"text": "ab", "output_ids": [11, 1],
              "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 1},
                            "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "4",
                            "output_token_logprobs": [[-0.5, 11, "a"], [-0.25, 1, None]],
                            "routed_experts": base64.b64encode(rows.tobytes()).decode(),
                            "output_token_sampling_mask": [[11, 3], [1]],
                            "output_token_sampling_mask_length": [2, 1],
                            "output_token_sampling_logprobs": [-0.1, 0.0]}}
    s = sample_from_response(golden, [5, 6, 7], layout, need_routing=True, need_mask=True,
                             group_id=2, sample_id=9)
    assert s.response_ids.tolist() == [11, 1]
    # keep-sampling-mask on: the rollout log-prob is the post-truncation one, and the kept set's
    # full-vocabulary mass is exp(output_token_logprobs - output_token_sampling_logprobs)
    assert s.rollout_logprobs.tolist() == pytest.approx([-0.1, 0.0])
    assert s.kept_logmass.tolist() == pytest.approx([-0.4, -0.25])
    plain = sample_from_response(golden, [5, 6, 7], layout, need_routing=False, need_mask=False,
                                 group_id=2, sample_id=9)
    assert plain.rollout_logprobs.tolist() == [-0.5, -0.25] and plain.kept_logmass is None
    assert s.routing.tolist() == rows[:, 1:].tolist() and s.routing.dtype == torch.uint8
    assert s.sampling_mask_offsets.tolist() == [0, 2, 3] and s.sampling_mask_ids.tolist() == [11, 3, 1]
    assert s.weight_version == 4 and s.group_id == 2 and s.metadata["finish_reason"] == "stop"
    # missing routing under R3: fail at once with the fix in the message
    no_route = json.loads(json.dumps(golden))
    del no_route["meta_info"]["routed_experts"]
    with pytest.raises(ResponseError, match="start SGLang with --enable-return-routed-experts"):
        sample_from_response(no_route, [5, 6, 7], layout, need_routing=True, need_mask=False,
                             group_id=0, sample_id=0)
    with pytest.raises(ResponseError, match="sampling-mask-max-tokens"):
        del no_route["meta_info"]["output_token_sampling_mask"]
        sample_from_response(no_route, [5, 6, 7], layout, need_routing=False, need_mask=True,
                             group_id=0, sample_id=0)
    with pytest.raises(ResponseError, match="bytes, expected"):
        decode_routing(base64.b64encode(b"\0" * 12).decode(), 4, layout)


def test_all_zero_routing_is_refused_naming_the_moe_runner():
    """SGLang's triton_kernel runner (its own choice for gpt-oss) routes inside the kernel and
    returns every routing row as zeros: refused at decoding, naming the runner and the fix."""
    layout = MoEShape(num_layers=2, moe_layers=(0, 1), topk=2, num_experts=8)
    zeros = base64.b64encode(np.zeros((3, 2, 2), dtype="<i4").tobytes()).decode()
    with pytest.raises(ResponseError, match=r"position 0, MoE layer 0: the experts \[0, 0\] "
                                            r"repeat an id.*triton_kernel.*--moe-runner-backend "
                                            r"triton"):
        decode_routing(zeros, 3, layout)


def test_the_moe_runner_captures_routing_where_the_run_needs_it():
    """On GPUs, a run that needs the engine's routing pins SGLang's triton runner (routed in
    select_experts, where SGLang captures) unless the config names a runner; one that routes
    inside its kernel is refused when the configuration loads; no pin on CPU or without
    routing."""
    from moe_rl.config import ConfigError, load_config
    gpu = {"cluster": {"gpus_per_node": 8}, "algorithm": {"replay": "r3"}}

    def argv(rollout=None, **tree):
        cfg = config_from_dict({**gpu, **tree, "rollout": {"engine": "sglang", **(rollout or {})}})
        return " ".join(sglang_command(cfg, 30000)[0])
    assert "--moe-runner-backend triton" in argv()
    shipped = load_config("configs/gpt_oss_20b_r3_gspo.yaml")
    assert "--moe-runner-backend triton" in " ".join(sglang_command(shipped, 30000)[0])
    chosen = argv({"sglang": {"extra_args": ["--moe-runner-backend", "deep_gemm"]}})
    assert chosen.count("--moe-runner-backend") == 1 and "deep_gemm" in chosen
    assert "--moe-runner-backend" not in argv({"return_routing": False},
                                             algorithm={"replay": "off"})
    assert "--moe-runner-backend" not in argv({"sglang": {"device": "cpu"}},
                                             cluster={"gpus_per_node": 0})
    with pytest.raises(ConfigError, match="--moe-runner-backend triton_kernel routes inside its "
                                          "kernel"):
        argv({"sglang": {"extra_args": ["--moe-runner-backend", "triton_kernel"]}})


def test_malformed_requests_get_400_and_key_401(server):
    h = {"Authorization": "Bearer k3y"}
    bad = [({"input_ids": [1, 2, 999]}, "input_ids"),
           ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
           ({"input_ids": [1, 2], "return_sampling_mask": True}, "top_k"),
           ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
           ({"input_ids": []}, "input_ids")]
    for body, field in bad:
        r = httpx.post(server.url + "/generate", json=body, headers=h, timeout=30)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 401
    assert httpx.get(server.url + "/health", headers=h, timeout=5).status_code == 200
    # a non-ASCII byte in the header is a plain 401, not a server error
    odd = {"Authorization": "Bearer k3y\xe9".encode("latin-1")}
    assert httpx.get(server.url + "/health", headers=odd, timeout=5).status_code == 401


def test_weight_update_changes_outputs_and_version(server, layout, tiny_dir, tmp_path):
    other = str(tmp_path / "other")
    write_tiny_model(ModelInitConfig(seed=99), other)
    eng = engine_for([server.url], layout, need_mask=False)
    before = generate_samples(eng, [[6, 7, 68]], 1, SamplingConfig(max_new_tokens=4), seed=1)[0]
    eng.weights.load_from_disk(other, 7)
    assert eng.weight_versions() == ["7"]
    after = generate_samples(eng, [[6, 7, 68]], 1, SamplingConfig(max_new_tokens=4), seed=1)[0]
    assert after.weight_version == 7
    assert not torch.allclose(before.rollout_logprobs[:1], after.rollout_logprobs[:1])
    eng.weights.load_from_disk(tiny_dir, 8)   # restore for the other tests
    with pytest.raises(EngineHTTPError, match="HTTP 400"):
        eng.weights.load_from_disk(str(tmp_path / "missing"), 9)


def test_sglang_command_lines():
    cfg = config_from_dict({"model": {"path": "/m"}, "cluster": {"gpus_per_node": 8,
                                                                 "colocate": True},
                            "rollout": {"engine": "sglang",
                                        "sampling": {"temperature": 0.7, "top_k": 50},
                                        "servers": {"api_key": "s"},
                                        "sglang": {"tp_size": 4, "ep_size": 8,
                                                   "extra_args": ["--x", "1"]}},
                            "algorithm": {"replay": "r3", "keep_sampling_mask": True}})
    argv, env = sglang_command(cfg, 30001, gpus=[4, 5, 6, 7])
    line = " ".join(argv)
    for part in ("-m sglang.launch_server", "--model-path /m", "--port 30001", "--tp-size 4",
                 "--ep-size 8", "--enable-return-routed-experts", "--base-gpu-id 0",
                 "--sampling-mask-max-tokens 4096", "--enable-memory-saver", "--api-key s",
                 "--x 1", "--host 127.0.0.1"):
        assert part in line, part
    # its own GPUs; output log-probs stay log_softmax(logits / T) (the trainer's), never raw;
    # the working directory off its sys.path
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "CUDA_VISIBLE_DEVICES": "4,5,6,7",
                   "PYTHONSAFEPATH": "1"}
    assert "--device" not in argv and "--max-total-tokens" not in argv
    assert argv[argv.index("--dtype") + 1] == "float32"   # rollout.engine_dtype, on GPUs too
    assert "--enable-fp32-lm-head" not in argv
    plain = config_from_dict({"cluster": {"gpus_per_node": 8},
                              "rollout": {"engine": "sglang", "return_routing": False},
                              "algorithm": {"replay": "off"}})
    argv, env = sglang_command(plain, 30000)
    assert "--enable-return-routed-experts" not in argv and "--enable-memory-saver" not in argv
    assert "--sampling-mask-max-tokens" not in argv and "--quantization" not in argv
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "PYTHONSAFEPATH": "1"}
    # on CPU: SGLang's CPU engine, the engine dtype, a bounded KV pool, no GPU flags
    cpu = config_from_dict({"cluster": {"gpus_per_node": 0},
                            "rollout": {"engine": "sglang", "engine_dtype": "bfloat16",
                                        "sglang": {"device": "cpu"}}})
    argv, env = sglang_command(cpu, 30000)
    line = " ".join(argv)
    assert "--dtype bfloat16 --device cpu --max-total-tokens 65536" in line
    assert "--base-gpu-id" not in argv
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "PYTHONSAFEPATH": "1",
                   "SGLANG_USE_CPU_ENGINE": "1"}
    cpu = config_from_dict({"cluster": {"gpus_per_node": 0},
                            "rollout": {"engine": "sglang", "sglang": {"device": "cpu",
                                                                       "max_total_tokens": 4096}}})
    assert "--dtype float32 --device cpu --max-total-tokens 4096" in \
        " ".join(sglang_command(cpu, 30000)[0])
    # float16 with an fp32 LM head: the engine's head as the trainer's (model.fp32_output_layer)
    fp16 = config_from_dict({"cluster": {"gpus_per_node": 8},
                             "model": {"dtype": "float16", "fp32_output_layer": True},
                             "rollout": {"engine": "sglang", "engine_dtype": "float16"}})
    argv = sglang_command(fp16, 30000)[0]
    assert argv[argv.index("--dtype") + 1] == "float16" and "--enable-fp32-lm-head" in argv
    ref = ReferenceKind(fp16).server_command("127.0.0.1", 30000, [], 0, "/m")[0]
    assert ref[ref.index("--dtype") + 1] == "float16" and "--enable-fp32-lm-head" in ref
    # FP8: SGLang serves the FP8 checkpoint moe_rl wrote (its config declares the quantisation;
    # no --quantization flag, which SGLang's docs forbid for pre-quantised checkpoints)
    fp8 = config_from_dict({"cluster": {"gpus_per_node": 8, "weight_sync": "distributed"},
                            "rollout": {"engine": "sglang", "quantization": "fp8"},
                            # a path with no model: the init shape is what is checked
                            "model": {"path": "/nonexistent/model",
                                      "init": {"head_dim": 128, "moe_intermediate_size": 128,
                                               "intermediate_size": 256}}})
    argv = sglang_command(fp8, 30000, model_path="/run/fp8_start")[0]
    assert argv[argv.index("--model-path") + 1] == "/run/fp8_start"
    assert "--quantization" not in argv
    ref = ReferenceServer("/m", 30000, quantization="fp8").command()[0]
    assert ref[ref.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in ReferenceServer("/m", 30000).command()[0]


def test_scoring_passes_give_the_rollout_distribution_at_any_temperature(server, layout,
                                                                        hf_model):
    """pi_old passes describe the distribution the engine sampled from: the kept set at T with
    the mask on (renormalised from the listed kept ids, window by window), the full vocabulary at
    T with it off (renormalised from every id): each pass equals the rollout log-prob."""
    prompts = [[6, 7, 68, 12, 72], [9, 9]]
    masked = engine_for([server.url], layout, need_mask=True)
    sampling = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, min_p=0.02, max_new_tokens=5)
    samples = generate_samples(masked, prompts, 2, sampling, seed=21)
    masked.score(samples, 2, temperature=0.7, window=2)
    for s in samples:
        assert torch.allclose(s.pass_logprobs, s.rollout_logprobs.expand(2, -1), atol=2e-6)
    full_layout = MoEShape(layout.num_layers, layout.moe_layers, layout.topk,
                              layout.num_experts, hf_model.config.vocab_size)
    plain = engine_for([server.url], full_layout, need_mask=False)
    samples = generate_samples(plain, prompts, 2, SamplingConfig(temperature=0.7, max_new_tokens=5),
                             seed=22)
    plain.score(samples, 1, temperature=0.7, window=3)
    for s in samples:
        ids = torch.cat([s.prompt_ids, s.response_ids]).long()[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0].double() / 0.7, -1)
        want = logp[s.prompt_len - 1:-1].gather(1, s.response_ids.long()[:, None]).squeeze(1)
        assert torch.allclose(s.pass_logprobs[0].double(), want, atol=2e-6)
        assert torch.allclose(s.rollout_logprobs.double(), want, atol=2e-6)


def test_support_mode_and_listed_ids_follow_sglang(server):
    """sampling_logprobs_mode 'support': one log-prob per kept id, aligned, summing to 1;
    'selected': the sampled one's. token_ids_logprob: raw per-position log-probs, first None."""
    h = {"Authorization": "Bearer k3y"}
    params = {"temperature": 0.8, "top_k": 5, "max_new_tokens": 3, "sampling_seed": 4}
    sup = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7, 68], "sampling_params": params, "return_logprob": True,
        "return_sampling_mask": True, "sampling_logprobs_mode": "support"}).json()["meta_info"]
    sel = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7, 68], "sampling_params": params, "return_logprob": True,
        "return_sampling_mask": True}).json()["meta_info"]
    for ids, row, chosen, out in zip(sup["output_token_sampling_mask"],
                                     sup["output_token_sampling_logprobs"],
                                     sel["output_token_sampling_logprobs"],
                                     sel["output_token_logprobs"]):
        assert len(row) == len(ids) and sum(np.exp(row)) == pytest.approx(1.0, abs=1e-5)
        assert row[ids.index(out[1])] == pytest.approx(chosen, abs=1e-6)
    bad = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7], "sampling_params": params, "return_sampling_mask": True,
        "sampling_logprobs_mode": "all"})
    assert bad.status_code == 400 and "sampling_logprobs_mode" in bad.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7, 68, 12], "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 1, "token_ids_logprob": [12, 3]}).json()
    listed, inputs = r["meta_info"]["input_token_ids_logprobs"], \
        r["meta_info"]["input_token_logprobs"]
    assert listed[0] is None and len(listed) == len(inputs) == 3
    assert [e[1] for e in listed[2]] == [12, 3]
    assert listed[2][0][0] == pytest.approx(inputs[2][0], abs=1e-6)   # token 12 at position 3
    bad = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7], "token_ids_logprob": [10 ** 6]})
    assert bad.status_code == 400 and "token_ids_logprob" in bad.json()["error"]["message"]


@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("pi_old", ["trainer", "rollout", "engine_avg"])
def test_sglang_is_started_with_every_flag_its_requests_need(replay, mask, pi_old):
    from moe_rl.engines.needs import requests_routing, requests_sampling_mask
    cfg = config_from_dict({"model": {"path": "/m"}, "cluster": {"gpus_per_node": 8},
                            "rollout": {"engine": "sglang", "sampling": {"top_k": 20}},
                            "algorithm": {"replay": replay, "keep_sampling_mask": mask,
                                          "pi_old": pi_old, "pi_old_passes": 2}})
    argv, _ = sglang_command(cfg, 30000)
    layout = MoEShape(2, (0, 1), 2, 8)
    eng = SGLangEngine(lambda: None, layout, need_routing=requests_routing(cfg.algorithm, cfg.rollout),
                            need_mask=requests_sampling_mask(cfg.algorithm))
    body = eng.generate_body([1, 2, 3], SamplingConfig(top_k=20), seed=1)
    assert body["return_routed_experts"] == ("--enable-return-routed-experts" in argv)
    assert body["return_sampling_mask"] == ("--sampling-mask-max-tokens" in argv)
    assert body["return_routed_experts"]   # routing/agreement by default, r3 always
    off = config_from_dict({"model": {"path": "/m"}, "cluster": {"gpus_per_node": 8},
                            "rollout": {"engine": "sglang", "return_routing": False},
                            "algorithm": {"replay": replay}})
    assert ("--enable-return-routed-experts" in sglang_command(off, 30000)[0]) == \
        (replay == "r3") == requests_routing(off.algorithm, off.rollout)


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_reference_engine_omits_routing_unless_started_with_the_flag(tiny_dir, layout):
    proc = ReferenceServer(tiny_dir, free_port(), return_routed_experts=False).start()
    try:
        r = httpx.post(proc.url + "/generate", timeout=60, json={
            "input_ids": [6, 7, 68], "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True, "return_routed_experts": True}).json()
        assert "routed_experts" not in r["meta_info"]
        eng = SGLangEngine(lambda: ServerPool([proc.url]), layout, need_routing=True,
                                need_mask=False)
        assert eng.weight_versions() == ["default"]   # SGLang's before any update
        with pytest.raises(ResponseError, match="--enable-return-routed-experts"):
            generate_samples(eng, [[6, 7, 68]], 1, SamplingConfig(max_new_tokens=2), seed=1)
    finally:
        proc.stop()


def test_kept_set_rules_of_sglangs_two_samplers_by_hand():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # flashinfer (default): top-k 2 -> renormalised [4/7, 3/7]; mass above token 1 is
    # 4/7 > 0.5, so it is cut; the torch sampler applies top-p to the full distribution (0.4)
    assert kept_set(probs, 2, 0.5, 0.0).tolist() == [0]
    assert kept_set(probs, 2, 0.5, 0.0, backend="pytorch").tolist() == [0, 1]
    # ties at the top-k cut are kept (flashinfer), cut to exactly k (torch)
    tied = torch.tensor([0.3, 0.3, 0.2, 0.2])
    assert sorted(kept_set(tied, 3, 1.0, 0.0).tolist()) == [0, 1, 2, 3]
    assert len(kept_set(tied, 3, 1.0, 0.0, backend="pytorch")) == 3
    # ties at the top-p cut are kept too
    assert sorted(kept_set(tied, -1, 0.25, 0.0).tolist()) == [0, 1]
    # min-p relative to the most likely token, after both
    assert kept_set(probs, -1, 1.0, 0.6).tolist() == [0, 1]


def test_reference_engine_speaks_sglangs_dialect(server, layout):
    h = {"Authorization": "Bearer k3y"}
    health = httpx.get(server.url + "/health", headers=h, timeout=5)
    assert health.status_code == 200 and health.content == b""
    flush = httpx.post(server.url + "/flush_cache", headers=h, timeout=5)
    assert flush.status_code == 200 and "text/plain" in flush.headers["content-type"]
    info = httpx.get(server.url + "/model_info", headers=h, timeout=5).json()
    assert info["is_generation"] is True
    bad = httpx.post(server.url + "/generate", headers=h, timeout=30, json={"input_ids": []})
    assert "input_ids" in bad.json()["error"]["message"]
    # n > 1: n samples of the prompt; a mask with top_k = 1; routing from start_len = P
    many = httpx.post(server.url + "/generate", headers=h, timeout=60, json={
        "input_ids": [6, 7, 68], "return_logprob": True, "return_sampling_mask": True,
        "return_routed_experts": True, "routed_experts_start_len": 3,
        "sampling_params": {"n": 3, "top_k": 1, "max_new_tokens": 3, "sampling_seed": 2}}).json()
    assert isinstance(many, list) and len(many) == 3
    for r in many:
        meta = r["meta_info"]
        assert meta["output_token_sampling_mask_length"] == len(r["output_ids"])
        assert all(len(m) == 1 for m in meta["output_token_sampling_mask"])
        rows = len(base64.b64decode(meta["routed_experts"])) // (4 * 2 * 2)
        assert rows == 3 + len(r["output_ids"]) - 1 - 3
    # the client reads every one of these as SGLang sends them
    eng = engine_for([server.url], layout)
    eng.check_health()
    eng.flush_cache()
    flushed = eng.run_with_pool(lambda pool: pool.broadcast("/flush_cache", {}))
    assert flushed[0]["text"].startswith("Cache flushed")
    with pytest.raises(EngineHTTPError, match=r"HTTP 400: input_ids: expected"):
        asyncio.run(_post(server.url, {"input_ids": []}))


async def _post(url, body):
    async with ServerPool([url], api_key="k3y", max_retries=0) as pool:
        return await pool.request("/generate", body)


def test_token_ids_outside_the_vocabulary_are_refused_before_they_are_sent(layout):
    """SGLang's scheduler dies on an out-of-vocabulary input id (its embedding lookup fails),
    taking every request in flight: the client refuses such ids, naming them, and never sends
    them (the pool's only server here is a closed port)."""
    eng = SGLangEngine(lambda: ServerPool([f"http://127.0.0.1:{free_port()}"], max_retries=0),
                       layout, need_routing=True, need_mask=False)
    vocab = layout.vocab_size

    async def turn(session):
        return await session.generate_turn([5, vocab], SamplingConfig(max_new_tokens=2))

    async def refetch(session):
        return await session.routing([5, -1, 6], 0, server=0)
    for fn in (turn, refetch):
        with pytest.raises(ValueError, match=rf"input_ids: token id (-1|{vocab}) outside the "
                                             rf"model's vocabulary \[0, {vocab}\)"):
            eng.run(fn)
