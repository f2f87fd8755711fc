"""W&B logging (logging.wandb) through `moe-rl train` in offline mode: the run's W&B files are
under the run directory and hold every scalar of metrics.jsonl (evaluations included, each also
as a table) and the resolved config; a
resumed run continues the same W&B run; without the package the key is refused."""
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.helpers import init_tiny_model
from tests.helpers import ROOT


def wandb_records(path):
    """The records of a W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log blocks of 32 KiB holding chunks (CRC, length, type) of serialised
    ``wandb_internal_pb2.Record`` messages, decoded with W&B's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:   # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # FULL or LAST chunk: one record complete
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(part)
            records.append(rec)
            part = b""
    return records


def _history(run_file):
    out = {}
    for rec in wandb_records(run_file):
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                     for i in rec.history.item}
            out[int(items["_step"])] = items
    return out


def _train(tmp, steps, *extra):
    from tests.helpers import engine_base_port
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
           str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp / 'model'}",
           f"logging.dir={tmp / 'run'}", f"trainer.steps={steps}", "trainer.warmup.steps=0",
           "trainer.checkpoint.interval=1", "logging.progress=false", f"rollout.servers.base_port={engine_base_port()}",
           "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2",
           "logging.wandb.enabled=true", "logging.wandb.mode=offline",
           "logging.wandb.project=tiny", "logging.wandb.tags=[cpu,test]", *extra]
    res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, WANDB_SILENT="true"))
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: two runs for an optional logger (CI time, 2026-11-28)
def test_offline_wandb_run_holds_every_scalar_and_the_config(tmp_path):
    pytest.importorskip("wandb")   # installed by `make test-slow`, not by the CI targets
    init_tiny_model(str(tmp_path / "model"))
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+1=", "answer": "3"}\n')
    _train(tmp_path, 1, f"eval.sets=[{{path: {held}}}]", "eval.at_start=true")
    run = tmp_path / "run"
    rid = (run / "wandb_run_id").read_text().strip()
    (run_file,) = (run / "wandb").glob(f"offline-run-*-{rid}/run-{rid}.wandb")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("kind")) for r in lines] == [(0, "eval"), (0, None), (1, "eval")]
    history = _history(run_file)
    assert set(history) == {0, 1}
    for r in lines:   # the train row and the evaluations, every scalar
        for k, v in r.items():
            if k not in ("step", "kind") and v is not None:
                assert history[r["step"]][k] == pytest.approx(v, rel=1e-6), k
    for step in (0, 1):   # each evaluation also as a table
        assert history[step]["eval/table/_type"] == "table-file"   # nested keys, flattened
        assert history[step]["eval/table/nrows"] == 1 and history[step]["eval/table/ncols"] == 6
    records = wandb_records(run_file)
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_rec.project == "tiny" and list(run_rec.tags) == ["cpu", "test"]
    assert run_rec.display_name == "run" and run_rec.run_id == rid
    updates = [run_rec.config] + [r.config for r in records
                                  if r.WhichOneof("record_type") == "config"]
    config = {i.key: json.loads(i.value_json) for c in updates for i in c.update}
    assert config["trainer"]["steps"] == 1 and config["logging"]["wandb"]["mode"] == "offline"
    # a resumed run continues the same W&B run from the next step
    _train(tmp_path, 2, "--resume")
    assert (run / "wandb_run_id").read_text().strip() == rid
    files = sorted((run / "wandb").glob(f"offline-run-*-{rid}/run-{rid}.wandb"))
    assert 1 in _history(files[-1])


def test_wandb_without_the_package_is_refused(monkeypatch):
    import importlib.util
    from moe_rl.config import ConfigError, load_config
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb.enabled: .*pip install 'moe_rl\[wandb\]'"):
        load_config(None, ["logging.wandb.enabled=true"])
    load_config(None, ["logging.wandb.enabled=true", "logging.wandb.mode=disabled"])
