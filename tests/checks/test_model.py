"""`moe-rl check-model`: transformers, moe_rl's trainer and an engine server on the same prompts;
aligned on every tiny family, and not aligned (exit 1, naming the side and the layer) when one
side's weights were deliberately made to differ."""
from __future__ import annotations

import json

import pytest
import torch

from moe_rl.cli import main
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.checks.model import (SideReport, check_trainer, transformers_reference, verdict)
from moe_rl.families.shape import MoEShape
from moe_rl.trainer.parallel import free_port
from tests.hf_models import MIXTRAL, write_hf_model
from tests.helpers import GPT_OSS_INIT, init_tiny_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("check_qwen") / "model")


def _check(capsys, *argv):
    code = main(["check-model", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _rows(out: str) -> dict[str, list[str]]:
    """side -> its layer numbers, from the printed table."""
    sides, side = {}, None
    for line in out.splitlines()[2:-1]:
        parts = line.split()
        if not line.startswith(" "):
            side = line[:34].strip()
            sides[side] = []
        sides[side].append(parts[-4] if not line.startswith(" ") else parts[0])
    return sides


@pytest.mark.parametrize("config,overrides", [
    ("tiny_cpu.yaml", ()), ("deepseek_tiny_cpu.yaml", ()),
    ("glm45_air_r3_gspo.yaml", ()),   # its tiny twin: 128 experts, top-8
    ("tiny_cpu.yaml", GPT_OSS_INIT), ("tiny_cpu.yaml", ("model.init.architecture=minimax_m2",))],
    ids=["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2"])
def test_every_tiny_family_is_aligned(tmp_path, capsys, config, overrides):
    model = init_tiny_model(tmp_path / "model", config, *overrides)
    moe_layers = [str(i) for i in MoEShape.from_hf(
        json.loads((model / "config.json").read_text())).moe_layers]
    code, out, _ = _check(capsys, model)
    assert code == 0, out
    assert _rows(out) == {"trainer, replayed routing": moe_layers,
                          "trainer, own routing": moe_layers}
    last = out.splitlines()[-1]
    assert last.startswith("aligned: routing agreement >= 1.0000 on every layer"), last
    assert float(last.split("max |delta log-prob| ")[1].split()[0]) < 1e-4


def test_mixtral_is_aligned(tmp_path):
    """Mixtral has no tiny model of `moe-rl init-model` (and no tokenizer): its token ids
    straight into the check."""
    path, _ = write_hf_model(tmp_path, MIXTRAL)
    with open(f"{path}/config.json") as fh:
        shape = MoEShape.from_hf(json.load(fh))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 48, (n,), generator=g).tolist() for n in (30, 17)]
    ref = transformers_reference(path, prompts, shape)
    replayed, own = check_trainer(path, ref, shape)
    assert replayed.agreement == own.agreement == {layer: 1.0 for layer in shape.moe_layers}
    assert replayed.max_abs_delta < 1e-4 and own.max_abs_delta < 1e-4
    assert verdict([replayed, own], 0.99, 1e-3)[0]


def test_an_engine_serving_other_weights_is_not_aligned(qwen, tmp_path, capsys):
    """The same model on the reference engine agrees; an engine serving another seed's weights
    (a sync that never landed) fails the check, naming the engine."""
    other = init_tiny_model(tmp_path / "other", "tiny_cpu.yaml", "model.init.seed=7")
    same, wrong = ReferenceServer(str(qwen), free_port()), ReferenceServer(str(other), free_port())
    try:
        same.start()
        wrong.start()
        code, out, _ = _check(capsys, qwen, "--engine", same.url)
        assert code == 0, out
        assert f"engine at {same.url}" in _rows(out)
        code, out, _ = _check(capsys, qwen, "--engine", wrong.url, "--max-prompts", "2")
    finally:
        same.stop()
        wrong.stop()
    assert code == 1
    last = out.splitlines()[-1]
    assert last.startswith(f"NOT ALIGNED: engine at {wrong.url}: "), last
    assert "max |delta log-prob|" in last and "trainer" not in last


