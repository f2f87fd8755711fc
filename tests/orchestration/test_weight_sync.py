"""Weight sync over a process group (gloo on CPU) into the reference engine, and memory release
for colocated training, over real HTTP."""
import json
import time
import os
import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.families.shape import MoEShape
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine, broadcast_tolerant
from moe_rl.rollout.trajectories import generate_samples
from moe_rl.engines.sglang.pool import EngineHTTPError, ServerPool
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port
from moe_rl.engines.sglang.weights import (broadcast_tensors, close_group, open_group,
                               update_request)
from moe_rl.weights.serialize import parse_dtype
from tests.helpers import assert_serves_like, fake_cuda_ipc, start_ranks


@pytest.mark.multiproc
def assert_same_policy(got, want):
    """Same tokens, log-probs equal to float32 rounding: a later request may land on the other
    server, whose CPU kernels can round the last bit differently under load (seen once in CI);
    other weights move them by far more."""
    assert got.response_ids.tolist() == want.response_ids.tolist()
    torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-5)


def test_broadcast_update_and_memory_release(tmp_path, monkeypatch):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    scratch = tmp_path / "tmp"   # the servers' temporary directory: empty once they stopped
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    write_tiny_model(ModelInitConfig(seed=1), a)
    write_tiny_model(ModelInitConfig(seed=2), b)
    facts = MoEShape.from_hf(json.load(open(f"{a}/config.json")))
    layout = facts
    procs = [ReferenceServer(a, free_port()).start() for _ in range(2)]
    ref = ReferenceServer(b, free_port()).start()   # serves b's weights from disk: the target
    try:
        eng = SGLangEngine(lambda: ServerPool([p.url for p in procs], max_retries=0),
                           layout, need_routing=True, need_mask=False)
        w = eng.weights
        port = free_port()
        joined = {}
        t = threading.Thread(target=lambda: joined.update(
            group=open_group("gloo", "127.0.0.1", port, 0, 3, "w")))
        t.start()
        w.join_group("127.0.0.1", port, "w", "gloo")
        t.join(60)
        assert "group" in joined
        named = sorted(load_file(f"{b}/model.safetensors").items())
        body = update_request(named, 5, "w")
        # SGLang loads a distributed update only inside a weight-update session
        with pytest.raises(EngineHTTPError, match="begin_weight_update first"):
            w.announce_bucket(named, 5, "w", True)
        w.begin()
        with pytest.raises(EngineHTTPError, match="already open"):
            w.begin()
        # in two buckets: the first is staged, the last (flush_cache) commits the update
        half = len(named) // 2

        def send(bucket, last):
            sender = threading.Thread(target=broadcast_tensors, args=(joined["group"], bucket))
            sender.start()
            try:
                return w.announce_bucket(bucket, 5, "w", last)
            finally:
                sender.join(60)
        send(named[:half], False)
        assert eng.weight_versions() == ["default", "default"]   # staged, not served yet
        send(named[half:], True)
        w.end()
        with pytest.raises(EngineHTTPError, match="no weight-update session"):
            w.end()
        assert eng.weight_versions() == ["5", "5"]
        prompt = [[6, 7, 68, 12, 72]]
        got, want = assert_serves_like(eng, ref.url, layout, prompt)
        assert got.weight_version == 5
        # colocated: released servers refuse generation, resumed ones serve the same weights
        eng.release_memory()
        r = httpx.post(procs[0].url + "/generate", json={"input_ids": [6, 7]}, timeout=30)
        assert r.status_code == 400 and "released" in r.json()["error"]["message"]
        eng.resume_memory()
        again = generate_samples(eng, prompt, 1, SamplingConfig(max_new_tokens=4), seed=3)[0]
        assert_same_policy(again, want)
        # bad update bodies are refused with the field named
        w.begin()
        with pytest.raises(EngineHTTPError, match="group_name"):
            eng.run_with_pool(lambda pool: pool.broadcast("/update_weights_from_distributed",
                                                          {**body, "group_name": "nope"}))
        w.end()
        # a last bucket that leaves a tensor out is refused: the served weights stay
        w.begin()
        send(named[:half], False)
        with pytest.raises(EngineHTTPError, match="missing"):
            send(named[half:-1], True)
        w.end()
        assert eng.weight_versions() == ["5", "5"]
        kept = generate_samples(eng, prompt, 1, SamplingConfig(max_new_tokens=4), seed=3)[0]
        assert_same_policy(kept, want)
        # a session closed before the last bucket drops what it staged
        w.begin()
        send(named[:half], False)
        with pytest.raises(EngineHTTPError, match="never came"):
            w.end()
        # leaving the group: the servers forget it (a rebuilt group takes a new name)
        def leave():
            return eng.run_with_pool(lambda pool: broadcast_tolerant(
                pool, "/destroy_weights_update_group", {"group_name": "w"}))
        assert all(r["success"] for r in leave())
        assert not any(r["success"] for r in leave())
        w.begin()
        with pytest.raises(EngineHTTPError, match="no weight-update group 'w'"):
            w.announce_bucket(named, 5, "w", True)
        w.end()
    finally:
        for p in procs + [ref]:
            p.stop()
    assert list(scratch.iterdir()) == []


