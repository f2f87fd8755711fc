"""Configuration: YAML + overrides, types, ranges and every cross-field error named in the issue."""
import json
import pathlib
import re

import pytest
import yaml

from moe_rl.config import (Config, ConfigError, config_from_dict, dump_config, iter_keys, load_config, parse_override)
from moe_rl.errors import UserError
from moe_rl.families.shape import MoEShape


def _err(overrides, path=None):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, Config)
    f = tmp_path / "c.yaml"
    f.write_text(dump_config(cfg))
    again = load_config(f)
    assert again == cfg


def test_yaml_then_overrides_take_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"trainer": {"optim": {"lr": 1e-4}, "steps": 3},
                                 "algorithm": {"loss": "gspo", "clip_low": 3e-4,
                                               "clip_high": 4e-4,
                                               "aggregation": "seq-mean-token-mean"}}))
    cfg = load_config(f, ["trainer.steps=7", "algorithm.corrections=[icepop,seq_mis]",
                          "algorithm.correction.mis_c=3", "trainer.optim.lr=2e-6"])
    assert cfg.trainer.steps == 7
    assert cfg.trainer.optim.lr == 2e-6
    assert cfg.algorithm.loss == "gspo" and cfg.algorithm.clip_high == 4e-4
    assert cfg.algorithm.corrections == ["icepop", "seq_mis"]
    assert cfg.algorithm.correction.mis_c == 3.0 and isinstance(cfg.algorithm.correction.mis_c,
                                                                   float)


def test_comma_list_and_null_override():
    cfg = load_config(None, ["algorithm.corrections=icepop,seq_tis", "algorithm.dual_clip_c=null"])
    assert cfg.algorithm.corrections == ["icepop", "seq_tis"]
    assert cfg.algorithm.dual_clip_c is None


def test_unknown_key_is_named_with_suggestion():
    msg = _err(["algorithm.los=gspo"])
    assert "algorithm.los" in msg and "did you mean 'algorithm.loss'" in msg
    msg = _err(["trainr.lr=1"])
    assert "'trainr'" in msg and "did you mean 'trainer'" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  temprature: 0.7\n")
    msg = _err([], f)
    assert "rollout.temprature" in msg and "rollout.sampling.temperature" in msg


@pytest.mark.parametrize("override,expect", [
    ("trainer.optim.lr=abc", "trainer.optim.lr: expected a number"),
    ("trainer.steps=2.5", "trainer.steps: expected an integer"),
    ("algorithm.keep_sampling_mask=maybe", "expected a boolean"),
    ("algorithm.replay=r4", "algorithm.replay: expected one of 'off', 'r2', 'r3'"),
    ("rollout.engine=sglng", "did you mean 'sglang'"),
])
def test_wrong_type(override, expect):
    assert expect in _err([override])


@pytest.mark.parametrize("override,key", [
    ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
    ("rollout.sampling.temperature=-1", "rollout.sampling.temperature"),
    ("trainer.optim.lr=0", "trainer.optim.lr"),
    ("model.init.num_experts=0", "model.init.num_experts"),
    ("rollout.servers.base_port=70000", "rollout.servers.base_port"),
])
def test_out_of_range(override, key):
    msg = _err([override])
    assert msg.startswith(key) and "out of range" in msg


def test_replay_on_model_without_moe_layers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "num_hidden_layers": 2, "vocab_size": 100}))
    msg = _err([f"model.path={tmp_path}", "algorithm.replay=r3"])
    assert msg.startswith("algorithm.replay: 'r3' needs a model with MoE layers")
    assert msg.endswith("has none; set algorithm.replay=off")
    cfg = load_config(None, [f"model.path={tmp_path}", "algorithm.replay=off"])
    assert cfg.algorithm.replay == "off"


def test_sampling_mask_needs_finite_topk_within_cap():
    assert "rollout.sampling.top_k" in _err(["algorithm.keep_sampling_mask=true"])
    assert "rollout.sampling.mask_max_tokens" in _err(["algorithm.keep_sampling_mask=true",
                                               "rollout.sampling.top_k=5000"])
    assert "1 < top_k" in _err(["algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=1"])
    cfg = load_config(None, ["algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=50"])
    assert cfg.algorithm.keep_sampling_mask


def test_engine_avg_needs_positive_passes():
    msg = _err(["algorithm.pi_old=engine_avg", "algorithm.pi_old_passes=0"])
    assert "algorithm.pi_old_passes" in msg and "n >= 1" in msg


def test_gspo_needs_positive_clip_ranges():
    assert "GSPO needs positive clip ranges" in _err(["algorithm.loss=gspo",
                                                      "algorithm.clip_low=0"])
    assert "GSPO" in _err(["algorithm.loss=gspo", "algorithm.clip_high=-1e-4"])


def test_deepseek_mask_needs_delta():
    msg = _err(["algorithm.corrections=[opsm]"])
    assert "algorithm.correction.opsm_delta" in msg
    cfg = load_config(None, ["algorithm.corrections=[opsm]", "algorithm.correction.opsm_delta=1e-3"])
    assert cfg.algorithm.correction.opsm_delta == 1e-3
    assert "algorithm.correction.trm_delta" in _err(["algorithm.corrections=[trm]"])
    assert "trainer.ema.policy: needs trainer.ema.decay" in _err(["trainer.ema.policy=true"])
    assert "trainer.ema.start_step: needs" in _err(["trainer.ema.start_step=3"])
    assert "trainer.micro_batch_size: null needs" in _err(["trainer.micro_batch_size=null"])
    assert "'log_ratio', 'k2', 'k3'" in _err(["algorithm.corrections=[trm]",
                                                "algorithm.correction.trm_delta=0.1",
                                                "algorithm.correction.trm_measure=k4"])


def test_unknown_and_duplicate_corrections():
    assert "did you mean 'seq_mis'" in _err(["algorithm.corrections=[seq_mi]"])
    assert "listed twice" in _err(["algorithm.corrections=[icepop,icepop]"])


