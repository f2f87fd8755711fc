"""`launch/slurm_multinode.sbatch` run by a real Slurm (slurmctld + one slurmd per node, each node
a network namespace with its own address and hostname; see tests/launch/slurm_cluster.py): a 2-node run
with a trainer rank on each node (gloo between the namespaces), then a node killed mid-run, the
job requeued and resumed from its last complete checkpoint, equal to the uninterrupted run on
every step after the resume. `make test-cluster` (root; installs slurm-wlm and munge)."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import WALL_CLOCK

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "slurm_multinode.sbatch"
STEPS = 6
KILL_AFTER = 3            # the node dies once this step's checkpoint is complete
FAIL_WITHIN_S = 120       # the job must have failed and be requeued this soon after the kill
RUN_TIMEOUT_S = 480

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("slurmctld"),
                                 reason="needs root and slurm-wlm (make test-cluster)")]


@pytest.fixture(scope="module")
def cluster():
    from tests.launch.slurm_cluster import SlurmCluster
    with SlurmCluster(nodes=2, cpus=2) as c:
        yield c


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory every node sees (the shared filesystem) with the tiny model in it."""
    d = tmp_path_factory.mktemp("slurm")
    d.chmod(0o755)
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config", "tiny_cpu",
                    "--out", str(d / "model")], check=True, capture_output=True, timeout=300)
    return d


def _submit(cluster, work, name: str) -> int:
    bindir = pathlib.Path(sys.executable).parent
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "CONFIG": "tiny_cpu",
           "PYTHON": sys.executable, "MOE_RL": str(bindir / "moe-rl"), "STOP_TIMEOUT": "60",
           # the nodes share this machine's local filesystem, which doctor's shared-filesystem
           # check fails: reported, and the job goes on
           "DOCTOR": "warn"}
    return cluster.sbatch(
        "-N", "2", "--gpus-per-node=0", f"--output={work / name}-%j.out", str(SCRIPT),
        f"model.path={work / 'model'}", f"logging.dir={work / name}",
        "cluster.trainer_workers=2", "cluster.cpus_per_worker=0.5", f"trainer.steps={STEPS}",
        "trainer.checkpoint.interval=1", "trainer.warmup.steps=0", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.sglang.deterministic_inference=true",
        "logging.progress=false", cwd=work, env=env)