@pytest.mark.multiproc
def test_the_kinds_distributed_sender_reopens_and_aborts(tmp_path):
    """The sender the engine kind gives a trainer rank for ``weight_sync: distributed``: it
    opens its group with both servers, sends in buckets as a version (the servers serve it),
    reopens under a new name (the servers leave the old group) and sends again; a refused
    bucket is raised after the stream, and abort closes the open session."""
    from moe_rl.config import config_from_dict
    from moe_rl.engines.factory import engine_kind
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_tiny_model(ModelInitConfig(seed=1), a)
    write_tiny_model(ModelInitConfig(seed=2), b)
    layout = MoEShape.from_hf(json.load(open(f"{a}/config.json")))
    procs = [ReferenceServer(a, free_port()).start() for _ in range(2)]
    ref = ReferenceServer(b, free_port()).start()
    try:
        kind = engine_kind(config_from_dict({"model": {"path": a},
                                             "cluster": {"weight_sync": "distributed"}}))
        urls = [p.url for p in procs]
        sender, engine = kind.sender(urls, 0), kind.connect(urls, layout)
        assert not sender.opened and not sender.everywhere
        named = sorted(load_file(f"{b}/model.safetensors").items())
        half = len(named) // 2
        buckets = [(named[:half], False), ([], False), (named[half:], True)]
        for version in (7, 8):
            port = free_port()
            said = sender.open("127.0.0.1", port)
            assert said == (f"weight-update group moe_rl_weights_{version - 7}: gloo at "
                            f"127.0.0.1:{port}, 3 ranks")
            assert sender.opened and sender.group_name == f"moe_rl_weights_{version - 7}"
            assert sender.send(iter(buckets), version) == len(named)
            assert engine.weight_versions() == [str(version)] * 2
        assert_serves_like(engine, ref.url, layout, [[6, 7, 68, 12, 72]])
        wrong = [(n, t.to(torch.float64)) for n, t in named[:1]]   # not the served dtype
        started = time.monotonic()
        with pytest.raises(EngineHTTPError):
            sender.send(iter([(wrong, False)]), 9)
        sender.abort()   # the session the refused bucket left open
        assert time.monotonic() - started < 60   # the group's timeout (300 s) never waited out
        sender.abort()   # nothing open: no error
        assert engine.weight_versions() == ["8", "8"]
    finally:
        for p in procs + [ref]:
            p.stop()


class _Remote:
    """A Ray actor method stand-in: ``.remote(...)`` records the call and returns its value."""

    def __init__(self, calls: list, name: str, result=None):
        self.calls, self.name, self.result = calls, name, result

    def remote(self, *args):
        self.calls.append((self.name, args))
        return self.result() if callable(self.result) else self.result