def test_other_incompatible_combinations():
    assert "rollout.sglang.device=cpu" in _err(["rollout.engine=sglang"])  # no GPUs configured
    assert "trainer.parallel.tensor" in _err(["trainer.parallel.tensor=2"])
    assert "pipeline schedules" in _err(["trainer.parallel.pipeline=2", "cluster.gpus_per_node=8"])
    # bf16 training runs on CPU (megatron's mixed-precision optimizer); an EMA policy written into
    # the float32 master weights needs them whole, which the distributed optimizer (GPUs) is not
    load_config(None, ["model.dtype=bfloat16", "trainer.ema.decay=0.9", "trainer.ema.policy=true"])
    assert "set trainer.optim.distributed=false" in _err(
        ["model.dtype=bfloat16", "trainer.ema.decay=0.9", "trainer.ema.policy=true",
         "cluster.gpus_per_node=1"])
    assert "trainer.parallel.expert" in _err(["trainer.parallel.expert=3"])
    assert "algorithm.correction.rs_low" in _err(["algorithm.correction.rs_low=3"])
    assert "data.path" in _err(["data.source=jsonl"])
    assert "algorithm.kl.in_reward" in _err(["algorithm.kl.in_reward=true"])


def test_sglang_on_cpu_refuses_what_needs_cuda():
    cpu = ["rollout.engine=sglang", "rollout.sglang.device=cpu"]
    load_config(None, cpu + ["cluster.weight_sync=distributed"])   # gloo: fine
    for extra, key in ((["rollout.quantization=fp8"], "rollout.quantization"),
                       (["rollout.sglang.deterministic_inference=true"],
                        "rollout.sglang.deterministic_inference"),
                       (["cluster.colocate=true"], "cluster.colocate")):
        msg = _err(cpu + extra)
        assert msg.startswith(f"{key}: SGLang on CPU (rollout.sglang.device=cpu) cannot run"), msg
    assert _err(cpu + ["cluster.weight_sync=tensor"]).startswith("cluster.weight_sync: 'tensor'")
    assert "rollout.sglang.max_total_tokens" in _err(cpu + ["rollout.sglang.max_total_tokens=0"])
    assert "rollout.sglang.device" in _err(["rollout.sglang.device=tpu"])
    # SGLang's CPU path cannot serve MLA: its rotary embedding asserts deepseek_yarn, and with
    # YaRN its torch-native attention fails on the first prefill (measured on the tiny DeepSeek-V3)
    deepseek = str(pathlib.Path(__file__).resolve().parents[2] / "configs" /
                   "deepseek_tiny_cpu.yaml")
    msg = _err(cpu + ["model.path=/nonexistent"], deepseek)
    assert msg.startswith("model.path: SGLang on CPU") and "cannot serve MLA models" in msg
    # nor gpt-oss: its torch-native attention takes no sinks (measured on the tiny gpt-oss;
    # the exact error: tests/loop/test_sglang.py)
    from tests.helpers import GPT_OSS_INIT
    msg = _err(cpu + ["model.path=/nonexistent", *GPT_OSS_INIT])
    assert msg.startswith("model.path: SGLang on CPU") and "cannot serve models with attention sinks" in msg
    # nor MiniMax-M2: its q/k norm over all heads is a CUDA kernel there
    msg = _err(cpu + ["model.path=/nonexistent", "model.init.architecture=minimax_m2"])
    assert msg.startswith("model.path: SGLang on CPU") and "q/k norm spans all heads" in msg


def test_section_and_value_confusion():
    assert "is a section" in _err(["trainer=3"])
    assert "is a value" in _err(["trainer.optim.lr.x=3"])
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        parse_override("trainer.optim.lr")


def test_config_from_dict_and_key_table():
    cfg = config_from_dict({"rollout": {"sampling": {"top_k": 20}}})
    assert cfg.rollout.sampling.top_k == 20
    keys = {k for k, *_ in iter_keys()}
    assert {"algorithm.replay", "algorithm.correction.mis_c", "rollout.sglang.tp_size"} <= keys
    assert all(doc for *_, doc in iter_keys())


