"""A few steps of the real loop (Ray trainer actor + reference server on 127.0.0.1): finite
metrics, TensorBoard events with the metric names, a checkpoint written and resumed."""
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.helpers import init_tiny_model
from tests.helpers import engine_base_port
from tests.helpers import KILLER_REWARD, WALL_CLOCK, train_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train(tmp_path, steps, *extra, resume=False):
    return train_cli(tmp_path, steps, *extra, resume=resume)


@pytest.mark.loop
@pytest.mark.e2e
def test_loop_runs_logs_checkpoints_and_resumes(trained_run, tmp_path):
    import shutil
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)   # the resume changes the run
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ("reward/mean", "mismatch/k1", "mismatch/k3", "routing/agreement", "is/ess",
                    "grad_norm", "entropy", "timing/rollout_s", "timing/train_s"):
            assert key in r and r[key] is not None and math.isfinite(r[key]), key
    ck = run / "checkpoints"   # one folder per saved step, the last 2 kept, a tracker
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert (ck / "iter_0000003" / "trainer" / "rank0.pt").exists()
    assert json.loads((ck / "iter_0000003" / "loop_state.json").read_text())["step"] == 3
    assert (run / "final_hf" / "model.safetensors").exists()
    assert "algorithm:" in (run / "config.yaml").read_text()   # the resolved config, kept
    engine_log = (run / "logs" / "engine_0.log").read_text()   # quiet: no progress bars
    assert engine_log.count("listening on http://127.0.0.1:") == 1, engine_log[-2000:]
    assert "Loading weights" not in engine_log and "\r" not in engine_log, engine_log[-2000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "mismatch/k3", "routing/agreement", "routing/agreement_layer_0",
            "grad_norm"} <= tags
    assert [e.step for e in acc.Scalars("reward/mean")] == [0, 1, 2]
    # samples a user can read: two per step, with what the reward was given (the toy reward
    # of the logged inputs is the logged reward), the advantage and the largest mismatch
    from moe_rl.rewards.functions import toy_reward
    shown = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shown] == [0, 0, 1, 1, 2, 2]
    for r in shown:
        assert r["reward"] == toy_reward(r["prompt"], r["response"], r["label"], r["metadata"])
        assert r["prompt"].endswith("=") and r["response_tokens"] == r["tokens"] > 0
        assert math.isfinite(r["advantage"]) and r["tokens_removed"] >= 0
        worst = r["largest_mismatch"]
        assert 1 <= len(worst) <= 3 and all(0 <= t["position"] < r["tokens"] for t in worst)
        assert all(abs(t["engine_logprob"] - t["trainer_logprob"]) < 1e-3 for t in worst)
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [0, 1, 2]
    # a crash cut both logs inside a multi-byte character (the tail of a step-3 row): the
    # resume drops the cut line and goes on
    for name in ("samples.jsonl", "metrics.jsonl"):
        with open(run / name, "ab") as fh:
            fh.write('{"step": 3, "prompt": "数'.encode()[:-1])
    # resume: continues at step 3 with the same data order, no duplicated steps
    _train(tmp_path, 5, "algorithm.corrections=[icepop,seq_mis]", resume=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    shown = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shown] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000004", "iter_0000005"]


@pytest.mark.loop
@pytest.mark.e2e
def test_a_run_removes_only_the_weight_exports_it_wrote(trained_run):
    """The disk weight sync drops each earlier export, and nothing else: the user's folder in
    <logging.dir>/weights/ (there before the run) is whole, and so is the user's copy of an
    export (it carries the mark, naming the folder it was copied from: it was deleted)."""
    from moe_rl.owned_dirs import owned
    weights = trained_run / "run" / "weights"
    assert (weights / "precious" / "model.bin").read_text() == "data"
    assert (weights / "v1-kept" / "model.safetensors").read_text() == "kept"
    assert not owned(str(weights / "v1-kept"))
    exports = sorted(p.name for p in weights.iterdir() if p.name not in ("precious", "v1-kept"))
    assert len(exports) == 1 and exports[0].startswith("v"), exports
    assert owned(str(weights / exports[0]))


