"""The GPU initialisation of the trainer's process groups, on CPU: every group the trainer reduces
CPU tensors over must have a CPU backend (defect: a bare "nccl" default group serves CUDA tensors
only, and megatron's groups inherit it, so data parallel > 1 stopped at the first step).

NCCL cannot run here, so the test registers a stand-in backend that, like NCCL, declares the
``cuda`` device only, and has ``init_process_group`` use it wherever the trainer asks for "nccl".
A CPU collective over a group without a CPU backend then fails exactly as on a GPU machine."""
import os

import pytest
import torch
import torch.distributed as dist

from moe_rl.trainer.parallel import free_port
from tests.helpers import start_ranks

FAKE = "fakecuda"


def _as_gpu_machine(monkeypatch_like):
    """Make moe_rl's trainer initialise as on GPUs, with NCCL replaced by the CUDA-only
    stand-in."""
    import moe_rl.trainer.parallel as parallel
    from megatron.core import tensor_parallel

    def creator(store, rank, world, timeout):   # gloo underneath, declared for cuda only
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if FAKE not in dist.Backend.backend_list:
        dist.Backend.register_backend(FAKE, creator, devices=["cuda"])
    real_init = dist.init_process_group

    def init(backend=None, *a, **k):
        return real_init(backend.replace("nccl", FAKE), *a, **k)
    monkeypatch_like(dist, "init_process_group", init)
    monkeypatch_like(parallel, "cuda_absent", lambda: False)
    monkeypatch_like(torch.cuda, "set_device", lambda *_: None)
    monkeypatch_like(torch.cuda, "device_count", lambda: 8)
    monkeypatch_like(tensor_parallel, "model_parallel_cuda_manual_seed", lambda *_: None)


def _worker(rank, port, out_dir, expert):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    _as_gpu_machine(setattr)
    from megatron.core import parallel_state as ps
    from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
    from moe_rl.trainer.step import all_gather_text, reduce_sums
    from moe_rl.weights.serialize import gather_strings
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(expert=expert))
    groups = {"default": None, "data_parallel": ps.get_data_parallel_group(),
              "tensor_model_parallel": ps.get_tensor_model_parallel_group(),
              "expert_model_parallel": ps.get_expert_model_parallel_group(),
              "expert_tensor_and_model_parallel":
                  ps.get_expert_tensor_and_model_parallel_group()}
    failures = {}
    for name, group in groups.items():
        try:   # what the trainer does with CPU tensors: sums, maxima, gathers
            t = torch.ones(3)
            dist.all_reduce(t, group=group)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            parts = [torch.zeros(3) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t, group=group)
        except Exception as exc:   # noqa: BLE001  (recorded for the assertion)
            failures[name] = str(exc).splitlines()[0]
    try:
        sums = reduce_sums({"a": float(rank + 1), "m": float(rank)}, ("m",),
                           ps.get_data_parallel_group())
        texts = all_gather_text(f"rank{rank}", ps.get_data_parallel_group())
        gathered = gather_strings(f"payload{rank}")
    except Exception as exc:   # noqa: BLE001
        failures["trainer helpers"] = str(exc).splitlines()[0]
        sums, texts, gathered = None, None, None
    torch.save({"failures": failures, "sums": sums, "texts": texts, "gathered": gathered,
                "backend": dist.get_backend()}, os.path.join(out_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("expert", [1, 2])
def test_gpu_init_gives_every_trainer_group_a_cpu_backend(tmp_path, expert):
    start_ranks(_worker, (free_port(), str(tmp_path), expert), 2)
    r0 = torch.load(tmp_path / "r0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "r1.pt", weights_only=False)
    assert r0["failures"] == {} and r1["failures"] == {}, (r0["failures"], r1["failures"])
    assert "cuda:" + FAKE in r0["backend"] and "cpu:gloo" in r0["backend"]
    if expert == 1:   # data parallel 2
        assert r0["sums"] == {"a": 3.0, "m": 1.0} and r0["texts"] == ["rank0", "rank1"]
    assert r0["gathered"] == ["payload0", "payload1"] and r1["gathered"] is None


def test_default_backend_names_both_devices():
    from moe_rl.trainer.parallel import default_backend
    assert default_backend(cuda=False) == "gloo"
    assert default_backend(cuda=True) == "cpu:gloo,cuda:nccl"
