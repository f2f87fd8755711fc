"""SGLang 0.5.23's own code judging what moe_rl sends it. Runs in SGLang's environment (its own
venv, see the Makefile's test-contract), never in moe_rl's:

    python -P tests/contract/sglang_judge.py COMMAND IN.json OUT.json

``-P``: the checkout is not put on sys.path (its ``kernels/`` folder would shadow SGLang's
``kernels`` dependency). Each command reads its cases from IN.json and writes what SGLang made of
them to OUT.json; the pytest side (tests/contract/test_sglang_contract.py) decides."""
from __future__ import annotations

import json
import sys
import types


def _loadable_torchvision() -> None:
    """SGLang's config package imports torchvision at module level (multimodal helpers), and
    PyPI's torchvision, a CUDA build, does not load beside the CPU torch: the SGLang CPU
    environment's own shim (`moe-rl sglang-cpu-env`) defines the operator schemas it needs."""
    from moe_rl_sglang_cpu_shims import define_torchvision_schemas
    define_torchvision_schemas()


def _plain(value):
    """JSON-comparable form (tuples as lists, objects by repr)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):   # SGLang decodes base64 payloads
        import base64
        return "base64:" + base64.b64encode(bytes(value)).decode("ascii")
    return repr(value)


def server_args(cases: list[dict]) -> list[dict]:
    """Each argv (without the interpreter and ``-m sglang.launch_server``) through SGLang's own
    parser; every ``--flag [value]`` read back from the ServerArgs it made."""
    from sglang.srt.server_args import prepare_server_args
    out = []
    for case in cases:
        argv = case["argv"]
        try:
            args = prepare_server_args(list(argv))
        except BaseException as exc:   # argparse exits on an unknown flag
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        seen = {}
        for i, a in enumerate(argv):
            if a.startswith("--"):
                name = a[2:].replace("-", "_")
                seen[name] = _plain(getattr(args, name)) if hasattr(args, name) \
                    else "<missing attribute>"
        out.append({"parsed": seen})
    return out


class _Answer(tuple):
    """What a TokenizerManager call answers: ``(success, message)`` to the routes that unpack
    it, an object with ``.success`` to those that read attributes."""
    success, message = True, "ok"

    def __new__(cls):
        return super().__new__(cls, (True, "ok"))

    def __getattr__(self, name):
        return None


class _Recorder:
    """Stands in for SGLang's TokenizerManager behind its own FastAPI app: records the request
    object SGLang's route built from the JSON body."""

    def __init__(self):
        self.seen: list = []
        self.keywords: list = []   # what a route passed besides the request object (its query)

    def generate_request(self, obj, request=None):
        async def gen():
            self.seen.append(obj)
            yield {"text": "", "meta_info": {}}
        return gen()

    def __getattr__(self, name):
        async def handler(obj=None, request=None, *a, **k):
            self.seen.append(obj)
            self.keywords.append(_plain(k))
            return _Answer()
        return handler


def requests(cases: list[dict]) -> list[dict]:
    """Each (path, body) POSTed to SGLang's own HTTP app (its routes, body parsing and the
    /generate contract check); returns the status and, for every field moe_rl sent, the value
    on the request object SGLang built (a field it silently drops shows as missing); /generate
    bodies also go through ``normalize_batch_and_arguments`` and SamplingParams."""
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints import http_server as hs
    rec = _Recorder()
    hs.set_global_state(hs._GlobalState(tokenizer_manager=rec, template_manager=None,
                                        scheduler_info={}))
    client = TestClient(hs.app, raise_server_exceptions=False)
    routes = {(r.path, m) for r in hs.app.routes for m in getattr(r, "methods", ()) or ()}
    out = []
    for case in cases:
        path, method, body = case["path"], case.get("method", "POST"), case["body"]
        result = {"route": (path.split("?")[0], method) in routes}
        if method != "POST" or not result["route"]:
            out.append(result)
            continue
        before = len(rec.seen)
        resp = client.post(path, json=body)
        result["status"] = resp.status_code
        if resp.status_code >= 400:
            result["error"] = resp.text[:500]
        # reached: the route parsed the body and handed the request object on (what the
        # stand-in answers may not be what every route unpacks; that is not judged)
        result["reached"] = len(rec.seen) > before
        if result["reached"] and "?" in path:
            result["query_read_as"] = rec.keywords[-1]
        if result["reached"] and rec.seen[-1] is not None:
            obj = rec.seen[-1]
            result["class"] = type(obj).__name__
            result["fields"] = {k: _plain(getattr(obj, k)) if hasattr(obj, k)
                                else "<missing field>" for k in (body or {})}
            if path == "/generate":
                result.update(_generate_checks(obj))
        out.append(result)
    return out


def _generate_checks(obj) -> dict:
    from sglang.srt.sampling.sampling_params import SamplingParams
    out = {}
    try:
        obj.normalize_batch_and_arguments()
        out["normalized"] = {"batch_size": getattr(obj, "batch_size", None),
                             "is_single": obj.is_single,
                             "logprob_start_len": _plain(obj.logprob_start_len),
                             "return_logprob": _plain(obj.return_logprob)}
    except Exception as exc:
        out["normalize_error"] = f"{type(exc).__name__}: {exc}"
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else \
        [obj.sampling_params]
    try:
        for p in params:
            sp = SamplingParams(**(p or {}))
            sp.normalize(None)
            sp.verify(1 << 20)
        out["sampling_params_ok"] = True
    except Exception as exc:
        out["sampling_params_error"] = f"{type(exc).__name__}: {exc}"
    return out


