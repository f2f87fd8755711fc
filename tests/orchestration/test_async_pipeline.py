"""The asynchronous rollout/train pipeline (rollout.max_staleness) and dynamic sampling: the
trainer's same-version scoring (mismatch vs policy lag), the pipeline's data order across a
checkpoint, the config refusals, and `moe-rl train` end to end with k = 1 and with dynamic
sampling."""
import json

import pytest

from moe_rl.config import ConfigError, config_from_dict, load_config
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from tests.helpers import init_tiny_model
from tests.helpers import ROOT, train_cli
from tests.helpers import engine_samples, write_tiny_qwen


@pytest.fixture(scope="module")
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


@pytest.mark.parametrize("replay", ["r3", "off"])
def test_stale_samples_are_scored_at_their_own_version(tmp_path, parallel_state, replay):
    """max_staleness = 1: samples of version 0 trained at version 1 are scored again with the
    version-0 weights, so mismatch/* and routing/agreement (float32 engine = trainer) stay at
    no mismatch while staleness/* shows the update; a sample older than the window is left out
    of both."""
    from moe_rl.trainer.policy import PolicyTrainer
    hf_model = write_tiny_qwen(tmp_path / "qwen")
    cfg = config_from_dict({"model": {"path": str(tmp_path / "qwen")},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5,
                                        "max_staleness": 1},
                            "trainer": {"optim": {"lr": 3e-2}, "micro_batch_size": 2, "seed": 3},
                            "algorithm": {"replay": replay}})
    trainer = PolicyTrainer(cfg, str(tmp_path / "qwen"))
    first = trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=1))
    assert first["rollout/staleness_max"] == 0.0 and "staleness/k3" not in first
    assert abs(first["mismatch/k3"]) < 1e-6
    assert first["routing/agreement"] == 1.0 and first["routing/token_differs_frac"] == 0.0
    stale = engine_samples(hf_model, n_groups=2, group_size=2, seed=2)   # version 0 again
    second = trainer.train_step(stale)
    assert second["rollout/staleness_mean"] == 1.0
    assert abs(second["mismatch/k3"]) < 1e-6 and second["mismatch/abs_diff_max"] < 1e-4
    assert second["staleness/k3"] > 1e-5           # the version-1 policy moved
    assert second["staleness/unscored_samples"] == 0.0
    # routing compared at the samples' own version: no mismatch; the lag reported apart
    assert second["routing/agreement"] == 1.0 and second["routing/token_differs_frac"] == 0.0
    assert 0.0 <= second["staleness/routing_agreement"] < 1.0
    assert second["staleness/routing_token_differs_frac"] > 0.0
    # without the same-version score the lag would have shown as engine mismatch
    from moe_rl.algo import mismatch_metrics
    batch, _ = trainer.prepare(stale)
    assert mismatch_metrics(batch.lp_old, batch.lp_roll, batch.mask)["mismatch/k3"] > 1e-5
    # version 0 is now 2 versions old: outside the window, left out of both
    third = trainer.train_step(engine_samples(hf_model, n_groups=2, group_size=2, seed=3))
    assert third["staleness/unscored_samples"] == 4.0 and "mismatch/k3" not in third
    assert third["rollout/staleness_max"] == 2.0


def test_pipeline_keeps_the_data_order_across_a_checkpoint():
    """k = 2 with dynamic sampling: the batches are launched ahead with the sampler's draws;
    the state saved at a step is the one before the in-flight draws, and a pipeline restarted
    from it launches the same prompts for the remaining steps."""
    import ray
    from moe_rl.data.prompts import PromptSampler
    from moe_rl.orchestration.loop import RolloutPipeline

    @ray.remote
    class FakeRollout:
        def collect(self, indices, step, version, seed, shards, extra):
            return {"indices": list(indices), "extra": list(extra), "step": step,
                    "version": version, "seed": seed}, b""

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = config_from_dict({"rollout": {"prompts_per_step": 3, "max_staleness": 2,
                                            "dynamic_sampling": True, "max_oversample": 2},
                                "trainer": {"steps": 6}})
        fake = FakeRollout.remote()

        def run(start, state):
            sampler = PromptSampler(10, 3, seed=0)
            if state:
                sampler.load_state_dict(state)
            pipe = RolloutPipeline(cfg, fake, sampler, 1, start)
            got, saved = {}, {}
            for step in range(start, 6):
                pipe.launch(version=step)
                assert len(pipe.pending) <= 3 and pipe.pending[-1][0] <= step + 2
                summary, _ = pipe.next_batch(step)
                got[step] = summary
                saved[step + 1] = pipe.sampler_state()
            return got, saved

        straight, saved = run(0, None)
        assert [len(straight[s]["extra"]) for s in range(6)] == [2] * 6
        # each batch carries the weight version it was launched with, at most k = 2 behind
        assert [straight[s]["version"] for s in range(6)] == [0, 0, 0, 1, 2, 3]
        assert straight[0]["step"] == 0 and straight[1]["seed"] != straight[0]["seed"]
        resumed, _ = run(3, saved[3])
        for step in (3, 4, 5):   # the same prompts and seeds; generated from version >= 3 now
            assert {k: v for k, v in resumed[step].items() if k != "version"} == \
                {k: v for k, v in straight[step].items() if k != "version"}
        assert [resumed[s]["version"] for s in (3, 4, 5)] == [3, 3, 3]
        # the state saved after step 3 is the sampler after 3 steps' draws, not more
        fresh = PromptSampler(10, 3, seed=0)
        for _ in range(3):
            fresh.next_batch()
            fresh.next_batch()   # the oversampling reserve of each step
        assert saved[3] == fresh.state_dict()
    finally:
        ray.shutdown()


