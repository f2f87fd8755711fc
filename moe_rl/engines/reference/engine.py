"""CPU reference inference engine: a Hugging Face ``transformers`` MoE model that generates and
scores with SGLang's semantics, recording per-layer routing and the sampler's kept sets.

Semantics (as SGLang): output log-probs are ``log_softmax(logits / T)`` before truncation
(raw ``log_softmax(logits)`` when the environment sets SGLANG_RETURN_ORIGINAL_LOGPROB=1, and for
greedy sampling); input (prefill) log-probs are raw (T = 1), and so are the per-position
log-probs of the ids a request lists in ``token_ids_logprob`` (``input_token_ids_logprobs``,
``output_token_ids_logprobs``). With ``return_sampling_mask`` the response carries the kept ids
and ``output_token_sampling_logprobs``: with ``sampling_logprobs_mode`` "selected" (the default)
the sampled token's log-prob under the renormalised kept set at temperature T, with "support"
one such log-prob per kept id, aligned with the ids. The kept set of a sampled token is
top-k ∩ top-p on the temperature-scaled probabilities (top-p keeps a token when the mass ranked
strictly above it is <= p, so the crossing token is kept), then min-p relative to the most likely
token; the token is drawn from the renormalised kept set. Routing covers every position the model
ran: all prompt tokens and every generated token but the last, ``[P+R-1, num_hidden_layers, K]``
with dense layers 0.
"""
from __future__ import annotations

import base64
import functools
import inspect
import math
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
import gc

import numpy as np
import torch
from transformers import DynamicCache

from moe_rl.errors import first_line
from moe_rl.engines.reference.scratch import engine_scratch, sweep_engine_scratch
from moe_rl.families.shape import MoEShape
from moe_rl.plugins import PluginTimeout, call_bounded
from moe_rl.engines.reference import split_kv
from moe_rl.engines.reference.fp8_inference import apply_fp8
from moe_rl.engines.reference.mxfp4_inference import apply_mxfp4
from moe_rl.engines.reference.prefix_cache import CacheHit, PrefixCache
from moe_rl.rollout_record import MODEL_DTYPES
from moe_rl.weights.fp8 import is_fp8_checkpoint, read_fp8_checkpoint, write_dequantised_checkpoint
from moe_rl.weights.serialize import parse_dtype
from moe_rl.engines.sglang.weights import close_group, open_group, receive_tensors

# unquantised float dtypes a weight update may announce for one another (received, then cast to
# the served checkpoint's dtype, as SGLang's load_weights does); FP8 weights must match exactly
CASTABLE = {str(torch.float32), str(torch.bfloat16), str(torch.float16)}