def tensor_payload(cases: list[dict]) -> list[dict]:
    """Each payload read by SGLang's MultiprocessingSerializer.deserialize (its SafeUnpickler):
    refused globals fail; the CUDA rebuild (no GPU here) is recorded instead of called, after
    SafeUnpickler admitted it."""
    from sglang.srt.utils import common
    calls = []

    class Judge(common.SafeUnpickler):
        def find_class(self, module, name):
            found = super().find_class(module, name)   # raises for a refused global
            if name in ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"):
                def record(*args):
                    calls.append({"rebuild": f"{module}.{name}", "args": _plain(args)})
                    return {"tensor": len(calls) - 1}
                return record
            return found
    out = []
    real = common.SafeUnpickler
    common.SafeUnpickler = Judge
    try:
        for case in cases:
            calls.clear()
            try:
                named = common.MultiprocessingSerializer.deserialize(case["payload"])
                out.append({"names": [n for n, _ in named], "rebuilds": list(calls)})
            except Exception as exc:
                out.append({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        common.SafeUnpickler = real
    return out


def fp8_config(cases: list[dict]) -> list[dict]:
    """Each quantization_config through SGLang's Fp8Config.from_config."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    out = []
    for case in cases:
        try:
            c = Fp8Config.from_config(case["quantization_config"])
            out.append({"weight_block_size": _plain(c.weight_block_size),
                        "is_checkpoint_fp8_serialized": c.is_checkpoint_fp8_serialized,
                        "activation_scheme": c.activation_scheme,
                        "ignored_layers": _plain(getattr(c, "ignored_layers", None))})
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


def fp8_modules(case: dict) -> dict:
    """Build SGLang's own model class for the HF model at ``case["model"]`` on the meta device
    with block-wise FP8 (``Fp8Config``), tensor parallel 1 over a one-process gloo group; return
    every module that has a quantisation method, by name, with the method's class."""
    import os
    import torch
    for name in ("vllm", "vllm._custom_ops"):   # an optional CPU rotary kernel, never called
        m = types.ModuleType(name)
        m.__path__ = []
        m.rotary_embedding = None
        sys.modules[name] = m
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs
    import transformers
    rc.publish(ServerArgs(model_path=case["model"], device="cpu"), role="scheduler")
    port = case["port"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel("gloo")
    rc.get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_cp_rank=0, moe_dp_rank=0, moe_ep_rank=0, moe_tp_rank=0,
        attn_tp_rank=0, attn_dp_rank=0)
    hf = transformers.AutoConfig.from_pretrained(case["model"])
    cls, _ = ModelRegistry.resolve_model_cls(hf.architectures)
    qc = Fp8Config.from_config(case["quantization_config"])
    with torch.device("meta"):
        model = cls(hf, quant_config=qc)
    return {"class": cls.__name__,
            "methods": {n: type(m.quant_method).__name__ for n, m in model.named_modules()
                        if getattr(m, "quant_method", None) is not None}}


def weight_group(case: dict) -> dict:
    """Join the trainer's weight-update group as SGLang does (``init_custom_process_group``)
    and receive the announced tensors the way its model runner does (broadcast from rank 0)."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from sglang.srt.utils.common import init_custom_process_group
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://{case['address']}:{case['port']}",
        world_size=case["world_size"], rank=case["rank"], group_name=case["group_name"],
        timeout=timedelta(seconds=60))
    sums = {}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
    for name, dt, shape in zip(case["names"], case["dtypes"], case["shapes"]):
        t = torch.empty(shape, dtype=dtypes[dt])
        dist.broadcast(t, src=0, group=pg)
        sums[name] = float(t.double().sum())
    dist.barrier(group=pg)
    dist.destroy_process_group(pg)
    return {"sums": sums}


def sampling_mask(cases: list[dict]) -> list[dict]:
    """SGLang's torch sampler on each (probs, top_k, top_p, min_p): the token ids it keeps
    (positive filtered weight)."""
    import torch
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
    out = []
    for case in cases:
        probs = torch.tensor([case["probs"]], dtype=torch.float64)
        _, filtered, idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), torch.tensor([case["top_k"]]), torch.tensor([case["top_p"]],
                                                                        dtype=torch.float64),
            torch.tensor([case["min_p"]], dtype=torch.float64), case["min_p"] > 0, None,
            torch.zeros(1, dtype=torch.long), return_filtered_probs=True)
        out.append({"kept": sorted(int(i) for i in idx[0][filtered[0] > 0])})
    return out


COMMANDS = {"server_args": server_args, "requests": requests, "tensor_payload": tensor_payload,
            "fp8_config": fp8_config, "fp8_modules": fp8_modules, "weight_group": weight_group,
            "sampling_mask": sampling_mask}


def main(argv: list[str]) -> None:
    command, src, dst = argv
    _loadable_torchvision()
    with open(src, encoding="utf-8") as fh:
        cases = json.load(fh)
    result = COMMANDS[command](cases)
    with open(dst, "w", encoding="utf-8") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