def _rows(run: pathlib.Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
    return out


def _only_slurmd_left(cluster) -> None:
    deadline = time.monotonic() + 30
    while True:
        left = {n: [p for p in cluster.processes(n) if "slurmd" not in p.split()[1]]
                for n in cluster.nodes}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"processes left after the job: {left}"
        time.sleep(1)


class Bystander:
    """Another Ray of the same user on this machine (as another job's on a shared node): a
    `ray start --head --block` on 127.0.0.1 with a temp dir of its own, and its processes."""

    def __init__(self, tmp):
        import psutil
        from moe_rl.trainer.parallel import free_port
        ray = str(pathlib.Path(sys.executable).parent / "ray")
        self.proc = subprocess.Popen(
            [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false",
             f"--temp-dir={tmp}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline, self.children = time.monotonic() + 60, []
        while time.monotonic() < deadline and not any(
                c.name() == "raylet" for c in self.children):
            time.sleep(0.5)
            self.children = psutil.Process(self.proc.pid).children(recursive=True)
        assert any(c.name() == "raylet" for c in self.children), "the bystander Ray never started"

    def alive(self) -> list[str]:
        """What of the bystander has stopped (empty: all of it runs)."""
        gone = [f"{c.pid} {c.name()}" for c in self.children if not c.is_running()]
        return gone + ([] if self.proc.poll() is None else ["ray start --block"])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


@pytest.fixture(scope="module")
def uninterrupted(cluster, work, tmp_path_factory):
    """The 2-node job, run while another Ray of this user runs beside the nodes; returns the
    job, its Slurm record, and what of the bystander stopped meanwhile."""
    bystander = Bystander(tmp_path_factory.mktemp("bystander_ray"))
    try:
        job = _submit(cluster, work, "base")
        info = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"},
                                RUN_TIMEOUT_S)
        _only_slurmd_left(cluster)   # the job's teardown is over
        return job, info, bystander.alive()
    finally:
        bystander.stop()


def test_two_node_run_places_a_rank_on_each_node_and_leaves_nothing(cluster, work,
                                                                    uninterrupted):
    job, info, bystander_stopped = uninterrupted
    assert bystander_stopped == []   # the teardown stopped this job's Ray only
    out = (work / f"base-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-4000:]
    run = work / "base"
    addr = {cluster.addresses[n]: n for n in cluster.nodes}
    # Ray on both nodes, each at its own address; the head found at n1's cluster address
    assert f"head n1 ({cluster.addresses['n1']}:6379)" in out
    # moe-rl doctor ran on each node before Ray: its report in the job's output
    for n in cluster.nodes:
        report = out.split(f"moe_rl: moe-rl doctor on {n}:")[1]
        assert "[ok  ] model " in report.split("check(s) failed")[0], out[-4000:]
    assert "moe_rl: warning: moe-rl doctor failed on n1 n2 (DOCTOR=warn: going on)" in out
    assert f"ray cluster ready: 2 nodes ({', '.join(sorted(addr))})" in out
    for n in cluster.nodes:
        log = (run / "logs" / f"slurm-{job}.0" / f"ray-{n}.log").read_text()
        assert f"Local node IP: {cluster.addresses[n]}" in log, log[-2000:]
    # the run's own records: the plan's nodes are the two Slurm nodes, a trainer rank on each
    # (each reports the address it ran at), the engine at the address of the node the plan says
    plan = json.loads((run / "plan.json").read_text())
    node_addr = {r["node"]: r["address"] for r in plan["ray_nodes"]}
    assert sorted(node_addr.values()) == sorted(addr)
    trainers = [p for p in plan["processes"] if p["role"] == "trainer"]
    assert [t["address"] for t in trainers] == [node_addr[t["node"]] for t in trainers]
    assert len({t["address"] for t in trainers}) == 2
    engine = next(p for p in plan["processes"] if p["role"] == "engine")
    assert engine["host"] == node_addr[engine["node"]]
    # every step ran, and on identical float32 engine and trainer nothing differs
    rows = _rows(run)
    assert sorted(rows) == list(range(STEPS))
    for step, m in rows.items():
        assert m["mismatch/k3"] < 1e-6 and m["mismatch/extreme_frac"] == 0.0, (step, m)
        assert m["routing/agreement"] == 1.0, (step, m)
    assert "run finished: 6 RL steps" in out
    _only_slurmd_left(cluster)


def test_a_node_lost_mid_run_requeues_the_job_which_resumes_where_it_was(cluster, work,
                                                                       uninterrupted):
    job = _submit(cluster, work, "lost")
    run = work / "lost"
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (tracker.exists() and tracker.read_text().strip()
               and int(tracker.read_text()) >= KILL_AFTER):
        assert time.monotonic() < deadline, cluster.job(job)
        time.sleep(0.2)
    killed = cluster.kill_node("n2")
    t_kill = time.monotonic()
    assert killed
    # the job fails cleanly and goes back to the queue (no hang): Slurm's node-failure requeue
    # or the script's own, whichever comes first
    info = cluster.wait_job(job, {"PENDING"}, FAIL_WITHIN_S)
    failed_after = time.monotonic() - t_kill
    assert info["Restarts"] == "1", info
    print(f"job {job}: failed and requeued {failed_after:.0f} s after the node was killed")
    out = (work / f"lost-{job}.out").read_text()
    assert "Traceback" not in out, out[-4000:]
    # the head's Ray stopped at once, not after Ray's drain of up to 30 s (the requeue waits)
    head_log = (run / "logs" / f"slurm-{job}.0" / "ray-n1.log").read_text()
    assert "Draining for up to" not in head_log, head_log[-2000:]
    # the node comes back; Slurm holds a requeued job ~2 min before it may start again: now
    cluster.start_node("n2")
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")
    info = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"}, RUN_TIMEOUT_S)
    out = (work / f"lost-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out[-5000:]
    assert "restart 1," in out and f"logs in {run}/logs/slurm-{job}.1" in out
    resumed = re.search(r"resuming at step (\d+) from (\S+)", out)
    assert resumed, out[-4000:]
    start = int(resumed.group(1))
    assert KILL_AFTER <= start < STEPS
    # the same data order and the same numbers as the uninterrupted run after the resume
    base, lost = _rows(work / "base"), _rows(run)
    assert sorted(lost) == list(range(STEPS))
    for step in range(start, STEPS):
        assert lost[step] == base[step], step
    from safetensors.torch import load_file
    import torch
    a, b = (load_file(str(r / "final_hf" / "model.safetensors")) for r in (work / "base", run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _only_slurmd_left(cluster)


def _made_by(tag: str) -> list[str]:
    """Namespaces, links, /etc/netns entries, processes whose names carry ``tag``."""
    found = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout.split() if tag in n]
    found += [line for line in subprocess.run(["ip", "-o", "link"], capture_output=True,
                                              text=True).stdout.splitlines() if tag in line]
    if os.path.isdir("/etc/netns"):
        found += [n for n in os.listdir("/etc/netns") if tag in n]
    return found


def test_a_killed_sessions_cluster_is_removed_by_the_next(tmp_path):
    """A harness process killed with SIGKILL leaves its cluster; the next one removes it (the
    processes in its namespaces, munged, namespaces, bridge, files)."""
    ready = tmp_path / "ready.json"
    code = ("import json, sys, time\n"
            "from tests.launch.slurm_cluster import SlurmCluster\n"
            "c = SlurmCluster(nodes=1)\n"
            "c.start()\n"
            f"open({str(ready)!r}, 'w').write(json.dumps(c.made | {{'tag': c.tag}}))\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    made = json.loads(ready.read_text())
    proc.kill()
    proc.wait()
    assert _made_by(made["tag"]) and os.path.isdir(made["workdir"])   # left behind
    from tests.launch.slurm_cluster import remove_leftovers
    remove_leftovers()
    assert _made_by(made["tag"]) == [] and not os.path.exists(made["workdir"])
    for pid in made["pids"]:
        assert not pathlib.Path(f"/proc/{pid}").exists() or \
            "Z" in pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