def test_moe_facts_from_hf_configs():
    qwen = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "decoder_sparse_step": 2, "mlp_only_layers": [3], "vocab_size": 10}
    f = MoEShape.from_hf(qwen)
    assert f.moe_layers == (1,) and f.topk == 2 and f.num_experts == 8
    ds = {"num_hidden_layers": 5, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "first_k_dense_replace": 2, "moe_layer_freq": 1}
    assert MoEShape.from_hf(ds).moe_layers == (2, 3, 4)
    mixtral = {"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert MoEShape.from_hf(mixtral).moe_layers == (0, 1, 2)


def test_every_shipped_config_loads(tmp_path):
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert {f.name for f in files} >= {"tiny_cpu.yaml", "qwen3_30b_a3b_r3_gspo.yaml",
                                        "deepseek_style_r3_grpo.yaml"}
    for f in files:   # the printed configuration loads back to the same configuration
        cfg = load_config(f)
        again = tmp_path / f.name
        again.write_text(dump_config(cfg))
        assert load_config(again) == cfg
        assert dump_config(load_config(again)) == dump_config(cfg)
    demo = load_config(root / "tiny_cpu.yaml")
    assert (demo.algorithm.replay, demo.algorithm.loss, demo.algorithm.corrections) == \
        ("r3", "gspo", ["seq_mis"])


def test_a_checkpoint_quantised_otherwise_than_in_mxfp4_is_not_trained_from(tmp_path):
    """An FP8 checkpoint (block-wise, as DeepSeek-V3's and MiniMax-M2's releases; written here
    by moe_rl's own FP8 writer) would load its E4M3 values without their scales: refused when
    the configuration loads, naming model.path, and where the model is built."""
    from moe_rl.families.shape import model_spec
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.weights.fp8 import write_fp8_checkpoint
    from moe_rl.config import ModelInitConfig
    plain = write_tiny_model(ModelInitConfig(seed=1), str(tmp_path / "plain"))
    fp8 = write_fp8_checkpoint(plain, str(tmp_path / "fp8"))
    load_config(None, [f"model.path={plain}"])
    msg = _err([f"model.path={fp8}"])
    assert msg.startswith(f"model.path: {fp8}: quantization_config: a checkpoint quantised "
                          f"with 'fp8' is not read for training"), msg
    with pytest.raises(ValueError, match="bfloat16 copy"):
        model_spec(json.loads((tmp_path / "fp8" / "config.json").read_text()))


def test_the_manual_holds_the_generated_key_table():
    """docs/configuration.md's table is `moe-rl config --keys`, row for row (regenerate it with
    that command when a key, default or meaning changes)."""
    import pathlib
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = page.split("### Every key", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    want = [f"| `{key}` | {tp} | `{default!r}` | {doc} |" for key, tp, default, doc in iter_keys()]
    assert rows == want


def test_every_shipped_config_resolves_through_the_cli():
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    for f in sorted((root / "configs").glob("*.yaml")):
        res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--no-inputs",
                              "--config", str(f)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, (f.name, res.stderr[-2000:])
        assert "algorithm:" in res.stdout


def test_engine_avg_at_temperature_needs_the_mask_for_large_vocabularies(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 151936}))
    base = [f"model.path={tmp_path}", "algorithm.pi_old=engine_avg", "algorithm.pi_old_passes=2",
            "rollout.sampling.temperature=0.7"]
    with pytest.raises(ConfigError, match="algorithm.pi_old: engine_avg at rollout.sampling.temperature"
                                          "=0.7 .*keep_sampling_mask=true"):
        load_config(None, base)
    # exact alternatives are accepted: the kept-set renormalisation, T = 1, or a small vocabulary
    load_config(None, base + ["algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=20"])
    load_config(None, base[:-1] + ["rollout.sampling.temperature=1.0"])
    load_config(None, base + ["rollout.scoring.full_vocab_max=200000"])


def test_refusals_sglang_and_megatron_would_fail_on():
    gpu = ["rollout.engine=sglang", "cluster.gpus_per_node=8"]
    with pytest.raises(ConfigError, match="rollout.sampling.min_p: SGLang's deterministic inference"):
        load_config(None, gpu + ["rollout.sglang.deterministic_inference=true",
                                 "rollout.sampling.min_p=0.05"])
    with pytest.raises(ConfigError, match="rollout.sampling.top_k: 4096 must stay below"):
        load_config(None, ["algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=4096"])
    load_config(None, ["algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=4095"])
    with pytest.raises(ConfigError, match="trainer.parallel.sequence: megatron-core's MoE"):
        load_config(None, gpu + ["trainer.parallel.tensor=2"])
    load_config(None, gpu + ["trainer.parallel.tensor=2", "trainer.parallel.sequence=true",
                             "cluster.trainer_workers=2"])
    # context parallelism: ranks in CP groups of 2; packed rows need a row length
    cfg = load_config(None, gpu + ["trainer.parallel.context=2", "cluster.trainer_workers=2"])
    assert cfg.trainer.parallel.context == 2
    with pytest.raises(ConfigError, match="tensor x pipeline x context parallel"):
        load_config(None, gpu + ["trainer.parallel.context=2"])
    with pytest.raises(ConfigError, match="trainer.pack_sequences: needs trainer.max_tokens_per"):
        load_config(None, ["trainer.pack_sequences=true"])


def test_an_fp32_lm_head_on_one_side_only_is_refused():
    """NeMo-RL's finding: a float32 head on the engine alone widens the mismatch; the key sets
    it on both sides, so a bare --enable-fp32-lm-head in SGLang's extra arguments is refused."""
    gpu = ["rollout.engine=sglang", "cluster.gpus_per_node=8", "model.dtype=bfloat16",
           "rollout.engine_dtype=bfloat16"]
    with pytest.raises(ConfigError, match=r"rollout.sglang.extra_args: --enable-fp32-lm-head "
                                          r".*set model.fp32_output_layer=true"):
        load_config(None, gpu + ["rollout.sglang.extra_args=[--enable-fp32-lm-head]"])
    load_config(None, gpu + ["rollout.sglang.extra_args=[--enable-fp32-lm-head]",
                             "model.fp32_output_layer=true"])


def _models(cfg):   # the two sections the precision pair's warning reads
    return cfg.model, cfg.rollout


@pytest.mark.parametrize("overrides,said", [
    (["model.dtype=float16", "rollout.engine_dtype=bfloat16"],
     "model.dtype=float16 trains against rollout.engine_dtype=bfloat16: float16 and bfloat16 "
     "round to different grids"),
    (["model.dtype=bfloat16", "rollout.engine_dtype=float16"],
     "model.dtype=bfloat16 trains against rollout.engine_dtype=float16"),
    (["model.dtype=float16", "rollout.engine_dtype=float16"], None),
    (["model.dtype=bfloat16", "rollout.engine_dtype=bfloat16"], None),
    (["model.dtype=float32", "rollout.engine_dtype=bfloat16"], None),
])
def test_a_mixed_16_bit_pair_is_allowed_with_a_warning(overrides, said):
    from moe_rl.config.checks import precision_pair_warning
    got = precision_pair_warning(*_models(load_config(None, overrides)))
    assert (got is None) if said is None else (got.startswith("warning: ") and said in got)