def test_async_and_dynamic_sampling_settings_are_checked():
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    with pytest.raises(ConfigError, match="cluster.colocate"):
        load_config(cfg, ["rollout.max_staleness=1", "cluster.colocate=true"])
    with pytest.raises(ConfigError, match="algorithm.pi_old"):
        load_config(cfg, ["rollout.max_staleness=1", "algorithm.pi_old=rollout"])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(cfg, ["rollout.max_staleness=-1"])


def _metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.loop
@pytest.mark.e2e
# `make test-slow`; CI: the shipped Qwen3 config's run (staleness 1, dynamic sampling) and the
# asynchronous killed-engine run
@pytest.mark.slow
def test_train_with_max_staleness_1_through_the_loop(tmp_path):
    """`moe-rl train` with rollout.max_staleness=1 and dynamic sampling (float32 engine, R3):
    step 0 trains on version-0 samples, every later step on samples one version old; the
    same-version mismatch stays ~0 and nothing is corrected away (nor does the weight check
    fire), the lag shows in staleness/*; groups whose rewards are all equal are dropped and
    replaced from the oversampling reserve (rollout.max_oversample), each step training on
    prompts_per_step groups; the checkpoint keeps the data order of the consumed steps."""
    from moe_rl.data.prompts import PromptSampler
    init_tiny_model(str(tmp_path / "model"))
    train_cli(tmp_path, 4, "rollout.max_staleness=1", "rollout.dynamic_sampling=true",
              "rollout.max_oversample=4", "rollout.weight_check.enabled=true")
    rows = _metrics(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # the weight check of each version runs when its load is confirmed (the next sync): the
    # trainer's side was taken when it held that version, so no false alarm although it has
    # moved on by then
    assert all(r["weights/probe_k3"] < 1e-6 and r["weights/check_resyncs"] == 0 for r in rows)
    assert [r["rollout/stale_samples"] for r in rows] == [0.0, 16.0, 16.0, 16.0]
    for r in rows:
        assert abs(r["mismatch/k3"]) < 1e-6
        assert r["correction/seq_mis/masked_seq_frac"] == 0.0
        assert r["staleness/unscored_samples"] == 0.0
        generated, dropped = r["rollout/generated_groups"], r["rollout/dropped_groups"]
        assert 4 <= generated <= 8 and generated - dropped == 4
        assert r["rollout/filled_groups"] <= 4
    assert sum(r["rollout/dropped_groups"] for r in rows) > 0   # a 2-step warm start: many
    # groups are all-zero
    assert all("staleness/k3" in r for r in rows[1:])
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter_0000002" /
                        "loop_state.json").read_text())
    sampler = PromptSampler(100, 4, seed=0)
    for _ in range(2 * 2):   # 2 steps, each a batch and its oversampling reserve
        sampler.next_batch()
    assert state["sampler"] == sampler.state_dict()   # step 2's batch was in flight


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: the staleness-1 run above holds dynamic sampling in CI
def test_train_with_dynamic_sampling_through_the_loop(tmp_path):
    """`moe-rl train` with rollout.dynamic_sampling=true (synchronous loop): groups whose
    rewards are all equal are dropped and replaced from the oversampling reserve; each step
    trains on prompts_per_step groups."""
    init_tiny_model(str(tmp_path / "model"))
    train_cli(tmp_path, 3, "rollout.dynamic_sampling=true", "rollout.max_oversample=4")
    rows = _metrics(tmp_path / "run")
    for r in rows:
        generated, dropped = r["rollout/generated_groups"], r["rollout/dropped_groups"]
        assert 4 <= generated <= 8 and generated - dropped == 4
        assert r["rollout/filled_groups"] <= 4
    assert sum(r["rollout/dropped_groups"] for r in rows) > 0   # a 2-step warm start: many
    # groups are all-zero
