"""Expert parallel and data parallel over two gloo processes (multiproc)."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers import engine_samples, start_ranks, write_tiny_qwen


def _worker(rank, port, model_dir, out_dir, mode):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.weights.hf import (iter_hf_buckets, load_hf_into_megatron,
                                           megatron_to_hf)
    from moe_rl.trainer.model_builder import build_model
    from moe_rl.trainer.parallel import ParallelSizes, destroy, init_distributed, \
        init_model_parallel
    from moe_rl.trainer.replay import ReplayController
    from moe_rl.rollout_record import RolloutBatch
    init_distributed(rank=rank, world_size=2)
    samples = RolloutBatch.load(os.path.join(out_dir, "samples.st")).samples
    if mode == "ep":
        init_model_parallel(ParallelSizes(expert=2))
        model, spec = build_model(model_dir, sizes=ParallelSizes(expert=2))
        load_hf_into_megatron(model, spec, model_dir)
        n_local = sum(1 for n, _ in model.named_parameters() if "local_experts" in n and
                      "decoder.layers.0." in n and "fc1" in n)
        ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
        mb = pack_one(samples, list(range(len(samples))), pad_token_id=0, num_experts=8)
        ctl.replay(mb.replay_indices())
        model.eval()
        with torch.no_grad():
            lp, _ = forward_logprobs(model, mb)
        exported = megatron_to_hf(model, spec)
        streamed = {k: v for bucket, _ in iter_hf_buckets(model, spec, 4096)   # to rank 0 only
                    for k, v in bucket}
        torch.save({"lp": lp, "n_local": n_local, "keys": sorted(exported),
                    "streamed_keys": sorted(streamed),
                    "streamed_equal": all(torch.equal(v, exported[k]) for k, v in streamed.items()),
                    "expert5": exported["model.layers.0.mlp.experts.5.gate_proj.weight"]},
                   os.path.join(out_dir, f"ep{rank}.pt"))
    elif mode == "ep_ragged":   # EP 2 / DP 2 with micro-batches of different shapes per rank
        init_model_parallel(ParallelSizes(expert=2))
        from moe_rl.trainer.policy import PolicyTrainer
        cfg = config_from_dict({"model": {"path": model_dir},
                                "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                                "trainer": {"optim": {"lr": 1e-2, "grad_clip": 0.0}, "parallel": {"expert": 2},
                                            "epochs": 2},
                                "cluster": {"trainer_workers": 2},
                                "algorithm": RAGGED_ALGORITHM})
        trainer = PolicyTrainer(cfg, model_dir)
        m = trainer.train_step(_ragged_shares(samples)[rank])
        torch.save({"grad_norm": m["grad_norm"], "agreement": m["routing/agreement"],
                    "gamma": m["router_shift/gamma_mean"]},
                   os.path.join(out_dir, f"epr{rank}.pt"))
    else:   # data parallel: each rank trains on its own group; gradients are all-reduced
        init_model_parallel()
        from moe_rl.trainer.policy import PolicyTrainer
        cfg = config_from_dict({"model": {"path": model_dir},
                                "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                                "trainer": {"optim": {"lr": 1e-3, "grad_clip": 0.0}}})
        trainer = PolicyTrainer(cfg, model_dir)
        share = [s for s in samples if s.group_id == rank]
        m = trainer.train_step(share)
        torch.save({"grads": [p.main_grad.clone() for p in trainer.model.module.parameters()],
                    "grad_norm": m["grad_norm"]}, os.path.join(out_dir, f"dp{rank}.pt"))
    destroy()


# RSPO (GMPO with the router-shift weight) over two epochs: the second reads the routers moved
RAGGED_ALGORITHM = {"replay": "r3", "loss": "gmpo", "clip_low": 0.4, "clip_high": 0.4,
                    "aggregation": "seq-mean-token-mean", "router_shift": {"enabled": True}}


def _ragged_shares(samples):
    """Rank 0: group 0 (two rows); rank 1: one row of group 1: different micro-batch shapes."""
    return [s for s in samples if s.group_id == 0], [s for s in samples if s.group_id == 1][:1]


def _spawn(tmp_path, mode):
    from moe_rl.trainer.parallel import free_port
    model_dir = tmp_path / "qwen"
    hf = write_tiny_qwen(model_dir, seed=21)
    from moe_rl.rollout_record import RolloutBatch
    samples = engine_samples(hf, n_groups=2, group_size=2, seed=22)
    RolloutBatch(samples).save(str(tmp_path / "samples.st"))
    start_ranks(_worker, (free_port(), str(model_dir), str(tmp_path), mode), 2)
    return str(model_dir), samples


@pytest.mark.multiproc
def test_expert_parallel_2_matches_single_process(tmp_path):
    model_dir, samples = _spawn(tmp_path, "ep")
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.weights.hf import load_hf_into_megatron
    from moe_rl.trainer.model_builder import build_model
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.replay import ReplayController
    init_distributed()
    init_model_parallel()
    model, spec = build_model(model_dir)
    load_hf_into_megatron(model, spec, model_dir)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    mb = pack_one(samples, list(range(len(samples))), pad_token_id=0, num_experts=8)
    ctl.replay(mb.replay_indices())
    model.eval()
    with torch.no_grad():
        ref, _ = forward_logprobs(model, mb)
    ctl.close()
    for r in range(2):
        out = torch.load(tmp_path / f"ep{r}.pt")
        assert out["n_local"] == 4                       # 8 experts split over 2 ranks
        assert torch.allclose(out["lp"], ref, atol=1e-5), (out["lp"] - ref).abs().max()
        assert len(out["keys"]) == len(set(out["keys"]))
    e0, e1 = (torch.load(tmp_path / f"ep{r}.pt") for r in range(2))
    assert e0["keys"] == e1["keys"] and torch.equal(e0["expert5"], e1["expert5"])
    # the streaming exporter: every tensor on the exporting rank, each expert sent by its owner;
    # nothing materialised on the other rank
    assert e0["streamed_keys"] == e0["keys"] and e0["streamed_equal"]
    assert e1["streamed_keys"] == []


@pytest.mark.multiproc
def test_data_parallel_gradients_are_the_global_mean(tmp_path):
    model_dir, samples = _spawn(tmp_path, "dp")
    outs = [torch.load(tmp_path / f"dp{r}.pt") for r in range(2)]
    for a, b in zip(outs[0]["grads"], outs[1]["grads"]):
        assert torch.equal(a, b)                          # all-reduced: identical on both ranks
    # against one process training on the whole batch
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    init_distributed()
    init_model_parallel()
    cfg = config_from_dict({"model": {"path": model_dir},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                            "trainer": {"optim": {"lr": 1e-3, "grad_clip": 0.0}}})
    trainer = PolicyTrainer(cfg, model_dir)
    trainer.train_step(samples)
    for a, p in zip(outs[0]["grads"], trainer.model.module.parameters()):
        assert torch.allclose(a, p.main_grad, atol=1e-7, rtol=1e-4)


@pytest.mark.multiproc
def test_expert_parallel_ranks_with_different_micro_batch_shapes(tmp_path):
    """On CPU the allgather dispatcher gathers hidden states over the expert-parallel group: a
    rank with 2 rows and one with 1 row (other lengths too) must still train (each forward is
    padded to the group's shape and cropped back), with the gradient norm and routing agreement
    of one process training on the same 3 rows; with RSPO over two epochs, the router-shift
    weight read through the padded, cropped forwards equals the one process's too."""
    model_dir, samples = _spawn(tmp_path, "ep_ragged")
    outs = [torch.load(tmp_path / f"epr{r}.pt") for r in range(2)]
    from moe_rl.config import config_from_dict
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.policy import PolicyTrainer
    init_distributed()
    init_model_parallel()
    cfg = config_from_dict({"model": {"path": model_dir},
                            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 5},
                            "trainer": {"optim": {"lr": 1e-2, "grad_clip": 0.0}, "epochs": 2},
                            "algorithm": RAGGED_ALGORITHM})
    share0, share1 = _ragged_shares(samples)
    m = PolicyTrainer(cfg, model_dir).train_step(share0 + share1)
    assert m["router_shift/gamma_mean"] < 1.0   # the second epoch saw the routers move
    for out in outs:
        assert out["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5)
        assert out["agreement"] == pytest.approx(m["routing/agreement"], abs=1e-7)
        assert out["gamma"] == pytest.approx(m["router_shift/gamma_mean"], rel=1e-6)


def test_the_planned_master_address_wins_over_an_inherited_one():
    """A trainer rank is told rank 0's address by the plan; an inherited ``MASTER_ADDR`` (some
    Slurm templates export one) must not override it, or the ranks never meet. Here the
    inherited name does not resolve (no traffic leaves the machine): the planned 127.0.0.1
    must be the one set."""
    code = ("import os; from moe_rl.trainer.parallel import free_port, init_distributed; "
            "init_distributed(rank=0, world_size=1, master_addr='127.0.0.1', "
            "master_port=free_port()); print(os.environ['MASTER_ADDR'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "MASTER_ADDR": "inherited.invalid"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "127.0.0.1"


def test_one_rank_needs_no_rendezvous_port():
    """A one-rank trainer meets nobody: its group starts even when the port it was given was
    taken between being picked free and being bound (the run's engines and other processes
    pick ports on the same machine at the same time)."""
    from moe_rl.engines.process import bind_port
    from moe_rl.trainer.parallel import free_port
    with bind_port("127.0.0.1", free_port()) as busy:
        code = ("from moe_rl.trainer.parallel import init_distributed; import torch.distributed "
                f"as d; init_distributed(rank=0, world_size=1, master_addr='127.0.0.1', "
                f"master_port={busy.getsockname()[1]}); print(d.get_world_size())")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "1"


def _agreement_worker(rank, port, sizes, out_dir):
    import types
    from moe_rl.trainer.parallel import ParallelSizes, destroy, init_distributed, \
        init_model_parallel
    from moe_rl.trainer.passes import StepPasses
    init_distributed(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port)
    init_model_parallel(ParallelSizes(**sizes))
    # rank 0 holds 6 positions that agree, rank 1 the other 2 positions, which do not
    agree = 1.0 if rank == 0 else 0.0
    rows = [{"w": 6.0 if rank == 0 else 2.0, "routing/agreement": agree,
             "routing/token_differs_frac": 1 - agree, "routing/agreement_layer_0": agree}]
    fake = types.SimpleNamespace(replay=types.SimpleNamespace(layer_names=["0"]))
    got = StepPasses._agreement_metrics(fake, rows)
    with open(os.path.join(out_dir, f"agree{rank}.txt"), "w") as fh:
        fh.write(repr(got))
    destroy()


@pytest.mark.multiproc
@pytest.mark.parametrize("sizes", [{"tensor": 2}, {"context": 2}], ids=["tp2", "cp2"])
def test_routing_agreement_counts_every_ranks_positions(tmp_path, sizes):
    """Under sequence parallelism each tensor-parallel rank routes a slice of the positions,
    under context parallelism each CP rank its chunks: routing/agreement is the position-weighted
    mean over every rank's slice (6 agreeing + 2 not = 0.75), not over data-parallel rank 0's
    (here the only one: 1.0), on every rank."""
    import ast
    from moe_rl.trainer.parallel import free_port
    start_ranks(_agreement_worker, (free_port(), sizes, str(tmp_path)), 2)
    for rank in (0, 1):
        got = ast.literal_eval((tmp_path / f"agree{rank}.txt").read_text())
        assert got == pytest.approx({"routing/agreement": 0.75, "routing/token_differs_frac": 0.25,
                                     "routing/agreement_layer_0": 0.75})


def test_a_rendezvous_port_lies_outside_the_ephemeral_range(tmp_path, monkeypatch):
    """A port picked for a listener another rank connects to is never one the kernel hands out
    to bind(0) or to an outgoing connection (another test's or process's gloo pairs took such a
    port between its pick and its bind once: 'Connection reset by peer' in CI)."""
    from moe_rl.trainer import parallel
    low, high = parallel.ephemeral_range()
    ports = [parallel.free_port() for _ in range(40)]
    assert not [p for p in ports if low <= p <= high]
    (tmp_path / "range").write_text("40000\t50000\n")
    assert parallel.ephemeral_range(str(tmp_path / "range")) == (40000, 50000)
    assert parallel.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    monkeypatch.setattr(parallel, "ephemeral_range", lambda: (1024, 65535))   # nothing outside
    port = parallel.free_port()   # the kernel's choice, still free
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
