"""One step contract across data-parallel ranks (2 gloo processes): every decision and every
logged metric comes from the whole batch, so ranks decide alike and log what one process on the
whole batch logs; ranks with less work still enter every collective."""
import json
import math
import os

import pytest
import torch

from moe_rl.trainer.step import StepRows, gather_rows, step_inputs
from tests.helpers import engine_samples, start_ranks, write_tiny_qwen

ALGO = {"replay": "r3", "corrections": ["icepop", "seq_mis"]}


def _cfg(model_dir, **trainer):
    from moe_rl.config import config_from_dict
    return config_from_dict({"model": {"path": model_dir},
                             "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                             "trainer": {"optim": {"lr": 1e-3}, "seed": 3, "micro_batch_size": 2,
                                         **trainer},
                             "algorithm": {**ALGO, "collapse_guard_k3": 0.5}})


def _worker(rank, port, model_dir, out_dir, case):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.trainer.parallel import destroy, init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    from moe_rl.rollout_record import RolloutBatch
    init_distributed(rank=rank, world_size=2)
    init_model_parallel()
    samples = RolloutBatch.load(os.path.join(out_dir, f"{case}.st")).samples
    trainer = PolicyTrainer(_cfg(model_dir, mini_batches=3 if case == "uneven" else 1),
                            model_dir)
    before = [p.detach().clone() for p in trainer.model.module.parameters()]
    m = trainer.train_step([s for s in samples if s.group_id % 2 == rank])
    changed = any(not torch.equal(a, b) for a, b in zip(before,
                                                        trainer.model.module.parameters()))
    with open(os.path.join(out_dir, f"{case}{rank}.json"), "w") as fh:
        json.dump({"metrics": m, "changed": changed}, fh)
    destroy()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from moe_rl.rollout_record import RolloutBatch
    tmp = tmp_path_factory.mktemp("contract")
    model_dir = tmp / "qwen"
    hf = write_tiny_qwen(model_dir, seed=31)
    clean = engine_samples(hf, n_groups=2, group_size=2, seed=32)
    noisy = engine_samples(hf, n_groups=2, group_size=2, seed=32, noise=2.0)
    # rank 1's shard (group 1) is noisy, rank 0's is exact: the guard statistic is the batch's
    guard = clean[:2] + noisy[2:]
    RolloutBatch(clean).save(str(tmp / "clean.st"))
    RolloutBatch(guard).save(str(tmp / "guard.st"))
    RolloutBatch(engine_samples(hf, n_groups=2, group_size=2, seed=33)).save(
        str(tmp / "uneven.st"))
    return str(model_dir), tmp, {"clean": clean, "guard": guard}


