"""Hugging Face safetensors <-> megatron-core weights (every family of :mod:`moe_rl.families`),
with tensor- and expert-parallel sharding and pipeline-stage layer offsets. The DeepSeek-V3 router's
expert bias (``e_score_correction_bias``) is a megatron buffer, not a parameter: it travels with
the parameters (:func:`hf_mapped_tensors`) in loads, exports and weight syncs.

mbridge (the peers' bridge) maps to the Transformer Engine spec only and pins megatron versions;
the CPU path uses the local spec, so the mapping is written here, for both specs: a parameter's
megatron name (local or TE) is resolved to the HF tensors it is made of, and sliced for this
rank. Export is the exact inverse (round trip HF -> Megatron -> HF is bit-identical). A
checkpoint that stacks a layer's experts in one tensor (gpt-oss) is read one expert's row at a
time and written with all rows of a stacked tensor in one bucket.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from moe_rl.families.shape import ModelSpec, model_spec
from moe_rl.weights.mxfp4_checkpoint import BLOCKS, SCALES, dequantise, stacked_name
from moe_rl.owned_dirs import claim


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# parallel layout

def _ranks():
    """(tp_rank, tp_size, ep_rank, ep_size) from megatron's parallel state (1/0 when absent)."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return 0, 1, 0, 1
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_groups: int) -> torch.Tensor:
    """HF q/k/v projections -> megatron's fused QKV, grouped as [q heads of g, k_g, v_g] per g
    (weights [rows, hidden], or biases [rows])."""
    if q.dim() == 1:
        return qkv_merge(q[:, None], k[:, None], v[:, None], n_groups)[:, 0]
    qs = q.reshape(n_groups, -1, q.shape[-1])
    ks = k.reshape(n_groups, -1, k.shape[-1])
    vs = v.reshape(n_groups, -1, v.shape[-1])
    return torch.cat([qs, ks, vs], dim=1).reshape(-1, q.shape[-1])


