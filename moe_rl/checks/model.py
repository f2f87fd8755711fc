"""``moe-rl check-model``: whether a Hugging Face checkpoint is aligned in moe_rl before GPUs are
spent on it. The same prompts go through transformers (the reference), moe_rl's megatron-core
model built and loaded from the checkpoint, and, when given, an engine server speaking SGLang's
protocol (SGLang itself or the reference engine). For each side it measures, per MoE layer, how
often the side's routers pick the experts transformers' routers picked (every token), and how far
its next-token log-probs are from transformers': the trainer's with transformers' routing
replayed (R3, what training uses) and with its own; the engine's as it scores them."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator
import shutil
import tempfile

import torch

from moe_rl.algo.metrics import routing_agreement
from moe_rl.engines.base import EngineError
from moe_rl.errors import UserError
from moe_rl.families.shape import MoEShape
from moe_rl.weights.mxfp4_checkpoint import transformers_dequantising
from moe_rl.rollout_record import Sample, routing_dtype
from moe_rl.trainer.parallel import free_port, init_distributed, init_model_parallel
from moe_rl.families import family, transformers_config
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.trainer.packing import pack_one
from moe_rl.trainer.replay import ReplayController
from moe_rl.weights.hf import load_hf_into_megatron

# SGLang 0.5.23 takes an input of fewer than min(context - 1, KV pool - 1) - 5 tokens
# (managers/tp_worker.py, managers/utils.py)
ENGINE_INPUT_RESERVE = 7
# prompts of its own when none are given: words, digits and symbols, short and longer
OWN_PROMPTS = (
    "The capital of France is Paris, and the capital of Italy is",
    "12+35=47, 8*7=56, 100-1=",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Mixture-of-Experts models route each token to a few experts; the router",
)


@dataclasses.dataclass
class SideReport:
    """One side against transformers: routing agreement per MoE layer (HF layer index), the
    max and mean |delta log-prob| over every scored token."""
    name: str
    agreement: dict[int, float]
    max_abs_delta: float
    mean_abs_delta: float

    def failures(self, min_agreement: float, max_abs_delta: float) -> list[str]:
        """What falls short of the thresholds, in words (empty: aligned)."""
        out = [f"layer {layer}: routing agreement {a:.4f} < {min_agreement}"
               for layer, a in self.agreement.items() if a < min_agreement]
        if not self.max_abs_delta <= max_abs_delta:   # NaN fails too
            out.append(f"max |delta log-prob| {self.max_abs_delta:.3g} > {max_abs_delta}")
        return out


@dataclasses.dataclass
class Reference:
    """transformers' answer on each prompt: log-probs of tokens 1.. [S-1] and its routers'
    choices at positions ..S-2 [S-1, MoE layers, K]."""
    prompts: list[list[int]]
    logprobs: list[torch.Tensor]
    routing: list[torch.Tensor]


def prompt_ids(path: str, context: int, data: str | None = None, prompt_key: str = "prompt",
               max_prompts: int = 16) -> list[list[int]]:
    """The prompts as token ids in the checkpoint's tokenizer, no chat template: the first
    ``max_prompts`` rows of ``data`` (JSONL or Parquet, its ``prompt_key`` text; a bad row is
    refused naming the file, the row and the key), else :data:`OWN_PROMPTS`; each cut to
    ``context`` - 7 tokens (an engine's request must fit: SGLang takes inputs of at most the
    context less 7), those of fewer than two tokens left out."""
    from transformers import AutoTokenizer
    from moe_rl.config import DataConfig
    from moe_rl.data.prompts import encode_prompt, load_prompts
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if data is None:
        ids = [encode_prompt(tokenizer, text, False) for text in OWN_PROMPTS]
    else:
        source = "parquet" if data.endswith(".parquet") else "jsonl"
        ids = [r.ids for r in load_prompts(DataConfig(source=source, path=data,
                                                      prompt_key=prompt_key,
                                                      chat_template=False), tokenizer)]
    out = [list(x)[:context - ENGINE_INPUT_RESERVE] for x in ids[:max_prompts] if len(x) >= 2]
    if not out:
        raise UserError(f"--data: no prompt of two tokens or more in {data or 'its own prompts'}")
    return out


def _router_choice(output) -> torch.Tensor:
    """The integer tensor (top-k expert ids) in a transformers router's output."""
    outputs = output if isinstance(output, tuple) else (output,)
    for t in outputs:
        if torch.is_tensor(t) and not t.is_floating_point():
            return t
    raise TypeError("the router's output holds no expert ids")


