"""The dose-response study's pre-registered outcomes (benchmarks/dose_response.py): time to
collapse and the paired bootstrap, on hand-worked cases and a float64 reference."""
from __future__ import annotations

import itertools
import statistics

import pytest

from benchmarks.dose_response import (ARMS, DOSES, EDGE_DOSES, MAIN_ARMS, RECOVER, compare,
                                      edge_jobs, group_stats, paired_bootstrap, study_jobs,
                                      time_to_collapse, write_data)


def test_a_stable_run_never_collapses():
    reward = [0.3 + 0.01 * t for t in range(40)]
    assert time_to_collapse(reward, [1.0] * 40) is None


def test_a_lasting_drop_collapses_where_it_starts():
    # 0.8 for 10 steps, then 0.1 for good: the 5-step mean is 0.66 at step 10 (within 0.2 of
    # the maximum 0.8) and 0.52 at step 11 (more than 0.2 below, and stays so)
    reward = [0.8] * 10 + [0.1] * 30
    assert time_to_collapse(reward, [1.0] * 40) == 11


def test_a_drop_that_recovers_within_the_window_is_not_a_collapse():
    reward = [0.8] * 10 + [0.1] * 3 + [0.8] * 27
    assert time_to_collapse(reward, [1.0] * 40) is None


def test_a_drop_too_late_to_confirm_is_not_a_collapse():
    reward = [0.8] * 35 + [0.0] * (RECOVER - 6)
    assert time_to_collapse(reward, [1.0] * len(reward)) is None


def test_entropy_collapse_counts_only_below_the_reward_bar():
    wrong = time_to_collapse([0.2] * 20, [1.0] * 5 + [0.001] * 15)
    assert wrong is not None and 5 <= wrong <= 9
    assert time_to_collapse([0.95] * 20, [1.0] * 5 + [0.001] * 15) is None


def test_paired_bootstrap_against_exact_enumeration():
    a, b = [3.0, 5.0, 4.0], [1.0, 2.0, 6.0]
    d = [x - y for x, y in zip(a, b)]   # 2, 3, -2
    res = paired_bootstrap(a, b, n=20000, seed=1)
    assert res["diff"] == pytest.approx(1.0)
    # exact distribution of the resampled mean: all 27 ordered draws, equally likely
    means = sorted(statistics.fmean(c) for c in itertools.product(d, repeat=3))
    lo, hi = means[int(0.025 * 27)], means[-1 - int(0.025 * 27)]
    assert res["lo"] == pytest.approx(lo, abs=0.34) and res["hi"] == pytest.approx(hi, abs=0.34)
    assert not res["distinguishable"]
    sure = paired_bootstrap([1.0, 1.1, 0.9, 1.2, 1.0], [0.0] * 5)
    assert sure["distinguishable"] and sure["lo"] > 0.8
    with pytest.raises(ValueError, match="paired_bootstrap"):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_the_design_has_the_seeds_and_arms_promised(tmp_path):
    jobs = study_jobs(1e-3, 5, 3)
    labels = [j[0] for j in jobs]
    for dose in DOSES:
        for arm in ARMS:
            n = sum(lab.startswith(f"{dose}__{arm}__") for lab in labels)
            assert n == (5 if arm in MAIN_ARMS else 3)
    edge = [j[0] for j in edge_jobs(1e-2, 5)]
    assert len(edge) == len(set(edge)) == len(EDGE_DOSES) * len(MAIN_ARMS) * 5
    assert all(j[2] == 1e-2 for j in edge_jobs(1e-2, 5))
    train, held = write_data(tmp_path)
    train_rows, held_rows = train.read_text().splitlines(), held.read_text().splitlines()
    assert not set(train_rows) & set(held_rows) and len(held_rows) == 6


def test_arms_compared_with_none_only_where_their_runs_exist():
    """A report holding `none` and one added arm (as `--add-arms ... --rebaseline` writes)
    compares each dose's none with the control's and the arm with none at its dose; arms it has
    not run are left out, not a KeyError."""
    def run(k3):
        return {"time_to_collapse": 40, "held_out_reward": 0.5, "k3_mean": k3,
                "collapse_step": None, "reward": [0.5] * 40, "agreement": [1.0]}
    runs = {}
    for i, dose in enumerate(DOSES):
        for s in range(1, 6):
            runs[f"{dose}__none__s{s}"] = run(float(i))
        for s in range(1, 4):
            runs[f"{dose}__qae__s{s}"] = run(float(i) + 0.5)
    rows = {c["what"]: c for c in compare(runs, 5, 3)}
    assert set(rows) == {f"{d}/none - control_fp32/none" for d in DOSES if d != "control_fp32"} \
        | {f"{d}/qae - {d}/none" for d in DOSES}
    assert all(rows[f"{d}/qae - {d}/none"]["k3_mean"]["diff"] == 0.5 for d in DOSES)
    groups = group_stats(runs, 5, 3, ("none", "qae"))
    assert [(g["dose"], g["arm"], g["seeds"]) for g in groups] == \
        [(d, a, 5 if a == "none" else 3) for d in DOSES for a in ("none", "qae")]


def test_an_added_dose_is_run_beside_the_control_and_bf16_made_again(tmp_path, monkeypatch):
    """`--add-doses fp16`: `none` at fp16, the control and bfloat16 with the same seeds, in
    run folders of their own (the report's seed-1 folders untouched); the report compares fp16
    with the control and with bfloat16."""
    import json
    import benchmarks.dose_response as study
    (tmp_path / "dose_response.json").write_text(json.dumps({"steps": 40, "lr": 3e-3}))
    kept = tmp_path / "runs" / "control_fp32__none__s1"
    kept.mkdir(parents=True)
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    monkeypatch.setattr(study, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(study, "warm_model", lambda work, train: "model")
    seen = []
    k3 = {"control_fp32": 0.0, "bf16": 2e-5, "fp16": 3e-6}

    def run_all(jobs, model, data, steps):
        seen.extend(jobs)
        return {label: {"time_to_collapse": 40, "held_out_reward": 0.5, "collapse_step": None,
                        "k3_mean": k3[label.split("__")[1]] * seed, "reward": [0.5] * 40,
                        "agreement": [1.0]} for label, _, _, seed in jobs}
    monkeypatch.setattr(study, "run_all", run_all)
    assert study.add_doses(["fp16"]) == 0
    assert sorted(j[0] for j in seen) == sorted(f"doses__{d}__none__s{s}" for d in k3
                                                for s in (1, 2, 3))
    assert all("model.dtype=float16" in j[1] for j in seen if "fp16" in j[0])
    assert kept.exists()
    report = json.loads((tmp_path / "dose_response_fp16.json").read_text())
    rows = {c["what"]: c for c in report["comparisons"]}
    assert set(rows) == {"bf16/none - control_fp32/none", "fp16/none - control_fp32/none",
                         "fp16/none - bf16/none"}
    assert rows["fp16/none - bf16/none"]["k3_mean"]["diff"] == pytest.approx((3e-6 - 2e-5) * 2)
    assert "fp16/none - bf16/none" in (tmp_path / "dose_response_fp16.md").read_text()