def qkv_split(qkv: torch.Tensor, n_groups: int, head_dim: int, heads_per_group: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_merge`."""
    if qkv.dim() == 1:
        q, k, v = qkv_split(qkv[:, None], n_groups, head_dim, heads_per_group)
        return q[:, 0], k[:, 0], v[:, 0]
    g = qkv.reshape(n_groups, (heads_per_group + 2) * head_dim, qkv.shape[-1])
    q = g[:, :heads_per_group * head_dim].reshape(-1, qkv.shape[-1])
    k = g[:, heads_per_group * head_dim:(heads_per_group + 1) * head_dim].reshape(-1, qkv.shape[-1])
    v = g[:, (heads_per_group + 1) * head_dim:].reshape(-1, qkv.shape[-1])
    return q, k, v


def tp_split(full: torch.Tensor, kind: str, rank: int, size: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of a full megatron tensor.

    kind: 'column' (rows split), 'row' (columns split), 'fc1' (gate and up halves split
    separately, then concatenated), 'replicated'. QKV is column-split by query group, which is
    the same as 'column' on the grouped layout.
    """
    if size == 1 or kind == "replicated":
        return full
    if kind == "column":
        return full.chunk(size, dim=0)[rank]
    if kind == "row":
        return full.chunk(size, dim=1)[rank]
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    raise ValueError(f"kind: unknown sharding {kind!r}")


def tp_merge(shards: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of :func:`tp_split` over all ranks' shards."""
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "column":
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "fc1":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([torch.cat(gates), torch.cat(ups)])
    raise ValueError(f"kind: unknown sharding {kind!r}")


def _sharding(local_name: str) -> str:
    if local_name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight",
                            "output_layer.weight",
                            "linear_q_proj.weight", "linear_q_up_proj.weight",
                            "linear_kv_up_proj.weight")):
        return "column"
    if local_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if local_name.endswith("linear_fc1.weight"):
        return "fc1"
    return "replicated"


# ---------------------------------------------------------------------------------------------
# name mapping

ROWS = "rows:"   # a way of the name table: one expert's row of a stacked HF tensor


class Source(NamedTuple):
    """How megatron parameter's value is made of HF tensors: ``how`` ("copy", "cat", "qkv", or
    ``rows:<kind>``: row ``row`` of the stacked tensor ``parts[0]``, see
    :func:`row_to_megatron`)."""
    how: str
    parts: list[str]
    row: int | None = None


def row_to_megatron(kind: str, row: torch.Tensor) -> torch.Tensor:
    """One expert's row of a stacked HF tensor as its megatron tensor: ``gate_up`` [hidden,
    2 x inter] with gate and up columns interleaved -> linear_fc1 [gate rows; up rows];
    ``gate_up_bias`` likewise; ``down`` [inter, hidden] -> linear_fc2 [hidden, inter];
    ``copy``."""
    if kind == "gate_up":
        return torch.cat([row[:, 0::2].t(), row[:, 1::2].t()])
    if kind == "gate_up_bias":
        return torch.cat([row[0::2], row[1::2]])
    if kind == "down":
        return row.t().contiguous()
    if kind == "copy":
        return row
    raise ValueError(f"unknown stacked-row kind {kind!r}")


def megatron_to_row(kind: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`row_to_megatron` (a new tensor)."""
    if kind in ("gate_up", "gate_up_bias"):
        gate, up = t.chunk(2)
        return torch.stack([gate.t(), up.t()] if kind == "gate_up" else [gate, up],
                           dim=-1).flatten(-2)
    if kind == "down":
        return t.t().contiguous()
    if kind == "copy":
        return t.clone()
    raise ValueError(f"unknown stacked-row kind {kind!r}")


class _Names:
    """HF tensor names of one model (its family's table, :mod:`moe_rl.families`)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.family = spec.family
        self.router = self.family.HF_ROUTER

    def hf_parts(self, name: str, layer_of: dict[int, int], ep_rank: int, e_local: int
                 ) -> Source:
        """How megatron parameter ``name`` is made of HF tensors."""
        if name == "embedding.word_embeddings.weight":
            return Source("copy", ["model.embed_tokens.weight"])
        if name == "output_layer.weight":
            return Source("copy", ["lm_head.weight"])
        if name == "decoder.final_layernorm.weight":
            return Source("copy", ["model.norm.weight"])
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"no Hugging Face tensor for megatron parameter {name!r}")
        i = layer_of[int(m.group(1))]
        rest = m.group(2)
        p = f"model.layers.{i}."
        e = _EXPERT.match(rest)
        if e:
            g = ep_rank * e_local + int(e.group(1))
            experts = self.family.hf_expert_names(p)
            if e.group(2) not in experts:
                raise KeyError(f"no Hugging Face tensor for megatron parameter {name!r}")
            how, parts = experts[e.group(2)]
            return Source(how, [x.format(e=g) for x in parts], g)
        table = {
            "input_layernorm.weight": ("copy", [p + "input_layernorm.weight"]),
            "self_attention.linear_qkv.layer_norm_weight": ("copy", [p + "input_layernorm.weight"]),
            "self_attention.linear_qkv.weight": ("qkv", [p + "self_attn.q_proj.weight",
                                                        p + "self_attn.k_proj.weight",
                                                        p + "self_attn.v_proj.weight"]),
            "self_attention.linear_proj.weight": ("copy", [p + "self_attn.o_proj.weight"]),
            "self_attention.q_layernorm.weight": ("copy", [p + "self_attn.q_norm.weight"]),
            "self_attention.k_layernorm.weight": ("copy", [p + "self_attn.k_norm.weight"]),
            "pre_mlp_layernorm.weight": ("copy", [p + "post_attention_layernorm.weight"]),
            "mlp.linear_fc1.layer_norm_weight": ("copy", [p + "post_attention_layernorm.weight"]),
            "mlp.router.weight": ("copy", [p + self.router + ".weight"]),
            "mlp.router.expert_bias": ("copy", [p + self.router + ".e_score_correction_bias"]),
            "mlp.linear_fc1.weight": ("cat", [p + "mlp.gate_proj.weight",
                                              p + "mlp.up_proj.weight"]),
            "mlp.linear_fc2.weight": ("copy", [p + "mlp.down_proj.weight"]),
        }
        table.update(self.family.hf_attention_names(p))
        if rest not in table:
            raise KeyError(f"no Hugging Face tensor for megatron parameter {name!r}")
        return Source(*table[rest])


def hf_mapped_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(megatron name, tensor) of everything that maps to the HF checkpoint: the parameters and
    the routers' persistent expert-bias buffers. Transformer Engine's grouped experts
    (``TEGroupedMLP``) are named and ordered as megatron's loop names its experts
    (:func:`as_sequential_experts`), so every expert path exports, loads and syncs the same."""
    return as_sequential_experts(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]


# TEGroupedMLP's expert e: ``linear_fc1.weight<e>`` / ``bias<e>`` of one TE GroupedLinear per
# projection (megatron-core's ``TEGroupedLinear._sharded_state_dict_grouped`` reads them so)
_TE_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")


def as_sequential_experts(named: Iterable[tuple[str, torch.Tensor]]
                          ) -> list[tuple[str, torch.Tensor]]:
    """``named`` with each TE grouped expert tensor renamed to the loop's name
    (``...mlp.experts.linear_fc1.weight3`` -> ``...mlp.experts.local_experts.3.linear_fc1.
    weight``) and a layer's experts in the loop's order (expert by expert: fc1 weight and bias,
    fc2 weight and bias) where its first tensor stood; every other name as it is."""
    out: list[tuple[str, torch.Tensor]] = []
    groups: dict[str, list] = {}
    for name, tensor in named:
        m = _TE_EXPERT.match(name)
        if m is None:
            out.append((name, tensor))
            continue
        prefix, linear, kind, e = m.groups()
        if prefix not in groups:
            groups[prefix] = []
            out.append((prefix, None))   # the layer's experts go here
        key = (int(e), linear, kind != "weight")
        groups[prefix].append((key, f"{prefix}local_experts.{e}.{linear}.{kind}", tensor))
    ordered: list[tuple[str, torch.Tensor]] = []
    for name, tensor in out:
        if tensor is None and name in groups:
            ordered += [(n, t) for _, n, t in sorted(groups[name], key=lambda g: g[0])]
        else:
            ordered.append((name, tensor))
    return ordered


def _layer_numbers(model) -> dict[int, int]:
    """Local decoder-layer index -> global (0-based) layer index (pipeline-stage offsets)."""
    return {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}


def _local_experts(spec: ModelSpec, ep_size: int) -> int:
    if spec.moe_shape.num_experts % ep_size:
        raise ValueError(f"expert_parallel: {ep_size} does not divide {spec.moe_shape.num_experts}")
    return spec.moe_shape.num_experts // ep_size


# ---------------------------------------------------------------------------------------------
# HF -> megatron

class HFCheckpoint:
    """Lazy reader of a HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            self.where = {k: os.path.join(path, f) for k, f in weight_map.items()}
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"model.path: no model.safetensors or index in {path}")
            with safe_open(single, "pt") as f:
                self.where = {k: single for k in f.keys()}

    def _file(self, name: str) -> str:
        if name not in self.where:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}")
        return self.where[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (KeyError naming it when absent); one stored in MXFP4 blocks
        and scales, dequantised."""
        if name not in self.where and name + BLOCKS in self.where:
            return dequantise(self.get(name + BLOCKS), self.get(name + SCALES))
        with safe_open(self._file(name), "pt") as f:
            return f.get_tensor(name)

    def get_row(self, name: str, row: int) -> torch.Tensor:
        """Row ``row`` of the tensor ``name`` (only its bytes are read); of one stored in MXFP4
        blocks and scales, dequantised."""
        if name not in self.where and name + BLOCKS in self.where:
            return dequantise(self.get_row(name + BLOCKS, row), self.get_row(name + SCALES, row))
        with safe_open(self._file(name), "pt") as f:
            return f.get_slice(name)[row]


def megatron_param_from_hf(name: str, ckpt: HFCheckpoint, spec: ModelSpec,
                           layer_of: dict[int, int], ranks=(0, 1, 0, 1)) -> torch.Tensor:
    """The value of megatron parameter ``name`` on this rank, read from ``ckpt``."""
    tp_rank, tp_size, ep_rank, ep_size = ranks
    names = _Names(spec)
    how, parts, row = names.hf_parts(name, layer_of, ep_rank, _local_experts(spec, ep_size))
    if how.startswith(ROWS):
        full = row_to_megatron(how[len(ROWS):], ckpt.get_row(parts[0], row))
        return tp_split(full, _sharding(name), tp_rank, tp_size)
    tensors = [ckpt.get(p) for p in parts]
    if how == "copy":
        full = tensors[0]
    elif how == "cat":
        full = torch.cat(tensors, dim=0)
    else:
        hf = spec.hf_config
        full = qkv_merge(*tensors, n_groups=int(hf.get("num_key_value_heads")
                                                or hf["num_attention_heads"]))
    return tp_split(full, _sharding(name), tp_rank, tp_size)


def mtp_layers(names, spec: ModelSpec) -> list[int]:
    """Indices of decoder layers beyond ``num_hidden_layers`` that tensor ``names`` hold (the
    multi-token-prediction layers of a DeepSeek-V3 checkpoint)."""
    found = {int(m.group(1)) for m in map(re.compile(r"^model\.layers\.(\d+)\.").match, names)
             if m}
    return sorted(i for i in found if i >= spec.num_layers)


@torch.no_grad()
def load_hf_into_megatron(model, spec: ModelSpec, hf_path: str) -> None:
    """Copy the HF checkpoint at ``hf_path`` into ``model`` (this rank's shards)."""
    ckpt = HFCheckpoint(hf_path)
    layer_of = _layer_numbers(model)
    ranks = _ranks()
    extra = mtp_layers(ckpt.where, spec)
    if extra:
        raise ValueError(f"{hf_path}: the checkpoint holds multi-token-prediction layer(s) "
                         f"{extra} (num_nextn_predict_layers), which moe_rl does not train or "
                         f"serve; write a copy without the tensors of those layers and set "
                         f"num_nextn_predict_layers: 0 in its config.json")
    for name, param in hf_mapped_tensors(model):
        value = megatron_param_from_hf(name, ckpt, spec, layer_of, ranks)
        if value.shape != param.shape:
            raise ValueError(f"{name}: checkpoint gives shape {list(value.shape)}, the model "
                             f"expects {list(param.shape)}")
        param.copy_(value.to(param.dtype))


# ---------------------------------------------------------------------------------------------
# megatron -> HF

def _collect(t: torch.Tensor, group, everywhere: bool) -> list[torch.Tensor] | None:
    """Every rank's ``t`` over ``group``: on every rank (``everywhere``, an all-gather) or on the
    group's first rank only (a gather; the others get None and allocate nothing)."""
    if group is None or dist.get_world_size(group) == 1:
        return [t]
    t = t.contiguous()
    n = dist.get_world_size(group)
    if everywhere:
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        return out
    first = dist.get_global_rank(group, 0)
    out = [torch.empty_like(t) for _ in range(n)] if dist.get_rank() == first else None
    dist.gather(t, out, dst=first, group=group)
    return out


def exporting_rank() -> bool:
    """The rank that holds the exported tensors (global rank 0)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class _Exporter:
    """Per-parameter HF export of this rank's model (shared by the streaming functions)."""

    def __init__(self, model, spec: ModelSpec, everywhere: bool):
        from megatron.core import parallel_state as ps
        self.tp_rank, self.tp_size, self.ep_rank, self.ep_size = _ranks()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep_size > 1 else None
        self.spec, self.everywhere = spec, everywhere
        self.names = _Names(spec)
        self.e_local = _local_experts(spec, self.ep_size)
        self.layer_of = _layer_numbers(model)
        hf = spec.hf_config
        self.n_groups = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
        self.n_heads = int(hf["num_attention_heads"])
        self.head_dim = int(hf.get("head_dim") or spec.hidden_size // self.n_heads)
        self.keep = everywhere or exporting_rank()
        self.params = hf_mapped_tensors(model)

    def full_bytes(self, name: str, param: torch.Tensor) -> int:
        """Bytes of the HF tensors parameter ``name`` becomes (all ranks' shards and experts),
        from shapes alone (every rank plans the same buckets)."""
        n = param.numel() * param.element_size()
        if _sharding(name) != "replicated":
            n *= self.tp_size
        if ".local_experts." in name:
            n *= self.ep_size
        return n

    def fused_key(self, name: str) -> str | None:
        """The key of the tensors that travel only together with parameter ``name``'s: the
        rows of one stacked expert tensor (they make one HF tensor), or those the engine loads
        only together (the family's :func:`engine_fused_key`); None: alone."""
        how, parts, _ = self.names.hf_parts(name, self.layer_of, self.ep_rank, self.e_local)
        if how.startswith(ROWS):
            return parts[0]
        if ".local_experts." in name:
            return None
        fam = self.spec.family
        return next((k for k in (fam.engine_fused_key(self.spec.hf_config, p) for p in parts)
                     if k is not None), None)

    def tensors(self, name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Parameter ``name`` as full HF tensors on this rank if it keeps them ([] otherwise);
        collective over its tensor/expert groups. Pieces of one parameter are copies (they
        must not share storage); an ungathered whole parameter is handed on as is."""
        kind = _sharding(name)
        is_expert = ".local_experts." in name
        value = param.detach()
        shards = (_collect(value, self.tp_group, self.everywhere) if kind != "replicated"
            else [value])
        if is_expert and self.ep_group is not None:
            # every rank enters the expert gather (a TP rank > 0 sends its own copy, unused)
            full = tp_merge(shards, kind) if shards is not None else value
            values = _collect(full, self.ep_group, self.everywhere)
            owners = list(range(self.ep_size))
        else:
            values = None if shards is None else [tp_merge(shards, kind)]
            owners = [self.ep_rank]
        out: list[tuple[str, torch.Tensor]] = []
        if not self.keep or values is None:
            return out
        for owner, full in zip(owners, values):
            how, parts, row = self.names.hf_parts(name, self.layer_of, owner, self.e_local)
            if how.startswith(ROWS):   # stacked by :func:`_stack_rows`
                out.append(((parts[0], row), megatron_to_row(how[len(ROWS):], full)))
                continue
            if how == "copy":
                pieces = [full.contiguous()]
            elif how == "cat":
                pieces = [p.clone() for p in full.chunk(2, dim=0)]
            else:
                pieces = [p.contiguous().clone() for p in
                          qkv_split(full, self.n_groups, self.head_dim,
                                    self.n_heads // self.n_groups)]
            for part, piece in zip(parts, pieces):
                if not (part == "lm_head.weight" and self.spec.tie_word_embeddings):
                    out.append((part, piece))
        return out


@torch.no_grad()
def iter_hf_buckets(model, spec: ModelSpec, bucket_bytes: int, everywhere: bool = False
                    ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """The policy as full HF-named tensors in buckets of at most ``bucket_bytes`` (a parameter
    larger than that travels alone; parameters the engine loads only together, e.g.
    DeepSeek's q-LoRA ``q_a_proj`` and ``kv_a_proj_with_mqa``, share one): yields (bucket,
    is_last). Collective: every tensor- and
    expert-parallel rank iterates it to the end. The buckets are planned from parameter shapes
    before anything is gathered, so a rank holds one bucket at a time. A tensor-parallel
    parameter is gathered to the first rank of its group and an expert is sent by the rank that
    owns it to the first expert-parallel rank: only the exporting rank (:func:`exporting_rank`)
    gets tensors (the others get empty buckets), unless ``everywhere`` (all-gathers: the per-GPU
    tensor path needs every rank to hold each bucket)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
    ex = _Exporter(model, spec, everywhere)
    units: dict[str, list[int]] = {}   # parameters the engine loads only together, in order
    for i, (name, _) in enumerate(ex.params):
        units.setdefault(ex.fused_key(name) or f"#{i}", []).append(i)
    groups: list[list[int]] = []
    size = 0
    for unit in units.values():
        n = sum(ex.full_bytes(*ex.params[i]) for i in unit)
        if not groups or size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += n
    for k, group in enumerate(groups):
        bucket = [t for i in group for t in ex.tensors(*ex.params[i])]
        yield _stack_rows(bucket, spec.moe_shape.num_experts), k == len(groups) - 1


def _stack_rows(bucket: list, experts: int) -> list[tuple[str, torch.Tensor]]:
    """A bucket whose stacked-expert rows (keyed (HF name, row)) are stacked into their HF
    tensors, in place of the first row; every row of each must be there."""
    rows: dict[str, dict[int, torch.Tensor]] = {}
    out: list = []
    for key, t in bucket:
        if isinstance(key, tuple):
            if key[0] not in rows:
                rows[key[0]] = {}
                out.append((key[0], None))
            rows[key[0]][key[1]] = t
        else:
            out.append((key, t))
    for name, got in rows.items():
        if sorted(got) != list(range(experts)):
            raise RuntimeError(f"{name}: a bucket holds rows {sorted(got)} of {experts} experts")
    return [(k, torch.stack([rows[k][e] for e in range(experts)]) if t is None else t)
            for k, t in out]


def hf_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group (name, tensor) pairs into buckets of at most ``bucket_bytes`` (a larger tensor
    alone); yields (bucket, is_last)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    yield bucket, True


@torch.no_grad()
def megatron_to_hf(model, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full HF-named tensors (copies) of this pipeline stage on every tensor- and
    expert-parallel rank (collective). Materialises the whole model: the syncs stream
    :func:`iter_hf_buckets` instead."""
    return {k: v.clone() for bucket, _ in iter_hf_buckets(model, spec, 1 << 62, everywhere=True)
            for k, v in bucket}


def save_hf_checkpoint(tensors, spec: ModelSpec, out_dir: str, source_dir: str | None = None,
                       dtype: torch.dtype | None = None, shard_bytes: int = 1 << 62) -> None:
    """Write ``config.json`` and the weights (and the tokenizer files of ``source_dir``) in the
    layout SGLang and the reference engine load. ``tensors``: a dict (cut into shards of at
    most ``shard_bytes``), or streamed (bucket, is_last) pairs, each written as one shard as it
    comes: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` (each file appears whole: written aside, then renamed).
    The config's dtype says what the weights were written in. ``out_dir`` is new, empty or an
    earlier export's (marked: :mod:`moe_rl.owned_dirs`); one holding other files is refused."""
    claim(out_dir)
    for fname in os.listdir(out_dir):   # a previous export's shards must not linger
        if fname.endswith(".safetensors") or fname == INDEX_FILE:
            os.remove(os.path.join(out_dir, fname))
    buckets = (hf_buckets(sorted(tensors.items()), shard_bytes) if isinstance(tensors, dict)
        else tensors)
    shards: list[tuple[str, list[str]]] = []
    total = 0
    by_dtype: dict[torch.dtype, int] = {}   # elements of the unquantised weights per dtype
    for bucket, _ in buckets:
        bucket = [(k, (v.to(dtype) if dtype is not None else v).contiguous()) for k, v in bucket]
        if not bucket:
            continue
        for k, v in bucket:
            if (v.dtype in (torch.float32, torch.bfloat16, torch.float16)
                    and not k.endswith("scale_inv")):
                by_dtype[v.dtype] = by_dtype.get(v.dtype, 0) + v.numel()
        tmp = os.path.join(out_dir, f".shard-{len(shards)}.tmp")
        save_file(dict(bucket), tmp, metadata={"format": "pt"})
        shards.append((tmp, [k for k, _ in bucket]))
        total += sum(v.numel() * v.element_size() for _, v in bucket)
    if len(shards) == 1:
        os.replace(shards[0][0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(tmp, os.path.join(out_dir, fname))
            weight_map.update({k: fname for k in names})
        tmp = os.path.join(out_dir, INDEX_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh,
                      indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(out_dir, INDEX_FILE))
    config = dict(spec.hf_config)
    if by_dtype:   # the dtype the weights are in (what SGLang's --dtype auto serves)
        key = "dtype" if "torch_dtype" not in config else "torch_dtype"
        config[key] = str(max(by_dtype, key=by_dtype.get)).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    if source_dir:
        for fname in os.listdir(source_dir):
            if fname.startswith(("tokenizer", "special_tokens", "generation_config",
                                 "chat_template", "vocab", "merges")):
                shutil.copy2(os.path.join(source_dir, fname), os.path.join(out_dir, fname))


def write_dequantised_mxfp4(src: str, dst: str) -> str:
    """A copy at ``dst`` of the MXFP4 checkpoint ``src`` with every blocks/scales pair
    dequantised to bfloat16 (one output shard per input shard, a tensor read at a time; its
    config.json without ``quantization_config``; the tokenizer files beside it), the form the
    engines serve it in; returns ``dst``."""
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        spec = model_spec(json.load(fh))
    ckpt = HFCheckpoint(src)
    files = sorted(set(ckpt.where.values()))

    def shards():
        for i, file in enumerate(files):
            names = [stacked_name(k) or k for k, f in ckpt.where.items()
                     if f == file and not k.endswith(SCALES)]
            yield [(k, ckpt.get(k)) for k in sorted(names)], i == len(files) - 1
    save_hf_checkpoint(shards(), spec, dst, source_dir=src)
    return dst