@pytest.mark.loop
@pytest.mark.e2e
def test_saved_steps_convert_to_hf_and_exports_every_n_steps(trained_run, tmp_path):
    """`moe-rl convert --to hf --checkpoint`: a run's checkpoint folder converts (its latest
    step: the final policy exactly), so does a named step; trainer.checkpoint.export_hf_interval=2 wrote
    the policy of step 2, equal to its checkpoint's; a damaged step is refused naming the file;
    --ema without an EMA is refused."""
    import shutil
    from safetensors.torch import load_file
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    ck = tmp_path / "run" / "checkpoints"

    def convert(*args):
        return subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf",
                               *args], capture_output=True, text=True, timeout=300)

    def weights(d):
        return {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(p).items()}

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    res = convert("--checkpoint", str(ck), "--out", str(tmp_path / "latest"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "iter_0000003" in res.stdout
    assert same(weights(tmp_path / "latest"), weights(tmp_path / "run" / "final_hf"))
    assert (tmp_path / "latest" / "tokenizer.json").exists()
    res = convert("--checkpoint", str(ck / "iter_0000002"), "--out", str(tmp_path / "two"))
    assert res.returncode == 0, res.stdout + res.stderr
    step2 = weights(tmp_path / "two")
    assert same(step2, weights(tmp_path / "run" / "hf" / "iter_0000002"))
    assert not same(step2, weights(tmp_path / "latest"))
    assert sorted(p.name for p in (tmp_path / "run" / "hf").iterdir()) == ["iter_0000002"]
    res = convert("--checkpoint", str(ck / "iter_0000002"), "--ema", "--out", str(tmp_path / "e"))
    assert res.returncode == 2 and "saved without an EMA" in res.stderr
    victim = ck / "iter_0000002" / "trainer" / "rank0.pt"
    victim.write_bytes(victim.read_bytes()[:-5])
    res = convert("--checkpoint", str(ck / "iter_0000002"), "--out", str(tmp_path / "bad"))
    assert res.returncode == 2 and "rank0.pt" in res.stderr and "truncated" in res.stderr


@pytest.mark.loop
@pytest.mark.e2e
def test_colocated_engines_synced_over_gloo_serve_the_ema_policy_and_trm_removes_nothing(
        tmp_path):
    """Two colocated engines (they give their memory to the trainer for each update) get each
    version broadcast over gloo in ~20 KB buckets; trainer.ema.policy from step 1 makes them
    serve the smoothed weights the trainer continues from, under Trust Region Masking: every
    step's samples come from the previous update's weights, the float32 engine equals the
    trainer (k3 ~ 0) and TRM removes nothing; one final policy is exported (the EMA)."""
    init_tiny_model(str(tmp_path / "model"))
    res = _train(tmp_path, 3, "cluster.weight_sync=distributed", "cluster.colocate=true",
                 "rollout.num_servers=2", "cluster.weight_sync_bucket_mb=0.02",
                 "trainer.ema.decay=0.5", "trainer.ema.policy=true", "trainer.ema.start_step=1",
                 "algorithm.corrections=[trm]", "algorithm.correction.trm_delta=1e-3")
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version/min"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["rollout/stale_samples"] == 0 for r in rows)
    assert all(r["mismatch/k3"] < 1e-6 for r in rows)   # float32 engine = trained weights
    assert all(r["timing/engine_release_s"] > 0 and r["timing/engine_resume_s"] > 0 for r in rows)
    assert all(r["correction/trm/masked_seq_frac"] == 0.0 for r in rows)
    assert (tmp_path / "run" / "final_hf" / "config.json").exists()
    assert not (tmp_path / "run" / "final_hf_raw").exists()
    assert "final policy exported to" in res.stdout


def _reward_run_command(tmp_path) -> list[str]:
    """A tiny model in tmp_path/model and the `moe-rl train` command of 3 steps over it."""
    init_tiny_model(str(tmp_path / "model"))
    return [sys.executable, "-m", "moe_rl.cli", "train", "--config",
           str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
           f"logging.dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.warmup.steps=0",
           "logging.progress=false", f"rollout.servers.base_port={engine_base_port()}",
           "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2"]


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: the async reward of tests/data/test_data_rewards.py's
# hanging-reward run fails on a whole batch at its third step and stops it the same way
def test_a_reward_failing_on_a_whole_batch_stops_the_run_with_the_reason(tmp_path):
    """A Python reward that raises on every sample: the run stops after
    data.max_failed_reward_batches in one line naming the reward and its error, exit 1, no
    traceback, no metrics written."""
    cmd = _reward_run_command(tmp_path)
    (tmp_path / "broken_reward.py").write_text(
        "def score(prompt, response, answer, metadata):\n"
        "    raise KeyError('answer_field')\n")
    import os
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run(cmd + ["data.reward=broken_reward:score"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: data.reward: broken_reward:score failed on every "
                           "sample of 1 batch(es)") and "KeyError" in last, last
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        (tmp_path / "run" / "metrics.jsonl").read_text() == ""


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: the Python reward above stops the run the same way
def test_a_reward_service_failing_on_whole_batches_stops_the_run_with_its_url(tmp_path):
    """A reward service that answers 500 to everything: the run stops after
    data.max_failed_reward_batches in one line naming the service's url, not the unused
    data.reward default, exit 1, no traceback."""
    from tests.helpers import RewardServer
    cmd = _reward_run_command(tmp_path)
    srv = RewardServer(lambda body, call: (500, b'{"detail": "model not loaded"}'))
    try:
        res = subprocess.run(cmd + [f"data.reward_service.url={srv.url}",
                                    "data.reward_service.max_retries=0",
                                    "data.max_failed_reward_batches=2"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
    finally:
        srv.close()
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"moe-rl train: data.reward_service.url: {srv.url} failed on every "
                           f"sample of 2 batch(es) in a row (data.max_failed_reward_batches=2)")
    assert "HTTP 500" in last and "data.reward:" not in last, last


def test_shard_by_group_keeps_groups_whole_and_balances_tokens():
    from moe_rl.orchestration.sharding import shard_by_group
    from moe_rl.rollout_record import Sample
    samples = [Sample(prompt_ids=[1] * (g + 1), response_ids=[2] * (3 + (i % 2)),
                      rollout_logprobs=[-0.1] * (3 + (i % 2)), group_id=g, sample_id=4 * g + i)
               for g in range(5) for i in range(4)]
    shards = shard_by_group(samples, 3)
    ids = sorted(s.sample_id for shard in shards for s in shard)
    assert ids == sorted(s.sample_id for s in samples)          # each sample exactly once
    for shard in shards:                                       # whole groups
        for g in {s.group_id for s in shard}:
            assert sum(s.group_id == g for s in shard) == 4
    load = [sum(s.prompt_len + s.response_len for s in shard) for shard in shards]
    group_tokens = [sum(s.prompt_len + s.response_len for s in samples if s.group_id == g)
                    for g in range(5)]
    assert max(load) - min(load) <= max(group_tokens)          # greedy balance bound
    assert sum(1 for shard in shard_by_group(samples, 7) if not shard) == 2   # 5 groups


def _run_with_a_killer_reward(tmp_path, reward: str, *overrides: str) -> tuple[list[dict], str]:
    """`moe-rl train` of the tiny config (3 steps, 2 prompts x 2) whose reward ``reward`` (a
    module's source) SIGKILLs the reference engine at its fifth call; each step's metrics and
    the run's output."""
    import os
    init_tiny_model(str(tmp_path / "model"))
    (tmp_path / "killer_reward.py").write_text(reward)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
               KILL_AT="4", KILL_MATCH=str(tmp_path / "model"), KILL_ARGV="serve-reference")
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
           str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
           f"logging.dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.warmup.steps=0",
           "logging.progress=false", f"rollout.servers.base_port={engine_base_port()}",
           "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
           "data.reward=killer_reward:score", "trainer.checkpoint.export_hf=false", *overrides]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()], res.stdout


@pytest.mark.loop
@pytest.mark.e2e
# `make test-slow`: the chaos run kills an SGLang server mid-sync and checks its restart
@pytest.mark.slow
@pytest.mark.parametrize("sync,pi_old", [("distributed", "trainer"), ("disk", "engine_avg")])
def test_an_engine_killed_between_phases_comes_back_with_the_current_weights(tmp_path, sync,
                                                                              pi_old):
    """The engine dies after step 1's rollout (in the reward phase): the next contact (the
    weight sync's health check, or the engine_avg scoring passes) restarts it with the trainer's
    current weights and rebuilds the weight group; the float32 engine then still equals the
    trainer (k3 ~ 0 on every step), nothing is stale, the run ends."""
    rows, _ = _run_with_a_killer_reward(tmp_path, KILLER_REWARD, f"cluster.weight_sync={sync}",
                                        f"algorithm.pi_old={pi_old}")
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["weight_version/min"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["rollout/stale_samples"] == 0 for r in rows)
    assert all(r["mismatch/k3"] < 1e-6 for r in rows)
    if pi_old == "engine_avg":
        assert all(r["ratio/first_minibatch_max_dev"] < 1e-4 for r in rows)   # pi_old = pi_theta


@pytest.mark.loop
@pytest.mark.e2e
def test_an_engine_killed_mid_batch_in_the_async_pipeline_serves_the_version_it_is_labelled(
        tmp_path):
    """Asynchronous pipeline (``max_staleness`` 1), distributed weight sync, one group admitted
    at a time: the engine dies at the first reward of step 1's batch, generated under weights
    0 while the trainer trains step 0, and the next group's requests restart it mid-batch. The
    trainer is then past version 0; the restarted server must still serve version 0 (the copy
    the trainer holds for stale samples), since its samples are labelled so: every step's
    float32 engine equals the trainer at the samples' own version (k3 ~ 0). Before, it served
    the trainer's post-update weights labelled 0 (k3 2.2e-3 at step 1)."""
    # graded rewards: step 0's update moves the weights (the toy task's are all 0 here)
    graded = KILLER_REWARD.replace("return toy_reward(prompt, response, answer, metadata)",
                                   "return (sum(map(ord, response)) % 101) / 100")
    rows, out = _run_with_a_killer_reward(tmp_path, graded, "cluster.weight_sync=distributed",
                                          "rollout.servers.concurrency=2", "rollout.max_new_tokens=8",
                                          "rollout.max_staleness=1")
    assert rows[-1]["rollout/engine_restarts"] == 1.0
    # the next sync read the restart from the served-weights record and rebuilt the group
    assert "1 server(s) restarted since the last sync" in out, out[-3000:]
    assert [r["weight_version/min"] for r in rows] == [0.0, 0.0, 1.0]
    assert all(r["mismatch/k3"] < 1e-6 for r in rows), [r["mismatch/k3"] for r in rows]
    assert rows[0]["grad_norm"] > 0   # the weights moved, so a wrong version would show


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # 66 s: in `make test-slow`; engine determinism stays in `make test`
def test_two_deterministic_runs_are_bit_identical(tmp_path):
    """Same config, deterministic inference: every logged value of every step is equal (the
    reference engine's batch composition, the only run-to-run difference, is taken out)."""
    init_tiny_model(str(tmp_path / "model"))
    runs = []
    for name in ("a", "b"):
        work = tmp_path / name
        work.mkdir()
        (work / "model").symlink_to(tmp_path / "model")
        _train(work, 2, "rollout.sglang.deterministic_inference=true", "trainer.checkpoint.export_hf=false",
               "trainer.warmup.steps=1")
        rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text()
                .splitlines()]
        runs.append([{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows])
    assert len(runs[0]) == 2 and runs[0] == runs[1]


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # 100 s: in `make test-slow`; the exporter and resharding run in `make test`
def test_expert_parallel_export_streams_sharded_checkpoints_and_resumes_on_one_rank(tmp_path):
    """Two trainer ranks with expert parallel 2, disk sync in ~20 KB shards: each expert is
    sent by its owner to the exporting rank, the engines load the sharded checkpoint, and the
    float32 engine equals the trainer at every step; the run resumes on one rank."""
    init_tiny_model(str(tmp_path / "model"))
    _train(tmp_path, 2, "cluster.trainer_workers=2", "trainer.parallel.expert=2",
           "cluster.weight_sync_bucket_mb=0.02", "trainer.checkpoint.export_hf=false",
           "trainer.warmup.steps=1")
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version/min"] for r in rows] == [0.0, 1.0]
    assert all(r["mismatch/k3"] < 1e-6 for r in rows)
    shards = sorted((tmp_path / "run" / "weights" / "v2").glob("model-*.safetensors"))
    index = json.loads((tmp_path / "run" / "weights" / "v2" /
                        "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    # resumed by ONE rank holding every expert: the EP2/DP2 checkpoint is resharded, and the
    # weights it syncs at the resume equal those the two ranks synced after step 2
    from safetensors.torch import load_file
    before = {k: v for p in shards for k, v in load_file(p).items()}
    one_rank = ("cluster.trainer_workers=1", "trainer.parallel.expert=1",
                "cluster.weight_sync_bucket_mb=0.02", "trainer.checkpoint.export_hf=false",
                "trainer.warmup.steps=1")
    res = _train(tmp_path, 2, *one_rank, resume=True)   # nothing left to do: sync and stop
    assert "resharding" in res.stdout and "resuming at step 2" in res.stdout
    after = {k: v for p in (tmp_path / "run" / "weights" / "v2").glob("model-*.safetensors")
             for k, v in load_file(p).items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    _train(tmp_path, 3, *one_rank, resume=True)   # and one more step on one rank
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["mismatch/k3"] < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """kill -9 of the whole run (driver, Ray, engines) at random moments, one of them during a
    save, with a checkpoint every step; each time `--resume` continues from the last complete
    checkpoint. The per-step metrics and the final weights equal an uninterrupted run's (float32,
    deterministic inference)."""
    import os
    import random
    import signal
    import time
    from safetensors.torch import load_file
    init_tiny_model(str(tmp_path / "model"))
    steps = 16

    def command(run, resume):
        return [sys.executable, "-m", "moe_rl.cli", "train", "--config",
                str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
                f"logging.dir={run}", f"trainer.steps={steps}", "trainer.warmup.steps=1",
                "trainer.checkpoint.interval=1", "logging.progress=false",
                f"rollout.servers.base_port={engine_base_port()}", "rollout.prompts_per_step=2",
                "rollout.n_samples_per_prompt=2", "rollout.sglang.deterministic_inference=true",
                *(["--resume"] if resume else [])]

    def rows(run):
        out = {}
        for line in (run / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)
                              and k != "rollout/engine_restarts"}
        return out
    base = tmp_path / "base"
    res = subprocess.run(command(base, False), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    run, ck = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    tracker = ck / "latest_checkpointed_iteration.txt"

    def saved() -> int:
        try:
            return int(tracker.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0
    rng = random.Random(0)
    targets = [2, 4, 6, 9, 12]   # kill once the run has saved this step; the third in a save
    kills, during_save, resumes = 0, 0, 0
    while True:
        proc = subprocess.Popen(command(run, resumes > 0), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        if kills < len(targets):
            deadline = time.monotonic() + 300
            while saved() < targets[kills] and proc.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
            if kills == 2:   # the next save in progress
                while proc.poll() is None and not list(ck.glob("iter_*.tmp")) and \
                        time.monotonic() < deadline:
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.4))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                during_save += kills == 2 and bool(list(ck.glob("iter_*.tmp")))
                kills += 1
                resumes += 1
                continue
        assert proc.wait(timeout=900) == 0
        break
    print(f"kills {kills} (during a save: {during_save}), resumes {resumes}")
    assert kills == 5 and during_save == 1
    assert rows(run) == rows(base) and sorted(rows(base)) == list(range(steps))
    a, b = (load_file(str(r / "final_hf" / "model.safetensors")) for r in (base, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.loop
@pytest.mark.e2e
def test_a_resume_refused_for_a_changed_key_gives_the_command_that_resumes(trained_run,
                                                                          tmp_path):
    """The run's own config.yaml is what resumes it: the refusal names that command, and the
    command it names resumes (a step more, to have something to do)."""
    import shutil
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True)
    run = tmp_path / "run"
    common = [f"rollout.servers.base_port={engine_base_port()}"]
    refused = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'model'}",
         f"logging.dir={run}", "trainer.optim.lr=1e-5", "--resume", *common],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    named = f"moe-rl train --config {run / 'config.yaml'} --resume"
    assert f"resume with the saved config (`{named}`)" in refused.stderr
    # the copy's saved config names the shared run's directory: this one is pointed at the copy
    resumed = subprocess.run([sys.executable, "-m", "moe_rl.cli", *named.split()[1:],
                              "trainer.steps=4", f"logging.dir={run}",
                              f"model.path={tmp_path / 'model'}", *common], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 3" in resumed.stdout
