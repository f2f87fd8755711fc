"""``moe-rl plan --config FILE [overrides] [--nodes N] [--gpus-per-node G] [--gpu-memory-gib M]
[--json]``: every process the run would start (role, node, GPUs; engines' command lines and
environment) and the weight-update group, without starting anything; then each trainer rank's
place in the parallel groups, the memory one trainer GPU and one SGLang GPU will hold
(estimated) and the GPUs the plan leaves idle. ``moe-rl train`` places its processes by the same
plan."""
from __future__ import annotations

import argparse
import json
import os

from moe_rl.config import load_config, response_cap
from moe_rl.engines.factory import engine_kind
from moe_rl.config.memory_estimate import GIB, format_memory, param_counts, trainer_memory
from moe_rl.config.release_shapes import release_shape
from moe_rl.config.schema import ModelConfig, TrainerConfig
from moe_rl.models.tiny import tiny_config_fields
from moe_rl.orchestration.run_inputs import load_run_inputs
from moe_rl.orchestration.placement import format_plan, idle_gpus, make_plan
from moe_rl.orchestration.trainer_layout import format_layout, trainer_layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes (default: cluster.num_nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: cluster.gpus_per_node)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory of one GPU, for the estimates (default 80: an H100)")
    parser.add_argument("--json", action="store_true",
                        help='print {"processes": [{"role", "node", "gpus", "argv", "env", ...}], '
                             '"weight_update_group": ...}')
    parser.add_argument("--no-inputs", action="store_true",
                        help="skip the checks of the model, tokenizer, data and reward function "
                             "(a model's config.json is still read when present)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. cluster.num_nodes=4 trainer.parallel.tensor=2 "
                             "(flags and overrides in any order)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"cluster.num_nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    cfg = load_config(args.config, overrides)
    inputs = None if args.no_inputs else load_run_inputs(cfg)
    plan = make_plan(cfg)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
        return 0
    print(format_plan(plan))
    print(format_layout(trainer_layout(cfg)))
    print(_experts_line(cfg.model, cfg.trainer))
    for line in _memory_lines(cfg, inputs, args.gpu_memory_gib * GIB):
        print(line)
    idle = idle_gpus(plan)
    if idle:
        print(f"warning: {idle} of the {plan.nodes} x {plan.gpus_per_node} GPUs are idle in "
              f"this plan: raise cluster.trainer_workers or rollout.num_servers, or ask for "
              f"fewer nodes")
    return 0


def _model_fields(model: ModelConfig) -> tuple[dict, str | None]:
    """The model's config.json fields and, when the file is not at model.path yet, where the
    shape came from instead: the release model.path names, else the ``model.init`` shape
    (what ``moe-rl init-model`` writes there)."""
    hf_file = os.path.join(model.path, "config.json")
    if os.path.isfile(hf_file):
        with open(hf_file, encoding="utf-8") as fh:
            return json.load(fh), None
    release = release_shape(model.path)
    if release is not None:
        return release[1], f"{release[0]}'s published shape"
    return (tiny_config_fields(model.init), "the model.init shape (what `moe-rl "
            "init-model` writes there; the checkpoint's own config.json gives its own estimate)")


def _experts_line(model: ModelConfig, trainer: TrainerConfig) -> str:
    """How the trainer's MoE experts will compute (``trainer.experts``), as the trainer decides."""
    from moe_rl.rollout_record import MODEL_DTYPES
    from moe_rl.trainer.expert_path import model_expert_path
    from moe_rl.trainer.model_builder import te_available
    hf, _ = _model_fields(model)
    te = te_available()
    requested = trainer.experts
    if requested == "te_grouped" and not te:   # decided on the trainer's machine
        return ("trainer experts: te_grouped where the trainer's machine has Transformer "
                "Engine and CUDA (refused at its start otherwise; not on this machine)")
    path, why = model_expert_path(requested, hf, trainer.parallel.tensor,
                                  MODEL_DTYPES[model.dtype], te)
    if requested == "auto" and not te:
        why += "; te_grouped where the trainer's machine has Transformer Engine and CUDA"
    return f"trainer experts: {path} ({why})"


def _memory_lines(cfg, inputs, gpu_bytes: float) -> list[str]:
    """The memory estimates; sequences as long as the longest prompt (when the inputs were
    read) plus the response cap, within the model's context."""
    hf, source = _model_fields(cfg.model)
    said = ([] if source is None else
            [f"no config.json in model.path ({cfg.model.path}) yet: memory estimated for "
             f"{source}"])
    context = int(hf.get("max_position_embeddings") or 0)
    prompt = max((len(p.ids) for p in inputs.prompts), default=0) if inputs else 0
    seq_len = prompt + response_cap(cfg) if inputs else context
    seq_len = min(seq_len, context) if context else seq_len
    counts = param_counts(hf)
    engine = engine_kind(cfg).gpu_memory(hf, counts.total, gpu_bytes)
    return said + format_memory(trainer_memory(cfg, hf, counts, seq_len), engine, gpu_bytes)
