"""SGLang's answers under pressure, decoded and survived: a retracted request aborted from the
waiting queue (ids and log-probs, no routing, no kept sets) is no progress; an abort that came
with EOS finishes the response; retractions are counted and, by ``rollout.retracted``, kept or
masked; a failed tensor sync stops every rank's serialising and gives back the shares no server
received; the weight check's probe never lists the whole vocabulary."""
from __future__ import annotations

import asyncio

import pytest
import torch

from moe_rl.config import load_config, probe_temperature
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine, SGLangSession
from moe_rl.engines.sglang.decode import decode_turn
from moe_rl.engines.sglang.pool import EngineHTTPError, ServerPool
from moe_rl.families.shape import MoEShape
from moe_rl.rollout.groups import retraction_counts
from moe_rl.rollout.partial import PartialRollout
from moe_rl.rollout.trajectories import sample_of_turn
from moe_rl.trainer.parallel import free_port
from tests.helpers import RewardServer

LAYOUT = MoEShape(num_layers=1, moe_layers=(0,), topk=2, num_experts=4, vocab_size=16,
                  eos_ids=(2,))


def waiting_queue_abort(output_ids: list[int]) -> dict:
    """SGLang 0.5.23's answer to ``abort_all`` for a request that KV-pool pressure moved back to
    the waiting queue (``TokenizerManager._handle_abort_req``): its output ids so far and their
    log-probs, but no ``routed_experts``, kept sets or ``cached_tokens``."""
    return {"text": "", "output_ids": output_ids, "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "3", "e2e_latency": 0.5, "completion_tokens": len(output_ids),
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids]}}


@pytest.mark.parametrize("need", [(True, False), (False, True)], ids=["routing", "mask"])
def test_a_retracted_request_aborted_in_the_waiting_queue_is_no_progress(need):
    """Counted as an abort before it ran: nothing kept, continued later from the same prefix
    (it raised ResponseError and ended the step)."""
    routing, mask = need
    turn = decode_turn(waiting_queue_abort([5, 6, 7]), 4, LAYOUT, need_routing=routing,
                       need_mask=mask)
    assert turn.aborted and turn.output_ids == [] and turn.weight_version == 3
    assert turn.discarded == 3


class _CannedPool:
    """A pool answering each /generate with the next canned answer (recording the bodies)."""

    def __init__(self, answers: list[dict]):
        self.answers, self.bodies, self.servers = list(answers), [], [object()]

    async def request(self, path, body=None, *, server=None, method="POST", resend=True):
        if path == "/abort_request":
            return {}
        self.bodies.append(body)
        return self.answers.pop(0)


class _CannedEngine(SGLangEngine):
    def __init__(self, pool: _CannedPool, layout: MoEShape = LAYOUT):
        super().__init__(lambda: pool, layout, need_routing=False, need_mask=False)
        self.pool = pool

    def run(self, fn):
        return asyncio.run(fn(SGLangSession(self, self.pool)))


def _answer(output_ids: list[int], finish: dict, **meta) -> dict:
    return {"text": "", "output_ids": output_ids, "meta_info": {
        "finish_reason": finish, "weight_version": "0", "cached_tokens": 0,
        "output_token_logprobs": [[-0.25, t, None] for t in output_ids], **meta}}


class _Prompt:
    def __init__(self, ids):
        self.ids = ids


async def _score(samples):
    return samples


@pytest.mark.parametrize("last", ["eos", "stop_id"])
def test_an_abort_that_came_with_eos_finishes_the_response(last):
    """An aborted running request gets one more decode step: its answer ends in EOS (or a stop
    id the request named) while finish_reason says abort. The partial rollout finishes it there
    (finish ``stop``, trained this step) instead of continuing it past its end."""
    end = 2 if last == "eos" else 9
    pool = _CannedPool([_answer([5, 6, end], {"type": "abort"})])
    rollout = PartialRollout(max_new_tokens=8, max_staleness=1, stale="drop",
                             mask_offpolicy=False, need_routing=False, need_mask=False)
    sampling = SamplingConfig(max_new_tokens=8, stop_token_ids=(9,) if last == "stop_id" else ())
    out = rollout.collect(_CannedEngine(pool), [_Prompt([1, 3, 4])], [0], 1, sampling, 0, 0, 1,
                          _score)
    (s,) = out.samples
    assert s.response_ids.tolist() == [5, 6, end]
    assert s.metadata["finish_reason"] == "stop" and len(pool.bodies) == 1
    assert out.counts["rollout/partial_in_flight"] == 0.0