def test_the_drivers_in_memory_sync_is_one_call_to_the_trainers(monkeypatch, capsys):
    """The driver's in-memory sync: one read of the rollout side (health, versions, servers
    restarted since the last sync), one call to the trainers (which reopen their transport
    when a server restarted since it was opened), the record's update. A sync that fails
    midway is redone from disk and the transport reopened at the next; a transport opened and
    a restarted server are named in the driver's log."""
    import types
    import ray
    from moe_rl.orchestration import weight_sync
    monkeypatch.setattr(ray, "get", lambda x: x)
    calls, restarted, failing = [], [[]], [False]

    def send_weights(version, reopen):
        calls.append(("send_weights", (version, reopen)))
        if failing[0]:
            raise RuntimeError("server 1 died")
        return {"sent": 3, "opened": "weight-update group g" if reopen else None}

    rollout = types.SimpleNamespace(**{name: _Remote(calls, name, result) for name, result in [
        ("urls", ["u0", "u1"]), ("set_weight_source", None),
        ("served_state", lambda: {"versions": ["1", "0"], "restarted": restarted[0]}),
        ("mark_served", None), ("update_weights", None)]})
    trainers = types.SimpleNamespace(
        actors=["a0"], send_weights=send_weights, export=lambda path: None,
        connect_engines=lambda urls, sources: calls.append(("connect", (urls, sources))),
        abort_weight_update=lambda: calls.append(("abort", ())))
    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(weight_sync="distributed"))
    plan = types.SimpleNamespace(tensor_sources=None)
    sync = weight_sync.WeightSync(cfg, plan, trainers, rollout, "/nonexistent")
    confirmed = []   # each confirmed sync drops the exports older than its version
    monkeypatch.setattr(sync.disk, "drop_older", confirmed.append)
    assert calls == [("urls", ()), ("connect", (["u0", "u1"], None)),
                     ("set_weight_source", (["a0"], "/nonexistent"))]
    del calls[:]
    sync.sync(1)
    assert calls == [("served_state", ()), ("send_weights", (1, False)), ("mark_served", (1,))]
    assert confirmed == [1]
    restarted[0] = ["u1"]   # a server restarted since
    del calls[:]
    capsys.readouterr()
    sync.sync(2)
    assert ("send_weights", (2, True)) in calls
    out = capsys.readouterr().out
    assert "1 server(s) restarted since the last sync (u1" in out
    assert out.endswith("weight-update group g\n")   # the run's log says so
    restarted[0], failing[0] = [], True
    monkeypatch.setattr(sync.disk, "export", lambda v: calls.append(("export", (v,))) or "p")
    del calls[:]
    sync.sync(3)
    assert [c[0] for c in calls] == ["served_state", "send_weights", "served_state", "abort",
                                     "export", "update_weights"]
    assert sync.recoveries == 1 and confirmed[-1] == 3
    failing[0] = False
    del calls[:]
    sync.sync(4)
    assert ("send_weights", (4, True)) in calls and ("mark_served", (4,)) in calls


def test_the_disk_sync_queues_the_read_and_the_load_and_confirms_them_later(monkeypatch,
                                                                           tmp_path):
    """Disk sync in the asynchronous pipeline: export, then the rollout side's read and the
    load queued (not awaited); the next sync (or wait) confirms them and drops the older
    exports, only those this run marked."""
    import types
    import ray
    from moe_rl.orchestration import weight_sync
    from moe_rl.owned_dirs import claim
    got = []
    monkeypatch.setattr(ray, "get", lambda x: got.append(x) or x)
    calls = []
    rollout = types.SimpleNamespace(**{name: _Remote(calls, name, name) for name in
                                       ("served_state", "update_weights")})
    trainers = types.SimpleNamespace(export=lambda path: claim(path))
    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(weight_sync="disk"))
    (tmp_path / "users").mkdir()
    sync = weight_sync.WeightSync(cfg, None, trainers, rollout, str(tmp_path))
    confirmed, drop = [], sync.disk.drop_older   # each confirmed sync drops the older exports
    monkeypatch.setattr(sync.disk, "drop_older", lambda v: confirmed.append(v) or drop(v))
    sync.sync(1, wait=False)
    assert calls == [("served_state", ()), ("update_weights", (str(tmp_path / "v1"), 1))]
    assert got == [] and confirmed == []   # queued, unconfirmed
    sync.sync(2, wait=False)
    assert got == [["served_state", "update_weights"]] and confirmed == [1]
    sync.wait()
    assert confirmed == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users", "v2"]