def test_a_trainer_loaded_wrong_is_not_aligned(qwen, capsys, monkeypatch):
    """A conversion that gets the first MoE layer's router wrong (its rows permuted: the experts
    renamed) is named: that layer's agreement falls, the log-probs move."""
    from moe_rl.checks import model as check_model
    load = check_model.load_hf_into_megatron

    def wrong(model, spec, path):
        load(model, spec, path)
        router = next(layer.mlp.router for layer in model.decoder.layers
                      if hasattr(layer.mlp, "router"))
        with torch.no_grad():
            router.weight.copy_(router.weight.roll(1, 0))
    monkeypatch.setattr(check_model, "load_hf_into_megatron", wrong)
    code, out, _ = _check(capsys, qwen)
    assert code == 1
    last = out.splitlines()[-1]
    assert last.startswith("NOT ALIGNED: trainer, replayed routing: layer 0: routing agreement"), last
    assert "trainer, own routing: layer 0:" in last and "max |delta log-prob|" in last


def test_the_verdict_names_every_failure_and_nan_fails():
    ok = SideReport("a", {0: 1.0, 2: 0.995}, 1e-5, 1e-6)
    bad = SideReport("b", {0: 0.9, 2: 1.0}, float("nan"), float("nan"))
    assert verdict([ok], 0.99, 1e-3)[0]
    aligned, line = verdict([ok, bad], 0.99, 1e-3)
    assert not aligned
    assert line == ("NOT ALIGNED: b: layer 0: routing agreement 0.9000 < 0.99; "
                    "b: max |delta log-prob| nan > 0.001")


def test_bad_input_is_one_line(tmp_path, capsys):
    code, _, err = _check(capsys, tmp_path / "nowhere")
    assert code == 2 and err.startswith("moe-rl check-model: PATH: expected a Hugging Face "
                                        "checkpoint directory with config.json"), err
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = _check(capsys, tmp_path / "llama")
    assert code == 2 and "'llama' is not supported" in err