def test_an_abort_before_a_token_that_ends_nothing_is_continued():
    """The counter-case: an aborted answer ending in an ordinary token stays in flight."""
    pool = _CannedPool([_answer([5, 6], {"type": "abort"})])
    rollout = PartialRollout(max_new_tokens=8, max_staleness=1, stale="drop",
                             mask_offpolicy=False, need_routing=False, need_mask=False)
    out = rollout.collect(_CannedEngine(pool), [_Prompt([1, 3, 4])], [0], 1,
                          SamplingConfig(max_new_tokens=8), 0, 0, 1, _score)
    assert out.samples == [] and out.counts["rollout/partial_in_flight"] == 1.0


def test_the_end_ids_come_from_config_and_generation_config(tmp_path):
    """SGLang stops at the eos ids of config.json and of generation_config.json."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 7}))
    assert MoEShape.from_model_dir(str(tmp_path)).eos_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    assert MoEShape.from_model_dir(str(tmp_path)).eos_ids == (7, 11)


def test_the_end_ids_include_the_tokenizers_end_token_and_sglangs_extra_stop_tokens(tmp_path):
    """SGLang also stops at the tokenizer's eos_token and at a few added turn-end tokens
    (<|eom_id|> among them): a tokenizer whose end token and an added <|eom_id|> are ids the
    config does not name adds both."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 7}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": 3, "content": "<|im_end|>"}, {"id": 9, "content": "<|eom_id|>"},
                         {"id": 7, "content": "<|endoftext|>"}],
        "model": {"vocab": {"a": 0, "b": 1}}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert MoEShape.from_model_dir(str(tmp_path)).eos_ids == (7, 3, 9)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "b"}}))
    assert MoEShape.from_model_dir(str(tmp_path)).eos_ids == (7, 1, 9)


@pytest.mark.parametrize("rule", ["keep", "mask"])
def test_retractions_are_read_counted_and_kept_or_masked(rule):
    """SGLang's ``num_retractions`` reaches the sample; ``rollout/retracted`` counts the
    samples retracted at least once; ``mask`` takes their tokens out of the loss."""
    turns = [decode_turn(_answer([5, 6], {"type": "stop"}, num_retractions=n), 3, LAYOUT,
                         need_routing=False, need_mask=False) for n in (0, 2)]
    samples = [sample_of_turn([1, 3, 4], t, group_id=0, sample_id=k)
               for k, t in enumerate(turns)]
    assert [s.metadata.get("retractions", 0) for s in samples] == [0, 2]
    counts = retraction_counts(samples, rule == "mask")
    assert counts["rollout/retracted"] == 1.0
    assert counts["rollout/retracted_masked_tokens"] == (2.0 if rule == "mask" else 0.0)
    assert samples[0].loss_mask.all()
    assert samples[1].loss_mask.any() == (rule == "keep")
    with pytest.raises(Exception, match="num_retractions"):
        decode_turn(_answer([5], {"type": "stop"}, num_retractions=-1), 3, LAYOUT,
                    need_routing=False, need_mask=False)


def _tensor_sync_rank(rank: int, port: int, out, sources, unsent) -> None:
    """One trainer rank of a colocated tensor sync over gloo (2 ranks feeding ``sources``);
    the first bucket fails on rank 0 with ``unsent`` the servers it never reached. Reports how
    many buckets it serialised, how many it gave back and the error it raised."""
    import torch.distributed as dist
    import moe_rl.weights.serialize as serialize
    from moe_rl.engines.sglang.client import TensorsNotLoaded
    from moe_rl.engines.sglang.sender import TensorSender
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    made, released = [], []
    serialize.share_named_tensors = lambda named: made.append(1) or serialize.SharedBucket(
        f"payload{rank}", ((b"ref", rank),))
    serialize.release_unopened = released.append

    class Refusing:
        def begin(self):
            pass

        def end(self, missing_ok=False):
            pass

        def receive_tensors(self, payloads, version, last):
            raise TensorsNotLoaded("HTTP 400: refused", unsent)

    sender = TensorSender(Refusing(), rank, fp8=False, sources=sources)
    buckets = iter([([("w", torch.ones(2))], False)] * 3 + [([("w", torch.ones(2))], True)])
    try:
        sender.send(buckets, 1)
        out.put((rank, len(made), [s.counters for s in released], None))
    except TensorsNotLoaded as exc:
        out.put((rank, len(made), [s.counters for s in released], str(exc)))
    dist.destroy_process_group()