def transformers_reference(path: str, prompts: list[list[int]], moe_shape: MoEShape) -> Reference:
    """Run every prompt through transformers' own model (float32) and record its routers'
    choices (``model.layers.<i>.mlp.<router>`` of each MoE layer: transformers 5 holds every
    family's MoE block as ``mlp``, the router under the last name of the family's
    ``HF_ROUTER``, ``gate`` or gpt-oss's ``router``)."""
    from transformers import AutoModelForCausalLM

    with open(os.path.join(path, "config.json")) as fh:
        hf = json.load(fh)
    config = transformers_config(hf)
    router = family(hf.get("model_type")).HF_ROUTER.rsplit(".", 1)[-1]
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                 local_files_only=True,
                                                 **transformers_dequantising(path))
    model.eval()
    picks: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in moe_shape.moe_layers:
        gate = model.get_submodule(f"model.layers.{layer}.mlp.{router}")
        hooks.append(gate.register_forward_hook(
            lambda _m, _i, out, layer=layer: picks.__setitem__(layer, _router_choice(out))))
    ref = Reference(prompts, [], [])
    try:
        for ids in prompts:
            picks.clear()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
            ref.logprobs.append(lp[:, 0])
            chosen = torch.stack([picks[layer].reshape(len(ids), -1)
                                  for layer in moe_shape.moe_layers], 1)
            ref.routing.append(chosen[:-1])
    finally:
        for h in hooks:
            h.remove()
    return ref


def _deltas(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(g.double() - w.double()).abs() for g, w in zip(got, want)])
    return float(d.max()), float(d.mean())


def _per_layer(agreement: dict[str, float], layers: tuple[int, ...]) -> dict[int, float]:
    return {layer: agreement[f"routing/agreement_layer_{layer}"] for layer in layers}


def _samples(ref: Reference, routing: list[torch.Tensor] | None = None) -> list[Sample]:
    """Each prompt as a sample whose first token is the prompt and the rest the scored
    response (tokens 1..), with ``routing`` when given."""
    return [Sample(prompt_ids=torch.tensor(ids[:1]), response_ids=torch.tensor(ids[1:]),
                   rollout_logprobs=torch.zeros(len(ids) - 1),
                   routing=None if routing is None else routing[i])
            for i, ids in enumerate(ref.prompts)]


def check_trainer(path: str, ref: Reference, moe_shape: MoEShape) -> tuple[SideReport, SideReport]:
    """moe_rl's megatron-core model of ``path`` (one process): transformers' routing replayed
    (R3), then its own routing; the agreement is its routers' own choice either way."""
    from moe_rl.trainer.model_builder import build_model
    init_distributed()
    init_model_parallel()
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    model.eval()
    dtype = routing_dtype(moe_shape.num_experts)
    samples = _samples(ref, [r.to(dtype) for r in ref.routing])
    mb = pack_one(samples, list(range(len(samples))), pad_token_id=0,
                  num_experts=moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk,
                           spec.moe_shape.num_experts)
    reports = []
    try:
        for mode in ("replayed", "own"):
            if mode == "replayed":
                ctl.replay(mb.replay_indices())
            else:
                ctl.record()
            with torch.no_grad():
                lp, _ = forward_logprobs(model, mb)
            own = ctl.own_choice() if mode == "replayed" else ctl.recorded()
            ctl.finish_forward()
            agreement = ctl.agreement(mb.replay_indices(), mb.routing_valid_router_order(),
                                      trainer=own)
            got = [lp[b, :len(ids) - 1] for b, ids in enumerate(ref.prompts)]
            reports.append(SideReport(f"trainer, {mode} routing",
                                      _per_layer(agreement, moe_shape.moe_layers),
                                      *_deltas(got, ref.logprobs)))
    finally:
        ctl.close()
    return reports[0], reports[1]


# the largest answer check-model reads from an engine (its prompts' routing and scores)
ENGINE_ANSWER_MB = 256