@pytest.mark.parametrize("engine", [[], ["rollout.engine=sglang", "cluster.gpus_per_node=8"]])
def test_a_16_bit_trainer_against_the_float32_engine_default_is_warned_about(engine):
    """model.dtype set alone: the engine (SGLang's --dtype, or the reference engine) stays at
    rollout.engine_dtype's float32 default, said on every engine."""
    from moe_rl.config.checks import precision_pair_warning
    for dtype in ("bfloat16", "float16"):
        got = precision_pair_warning(
            *_models(load_config(None, engine + [f"model.dtype={dtype}"])))
        assert got == (f"warning: rollout.engine_dtype=float32: the engine serves in float32 "
                       f"while the trainer trains in {dtype}, so their log-probs differ by "
                       f"{dtype}'s rounding; set rollout.engine_dtype={dtype} to serve in the "
                       f"trainer's precision")
    for same in (["model.dtype=bfloat16", "rollout.engine_dtype=bfloat16"], []):
        assert precision_pair_warning(*_models(load_config(None, engine + same))) is None


@pytest.mark.parametrize("override,message", [
    ("trainer.optim.lr=nan", "trainer.optim.lr: expected a finite number"),
    ("rollout.sampling.temperature=1e400", "rollout.sampling.temperature: expected a finite number"),
    ("algorithm.correction.mis_c=.inf", "algorithm.correction.mis_c: expected a finite number"),
    ("rollout.servers.concurrency=10000000", "rollout.servers.concurrency: 10000000 is out of range, expected a "
     "value in [1, 65536] (requests in flight per server, each a task and a connection)"),
    ("eval.n=100000", "eval.n: 100000 is out of range"),
    ("trainer.optim.lr=" + "9" * 400, "trainer.optim.lr: expected a finite number, got an integer of 400 "
                                "digits"),
    ("trainer.seed=-1", "trainer.seed: -1 is out of range"),
    ("trainer.seed=99999999999", "trainer.seed: 99999999999 is out of range"),
    ("rollout.servers.base_port=65535", "rollout.servers.base_port: servers use ports 65535..65536"),
    ("logging.dir=''", "logging.dir: expected a directory path"),
])
def test_careless_values_are_refused_naming_the_key(override, message, capsys):
    """In the config and by `moe-rl config` (one line, exit 2)."""
    from moe_rl.cli import main
    extra = ["rollout.num_servers=2"] if "base_port" in override else []
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override] + extra)
    assert main(["config", "--no-inputs", override, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_partial_extra_groups_is_bounded_by_what_the_steps_can_take(capsys):
    """1 000 000 extra groups took the rollout worker to 3.7 GB with no step done."""
    from moe_rl.cli import main
    base = ["rollout.partial.enabled=true", "rollout.max_staleness=1", "rollout.prompts_per_step=8"]
    assert load_config(None, base + ["rollout.partial.extra_groups=128"])
    assert main(["config", "--no-inputs", *base, "rollout.partial.extra_groups=1000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-rl config: rollout.partial.extra_groups: 1000000 is more than")
    assert main(["config", "--no-inputs", *base, "rollout.partial.extra_groups=2000000"]) == 2
    assert "2000000 is out of range" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"partial.extra_groups: 129 is more than 8 x rollout."
                                          r"prompts_per_step x \(rollout.max_staleness \+ 1\) "
                                          r"= 128"):
        load_config(None, base + ["rollout.partial.extra_groups=129"])


def test_parallel_layout_and_batch_fit_the_trainer_world(tmp_path):
    with pytest.raises(ConfigError, match="cluster.trainer_workers: 3 ranks do not split"):
        load_config(None, ["cluster.trainer_workers=3", "trainer.parallel.expert=2"])
    with pytest.raises(ConfigError, match="rollout.prompts_per_step: 2 prompt groups cannot"):
        load_config(None, ["cluster.trainer_workers=4", "rollout.prompts_per_step=2"])
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 90,
        "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match="rollout.max_new_tokens: 64 leaves no room"):
        load_config(None, [f"model.path={tmp_path}", "rollout.max_new_tokens=64"])


def test_config_files_that_are_not_yaml_mappings_are_named(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"model:\n  path: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "latin1.yaml")
    (tmp_path / "twice.yaml").write_text("trainer:\n  lr: 1.0e-5\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match="key 'lr' is given twice"):
        load_config(tmp_path / "twice.yaml")


BOMB = ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\n")


def test_yaml_aliases_are_refused_in_files_overrides_and_saved_configs(tmp_path, capsys):
    """An alias bomb (a few hundred bytes expanding to 9^8 nodes when the config is copied)
    under data.chat_template_kwargs is one line, in the config file, in an override, and in a
    checkpoint's config.yaml read by a resume; the config moe_rl dumps holds no alias."""
    from moe_rl.orchestration import run_dir
    from moe_rl.cli import main
    nested = "".join("  " + line + "\n" for line in BOMB.splitlines())
    (tmp_path / "bomb.yaml").write_text(f"data:\n  chat_template_kwargs:\n{nested}")
    assert main(["config", "--config", str(tmp_path / "bomb.yaml"), "--no-inputs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bomb.yaml: YAML aliases (*name) are not accepted (line 4" \
        in err, err
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs: YAML aliases"):
        load_config(None, ["data.chat_template_kwargs={a: &a [1, 2], b: [*a, *a]}"])
    cfg = load_config(None, ["data.chat_template_kwargs={a: [1, 2], b: [1, 2]}"])
    assert "*" not in dump_config(cfg) and "&" not in dump_config(cfg)
    (tmp_path / "config.yaml").write_text(dump_config(cfg) + f"extra:\n{nested}")
    with pytest.raises(UserError, match=r"config.yaml: YAML aliases"):
        run_dir.resume_changes(str(tmp_path / "config.yaml"), cfg)


def test_config_and_train_refuse_missing_inputs_before_starting(tmp_path, monkeypatch, capsys):
    """`moe-rl config` checks what `train` reads (model, tokenizer, reward, data) and both refuse
    a missing or unloadable one on stderr with exit 2, naming the key, before anything starts.
    The first case of each command runs as a process of its own; the others call the CLI's
    entry point in this process (the same code, without a Python start each)."""
    from moe_rl.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))   # `sigs` as a process started here finds it
    import pathlib
    import subprocess
    import sys
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    root = pathlib.Path(__file__).resolve().parents[2]
    model = tmp_path / "model"
    write_tiny_model(ModelInitConfig(), str(model))
    base = ["--config", str(root / "configs" / "tiny_cpu.yaml"), f"model.path={model}",
            f"logging.dir={tmp_path / 'run'}"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n{not json\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "deep.jsonl").write_text('{"prompt": "2+2="}\n' + "[" * 200_000
                                         + "]" * 200_000 + "\n")
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "a\\ud800b"}\n')
    (tmp_path / "long.jsonl").write_text('{"prompt": "1+1="}\n'
                                         + json.dumps({"prompt": "9+9=" * 400}) + "\n")
    (tmp_path / "huge.jsonl").write_text('{"prompt": "1+1="}\n'
                                         + json.dumps({"prompt": "7" * 1_000_000}) + "\n")
    (tmp_path / "answer_surrogate.jsonl").write_text('{"prompt": "1+1=", "answer": "2\\udc00"}\n')
    (tmp_path / "answer_long.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n'
                                                + json.dumps({"prompt": "1+1=", "answer": "2" * 409})
                                                + "\n")
    (tmp_path / "answer_huge.jsonl").write_text(json.dumps({"prompt": "1+1=",
                                                            "answer": "3" * 3_000_000}) + "\n")
    (tmp_path / "sigs.py").write_text("def two_args(prompt, response):\n    return 0.0\n"
                                      "def nothing():\n    return 0.0\n")
    cases = [([f"model.path={tmp_path / 'nowhere'}"], "model.path: no local HF model"),
             (["data.reward=no_such_module:score"], "data.reward: cannot load"),
             (["data.reward=builtins:len_"], "data.reward: cannot load"),
             (["data.reward=sigs:two_args"], "data.reward: 'sigs:two_args' takes (prompt, "
              "response), which cannot be called as reward(prompt: str, response: str, answer: "
              "str | None, metadata: dict) -> float"),
             (["data.reward=sigs:nothing"], "data.reward: 'sigs:nothing' takes (), which cannot "
              "be called as reward(prompt"),
             (["data.source=jsonl", f"data.path={tmp_path / 'missing.jsonl'}"],
              "data.path: "),
             (["data.source=jsonl", f"data.path={tmp_path / 'bad.jsonl'}"],
              "line 2: invalid JSON"),
             (["data.source=jsonl", f"data.path={tmp_path / 'latin1.jsonl'}"],
              "latin1.jsonl line 2: not UTF-8 text (byte 0xe9 at column 16)"),
             (["data.source=jsonl", f"data.path={tmp_path / 'deep.jsonl'}"],
              "deep.jsonl line 2: JSON nested too deeply to read"),
             (["data.source=jsonl", f"data.path={tmp_path / 'surrogate.jsonl'}"],
              "data.prompt_key: row 1 of " + str(tmp_path / "surrogate.jsonl") + ": prompt: not "
              "valid text: a lone surrogate '\\ud800' at character 1"),
             # a prompt that cannot fit the context with the response: refused at load, named
             (["data.source=jsonl", f"data.path={tmp_path / 'long.jsonl'}"],
              "long.jsonl): 1 prompt(s) too long for the model's context of 256 tokens "
              "(max_position_embeddings) with rollout.max_new_tokens=4 generated after them "
              "(at most 252 prompt tokens): row 1 ("),
             (["eval.sets=[{path: " + str(tmp_path / "long.jsonl") + "}]"],
              "eval.sets[0] (" + str(tmp_path / "long.jsonl") + "): 1 prompt(s) too long"),
             # one far too long for any tokenisation to fit: refused before it is tokenised
             (["data.source=jsonl", f"data.path={tmp_path / 'huge.jsonl'}"],
              "data.prompt_key: row 1 of " + str(tmp_path / "huge.jsonl") + ": 1000000 "
              "characters, so at least"),
             (["eval.sets=[{path: " + str(tmp_path / "huge.jsonl") + "}]"],
              "eval.sets[0]: data.prompt_key: row 1 of " + str(tmp_path / "huge.jsonl") +
              ": 1000000 characters, so at least"),
             # the answer column gets the prompt's checks: text, and the warm start's length
             (["data.source=jsonl", f"data.path={tmp_path / 'answer_surrogate.jsonl'}"],
              "data.answer_key: row 0 of " + str(tmp_path / "answer_surrogate.jsonl") +
              ": answer: not valid text: a lone surrogate '\\udc00' at character 1"),
             (["data.source=jsonl", f"data.path={tmp_path / 'answer_long.jsonl'}"],
              "data.answer_key: data.path (" + str(tmp_path / "answer_long.jsonl") + "): 1 "
              "answer(s) too long for the warm start, which trains on prompt + answer + end of "
              "text within the model's context of 256 tokens (max_position_embeddings): row 1 "
              "(409 tokens after a"),
             (["data.source=jsonl", f"data.path={tmp_path / 'answer_huge.jsonl'}"],
              "row 0 (3000000 characters); shorten them or set trainer.warmup.steps=0")]
    for i, (extra, message) in enumerate(cases):
        for command in ("config", "train"):
            if i == 0:
                res = subprocess.run([sys.executable, "-m", "moe_rl.cli", command, *base, *extra],
                                     capture_output=True, text=True, timeout=120, cwd=tmp_path)
                code, err = res.returncode, res.stderr
            else:
                code, err = main([command, *base, *extra]), capsys.readouterr().err
            assert code == 2, (command, extra, err[-1500:])
            assert message in err and "Traceback" not in err, (command, extra)
    assert not (tmp_path / "run").exists()   # train refused before creating anything
    # without the warm start a long answer is only the reward's label: accepted
    assert main(["config", *base, "data.source=jsonl", "trainer.warmup.steps=0",
                 f"data.path={tmp_path / 'answer_long.jsonl'}"]) == 0
    capsys.readouterr()
    ok = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", *base],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "algorithm:" in ok.stdout
    # a cluster config: the hint is to point model.path at the real checkpoint
    gpu = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--config",
                          "qwen3_30b_a3b_r3_gspo.yaml", f"model.path={tmp_path / 'nowhere'}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert gpu.returncode == 2 and "point model.path at your local copy of the model's " \
        "Hugging Face checkpoint" in gpu.stderr and "init-model --config" not in gpu.stderr


def _hf_model(tmp_path, **fields):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(fields))
    return f"model.path={d}"


QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 num_hidden_layers=48, vocab_size=151936, decoder_sparse_step=1,
                 mlp_only_layers=[], max_position_embeddings=40960)
SGLANG_FP8 = ["rollout.engine=sglang", "cluster.gpus_per_node=8", "rollout.quantization=fp8"]


def test_mxfp4_is_the_reference_engines_emulation():
    assert "rollout.quantization: mxfp4 is emulated by the reference engine" in _err(
        ["rollout.engine=sglang", "cluster.gpus_per_node=8", "rollout.quantization=mxfp4"])
    assert load_config(None, ["rollout.quantization=mxfp4"]).rollout.quantization == "mxfp4"


def test_fp8_shapes_sglang_refuses_are_refused_at_config_time(tmp_path):
    """SGLang's block-wise FP8 loader needs every merged-linear partition and each expert's
    intermediate partition to be a multiple of 128 (hand-worked on Qwen3-30B-A3B's shape)."""
    from moe_rl.engines.sglang.fp8_shapes import fp8_shape_errors
    assert fp8_shape_errors(QWEN3_30B, 1, 1) == []
    assert fp8_shape_errors(QWEN3_30B, 4, 4) == []          # experts whole (768)
    assert fp8_shape_errors(QWEN3_30B, 2, 1) == []          # 768 / 2 = 384 = 3 x 128
    errors = fp8_shape_errors(QWEN3_30B, 4, 1)              # 768 / 4 = 192
    assert len(errors) == 1 and "192" in errors[0] and "moe_intermediate_size 768" in errors[0]
    model = _hf_model(tmp_path, **QWEN3_30B)
    msg = _err(SGLANG_FP8 + [model, "rollout.sglang.tp_size=4", "cluster.trainer_workers=4"])
    assert "rollout.quantization" in msg and "tp_size=4" in msg and "192" in msg
    load_config(None, SGLANG_FP8 + [model, "rollout.sglang.tp_size=4",
                                    "rollout.sglang.ep_size=4"])
    # a merged QKV partition of 64 (head_dim 64 x 1 KV head) refuses even at TP 1
    small = _hf_model(tmp_path, **{**QWEN3_30B, "head_dim": 64, "num_key_value_heads": 1})
    assert "key/value partition" in _err(SGLANG_FP8 + [small])
    # the reference engine emulates FP8 on any shape; SGLang without FP8 loads any shape
    load_config(None, ["rollout.quantization=fp8"])
    load_config(None, [small, "rollout.engine=sglang", "cluster.gpus_per_node=8"])
    # Mixtral: the expert size is intermediate_size
    mixtral = dict(model_type="mixtral", hidden_size=4096, num_attention_heads=32,
                   num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                   num_experts_per_tok=2, num_hidden_layers=32, vocab_size=32000,
                   max_position_embeddings=4096)
    assert fp8_shape_errors(mixtral, 8, 1) == []             # 14336 / 8 = 1792 = 14 x 128
    assert fp8_shape_errors({**mixtral, "intermediate_size": 8256}, 1, 1)   # 8256 % 128 = 64


def test_colocated_distributed_sync_on_gpus_is_refused():
    """NCCL refuses two ranks of one communicator on the same GPU: trainer rank 0 and an SGLang
    rank would be, with colocated engines and a distributed weight sync."""
    gpu = ["cluster.gpus_per_node=8", "rollout.engine=sglang", "cluster.colocate=true"]
    msg = _err(gpu + ["cluster.weight_sync=distributed"])
    assert "cluster.weight_sync" in msg and "colocate" in msg and "NCCL" in msg
    load_config(None, gpu + ["cluster.weight_sync=disk"])
    load_config(None, ["cluster.colocate=true", "cluster.weight_sync=distributed"])   # gloo: fine


def test_every_shipped_config_states_its_checkpoint_interval():
    """A crash never loses a whole run: each shipped config says how often it checkpoints (by
    steps and by minutes), and the defaults checkpoint periodically too."""
    import pathlib
    import yaml
    from moe_rl.config import TrainerConfig
    configs = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        saved = yaml.safe_load(path.read_text())["trainer"].get("checkpoint", {})
        assert saved.get("interval", 0) > 0 and saved.get("interval_minutes", 0) > 0, path.name
    c = TrainerConfig().checkpoint
    assert c.interval > 0 and c.interval_minutes > 0


def test_readme_and_the_manual_name_the_same_libraries():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]

    def table(path):
        text = path.read_text()
        start = text.index("| job | library |")
        return text[start:text.index("\n\n", start)]
    assert table(root / "README.md") == table(root / "docs" / "libraries.md") \
        == table(root / "docs" / "index.md")


def test_the_manuals_home_page_is_the_readme():
    """docs/index.md is README.md with its links made relative to docs/ (edit both together)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    home = (root / "docs" / "index.md").read_text()
    assert home == readme.replace("](docs/", "](").replace(
        "The manual is in [`docs/`](index.md), one page per concern",
        "This manual has one page per concern")


def test_the_front_page_stays_under_300_lines():
    """README.md is the front page; the manual lives in docs/ (issue 63)."""
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert len(readme.splitlines()) < 300, len(readme.splitlines())


def test_context_parallel_without_transformer_engine_is_refused_early(monkeypatch):
    """CP > 1 runs in Transformer Engine's attention only (megatron's local attention asserts
    CP == 1 at the first forward): refused by the model builder, where the trainer starts and
    before anything is built, naming the key and the fix. (Not at config time: the driver may
    lack TE where the trainer's nodes have it.)"""
    import importlib.util
    from moe_rl.trainer import model_builder
    from moe_rl.trainer.parallel import ParallelSizes
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ValueError, match=r"trainer.parallel.context: > 1 needs Transformer "
                                         r"Engine.*install transformer-engine\[pytorch\]"):
        model_builder.build_model("unused", sizes=ParallelSizes(1, 1, 1, 2))