def test_a_copy_of_an_export_is_not_this_runs_to_delete(tmp_path):
    """``cp -r weights/v1 weights/v1-keep`` carries moe_rl's mark: the copy is the user's (its
    mark names another folder, by inode and name), so the next sync keeps it and an export into
    it is refused; the run's own export, even renamed (same inode), is still its own, and so is
    one in a run directory copied whole (same name)."""
    import shutil
    from moe_rl.errors import UserError
    from moe_rl.orchestration.weight_sync import DiskExport
    from moe_rl.owned_dirs import claim
    claim(str(tmp_path / "v1"))
    (tmp_path / "v1" / "model.safetensors").write_text("export 1")
    shutil.copytree(tmp_path / "v1", tmp_path / "v1-keep")
    claim(str(tmp_path / "v0"))
    os.rename(tmp_path / "v0", tmp_path / "v0-renamed")
    DiskExport(None, None, str(tmp_path)).drop_older(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1-keep"]
    assert (tmp_path / "v1-keep" / "model.safetensors").read_text() == "export 1"
    with pytest.raises(UserError, match="holds files moe_rl did not write"):
        claim(str(tmp_path / "v1-keep"))
    claim(str(tmp_path / "v5"))
    shutil.copytree(tmp_path, tmp_path.parent / "copied_run")
    DiskExport(None, None, str(tmp_path.parent / "copied_run")).drop_older(6)
    assert sorted(p.name for p in (tmp_path.parent / "copied_run").iterdir()) == ["v1-keep"]


def test_request_bodies():
    named = [("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("y", torch.zeros(4))]
    body = update_request(named, 7, "g")
    assert body == {"names": ["x", "y"], "dtypes": ["bfloat16", "float32"],
                    "shapes": [[2, 3], [4]], "group_name": "g", "flush_cache": True,
                    "weight_version": "7"}
    assert parse_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtypes"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="backend"):
        open_group("mpi", "127.0.0.1", free_port(), 0, 1, "g")


def pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) globals a pickle references (loaded with every global stubbed, so
    nothing it names runs)."""
    import io
    import pickle
    seen = set()

    class Stub:
        def __init__(self, *a, **k):
            pass

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return Stub
    Recorder(io.BytesIO(data)).load()
    return seen


def test_tensor_update_body_is_sglangs_serialisation(monkeypatch):
    """CUDA tensors travel as IPC handles naming the GPU by UUID, through module-level functions
    only (the defect: closures installed on torch's reductions could not be pickled, and a
    moe_rl global would be refused by SGLang's SafeUnpickler). make test-contract reads these
    bytes with SGLang's own deserializer."""
    import base64
    from moe_rl.engines.sglang.weights import tensor_update_request
    from moe_rl.weights.serialize import share_named_tensors
    fake_cuda_ipc(monkeypatch)
    named = [("model.norm.weight", torch.arange(4.0)), ("w", torch.ones(2, 3, dtype=torch.bfloat16))]
    shared = share_named_tensors(named)
    per_rank = [shared.text, share_named_tensors([("x", torch.ones(2))]).text]
    assert shared.counters == ((b"ref-handle", 0), (b"ref-handle", 1))   # one share each
    body = tensor_update_request(per_rank, version=3)
    assert body["weight_version"] == "3" and body["flush_cache"] is True
    assert body["serialized_named_tensors"] == per_rank   # TP rank j reads entry j
    data = base64.b64decode(per_rank[0])
    assert pickle_globals(data) == {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                                    ("torch", "Tensor"), ("torch", "Size"),
                                    ("torch.storage", "UntypedStorage"), ("torch", "float32"),
                                    ("torch", "bfloat16")}
    assert b"GPU-uuid-0" in data and b"moe_rl" not in data
    import moe_rl.weights.serialize as ws
    monkeypatch.setattr(ws, "is_ipc_tensor", lambda t: t.is_cuda)
    with pytest.raises(ValueError, match="CUDA tensors"):
        share_named_tensors([("cpu", torch.ones(2))]).text


def test_an_unopened_payload_gives_every_share_back(monkeypatch):
    """Each share's reference counter is released as torch's receiver releases one it already
    holds, then torch frees the blocks (``ipc_collect``); a payload without shares does
    nothing. (The memory coming back is measured on a GPU: benchmarks/gpu_check.py.)"""
    from moe_rl.weights.serialize import SharedBucket, release_unopened, share_named_tensors
    from tests.helpers import fake_cuda_ipc
    fake_cuda_ipc(monkeypatch)
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append("collect"))
    release_unopened(SharedBucket(""))
    assert calls == []
    release_unopened(share_named_tensors([("a", torch.ones(2)), ("b", torch.ones(3))]))
    assert calls == [(b"ref-handle", 0), (b"ref-handle", 1), "collect"]


def _gather_worker(rank, port, out):
    import os

    import torch.distributed as dist
    from moe_rl.weights.serialize import gather_strings
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    got = gather_strings("payload-" + "x" * rank * 5)
    if rank == 0:
        with open(out, "w") as fh:
            fh.write("|".join(got))
    else:
        assert got is None
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_each_rank_payload_reaches_rank_zero_in_order(tmp_path):
    out = tmp_path / "g.txt"
    start_ranks(_gather_worker, (free_port(), str(out)), 3)
    assert out.read_text() == "payload-|payload-xxxxx|payload-xxxxxxxxxx"


def test_tensor_sync_config_requirements():
    from moe_rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="cluster.weight_sync"):
        load_config(None, ["cluster.weight_sync=tensor"])
    base = ["cluster.weight_sync=tensor", "cluster.colocate=true", "rollout.engine=sglang",
            "cluster.gpus_per_node=8"]
    cfg = load_config(None, base)
    assert cfg.cluster.weight_sync == "tensor"
    # one trainer rank per SGLang TP rank (each builds its GPU's payload)
    with pytest.raises(ConfigError, match="trainer_workers == rollout.num_servers"):
        load_config(None, base + ["rollout.sglang.tp_size=2"])
    load_config(None, base + ["rollout.sglang.tp_size=2", "cluster.trainer_workers=2"])
    # SGLang asserts dp_size 1 for distributed and tensor updates (the SGLang checks, run
    # after the general ones: distributed sync on its own, not colocated, GPUs)
    for mode in ("tensor", "distributed"):
        with pytest.raises(ConfigError, match="rollout.sglang.dp_size"):
            load_config(None, base[2:] + [f"cluster.weight_sync={mode}",
                                          f"cluster.colocate={mode == 'tensor'}",
                                          "rollout.sglang.dp_size=2"])


def test_buckets_hold_at_most_one_bucket_and_mark_the_last():
    from moe_rl.weights.hf import hf_buckets
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # floats
    got = list(hf_buckets(iter(tensors), bucket_bytes=80))
    assert [[n for n, _ in b] for b, _ in got] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [last for _, last in got] == [False, False, True]
    assert all(sum(t.numel() * 4 for _, t in b) <= 80 or len(b) == 1 for b, _ in got)
    assert list(hf_buckets(iter([]), 80)) == [([], True)]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(hf_buckets(iter(tensors), 0))


def test_sharded_checkpoint_loads_back(tmp_path):
    """Cut into small shards: files named as HF does, an index mapping every tensor, and
    every tensor read back bit for bit (the engines load it as any HF checkpoint)."""
    from moe_rl.weights.hf import HFCheckpoint, save_hf_checkpoint
    from moe_rl.families.shape import model_spec
    src = tmp_path / "src"
    write_tiny_model(ModelInitConfig(seed=4), str(src))
    tensors = load_file(str(src / "model.safetensors"))
    spec = model_spec(json.loads((src / "config.json").read_text()))
    from moe_rl.owned_dirs import claim
    out = tmp_path / "out"
    claim(str(out))   # a previous export's folder: its stale file goes
    (out / "model.safetensors").write_bytes(b"stale")
    save_hf_checkpoint(tensors, spec, str(out), source_dir=str(src),
                       shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    back = HFCheckpoint(str(out))
    assert all(torch.equal(back.get(k), v) for k, v in tensors.items())
    proc = ReferenceServer(str(out), free_port()).start()   # the reference engine serves it
    try:
        r = httpx.post(proc.url + "/generate", timeout=60, json={
            "input_ids": [6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        proc.stop()


def test_tensor_sync_sources_follow_the_plan():
    """Each SGLang TP rank takes the payload of the trainer rank on its own node and GPU, as the
    plan placed them: with 6 GPUs a node and servers of TP 4, server 1 moves to node 1, where
    trainer ranks 6-9 share its GPUs (``s * tp + j`` would have fed it ranks 4-7, two of them
    on node 0). With EP 8 and one TP-4 server only ranks 0-3 are sources. A TP rank on a GPU
    no trainer rank holds is refused, naming it."""
    from moe_rl.config import ConfigError, load_config
    from moe_rl.orchestration.placement import Plan, PlannedProcess, make_plan, tensor_sources
    base = ["rollout.engine=sglang", "cluster.weight_sync=tensor", "cluster.colocate=true"]
    moved = load_config(None, base + [
        "cluster.gpus_per_node=6", "cluster.num_nodes=2", "cluster.trainer_workers=12",
        "rollout.num_servers=2", "rollout.sglang.tp_size=4", "trainer.parallel.expert=2",
        "rollout.prompts_per_step=12"])
    plan = make_plan(moved)
    assert [(p.node, p.gpus) for p in plan.of("engine")] == [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3])]
    assert plan.tensor_sources == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert plan.to_json()["tensor_sources"] == [[0, 1, 2, 3], [6, 7, 8, 9]]
    ep8 = make_plan(load_config(None, base + [
        "cluster.gpus_per_node=8", "cluster.trainer_workers=8", "rollout.num_servers=1",
        "rollout.sglang.tp_size=4", "trainer.parallel.expert=8"]))
    assert ep8.tensor_sources == [[0, 1, 2, 3]]
    lone = Plan(1, 8, [PlannedProcess("trainer", 0, 0, [0]), PlannedProcess("trainer", 1, 0, [1]),
                       PlannedProcess("engine", 0, 0, [0, 1, 2, 3])])
    with pytest.raises(ConfigError, match=r"server 0's TP rank 2 \(node 0, GPU 2\) has none"):
        tensor_sources(load_config(None, base + ["cluster.gpus_per_node=8",
                                                 "rollout.sglang.tp_size=4",
                                                 "cluster.trainer_workers=4"]), lone)


@pytest.mark.parametrize("rank", [0, 5])
def test_only_the_ranks_a_server_reads_share_their_tensors(monkeypatch, rank):
    """A rank that feeds no TP rank never serialises (its CUDA IPC share would pin a model copy
    per sync until out of memory: torch keeps a shared block alive until a consumer releases
    it); rank 0 hands server s the payloads of ``sources[s]``."""
    import types
    import moe_rl.weights.serialize as serialize
    from moe_rl.engines.sglang.sender import TensorSender
    sources = [[0, 1], [3, 4]]
    serialised, received = [], []
    monkeypatch.setattr(serialize, "share_named_tensors", lambda named: serialised.append(
        named) or serialize.SharedBucket(f"payload{rank}"))
    monkeypatch.setattr(serialize, "gather_strings", lambda text: (
        [f"payload{r}" if r in (0, 1, 3, 4) else "" for r in range(6)] if rank == 0 else None))
    receiver = types.SimpleNamespace(
        receive_tensors=lambda payloads, version, last: received.append(payloads),
        begin=lambda: None, end=lambda: None)
    sender = TensorSender(receiver, rank, fp8=False, sources=sources)
    sent = sender.send(iter([([("w", torch.zeros(2))], True)]), 3)
    assert len(serialised) == (1 if rank == 0 else 0)
    if rank == 0:
        assert sent == 1 and received == [[["payload0", "payload1"], ["payload3", "payload4"]]]


def test_a_refused_announcement_ends_the_broadcast_at_once(tmp_path):
    """The server refuses a bucket's announcement (HTTP 400) and never joins its broadcast:
    rank 0 raises the refusal at once instead of waiting out the group's timeout (a bfloat16
    trainer's first sync into a float32 checkpoint waited 300 s so), and the group closes."""
    import subprocess
    import sys
    import time
    from concurrent.futures import Future
    from moe_rl.engines.sglang.pool import EngineHTTPError
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", (
        "import time; from moe_rl.engines.sglang.weights import open_group; "
        f"g = open_group('gloo', '127.0.0.1', {port}, 1, 2, 'refused', timeout_s=60); "
        "time.sleep(30)")])
    try:
        group = open_group("gloo", "127.0.0.1", port, 0, 2, "refused", timeout_s=60)
        answer = Future()
        answer.set_running_or_notify_cancel()
        threading.Timer(0.3, lambda: answer.set_exception(
            EngineHTTPError("HTTP 400: dtypes: refused"))).start()
        t0 = time.monotonic()
        with pytest.raises(EngineHTTPError, match="dtypes: refused"):
            broadcast_tensors(group, [("w", torch.ones(4))], answer)
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        close_group(group)
        assert time.monotonic() - t0 < 10
    finally:
        peer.kill()
        peer.wait()