def check_engine(url: str, ref: Reference, moe_shape: MoEShape, model_path: str,
                 timeout_s: float = 600.0) -> SideReport:
    """The engine server at ``url``: its routing of each prompt (positions ..S-2) and its
    scoring of tokens 1.. (one pass, temperature 1). Bounded: ``timeout_s`` for the whole
    check, :data:`ENGINE_ANSWER_MB` per answer; a silent server, a huge answer or one that is
    not what SGLang sends is one line (UserError)."""
    from moe_rl.config import config_from_dict
    from moe_rl.engines.factory import engine_kind
    # any server speaking SGLang's protocol: the protocol's client, routing requested
    cfg = config_from_dict({"model": {"path": model_path}, "algorithm": {"replay": "r3"},
                            "rollout": {"engine": "reference", "servers": {
                                "max_retries": 1, "request_timeout_s": timeout_s,
                                "health_timeout_s": min(timeout_s, 30.0),
                                "max_answer_mb": ENGINE_ANSWER_MB}}})
    engine = engine_kind(cfg).connect([url], moe_shape)
    samples = _samples(ref)

    async def routings(session):
        return [await session.routing(ids, 0, server=0) for ids in ref.prompts]

    def both():
        engine.score(samples, 1)
        return engine.run(routings)
    try:
        chosen = run_within(both, timeout_s, f"--engine {url}: no complete answer in "
                                             f"{timeout_s:g} s (--engine-timeout)")
    except EngineError as exc:
        raise UserError(f"--engine {url}: {exc}") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UserError(f"--engine {url}: its answer is not SGLang's ({type(exc).__name__}: "
                        f"{str(exc)[:200]})") from None
    got = [s.pass_logprobs[0] for s in samples]
    agreement = routing_agreement(torch.cat(chosen), torch.cat(ref.routing),
                                  layer_names=list(moe_shape.moe_layers))
    return SideReport(f"engine at {url}", _per_layer(agreement, moe_shape.moe_layers),
                      *_deltas(got, ref.logprobs))


def run_within(fn, timeout_s: float, late: str):
    """``fn()``'s result, or UserError(``late``) after ``timeout_s`` seconds (``fn`` runs on a
    daemon thread, left behind when late: the command ends with the refusal)."""
    out: dict = {}

    def call():
        try:
            out["result"] = fn()
        except BaseException as exc:   # re-raised in the caller's thread
            out["error"] = exc
    worker = threading.Thread(target=call, daemon=True, name="check-model engine")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise UserError(late)
    if "error" in out:
        raise out["error"]
    return out["result"]


@contextlib.contextmanager
def started_engine(kind: str, model_path: str, *, dtype: str = "float32", device: str = "cuda",
                   python: str | None = None, extra_args: tuple[str, ...] = (),
                   timeout_s: float = 1800.0) -> Iterator[str]:
    """An engine server of ``kind`` (a ``rollout.engine`` value; SGLang on ``device`` with the
    interpreter ``python`` and ``extra_args``) serving ``model_path`` in ``dtype`` on 127.0.0.1
    with its routing returned, as ``moe-rl train`` starts one; yields its URL, and stops it.
    What the engine refuses, or a server that does not come up (its log kept and named), is
    one UserError line."""

    from moe_rl.config import ConfigError, config_from_dict
    from moe_rl.engines.factory import engine_kind
    tree = {"model": {"path": model_path}, "algorithm": {"replay": "r3"},
            "cluster": {"gpus_per_node": int(device == "cuda")},
            "rollout": dict(engine=kind, engine_dtype=dtype,
                            sglang=dict(device=device, python=python,
                                        extra_args=list(extra_args)))}
    try:
        engines = engine_kind(config_from_dict(tree))
    except ConfigError as exc:
        raise UserError(f"--start-engine {kind}: {exc}") from None
    port, logs = free_port(), tempfile.mkdtemp(prefix="moe_rl_check_model_")
    argv, env = engines.server_command("127.0.0.1", port, [], 0, model_path)
    server = engines.server_process(argv, env, "127.0.0.1", port, os.path.join(logs, "engine.log"))
    try:
        server.start(timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise UserError(f"--start-engine {kind}: the server did not come up ({exc}); its log: "
                        f"{logs}/engine.log") from None
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(logs, ignore_errors=True)


def format_report(reports: list[SideReport], tokens: int, prompts: int) -> list[str]:
    """The table: one row per side and MoE layer."""
    lines = [f"{prompts} prompts, {tokens} scored tokens; against transformers (float32):",
             f"{'side':<34} {'layer':>5} {'agreement':>9} {'max |dlp|':>10} {'mean |dlp|':>10}"]
    for r in reports:
        for i, (layer, a) in enumerate(r.agreement.items()):
            deltas = (f"{r.max_abs_delta:>10.3g} {r.mean_abs_delta:>10.3g}" if i == 0
                      else f"{'':>10} {'':>10}")
            lines.append(f"{r.name if i == 0 else '':<34} {layer:>5} {a:>9.4f} {deltas}")
    return lines


def verdict(reports: list[SideReport], min_agreement: float, max_abs_delta: float
            ) -> tuple[bool, str]:
    """(aligned, the verdict line)."""
    failed = [f"{r.name}: {f}" for r in reports for f in r.failures(min_agreement, max_abs_delta)]
    if failed:
        return False, "NOT ALIGNED: " + "; ".join(failed)
    worst = max(r.max_abs_delta for r in reports)
    low = min(min(r.agreement.values()) for r in reports)
    return True, (f"aligned: routing agreement >= {low:.4f} on every layer (threshold "
                  f"{min_agreement}), max |delta log-prob| {worst:.3g} (threshold "
                  f"{max_abs_delta})")