def test_a_data_file_not_under_the_working_directory_is_found_beside_the_config(tmp_path,
                                                                               monkeypatch):
    """Relative paths resolve against the working directory; a data file that is not there
    is taken from the config file's folder (a shipped config's data); other paths never are."""
    conf = tmp_path / "confs"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (conf / "run.yaml").write_text(
        "data: {source: jsonl, path: data/train.jsonl}\n"
        "eval: {sets: [{path: data/train.jsonl, name: held}]}\nlogging: {dir: data}\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = load_config(str(conf / "run.yaml"))
    assert cfg.data.path == str(conf / "data" / "train.jsonl")
    assert cfg.eval.sets[0].path == str(conf / "data" / "train.jsonl")
    assert cfg.logging.dir == str(work / "data")   # not a data file: the working directory
    (work / "data").mkdir()
    (work / "data" / "train.jsonl").write_text("{}\n")   # one here wins
    assert load_config(str(conf / "run.yaml")).data.path == str(work / "data" / "train.jsonl")


GSPO_KEYS = ["algorithm.loss=gspo", "algorithm.aggregation=seq-mean-token-mean"]


@pytest.mark.parametrize("overrides,said", [
    (GSPO_KEYS + ["algorithm.clip_low=0.2", "algorithm.clip_high=0.28"],
     "algorithm.loss=gspo with algorithm.clip_low/clip_high = 0.2/0.28, ranges sized for a "
     "token's ratio: GSPO's sequence ratio (a geometric mean over the response) almost never "
     "leaves them, so almost nothing is clipped (the GSPO paper: 0.0003/0.0004; set "
     "algorithm.clip_low=0.0003 algorithm.clip_high=0.0004 unless meant)"),
    (GSPO_KEYS + ["algorithm.clip_low=3e-4", "algorithm.clip_high=0.01"], "0.0003/0.01"),
    (["algorithm.loss=ppo", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4"],
     "algorithm.loss=ppo with algorithm.clip_low/clip_high = 0.0003/0.0004, ranges sized for "
     "GSPO's sequence ratio: a token's ratio almost always leaves them, so almost every token "
     "is clipped (PPO with DAPO's clip-higher: 0.2/0.28; set algorithm.clip_low=0.2 "
     "algorithm.clip_high=0.28 unless meant)"),
    (GSPO_KEYS + ["algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4"], None),
    (GSPO_KEYS + ["algorithm.clip_low=3e-4", "algorithm.clip_high=0.0099"], None),
    (["algorithm.loss=ppo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28"], None),
    (["algorithm.loss=ppo", "algorithm.clip_low=0", "algorithm.clip_high=0"], None),   # no clip
    (["algorithm.loss=gmpo", "algorithm.aggregation=seq-mean-token-mean"], None),
])
def test_a_loss_with_the_other_losss_clip_ranges_is_warned_about(overrides, said):
    """Switching algorithm.loss between GSPO and PPO keeps the ranges of the other: said."""
    from moe_rl.config.checks import clip_range_warning
    got = clip_range_warning(load_config(None, overrides).algorithm)
    assert got is None if said is None else (got.startswith("warning: ") and said in got)


def test_no_shipped_config_pairs_a_loss_with_the_other_losss_clip_ranges():
    import pathlib
    from moe_rl.config.checks import clip_range_warning
    files = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(files) >= 6
    assert [f.name for f in files if clip_range_warning(load_config(f).algorithm)] == []


def test_the_config_to_start_from_in_own_data_md_runs_its_checks_and_the_gpu_one_resolves(
        tmp_path, monkeypatch):
    """docs/own-data.md's first config (model, data, reward, run directory; the rest defaults)
    passes `moe-rl config` on the tiny model it names; with the GPU keys merged over it, it
    resolves for one node of 8 GPUs."""
    import re
    import subprocess
    import sys
    import yaml
    from moe_rl.models.tiny import write_tiny_model
    from tests.helpers import ROOT
    text = (ROOT / "docs" / "own-data.md").read_text()
    start = text.index("**A config to start from.**")
    cpu_block, gpu_block = re.findall(r"```yaml\n(.*?)```", text[start:], re.S)[:2]
    cpu, gpu = (yaml.safe_load("\n".join(line[3:] for line in block.splitlines()))
                for block in (cpu_block, gpu_block))
    monkeypatch.chdir(tmp_path)
    write_tiny_model(load_config("tiny_math_cpu.yaml").model.init, cpu["model"]["path"])
    (tmp_path / cpu["data"]["path"]).write_text(
        '{"prompt": "What is 2+3?", "answer": "5"}\n{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(cpu))
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--config", "my.yaml"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "inputs checked: " in res.stderr and "2 training prompts" in res.stderr
    merged = {k: {**cpu.get(k, {}), **gpu.get(k, {})} for k in {*cpu, *gpu}}
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(merged))
    cfg = load_config(str(tmp_path / "gpu.yaml"))
    assert (cfg.cluster.gpus_per_node, cfg.rollout.engine, cfg.trainer.parallel.expert) == \
        (8, "sglang", 4)


def test_moe_rl_config_prints_every_warning_moe_rl_train_prints(tmp_path):
    """The precision pair (a float16 trainer against the engine's float32 default) and the
    clip ranges (GSPO with token-sized ranges), on stderr beside the YAML, as `train` says
    them."""
    import subprocess
    import sys
    from moe_rl.config.checks import config_warnings
    overrides = ["model.dtype=float16", "algorithm.loss=gspo", "algorithm.clip_low=0.2",
                 "algorithm.clip_high=0.28"]
    got = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--config", "tiny_cpu",
                          "--no-inputs", *overrides], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    want = config_warnings(load_config("configs/tiny_cpu.yaml", overrides))
    assert [w.split(":")[1].split()[0] for w in want] == ["rollout.engine_dtype=float32",
                                                          "algorithm.loss=gspo"]
    assert got.stderr.splitlines() == want


@pytest.mark.parametrize("command,overrides,refusals", [
    ("config", ["trainer.optim.lr=nan", "rollout.sampling.temperature=-1"],
     ["trainer.optim.lr: expected a finite number", "rollout.sampling.temperature: -1.0 is out of range"]),
    ("config", ["algorithm.loss=gspo", "algorithm.aggregation=token-mean",
                "algorithm.clip_low=-0.1"],
     ["algorithm.clip_low/clip_high: GSPO needs positive clip ranges",
      "algorithm.clip_low/clip_high: clip ranges must be >= 0",
      "algorithm.aggregation: GSPO's token form"]),
    ("plan", ["cluster.num_nodes=2", "cluster.colocate=true", "cluster.gpus_per_node=8",
              "rollout.engine=sglang", "model.dtype=bfloat16", "rollout.engine_dtype=bfloat16",
              "cluster.trainer_workers=16", "rollout.num_servers=2",
              "cluster.weight_sync=distributed"],
     ["cluster.weight_sync: 'distributed' with cluster.colocate=true",
      "rollout.prompts_per_step: 8 prompt groups cannot give each of the 16"]),
])
def test_every_refusal_of_a_config_comes_at_once(tmp_path, command, overrides, refusals):
    """Through the commands a user types: one line, numbered, naming each refusal."""
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-m", "moe_rl.cli", command, "--no-inputs",
                          *overrides], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got.stderr
    line = got.stderr.strip()
    assert line.startswith(f"moe-rl {command}: {len(refusals)} refusals: (1) ")
    for i, text in enumerate(refusals, 1):
        assert f"({i}) {text}" in line, line