def test_an_engine_that_does_not_answer_is_one_line(qwen, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, _, err = _check(capsys, qwen, "--engine", url, "--max-prompts", "1")
    assert code == 2 and err.splitlines()[-1].startswith(f"moe-rl check-model: --engine {url}: "), err
    assert "Traceback" not in err


def test_a_started_reference_engine_is_checked_and_stopped(qwen, capsys):
    """--start-engine reference: a server serving PATH comes up on 127.0.0.1, is checked as
    --engine checks one (aligned, its own rows), and is gone when the command returns."""
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code, out, _ = _check(capsys, qwen, "--start-engine", "reference", "--max-prompts", "2")
    assert code == 0, out
    assert "started reference engine" in _rows(out)
    assert out.splitlines()[-1].startswith("aligned: ")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_16_bit_engine_is_judged_at_its_own_tolerance_and_the_verdict_names_it(qwen, capsys):
    """A bfloat16 engine is off by its rounding alone (the tiny model: ~6e-3): judged at 0.1
    and said so; held to float32's 1e-3 by hand, the verdict names the tolerance that fits."""
    code, out, _ = _check(capsys, qwen, "--start-engine", "reference", "--engine-dtype",
                          "bfloat16", "--max-prompts", "4")
    assert code == 0, out
    line = out.splitlines()[-1]
    assert line.startswith("aligned: ") and line.endswith("(threshold 0.1) (bfloat16 engine)")
    code, out, _ = _check(capsys, qwen, "--start-engine", "reference", "--engine-dtype",
                          "bfloat16", "--max-prompts", "4", "--max-abs-delta", "1e-4")
    assert code == 1, out
    assert out.splitlines()[-1].endswith(
        "an engine serving 16-bit weights (bfloat16, float16) is off by its rounding alone: "
        "--max-abs-delta 0.1 fits it (--engine-dtype with --start-engine sets it)")


def test_an_engine_that_refuses_the_model_is_one_line(tmp_path, capsys):
    """What the started engine's checks refuse (SGLang on CPU and gpt-oss's sinks) is named in
    one line, before anything starts."""
    model = init_tiny_model(tmp_path / "model", "tiny_cpu.yaml", *GPT_OSS_INIT)
    code, _, err = _check(capsys, model, "--start-engine", "sglang", "--sglang-device", "cpu",
                          "--max-prompts", "1")
    assert code == 2, err
    assert err.splitlines()[-1].startswith("moe-rl check-model: --start-engine sglang: "
                                           "model.path: SGLang on CPU"), err


@pytest.mark.sglang
def test_a_started_sglang_on_cpu_is_aligned(qwen, capsys):
    """--start-engine sglang on SGLang's CPU path (float32): the real SGLang, started as `moe-rl
    train` starts it, routes and scores the tiny model as transformers does."""
    from tests.helpers import sglang_cpu_python
    code, out, _ = _check(capsys, qwen, "--start-engine", "sglang", "--sglang-device", "cpu",
                          "--sglang-python", sglang_cpu_python(), "--max-prompts", "2")
    assert code == 0, out
    assert "started sglang engine" in _rows(out)


class _OddEngine:
    """An engine on 127.0.0.1 answering /health and nothing else well: ``silent`` holds every
    other request until :meth:`close`; ``huge`` declares a 300 MB answer; ``garbage`` answers
    JSON that is not SGLang's."""

    def __init__(self, mode: str):
        import http.server
        import threading
        released = self.released = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status, body: bytes, length=None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length or len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._answer(200, b"")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if mode == "silent" and not released.wait(60):
                    return
                if released.is_set():
                    return self._answer(500, b'{"error": "closed"}')
                if mode == "huge":
                    return self._answer(200, b'{"text": "', length=300_000_000)
                self._answer(200, b'{"meta_info": 5, "output_ids": "x"}')

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        import time
        self.released.set()
        time.sleep(2)   # the check's thread, left behind, ends on the 500s (no thread lingers)
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("mode,expected", [
    ("silent", "no complete answer in 3 s (--engine-timeout)"),
    ("huge", "the answer is larger than rollout.servers.max_answer_mb=256 MB"),
    ("garbage", "its answer is not SGLang's")])
def test_a_silent_huge_or_garbage_engine_is_one_line_in_bounded_time(qwen, capsys, mode,
                                                                     expected):
    """check-model --engine on a server that never answers (it hung the command), declares a
    1.5 GB answer (it took 3.9 GB) or answers garbage (a traceback): one line naming the
    engine, within --engine-timeout."""
    import time
    engine = _OddEngine(mode)
    try:
        start = time.monotonic()
        code, _, err = _check(capsys, qwen, "--engine", engine.url, "--max-prompts", "1",
                              "--engine-timeout", "3")
        assert time.monotonic() - start < 60
    finally:
        engine.close()
    last = err.splitlines()[-1]
    assert code == 2 and last.startswith(f"moe-rl check-model: --engine {engine.url}: "), err
    assert expected in last and "Traceback" not in err


@pytest.mark.parametrize("damage,expected", [
    ("config.json", "not a readable JSON file"), ("model.safetensors", "SafetensorError"),
    ("tokenizer.json", "JSONDecodeError")])
def test_a_damaged_checkpoint_folder_is_one_line(qwen, tmp_path, capsys, damage, expected):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(qwen, model)
    (model / damage).write_text("{" if damage == "tokenizer.json" else "garbage")
    code, _, err = _check(capsys, model)
    assert code == 2 and err.splitlines()[-1].startswith(f"moe-rl check-model: PATH: {model}"), err
    assert expected in err and "Traceback" not in err