def _tensor_sync(sources, unsent):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_tensor_sync_rank, args=(r, port, out, sources, unsent))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    return got


def test_a_failed_tensor_sync_stops_serialising_on_every_rank():
    """Rank 0's server refuses the first of four buckets: every rank learns it right after
    that bucket and serialises nothing more (each consumer rank serialised all four before);
    the server was reached, so nothing is given back (it may have opened the payloads)."""
    got = _tensor_sync([[0, 1]], unsent=[])
    assert got == [(0, 1, [], "HTTP 400: refused"), (1, 1, [], None)], got


def test_a_failed_tensor_sync_gives_back_the_shares_no_server_received():
    """Two servers, one rank each: the first refuses the bucket and the second is never asked;
    rank 1, whose payload nobody opened, gives its shares back (torch would keep that block
    until the trainer exits: a model's bucket per failed sync); rank 0's stay with the server
    that may have opened them."""
    got = _tensor_sync([[0], [1]], unsent=[1])
    assert got == [(0, 1, [], "HTTP 400: refused"), (1, 1, [((b"ref", 1),)], None)], got


def test_a_tensor_bucket_names_the_servers_it_never_reached():
    """The receiver loads each server in turn: one that refused was reached (its payload may be
    open), one whose connection never opened was not, nor is any after a failure."""
    import asyncio
    from moe_rl.engines.sglang.client import SGLangWeightReceiver, TensorsNotLoaded
    refusing = RewardServer(lambda body, call: (400, b'{"error": "refused"}'))
    closed = f"http://127.0.0.1:{free_port()}"
    refusing_url = f"http://127.0.0.1:{refusing.httpd.server_address[1]}"
    try:
        for urls, want in [([refusing_url, closed], [1]), ([closed, refusing_url], [0, 1])]:
            receiver = SGLangWeightReceiver(lambda: ServerPool(urls, max_retries=0), 1)
            with pytest.raises(TensorsNotLoaded) as caught:
                receiver.receive_tensors([["p0"], ["p1"]], 3, last=True)
            assert caught.value.unsent == want, urls
    finally:
        refusing.close()


@pytest.mark.parametrize("mask,temperature,want", [(False, 0.7, 1.0), (False, 0.0, 1.0),
                                                    (True, 0.7, 0.7), (True, 1.0, 1.0)])
def test_the_weight_check_probe_never_lists_the_whole_vocabulary(mask, temperature, want):
    """Without the sampling mask the probe is scored at temperature 1 on both sides (the
    engine's prefill log-probs as they are; at 0.7 it listed every vocabulary id at every
    position); with the mask, at the rollout's temperature on the kept ids."""
    cfg = load_config(None, [f"algorithm.keep_sampling_mask={str(mask).lower()}",
                             f"rollout.sampling.temperature={temperature}", "rollout.sampling.top_k=20"])
    assert probe_temperature(cfg) == want
    if mask:
        return
    pool = _CannedPool([[{"meta_info": {"input_token_logprobs": [None, [-0.5, 5, None]]}}]])
    engine = _CannedEngine(pool)
    engine.run_with_pool = lambda coro_fn: asyncio.run(coro_fn(pool))
    from moe_rl.rollout_record import Sample
    s = Sample(prompt_ids=[1, 3], response_ids=[5], rollout_logprobs=[-0.5])
    engine.score([s], 1, temperature=probe_temperature(cfg))
    assert "token_ids_logprob" not in pool.bodies[0] and s.pass_logprobs.tolist() == [[-0.5]]