def test_gpt_oss_in_float16_on_sglang_is_warned_about_its_bfloat16_sinks(tmp_path):
    """SGLang keeps gpt-oss's attention sinks in bfloat16 under --dtype float16: said by
    `moe-rl config` (and train); not in bfloat16, nor for a family without sinks."""
    import subprocess
    import sys
    from moe_rl.engines.factory import engine_kind
    base = ["rollout.engine=sglang", "cluster.gpus_per_node=8", f"model.path={tmp_path}/none"]
    fp16 = ["model.dtype=float16", "rollout.engine_dtype=float16"]
    got = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--no-inputs", *base,
                          "model.init.architecture=gpt_oss", *fp16], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert "warning: rollout.engine_dtype=float16 with attention sinks (gpt-oss): SGLang keeps " \
        "the sinks in bfloat16" in got.stderr
    bf16 = ["model.dtype=bfloat16", "rollout.engine_dtype=bfloat16"]
    assert engine_kind(load_config(None, base + ["model.init.architecture=gpt_oss", *bf16])
                       ).config_warnings() == []
    assert engine_kind(load_config(None, base + fp16)).config_warnings() == []


def test_every_numeric_key_has_a_top():
    """trainer.steps=10**400 crashed after step 1, trainer.checkpoint.stop_grace_s=1e10 at the stop
    (setitimer), data.reward_abs_max=1e300 at the first reward: every int and float key is
    refused above its bound when the config loads, naming the key."""
    from moe_rl.config import iter_keys
    numeric = [(k, tp) for k, tp, _, _ in iter_keys() if tp.split()[0] in ("int", "float")]
    assert len(numeric) > 50
    for key, tp in numeric:
        huge = "1e300" if tp.startswith("float") else "1" + "0" * 400
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*is out of range"):
            load_config(None, [f"{key}={huge}"])
    load_config(None, ["trainer.loss_scale.initial=4294967296"])   # megatron's 2^32 still