class _ExportFails:
    """Trainers whose export writes part of the model, then fails with ``error``."""

    def __init__(self, error):
        self.error = error

    def export(self, target):
        from moe_rl.owned_dirs import claim
        claim(target)
        with open(os.path.join(target, ".shard-0.tmp"), "wb") as fh:
            fh.write(b"half")
        raise self.error


@pytest.mark.parametrize("error", ["OSError: [Errno 28] No space left on device",
                                   "PermissionError: [Errno 1] Operation not permitted",
                                   "PermissionError: [Errno 13] Permission denied"])
def test_an_export_on_a_full_or_unwritable_disk_is_one_line_and_leaves_nothing_half_written(
        tmp_path, error):
    """No space, or an entry that cannot be written (EPERM, EACCES: a traceback before)."""
    from moe_rl.orchestration.weight_sync import DiskExport, ExportError
    ray_error = RuntimeError("ray::TrainerWorker.export_hf() (pid=1)\nTraceback ...\n  File "
                             f"\"hf.py\", line 420\n{error}: '/run/weights/v3/.shard-0.tmp'")
    sync = DiskExport(_ExportFails(ray_error), None, str(tmp_path))
    with pytest.raises(ExportError) as got:
        sync.export(3)
    message = str(got.value)
    assert "\n" not in message and error.split("] ")[1] in message
    assert message.startswith(f"exporting the weights of version 3 to {tmp_path}/v3 failed")
    assert not (tmp_path / "v3").exists()
    other = DiskExport(_ExportFails(KeyError("a bug")), None, str(tmp_path))
    with pytest.raises(KeyError):   # not the disk: raised as it is, for its traceback
        other.export(4)
