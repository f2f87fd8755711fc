"""Two reference servers behind the pool; one is killed mid-rollout (multiproc)."""
import json
import os
import signal
import threading

import pytest

from moe_rl.config import ModelInitConfig
from moe_rl.models.tiny import write_tiny_model
from moe_rl.moe_shape import MoEShape
from moe_rl.engines.base import SamplingConfig
from moe_rl.engines.sglang.client import SGLangEngine
from moe_rl.rollout.trajectories import generate_samples
from moe_rl.engines.sglang.pool import ServerPool
from moe_rl.engines.reference.launcher import ReferenceServer
from moe_rl.trainer.parallel import free_port


@pytest.mark.multiproc
def test_killed_server_loses_and_duplicates_nothing_and_restarts(tmp_path):
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=1), model)
    facts = MoEShape.from_hf(json.load(open(f"{model}/config.json")))
    layout = facts
    procs = [ReferenceServer(model, free_port(), log_path=str(tmp_path / f"s{i}.log")).start()
             for i in range(2)]
    try:
        engine = SGLangEngine(
            lambda: ServerPool([p.url for p in procs], restarters=[p.restart for p in procs],
                               max_retries=4, backoff=0.05, concurrency=4),
            layout, need_routing=True, need_mask=False)
        done = []
        killed = threading.Event()

        def progress(n):
            done.append(n)
            if len(done) == 6 and not killed.is_set():   # mid-rollout
                os.kill(procs[0].proc.pid, signal.SIGKILL)
                killed.set()

        prompts = [[6, 7, 68, 12 + (i % 10), 72] for i in range(24)]
        samples = generate_samples(engine, prompts, 2, SamplingConfig(max_new_tokens=24),
                                   seed=0, progress=progress)
        assert killed.is_set()
        # every (prompt, sample) exactly once, in order, each a valid record
        assert [s.sample_id for s in samples] == list(range(48))
        assert [s.group_id for s in samples] == [i // 2 for i in range(48)]
        for s, want in zip(samples, [p for p in prompts for _ in range(2)]):
            assert s.prompt_ids.tolist() == want and s.routing is not None
        # the dead server was restarted and answers again
        assert procs[0].restarts == 1 and procs[0].alive()
        engine.check_health()
    finally:
        for p in procs:
            p.stop()


@pytest.mark.multiproc
def test_requests_wait_for_the_restart_of_the_only_server(tmp_path):
    """One server, killed mid-rollout: the requests sent while it restarts wait for it instead
    of failing with "no live engine server"."""
    model = str(tmp_path / "m")
    write_tiny_model(ModelInitConfig(seed=2), model)
    layout = MoEShape.from_hf(json.load(open(f"{model}/config.json")))
    proc = ReferenceServer(model, free_port(), log_path=str(tmp_path / "s.log")).start()
    try:
        engine = SGLangEngine(lambda: ServerPool([proc.url], restarters=[proc.restart],
                                                 max_retries=3, backoff=0.05, concurrency=8),
                              layout, need_routing=False, need_mask=False)
        done = []

        def progress(n):
            done.append(n)
            if len(done) == 4:
                os.kill(proc.proc.pid, signal.SIGKILL)
        prompts = [[6, 7, 68, 12 + (i % 10), 72] for i in range(16)]
        samples = generate_samples(engine, prompts, 2, SamplingConfig(max_new_tokens=16),
                                   seed=0, progress=progress)
        assert [s.sample_id for s in samples] == list(range(32))
        assert proc.restarts == 1 and proc.alive()
    finally:
        proc.stop()