@pytest.mark.parametrize("text,said", [
    ("trainer:\n  steps: 1" + "0" * 5001 + "\n", "a number of more than 4,300 digits"),
    ("trainer: " + "[" * 3000 + "]" * 3000 + "\n", "values nested deeper than Python's"),
], ids=["digits", "nesting"])
def test_numbers_too_long_and_nesting_too_deep_are_one_line(tmp_path, text, said):
    import subprocess
    import sys
    path = tmp_path / "c.yaml"
    path.write_text(text)
    got = subprocess.run([sys.executable, "-m", "moe_rl.cli", "config", "--no-inputs",
                          "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr[-2000:]
    assert got.stderr.startswith(f"moe-rl config: config file {path}: {said}")


def test_a_loss_scale_floor_above_its_start_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.loss_scale.min: 100 is above "
                                          r"trainer.loss_scale.initial \(10\)"):
        load_config(None, ["trainer.loss_scale.min=100", "trainer.loss_scale.initial=10"])


@pytest.mark.parametrize("command", [["config", "--no-inputs"], ["doctor"], ["check-model"]])
def test_a_size_beyond_any_model_in_config_json_is_one_line_before_anything_is_allocated(
        tmp_path, command):
    """num_hidden_layers: 10**12 took `moe-rl config`, `doctor` and `check-model` past 11 GB:
    under a 4 GiB address-space limit each names the field in one line."""
    import json
    import resource
    import subprocess
    import sys
    from tests.helpers import init_tiny_model
    model = init_tiny_model(tmp_path / "model")
    conf = json.loads((model / "config.json").read_text())
    conf["num_hidden_layers"] = 10 ** 12
    (model / "config.json").write_text(json.dumps(conf))
    argv = [*command, str(model)] if command == ["check-model"] else [*command,
                                                                       f"model.path={model}"]
    got = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", *argv], capture_output=True, text=True,
        timeout=180, cwd=tmp_path,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr[-2000:]
    assert f"{model / 'config.json'}: num_hidden_layers: 1000000000000, expected an integer " \
        "in [0, 4,096]" in got.stderr