def _run(setup, case):
    from moe_rl.trainer.parallel import free_port
    model_dir, tmp, _ = setup
    start_ranks(_worker, (free_port(), model_dir, str(tmp), case), 2)
    return [json.loads((tmp / f"{case}{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiproc
def test_a_noisy_shard_makes_both_ranks_skip_together(setup):
    r0, r1 = _run(setup, "guard")
    assert r0["metrics"]["guard/skipped"] == r1["metrics"]["guard/skipped"] == 1.0
    assert not r0["changed"] and not r1["changed"]
    assert r0["metrics"]["mismatch/k3"] == r1["metrics"]["mismatch/k3"] > 0.5


@pytest.mark.multiproc
def test_two_ranks_log_what_one_process_logs_on_the_whole_batch(setup):
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    model_dir, _, data = setup
    r0, r1 = _run(setup, "clean")
    assert r0["metrics"] == r1["metrics"]   # one contract: identical on every rank
    init_distributed()
    init_model_parallel()
    single = PolicyTrainer(_cfg(model_dir, mini_batches=1), model_dir).train_step(data["clean"])
    assert set(single) == set(r0["metrics"])
    for key, value in single.items():
        # float32 forwards of other micro-batch packings: equal to rounding
        assert math.isclose(value, r0["metrics"][key], rel_tol=1e-5, abs_tol=1e-6), key


@pytest.mark.multiproc
def test_a_rank_with_an_empty_mini_batch_still_takes_part(setup):
    r0, r1 = _run(setup, "uneven")   # 2 samples a rank, 3 mini-batches: one is empty
    assert r0["metrics"] == r1["metrics"] and r0["changed"] and r1["changed"]
    assert r0["metrics"]["guard/skipped"] == 0.0


def test_step_inputs_are_a_pure_function_of_the_rows():
    g = torch.Generator().manual_seed(0)
    N, R = 4, 5
    rows = StepRows(mask=torch.ones(N, R, dtype=torch.bool),
                    lp_roll=-torch.rand(N, R, generator=g), lp_tr=-torch.rand(N, R, generator=g),
                    entropy=torch.rand(N, R, generator=g),
                    rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]),
                    groups=torch.tensor([0, 0, 1, 1]),
                    weight_versions=torch.tensor([3, 3, 2, 3]),
                    sample_ids=torch.arange(N))
    from moe_rl.config import AlgorithmConfig
    a = AlgorithmConfig(corrections=["seq_mis"])
    out = step_inputs(a, rows, deferred=[])
    assert torch.equal(out.lp_old, rows.lp_tr)   # pi_old = trainer
    assert out.advantages.tolist()[2:] == [0.0, 0.0] and out.advantages[0] > 0
    assert out.metrics["weight_version/min"] == 2.0
    d = (rows.lp_tr - rows.lp_roll).double()
    assert out.metrics["mismatch/k3"] == pytest.approx(float((d.exp() - d - 1).mean()))
    merged, mine = gather_rows(rows)   # no process group: the rows themselves
    assert merged is rows and mine == slice(0, N)


def test_sample_notes_name_the_first_samples_and_their_largest_mismatch():
    """Hand-worked: rows out of order; the first two by (group, sample id) are reported with
    their advantage, the tokens a correction removed, and the tokens where trainer and engine
    differ most (padding never chosen); with the asynchronous pipeline, against the trainer at
    the sample's own version."""
    from moe_rl.trainer.step import StepInputs, sample_notes
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    lp_roll = torch.tensor([[-1.0, -2.0, -3.0, -9.0], [-1.0, -1.0, 0.0, 0.0],
                            [-0.5, -0.5, -0.5, -0.5]])
    lp_tr = torch.tensor([[-1.1, -2.0, -2.0, 0.0], [-1.0, -1.5, 0.0, 0.0],
                          [-0.5, -0.5, -0.5, -0.5]])
    rows = StepRows(mask=mask, lp_roll=lp_roll, lp_tr=lp_tr, entropy=torch.zeros(3, 4),
                    rewards=torch.tensor([1.0, 0.0, 0.0]), groups=torch.tensor([1, 0, 0]),
                    weight_versions=torch.zeros(3, dtype=torch.long),
                    sample_ids=torch.tensor([0, 5, 4]))
    keep = mask.clone()
    keep[1, 1] = False
    inputs = StepInputs(lp_old=lp_tr, advantages=torch.tensor([0.7, -0.3, 0.2]),
                        weights=torch.full((3, 4), 0.5), keep=keep, metrics={})
    notes = sample_notes(rows, inputs, k=2, top=2)
    assert [(n["group_id"], n["sample_id"]) for n in notes] == [(0, 4), (0, 5)]
    assert notes[1]["advantage"] == pytest.approx(-0.3) and notes[1]["tokens"] == 2
    assert notes[1]["tokens_removed"] == 1 and notes[1]["correction_weight_mean"] == 0.5
    assert notes[1]["largest_mismatch"][0] == {"position": 1, "engine_logprob": -1.0,
                                               "trainer_logprob": -1.5}
    first = sample_notes(rows, inputs, k=3, top=2)[2]   # (1, 0): the padded position 3 skipped
    assert [t["position"] for t in first["largest_mismatch"]] == [2, 0]
    rows.lp_same = lp_roll.clone()   # the trainer at the sample's version equals the engine
    rows.same_scored = torch.tensor([True, False, False])[:, None].expand(3, 4)
    rows.stale = torch.tensor([True, False, False])[:, None].expand(3, 4)
    first = sample_notes(rows, inputs, k=3, top=1)[2]
    assert first["largest_mismatch"][0]["trainer_logprob"] == first["largest_mismatch"][0][
        "engine_logprob"]