def test_the_weight_load_bound_reaches_the_pool_from_the_config():
    """``rollout.servers.weight_load_timeout_s`` is the bound of every weight call of the engine's and
    the weight receiver's pools."""
    from moe_rl.engines.factory import engine_kind
    cfg = load_config(None, ["rollout.servers.weight_load_timeout_s=12.5"])   # the reference engine
    # speaks SGLang's protocol through the same pools
    kind = engine_kind(cfg)
    assert kind.receiver(["http://127.0.0.1:1"]).pool_factory().weight_timeout == 12.5
    assert kind._pool_factory(["http://127.0.0.1:1"])().weight_timeout == 12.5


HUNG_AFTER_BIND_FAILURE = """
import sys, threading, time
import uvicorn
threading.Thread(target=time.sleep, args=(3600,)).start()   # SGLang's other threads: no exit
uvicorn.run(lambda scope, receive, send: None, host="127.0.0.1", port=int(sys.argv[1]))
"""


def test_a_server_whose_port_was_taken_before_its_own_bind_is_stopped_at_once(tmp_path):
    """A server that binds its port itself (SGLang) finds it taken by another process: uvicorn
    logs the bind error and its exit waits for the engine's other threads, so the process lives
    on without serving. The start fails at once, naming the cause, and the process is stopped
    (before: the health wait ran to ``rollout.servers.health_timeout_s``, 300 s by default)."""
    import socket
    import sys
    import time

    from moe_rl.engines.process import CommandServer
    thief = socket.create_server(("127.0.0.1", 0))
    port = thief.getsockname()[1]
    script = tmp_path / "server.py"
    script.write_text(HUNG_AFTER_BIND_FAILURE)
    log = tmp_path / "engine_0.log"
    log.write_bytes(b"error while attempting to bind on address (an earlier start)\n")
    server = CommandServer([sys.executable, str(script), str(port)], {}, "127.0.0.1", port,
                           inherits_socket=False, log_path=str(log))
    try:
        with pytest.raises(RuntimeError, match="not healthy after 0.5 s"):
            server.wait_healthy(0.5)   # an earlier start's words in the log are not this one's
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"port {port}: another process took the port"):
            server.start(60.0, sock=socket.create_server(("127.0.0.1", 0)))
        assert time.monotonic() - started < 30
        assert server.proc is None   # stopped
    finally:
        server.stop()
        thief.close()


class _PendingWork:
    """A broadcast no server completes (one refused the bucket and never joined)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("waited on a broadcast no server completes")


class _RecordingGroup:
    """A weight-update group that records what the sender does to it, in order."""

    def __init__(self, events: list):
        self.events, self.group = events, self

    def broadcast(self, tensor, root):
        self.events.append("broadcast")
        return _PendingWork()

    def abort(self) -> None:
        self.events.append("abort")


class _RefusingReceiver:
    def __init__(self, events: list):
        self.events = events

    def begin(self) -> None:
        self.events.append("begin")

    def announce_bucket(self, named, version, group_name, last) -> None:
        raise EngineHTTPError("HTTP 400: refused")

    def end(self, missing_ok: bool = False) -> None:
        self.events.append("end")


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_refused_broadcast_aborts_an_nccl_group_before_the_sync_fails(backend, monkeypatch):
    """A server refuses a bucket while rank 0's broadcast of it waits: on NCCL the group is
    aborted and dropped before ``send`` raises (so the disk fallback that follows never meets
    NCCL's watchdog ending the trainer); on gloo it is kept for the next sync to replace (torn
    down at once there, the trainer's next requests hung until the group's timeout)."""
    from moe_rl.engines.sglang import sender as sender_module
    from moe_rl.engines.sglang.sender import DistributedSender
    events: list = []
    monkeypatch.setattr(sender_module, "abort_group",
                        lambda g: (g.abort(), events.append("closed")))
    s = DistributedSender(_RefusingReceiver(events), 0, False, backend, 3, 60.0)
    group = s.group = _RecordingGroup(events)
    bucket = [("w", torch.zeros(2))]
    with pytest.raises(EngineHTTPError, match="refused"):
        s.send(iter([(bucket, False), (bucket, True)]), 4)
    events.append("raised")
    if backend == "nccl":
        assert events == ["begin", "broadcast", "abort", "closed", "raised"]
        assert s.group is None and not s.opened
    else:
        assert events == ["begin", "broadcast", "raised"]
        assert s.group is group and s.opened