class RequestError(ValueError):
    """A malformed request (HTTP 400); the message names the field."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: int = 1


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str = "selected"
    token_ids_logprob: list[int] | None = None


SAMPLING_LOGPROBS_MODES = ("selected", "support")
ABORTED = {"type": "abort", "message": "Abort request"}   # SGLang's finish_reason of an abort
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def _num(value, name, kind=float, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        raise RequestError(f"{name}: expected {'an integer' if kind is int else 'a number'}, "
                           f"got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{name}: expected a finite number, got {value!r}")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (
            hi is not None and value > hi):
        raise RequestError(f"{name}: {value!r} is out of range")
    return kind(value)


def parse_sampling_params(raw: dict | None, mask_cap: int, want_mask: bool) -> SamplingParams:
    """Validate SGLang ``sampling_params``; RequestError names the bad field."""
    raw = dict(raw or {})
    known = {f for f in SamplingParams.__dataclass_fields__} | {"n", "skip_special_tokens",
                                                                 "no_stop_trim", "stop"}
    unknown = set(raw) - known
    if unknown:
        raise RequestError(f"sampling_params: unknown field(s) {sorted(unknown)}")
    p = SamplingParams()
    if "n" in raw:
        p.n = _num(raw["n"], "sampling_params.n", int, lo=1)
    if "temperature" in raw:
        p.temperature = _num(raw["temperature"], "sampling_params.temperature", lo=0)
    if "top_p" in raw:
        p.top_p = _num(raw["top_p"], "sampling_params.top_p", lo=0, hi=1, lo_open=True)
    if "top_k" in raw:
        p.top_k = _num(raw["top_k"], "sampling_params.top_k", int)
        if p.top_k == 0 or p.top_k < -1:
            raise RequestError("sampling_params.top_k: expected -1 (off) or >= 1")
    if "min_p" in raw:
        p.min_p = _num(raw["min_p"], "sampling_params.min_p", lo=0, hi=1)
    if "max_new_tokens" in raw:
        p.max_new_tokens = _num(raw["max_new_tokens"], "sampling_params.max_new_tokens", int, lo=0)
    if "stop_token_ids" in raw and raw["stop_token_ids"] is not None:
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise RequestError("sampling_params.stop_token_ids: expected a list of integers")
        p.stop_token_ids = ids
    if "ignore_eos" in raw:
        if not isinstance(raw["ignore_eos"], bool):
            raise RequestError("sampling_params.ignore_eos: expected a boolean")
        p.ignore_eos = raw["ignore_eos"]
    if raw.get("sampling_seed") is not None:
        p.sampling_seed = _num(raw["sampling_seed"], "sampling_params.sampling_seed", int,
                               lo=0, hi=2 ** 63 - 1)
    if want_mask and p.temperature > 0 and not (1 <= p.top_k <= mask_cap):
        raise RequestError(f"return_sampling_mask: needs a finite sampling_params.top_k with "
                           f"1 <= top_k <= {mask_cap} (--sampling-mask-max-tokens) or greedy "
                           f"sampling; got top_k={p.top_k}")
    return p


SAMPLING_BACKENDS = ("flashinfer", "pytorch")


def kept_set(probs: torch.Tensor, top_k: int, top_p: float, min_p: float,
             backend: str = "flashinfer") -> torch.Tensor:
    """Token ids the sampler keeps, most likely first.

    ``flashinfer`` (SGLang's default on GPUs): top-k keeping every token tied with the k-th
    probability, then top-p on the top-k distribution renormalised (a token is kept when the
    mass ranked above it is <= p, and so is every token tied with the last one kept), then min-p
    relative to the most likely token. ``pytorch`` (SGLang's torch sampler): top-p on the full
    distribution, then exactly k tokens, then min-p.
    """
    if backend not in SAMPLING_BACKENDS:
        raise ValueError(f"sampling backend: expected one of {SAMPLING_BACKENDS}, got {backend!r}")
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if backend == "pytorch":
        keep &= (torch.cumsum(sorted_p, 0) - sorted_p) <= top_p
        if top_k > 0:
            keep[top_k:] = False
    else:
        if 0 < top_k < len(sorted_p):
            keep &= sorted_p >= sorted_p[top_k - 1]
        q = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        q = q / q.sum()
        nucleus = keep & ((torch.cumsum(q, 0) - q) <= top_p)
        nucleus[0] = True
        keep &= sorted_p >= sorted_p[nucleus].min()
    if min_p > 0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    return order[keep]


@dataclass(eq=False)
class _Row:
    """One running request of the continuous batch."""
    req: Request
    handle: object                 # the caller's token for this request (a future)
    gen: torch.Generator
    reserved: int                  # tokens admitted for it: input + max_new_tokens
    state: dict = field(default_factory=lambda: {"out": [], "lp": [], "mask": [], "mask_lp": [],
                                                 "ids_lp": []})
    routing: list = field(default_factory=list)   # [positions, L_moe, K] per forward
    pending: int | None = None     # sampled, not yet fed back
    cached: int = 0                # input tokens served from the prefix cache
    finish: dict | None = None
    error: Exception | None = None


@dataclass(eq=False)
class _Batch:
    """Rows decoded together: their KV cache [B, H, S, D] per layer and attention mask [B, S]
    (left padding masked)."""
    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep``; drop the cache columns no remaining row attends to."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            return
        mask = self.mask[keep]
        first = int(mask.any(0).nonzero()[0])
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[keep, :, first:]
            layer.values = layer.values[keep, :, first:]

    def merge(self, other: "_Batch") -> None:
        """Append ``other``'s rows, left-padding the shorter side's cache and mask (padding is
        masked out, so it changes no result beyond float rounding)."""
        L = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, L), _left_pad(other.mask, L)], dim=0)
        for layer, new in zip(self.cache.layers, other.cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, L), _left_pad(new.keys, L)], dim=0)
            layer.values = torch.cat([_left_pad(layer.values, L), _left_pad(new.values, L)],
                                     dim=0)
        self.rows.extend(other.rows)


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dimension 1 (mask [B, S]) or -2 (cache [B, H, S, D]) on the left to ``length``."""
    dim = 1 if t.dim() == 2 else -2
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def encode_routing(rows: np.ndarray) -> str:
    """SGLang's routed_experts payload: base64 of little-endian int32, flat."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


SAFETENSORS_DTYPES = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16",
                      "F64": "torch.float64", "F8_E4M3": "torch.float8_e4m3fn"}


def checkpoint_spec(model_path: str) -> dict[str, tuple[list[int], str]]:
    """{tensor name: (shape, torch dtype name)} of a HF safetensors checkpoint, read from the
    files' headers (no tensor is loaded)."""
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    spec = {}
    for fname in files:
        with safe_open(os.path.join(model_path, fname), "pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                spec[key] = (list(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype(),
                                                                          sl.get_dtype()))
    return spec


def _fp32_linear(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head in float32 (SGLang's --enable-fp32-lm-head on CPU: both operands cast)."""
    bias = None if head.bias is None else head.bias.float()
    return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


class ReferenceEngine:
    """Holds the model; ``run`` executes a batch of requests (generation and scoring)."""

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0,
                 sampling_mask_max_tokens: int = 4096, return_routed_experts: bool = True,
                 sampling_backend: str = "flashinfer", deterministic_inference: bool = False,
                 prefix_cache_tokens: int = 1 << 16, quantization: str = "none",
                 group_timeout_s: float = 120.0, fp32_lm_head: bool = False):
        if quantization not in ("none", "fp8", "mxfp4"):
            raise ValueError(f"quantization: expected 'none', 'fp8' or 'mxfp4', got "
                             f"{quantization!r}")
        self.quantization = quantization
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
        self.dtype_name = dtype
        self.fp32_lm_head = fp32_lm_head   # SGLang's --enable-fp32-lm-head
        self.seed = seed
        self.mask_cap = sampling_mask_max_tokens
        self.routing_enabled = return_routed_experts   # SGLang: --enable-return-routed-experts
        if sampling_backend not in SAMPLING_BACKENDS:
            raise ValueError(f"sampling_backend: expected one of {SAMPLING_BACKENDS}, got "
                             f"{sampling_backend!r}")
        self.sampling_backend = sampling_backend
        self.lock = threading.Lock()
        self.weight_version = "default"   # SGLang's until the first update names one
        self._requests_seen = 0
        self.groups: dict = {}
        self.in_update_session = False
        self.session = 0                     # number of the open (or last) weight-update session
        self._update_lock = threading.Lock()   # begin, end and a bucket's receive: one at a time
        self.group_timeout_s = group_timeout_s   # joining a weight-update group, at most
        self.max_context = 1 << 30
        self._received_dir: str | None = None
        sweep_engine_scratch()   # scratch of engines that were killed
        self._scratch = engine_scratch()   # gone at exit
        self._staged: dict[str, torch.Tensor] = {}   # buckets of an update not yet committed
        self.deterministic = deterministic_inference
        # 0: SGLang's --disable-radix-cache; deterministic inference computes every request
        # from scratch, so its numbers never depend on what ran before it either
        self.prefix_cache = PrefixCache(0 if deterministic_inference else prefix_cache_tokens)
        self.batches: list[_Batch] = []    # the running requests with their KV caches
        self._raw_logprobs = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0").lower() in (
            "1", "true")
        self.load(model_path)

    def load(self, model_path: str) -> None:
        """(Re)load weights from a local HF checkpoint directory, atomically: the checkpoint is
        loaded and checked (every weight present, none unknown or of another shape, all finite)
        before it replaces the served model; on any failure the old model, weights and routing
        layout stay and ValueError names what was wrong. Never downloads. An FP8 checkpoint
        (``quantization_config`` fp8, as SGLang serves) is served with FP8 numerics from its own
        E4M3 values and scales."""
        import transformers
        if not os.path.isdir(model_path) or not os.path.isfile(
                os.path.join(model_path, "config.json")):
            raise ValueError(f"model_path: {model_path!r} is not a local directory with a "
                             f"config.json (the engine never downloads)")
        exact, source = None, model_path
        if is_fp8_checkpoint(model_path):   # loaded through its dequantised twin
            exact = read_fp8_checkpoint(model_path)
            source = write_dequantised_checkpoint(
                model_path, tempfile.mkdtemp(prefix="fp8_", dir=self._scratch.name),
                torch.float32)
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                source, dtype=MODEL_DTYPES[self.dtype_name], local_files_only=True,
                output_loading_info=True, attn_implementation=split_kv.register())
        finally:
            if source != model_path:
                shutil.rmtree(source, ignore_errors=True)
        problems = {k: sorted(v)[:5] for k, v in info.items()
                    if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if problems:
            raise ValueError(f"model_path: {model_path}: checkpoint does not match the model: "
                             f"{problems}")
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise ValueError(f"model_path: {model_path}: non-finite weights in {bad[:5]}")
        model.eval()
        if self.quantization == "fp8" or exact is not None:   # quantised at every load
            apply_fp8(model, exact)
        elif self.quantization == "mxfp4":
            apply_mxfp4(model)
        if self.fp32_lm_head:
            head = model.get_output_embeddings()
            head.forward = functools.partial(_fp32_linear, head)
        hf = model.config.to_dict()
        moe_shape = MoEShape.from_hf(hf)
        if not moe_shape.moe_layers:
            raise ValueError(f"{model_path}: the reference engine serves MoE models only")
        routers = self._routers(model, moe_shape)
        try:   # a model the engine cannot run is refused now, not at every request
            with torch.no_grad(), split_kv.split_policy(self.deterministic):
                model(input_ids=torch.zeros((1, 2), dtype=torch.long))
        except Exception as exc:
            raise ValueError(f"model_path: {model_path}: the reference engine cannot run this "
                             f"model ({type(exc).__name__}: {exc})") from exc
        spec = checkpoint_spec(model_path)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_path,
                                                                   local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
        with self.lock:
            self.moe_shape = moe_shape
            self._captured: list[torch.Tensor] = []
            for m in routers:
                m.register_forward_hook(
                    lambda mod, inp, out: self._captured.append(out[2].detach()))
            self.max_context = int(hf.get("max_position_embeddings") or 1 << 30)
            self.checkpoint_spec = spec
            self.tokenizer = tokenizer
            self.model = model
            # transformers 5.24 renamed the KV cache argument `cache` (`past_key_values`, which
            # 5.19-5.23 take, warns there and goes in 5.40)
            self._cache_arg = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")
            self.prefix_cache.flush()   # stored KV belongs to the old weights
            self.model_path = model_path
            self.vocab_size = int(hf["vocab_size"])
            # every end id SGLang stops at: config.json's, generation_config.json's, the
            # tokenizer's end token and its turn-end added tokens
            self.eos = frozenset(MoEShape.from_model_dir(model_path).eos_ids)
            self.window = (hf.get("sliding_window") if "sliding_attention"
                           in (hf.get("layer_types") or ()) else None)

    # ------------------------------------------------------------------ forward helpers
    @staticmethod
    def _routers(model, moe_shape) -> list:
        """The MoE routers whose expert choice (their third output) is recorded."""
        routers = [m for m in model.modules()
                   if type(m).__name__.lower().endswith("topkrouter")]
        if len(routers) != len(moe_shape.moe_layers):
            raise ValueError(f"found {len(routers)} routers for {len(moe_shape.moe_layers)} MoE "
                             f"layers")
        return routers

    def _position_masks(self, mask: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The additive attention masks [B, 1, S, T] of a model with sliding-window layers, by
        position: a row's cache may hold pads between its cached and its new tokens (see
        :meth:`_prefill_batch`), which transformers' masks would count into the window as
        keys. Key column j of row b holds position (its real keys up to j) - 1; query i sees it
        when that position is at most its own and, in a window layer, within ``window`` of it."""
        key_pos = mask.cumsum(-1) - 1                              # [B, T]
        behind = pos[:, :, None] - key_pos[:, None, :]             # [B, S, T]
        causal = mask.bool()[:, None, :] & (behind >= 0)
        low = torch.finfo(MODEL_DTYPES[self.dtype_name]).min

        def additive(allowed):
            return torch.where(allowed, 0.0, low).to(MODEL_DTYPES[self.dtype_name])[:, None]
        return {"full_attention": additive(causal),
                "sliding_attention": additive(causal & (behind < self.window))}

    def _forward(self, ids, mask, pos, cache):
        """Logits [B, S, V] (float32) and the routers' choices [B, S, L_moe, K]; ``cache`` grows."""
        self._captured = []
        if self.window is not None:
            mask = self._position_masks(mask, pos)
        with split_kv.split_policy(self.deterministic):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             use_cache=True, **{self._cache_arg: cache})
        B, S = ids.shape
        topk = torch.stack([t.reshape(B, S, -1) for t in self._captured], dim=2)
        return out.logits.float(), topk

    def _full_routing(self, moe_rows: torch.Tensor) -> np.ndarray:
        """[N, L_moe, K] -> [N, num_hidden_layers, K] with dense layers 0 (SGLang layout)."""
        shape = self.moe_shape
        full = np.zeros((moe_rows.shape[0], shape.num_layers, shape.topk), np.int32)
        full[:, list(self.moe_shape.moe_layers)] = moe_rows.numpy()
        return full

    def validate(self, req: Request) -> None:
        """Token ids in range, lengths consistent; RequestError names the field."""
        ids = req.input_ids
        if not ids:
            raise RequestError("input_ids: expected at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size
               for t in ids):
            raise RequestError(f"input_ids: token ids must be integers in [0, {self.vocab_size})")
        if req.logprob_start_len >= len(ids):
            raise RequestError(f"logprob_start_len: {req.logprob_start_len} must be < the input "
                               f"length {len(ids)}")
        if len(ids) + req.params.max_new_tokens > self.max_context:
            raise RequestError(f"input_ids: {len(ids)} tokens + sampling_params.max_new_tokens "
                               f"{req.params.max_new_tokens} exceed the model's context "
                               f"({self.max_context})")
        if req.routed_experts_start_len < 0 or req.routed_experts_start_len > len(ids):
            raise RequestError("routed_experts_start_len: must lie in [0, input length]")
        if req.sampling_logprobs_mode not in SAMPLING_LOGPROBS_MODES:
            raise RequestError(f"sampling_logprobs_mode: expected one of "
                               f"{list(SAMPLING_LOGPROBS_MODES)}, got "
                               f"{req.sampling_logprobs_mode!r}")
        if req.token_ids_logprob is not None and any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab_size
                for t in req.token_ids_logprob):
            raise RequestError(f"token_ids_logprob: token ids must be integers in "
                               f"[0, {self.vocab_size})")

    # ------------------------------------------------------------------ memory and weight sync
    def close(self) -> None:
        """Remove the engine's temporary files (received weights)."""
        self._scratch.cleanup()

    def release_memory(self) -> None:
        """Drop the model's weights from memory (colocated training); /generate is refused until
        :meth:`resume_memory`."""
        with self.lock:
            self.model = None
            self.prefix_cache.flush()
            gc.collect()

    def resume_memory(self) -> None:
        """Reload the weights released by :meth:`release_memory`."""
        if self.model is None:
            self.load(self.model_path)

    def init_update_group(self, master_address: str, master_port: int, rank_offset: int,
                          world_size: int, group_name: str, backend: str) -> None:
        """Join the trainer's weight-update group (blocks until every member joined, at most
        ``group_timeout_s``: past it the attempt is abandoned on its thread and RequestError
        says so). Rank 0 hosts the group's store and belongs to the trainer."""
        if rank_offset < 1 or rank_offset >= world_size:
            raise RequestError(f"rank_offset: expected 1 <= rank_offset < world_size "
                               f"({world_size}); rank 0 is the trainer, which hosts the group")
        if backend != "gloo":
            raise RequestError(f"backend: the CPU reference engine supports 'gloo', got "
                               f"{backend!r}")
        limit = self.group_timeout_s
        try:   # bounded from outside too: a peer that accepts and never answers hangs torch
            self.groups[group_name] = call_bounded(
                lambda: open_group(backend, master_address, master_port, rank_offset,
                                   world_size, group_name, timeout_s=limit), timeout_s=limit)
        except (RuntimeError, OSError, PluginTimeout) as exc:   # nobody answered in time
            raise RequestError(f"init_weights_update_group: could not join group "
                               f"{group_name!r} at {master_address}:{master_port} within "
                               f"{self.group_timeout_s:g} s: {first_line(exc)}") from None

    def destroy_update_group(self, group_name: str) -> None:
        """Leave weight-update group ``group_name``."""
        if group_name not in self.groups:
            raise RequestError(f"group_name: no weight-update group {group_name!r}")
        close_group(self.groups.pop(group_name))

    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23 loads distributed and tensor updates only
        between /begin_weight_update and /end_weight_update; a second begin is refused). Waits
        for a bucket being received; anything staged before is dropped."""
        with self._update_lock:
            if self.in_update_session:
                raise RequestError("begin_weight_update: a weight-update session is already "
                                   "open")
            self.session += 1
            self.in_update_session = True
            self._staged = {}

    def end_weight_update(self) -> None:
        """Close the session opened by :meth:`begin_weight_update`, after the bucket being
        received (if any) is in; buckets of an update that never committed are dropped (the
        served weights stay) and the call says so."""
        with self._update_lock:
            if not self.in_update_session:
                raise RequestError("end_weight_update: no weight-update session is open")
            self.in_update_session = False
            if self._staged:
                self._staged = {}
                raise RequestError("end_weight_update: the update's last bucket (flush_cache: "
                                   "true) never came; its staged buckets are dropped, the served "
                                   "weights are unchanged")

    def check_announcement(self, names, dtypes, shapes) -> None:
        """An update's announced tensors against the served checkpoint, before anything is
        allocated: every name a tensor of the served model, announced once per update, with its
        shape, and its dtype or another unquantised float one (SGLang receives a tensor in the
        announced dtype and loads it into the model's, model_runner_components/
        weight_updater.py: a bfloat16 trainer updates a float32 checkpoint). RequestError names
        the tensor and what was expected."""
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)) or not (
                len(names) == len(dtypes) == len(shapes)):
            raise RequestError("names, dtypes, shapes: expected lists of equal length")
        seen: set = set()
        for name, dt, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or name not in self.checkpoint_spec:
                raise RequestError(f"names: {name!r} is not a tensor of the served model")
            if name in seen or name in self._staged:
                raise RequestError(f"names: {name!r} is sent twice in this update")
            seen.add(name)
            want_shape, want_dtype = self.checkpoint_spec[name]
            if (not isinstance(shape, list) or any(
                    not isinstance(d, int) or isinstance(d, bool) for d in shape) or
                    shape != want_shape):
                raise RequestError(f"shapes: {name}: announced {shape!r}, the served model's "
                                   f"is {want_shape}")
            try:
                dtype = str(parse_dtype(dt))
            except (ValueError, TypeError, AttributeError):
                dtype = None
            if dtype != want_dtype and (dtype not in CASTABLE or want_dtype not in CASTABLE):
                raise RequestError(f"dtypes: {name}: announced {dt!r}, the served model's is "
                                   f"{want_dtype.removeprefix('torch.')}")

    def update_from_distributed(self, names, dtypes, shapes, group_name: str,
                                flush_cache: bool = True) -> bool:
        """Receive one bucket of broadcast weights (HF names) inside a session. The announcement
        is checked first (:meth:`check_announcement`); buckets are staged for the open session
        (begin and end wait for a receive to finish); the one with ``flush_cache`` (SGLang's
        marker of an update's last request) commits them: the staged set must then be the
        served checkpoint's, exactly, all finite, and replaces the served weights atomically;
        on any refusal the staged buckets are dropped and the served weights stay. Returns
        whether this request committed."""
        with self._update_lock:
            if not self.in_update_session:
                raise RequestError("update_weights_from_distributed: outside a weight-update "
                                   "session; POST /begin_weight_update first")
            if group_name not in self.groups:
                raise RequestError(f"group_name: no weight-update group {group_name!r}; call "
                                   f"/init_weights_update_group first")
            try:
                self.check_announcement(names, dtypes, shapes)
            except RequestError:
                self._staged = {}
                raise
            try:   # a sender that vanished mid-broadcast: SGLang answers 400, success false
                received = receive_tensors(self.groups[group_name], names, dtypes, shapes)
            except Exception as exc:   # noqa: BLE001 - the collective's error, whatever it is
                self._staged = {}
                raise RequestError(f"update_weights_from_distributed: the broadcast failed "
                                   f"({type(exc).__name__}: {first_line(exc)}); the served "
                                   f"weights are unchanged") from None
            tensors = {k: t.to(getattr(torch, self.checkpoint_spec[k][1].removeprefix("torch.")))
                       for k, t in received.items()}   # as SGLang loads them
            bad = sorted(k for k, t in tensors.items() if not torch.isfinite(t.float()).all())
            missing = (sorted(set(self.checkpoint_spec) - set(tensors) - set(self._staged))
                if flush_cache else [])
            if bad or missing:
                self._staged = {}
                raise RequestError(f"update_weights_from_distributed: refused, the served "
                                   f"weights are unchanged: missing {missing[:5]}, non-finite "
                                   f"{bad[:5]}")
            self._staged.update(tensors)
            if not flush_cache:
                return False
            tensors, self._staged = self._staged, {}
            self._serve_received(tensors)
            return True

    def _serve_received(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write a complete received weight set beside the served checkpoint's config and load
        it (the previous received set is removed once the new one serves)."""
        from safetensors.torch import save_file
        target = tempfile.mkdtemp(prefix="weights_", dir=self._scratch.name)
        try:
            save_file(tensors, os.path.join(target, "model.safetensors"))
            for fname in os.listdir(self.model_path):
                if (fname.endswith(".json") and fname != "model.safetensors.index.json" or
                        fname.endswith(".jinja")):
                    shutil.copy2(os.path.join(self.model_path, fname), target)
            self.load(target)
        except Exception:
            shutil.rmtree(target, ignore_errors=True)
            raise
        previous = self._received_dir
        self._received_dir = target
        if previous:
            shutil.rmtree(previous, ignore_errors=True)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests are running, as SGLang."""
        with self.lock:
            if self.running:
                return False
            self.prefix_cache.flush()
            return True

    # ------------------------------------------------------------------ continuous batching
    @property
    def running(self) -> list["_Row"]:
        """The requests generating now."""
        return [row for batch in self.batches for row in batch.rows]

    def tokens_in_flight(self) -> int:
        """Tokens reserved by the running requests (input + max_new_tokens each)."""
        return sum(row.reserved for row in self.running)

    @torch.no_grad()
    def step(self, admit: list[tuple[Request, object]], drop: set[int] = frozenset(),
             abort=None) -> list[tuple[object, dict | Exception]]:
        """One scheduling iteration (continuous batching, as SGLang): forget the running rows
        whose handle id is in ``drop`` (their client left), finish the running requests
        ``abort(request)`` names with what they generated (finish_reason abort, as SGLang's
        /abort_request), prefill ``admit`` (request, handle) pairs and sample their first token,
        then decode one token for every running row. Returns (handle, response or exception) of
        every request that finished; a request that fails (in its sampling) fails alone."""
        with self.lock:
            if self.model is None:
                err = RequestError("the engine's memory is released: POST "
                                   "/resume_memory_occupation first")
                done = [(h, err) for _, h in admit] + [(r.handle, err) for r in self.running]
                self.batches = []
                return done
            if drop:
                for batch in self.batches:
                    batch.select([i for i, r in enumerate(batch.rows)
                                  if id(r.handle) not in drop])
                self.batches = [b for b in self.batches if b.rows]
            done: list = []
            if abort is not None:
                for batch in self.batches:
                    for row in batch.rows:
                        if abort(row.req):
                            row.finish = ABORTED
                    batch.select(self._collect(batch, done))
                self.batches = [b for b in self.batches if b.rows]
            try:
                if admit:
                    self._prefill(admit, done)
                for batch in self.batches:
                    self._decode(batch, done)
            except Exception as exc:   # the batch's forward failed: its requests fail with it
                answered = {id(h) for h, _ in done}
                pending = [h for _, h in admit] + [r.handle for r in self.running]
                done += [(h, exc) for h in dict.fromkeys(pending) if id(h) not in answered]
                self.batches = []
            self.batches = [b for b in self.batches if b.rows]
            return done

    def run(self, reqs: list[Request]) -> list[dict]:
        """Run ``reqs`` to completion together (in-process use); one SGLang response each."""
        handles = list(range(len(reqs)))
        results: dict = dict(self.step(list(zip(reqs, handles))))
        while self.batches:
            results.update(self.step([]))
        out = [results[h] for h in handles]
        for res in out:
            if isinstance(res, Exception):
                raise res
        return out

    def _new_row(self, r: Request, handle) -> "_Row":
        seed = r.params.sampling_seed
        if seed is None:
            seed = self.seed * 1_000_003 + self._requests_seen
        self._requests_seen += 1
        return _Row(r, handle, torch.Generator().manual_seed(seed),
                    reserved=len(r.input_ids) + r.params.max_new_tokens)

    def _prefill(self, admit: list[tuple[Request, object]], done: list) -> None:
        """Prefill the admitted requests, sample each one's first token and add the rows still
        generating to the running batch: together, left-padded, or (deterministic inference)
        each alone, as its own batch, so no request's numbers depend on another's."""
        rows = [self._new_row(r, h) for r, h in admit]
        hits = [self.prefix_cache.match(row.req.input_ids, self._reusable(row.req))
                for row in rows]
        pairs = list(zip(rows, hits))
        for group in ([[p] for p in pairs] if self.deterministic else [pairs]):
            batch = self._prefill_batch([r for r, _ in group], done, [h for _, h in group])
            if not batch.rows:
                continue
            if self.deterministic or not self.batches:
                self.batches.append(batch)
            else:
                self.batches[0].merge(batch)

    @staticmethod
    def _reusable(r: Request) -> int:
        """Most input positions a prefix-cache hit may cover: all but the last, and (as SGLang)
        none from ``logprob_start_len`` on when input log-probs are asked (they are computed
        from this request's own prefill)."""
        if r.return_logprob and r.logprob_start_len >= 0:
            return min(len(r.input_ids) - 1, r.logprob_start_len)
        return len(r.input_ids) - 1

    def _prefill_batch(self, rows: list["_Row"], done: list, hits: list[CacheHit | None]
                       ) -> "_Batch":
        """Prefill ``rows`` together. A row with a prefix-cache hit computes only the positions
        after it, on top of the stored KV, and the stored routing stands for the cached
        positions. Layout per row: [pad, cached KV, pad, new tokens], the cached part and the
        new part each right-aligned in a window as long as the longest (pads masked, positions
        given), so hits and misses of any lengths share one forward."""
        B = len(rows)
        cached = [h.length if h is not None else 0 for h in hits]
        new = [len(r.req.input_ids) - c for r, c in zip(rows, cached)]
        C, S = max(cached), max(new)
        cache = DynamicCache()
        if C:
            stored = [h.layers() if h is not None else None for h in hits]
            for layer in range(len(next(x for x in stored if x is not None))):
                parts_k, parts_v = [], []
                for b in range(B):
                    if stored[b] is None:
                        k0, v0 = next(x for x in stored if x is not None)[layer]
                        parts_k.append(k0.new_zeros(k0.shape[:2] + (C, k0.shape[3])))
                        parts_v.append(v0.new_zeros(v0.shape[:2] + (C, v0.shape[3])))
                    else:
                        k, v = stored[b][layer]
                        parts_k.append(_left_pad(k, C))
                        parts_v.append(_left_pad(v, C))
                cache.update(torch.cat(parts_k), torch.cat(parts_v), layer)
        ids = torch.zeros((B, S), dtype=torch.long)
        mask = torch.zeros((B, C + S), dtype=torch.long)
        pos = torch.zeros((B, S), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, S - new[b]:] = torch.tensor(r.req.input_ids[cached[b]:])
            mask[b, C - cached[b]:C] = 1
            mask[b, C + S - new[b]:] = 1
            pos[b, S - new[b]:] = torch.arange(cached[b], len(r.req.input_ids))
        batch = _Batch(rows, cache, mask)
        logits, topk = self._forward(ids, mask, pos, cache)
        for b, row in enumerate(rows):
            row.cached = cached[b]
            if hits[b] is not None:
                row.routing.append(hits[b].routing())
            row.routing.append(topk[b, S - new[b]:])
            try:   # a request's own failure fails it alone
                self._keep_input_logprobs(row, logits[b, S - new[b]:], cached[b])
            except Exception as exc:
                row.error = exc
        for b, row in enumerate(rows):
            if row.error is not None:
                continue
            if row.req.params.max_new_tokens == 0:
                row.finish = {"type": "length", "length": 0}
                if row.req.return_logprob and row.req.token_ids_logprob:
                    # SGLang lists the ids at the position after the input too
                    raw = torch.log_softmax(logits[b, -1].float(), -1)
                    row.state["ids_lp"] = [[[float(raw[v]), v, None]
                                            for v in row.req.token_ids_logprob]]
            else:
                self._advance(row, logits[b, -1])
        batch.select(self._collect(batch, done))
        return batch

    def _decode(self, batch: "_Batch", done: list) -> None:
        """Feed every row of ``batch`` its pending token and sample the next one."""
        B = len(batch.rows)
        ids = torch.tensor([[row.pending] for row in batch.rows], dtype=torch.long)
        pos = batch.mask.sum(-1, keepdim=True)
        batch.mask = torch.cat([batch.mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
        logits, topk = self._forward(ids, batch.mask, pos, batch.cache)
        for b, row in enumerate(batch.rows):
            row.routing.append(topk[b, -1:])
            self._advance(row, logits[b, -1])
        batch.select(self._collect(batch, done))

    def _advance(self, row: "_Row", logits: torch.Tensor) -> None:
        """Sample the row's next token (a failure finishes the row with its error)."""
        r = row.req
        try:
            tok = self._sample(logits, r, row.state, row.gen, self._raw_logprobs)
        except Exception as exc:
            row.error = exc
            return
        row.state["out"].append(tok)
        row.pending = tok
        if (tok in self.eos and not r.params.ignore_eos) or tok in r.params.stop_token_ids:
            row.finish = {"type": "stop", "matched": tok}
        elif len(row.state["out"]) >= r.params.max_new_tokens:
            row.finish = {"type": "length", "length": r.params.max_new_tokens}

    def _collect(self, batch: "_Batch", done: list) -> list[int]:
        """Answer the finished rows of ``batch`` into ``done`` (storing their KV and routing in
        the prefix cache); the indices of those still generating."""
        live = []
        for i, row in enumerate(batch.rows):
            if row.error is not None:
                done.append((row.handle, row.error))
            elif row.finish is not None:
                try:
                    self._cache_finished(batch, i)
                    done.append((row.handle, self._response(row)))
                except Exception as exc:
                    done.append((row.handle, exc))
            else:
                live.append(i)
        return live

    def _cache_finished(self, batch: "_Batch", b: int) -> None:
        """Store the KV and routing of row ``b``'s computed positions (its input and every
        generated token fed back) in the prefix cache."""
        if self.prefix_cache.capacity == 0:
            return
        row = batch.rows[b]
        out = row.state["out"]
        ids = list(row.req.input_ids) + out[:max(len(out) - 1, 0)]
        cols = batch.mask[b].bool()
        if int(cols.sum()) != len(ids):
            raise RuntimeError(f"prefix cache: row holds {int(cols.sum())} KV positions for "
                               f"{len(ids)} tokens")
        self.prefix_cache.insert(ids, [layer.keys[b][:, cols] for layer in batch.cache.layers],
                                 [layer.values[b][:, cols] for layer in batch.cache.layers],
                                 torch.cat(row.routing, dim=0)[:len(ids)])

    def _sample(self, logits: torch.Tensor, r: Request, s: dict, gen: torch.Generator,
                raw_env: bool) -> int:
        p = r.params
        raw = torch.log_softmax(logits, -1)
        if r.token_ids_logprob:
            s["ids_lp"].append([[float(raw[t]), t, None] for t in r.token_ids_logprob])
        if p.temperature == 0:
            tok = int(logits.argmax())
            s["lp"].append(float(raw[tok]))
            s["mask"].append([tok])
            s["mask_lp"].append([0.0] if r.sampling_logprobs_mode == "support" else 0.0)
            return tok
        scaled = torch.log_softmax(logits / p.temperature, -1)
        kept = kept_set(scaled.exp(), p.top_k, p.top_p, p.min_p, self.sampling_backend)
        if r.return_sampling_mask and len(kept) > self.mask_cap:
            raise RequestError(f"return_sampling_mask: {len(kept)} tokens tie at the top-k cut, "
                               f"more than --sampling-mask-max-tokens {self.mask_cap}")
        kept_lp = scaled[kept] - torch.logsumexp(scaled[kept], 0)   # renormalised on the set
        choice = int(torch.multinomial(kept_lp.exp(), 1, generator=gen))
        tok = int(kept[choice])
        s["lp"].append(float(raw[tok] if raw_env else scaled[tok]))
        s["mask"].append(kept.tolist())
        s["mask_lp"].append(kept_lp.tolist() if r.sampling_logprobs_mode == "support"
                            else float(kept_lp[choice]))
        return tok

    def aborted_response(self, r: Request) -> dict:
        """SGLang's answer to a request aborted before it ran: nothing generated."""
        return {"text": "", "output_ids": [],
                "meta_info": {"id": r.rid, "finish_reason": ABORTED_WAITING,
                              "prompt_tokens": len(r.input_ids), "completion_tokens": 0,
                              "cached_tokens": 0, "weight_version": self.weight_version}}

    def _response(self, row: "_Row") -> dict:
        r, s = row.req, row.state
        out = s["out"]
        meta = {"id": r.rid, "finish_reason": row.finish, "prompt_tokens": len(r.input_ids),
                "completion_tokens": len(out), "cached_tokens": row.cached,
                "weight_version": self.weight_version}
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s["lp"], out)]
            inputs, listed = s.get("input_lp", ([], []))
            meta["input_token_logprobs"] = inputs
            if r.token_ids_logprob:
                meta["input_token_ids_logprobs"] = listed
                meta["output_token_ids_logprobs"] = s["ids_lp"]
        if r.return_routed_experts and self.routing_enabled:   # omitted otherwise, as SGLang
            moe_rows = torch.cat(row.routing, dim=0)        # prompt + fed generated tokens
            n_rows = len(r.input_ids) + len(out) - 1
            rows = self._full_routing(moe_rows[:n_rows])
            meta["routed_experts"] = encode_routing(rows[r.routed_experts_start_len:])
        if r.return_sampling_mask:
            meta["output_token_sampling_mask"] = s["mask"]
            meta["output_token_sampling_mask_length"] = len(out)   # SGLang: an int
            meta["output_token_sampling_logprobs"] = s["mask_lp"]
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer else ""
        return {"text": text, "output_ids": out, "meta_info": meta}

    @staticmethod
    def _keep_input_logprobs(row: "_Row", logits: torch.Tensor, first: int) -> None:
        """From the prefill's ``logits`` of input positions ``first ..``: raw (T = 1) log-probs
        of the input tokens from ``logprob_start_len`` (first entry None) and per position those
        of the ids in ``token_ids_logprob`` (first None; [] when none asked), into the row's
        state. They come from the batch the request was prefilled in, so their last bits depend
        on it (split-KV attention), as on a serving engine."""
        r = row.req
        if not r.return_logprob or r.logprob_start_len < 0:
            return
        start, ids = r.logprob_start_len, r.input_ids
        logp = torch.log_softmax(logits[start - first:len(ids) - 1 - first].float(), -1)
        entries = [[None, ids[start], None]]
        listed = [None] if r.token_ids_logprob else []
        for t in range(start + 1, len(ids)):
            row_lp = logp[t - 1 - start]
            entries.append([float(row_lp[ids[t]]), ids[t], None])
            if r.token_ids_logprob:
                listed.append([[float(row_lp[v]), v, None] for v in r.token_ids_logprob])
        row.state["input_lp"] = (entries, listed)
