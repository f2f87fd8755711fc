"""A real Slurm cluster on this machine: one controller and N compute nodes, each node a network
namespace of its own (its own address on a bridge this harness makes, its own hostname through a
UTS namespace, its own /etc/hosts and /tmp/ray through a mount namespace), one munged shared by
all (as a shared munge key would be), slurmctld and slurmd from Debian's slurm-wlm.

Needs root (namespaces, a bridge). Everything made is recorded and removed by :meth:`stop` (the
processes in the namespaces, the daemons, the namespaces, the bridge, /etc/netns entries, the
work directory); :func:`remove_leftovers` removes what a killed earlier session left.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PREFIX = "mrlc"                         # every namespace, bridge and veth this harness makes
REGISTRY = Path("/run/moe-rl-cluster")  # one JSON per live cluster: what to remove


def _sh(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _netns_pids(ns: str) -> list[int]:
    res = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split()]


def _free_subnet() -> str:
    """A 10.213.X.0/24 no interface of this machine uses."""
    used = _sh("ip", "-4", "-o", "addr").stdout
    for _ in range(200):
        net = f"10.213.{random.randint(1, 254)}"
        if f" {net}." not in used:
            return net
    raise RuntimeError("no free 10.213.X.0/24 subnet")


def remove_leftovers() -> None:
    """Remove what a cluster whose owning process is gone left behind."""
    if not REGISTRY.is_dir():
        return
    for rec in REGISTRY.glob("*.json"):
        try:
            made = json.loads(rec.read_text())
        except (OSError, ValueError):
            rec.unlink(missing_ok=True)
            continue
        if not _alive(made["owner"]):
            _remove(made)
            rec.unlink(missing_ok=True)


def _remove(made: dict) -> None:
    for ns in made.get("namespaces", []):
        for _ in range(3):
            pids = _netns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        _sh("ip", "netns", "delete", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for pid in made.get("pids", []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if made.get("bridge"):
        _sh("ip", "link", "delete", made["bridge"], check=False)
    if made.get("workdir"):
        shutil.rmtree(made["workdir"], ignore_errors=True)
    for made_dir in made.get("dirs", []):   # made for this cluster; removed when left empty
        try:
            os.rmdir(made_dir)
        except OSError:
            pass


class SlurmCluster:
    """``with SlurmCluster(nodes=2, cpus=2) as c:`` a running cluster; ``c.env`` is the
    environment for sbatch/squeue/scontrol; node names ``c.nodes`` (n1, n2, ...)."""

    def __init__(self, nodes: int = 2, cpus: int = 2, slurmd_timeout_s: int = 10):
        self.tag = f"{PREFIX}{random.randrange(16**4):04x}"
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.slurmd_timeout_s = slurmd_timeout_s
        self.net = _free_subnet()
        self.workdir = Path(tempfile.mkdtemp(prefix="moe-rl-cluster-"))
        self.workdir.chmod(0o755)          # munged checks every directory above its socket
        self.bridge = f"{self.tag}br"
        self.addresses = {"ctl": f"{self.net}.10",
                          **{n: f"{self.net}.{11 + i}" for i, n in enumerate(self.nodes)}}
        self.made = {"owner": os.getpid(), "namespaces": [], "pids": [], "bridge": None,
                     "workdir": str(self.workdir), "dirs": []}
        self.conf = self.workdir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _record(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.tag}.json").write_text(json.dumps(self.made))

    def ns(self, node: str) -> str:
        """The network namespace of ``node`` (or of the controller, "ctl")."""
        return f"{self.tag}-{node}"

    def start(self) -> None:
        remove_leftovers()
        self._record()
        self._network()
        self._munge()
        self._write_conf()
        self._spawn("ctl", "mrlctl", ["slurmctld", "-i"])
        self._wait_for(lambda: _sh("scontrol", "ping", env=self.env, check=False)
                       .stdout.count("UP") >= 1, 30, "slurmctld to answer")
        for node in self.nodes:
            self.start_node(node)
        self._wait_for(self._all_idle, 60, "every node to be idle")

    def stop(self) -> None:
        """Stop every process in the namespaces and the daemons; remove all that was made."""
        _remove(self.made)
        (REGISTRY / f"{self.tag}.json").unlink(missing_ok=True)
        try:
            REGISTRY.rmdir()
        except OSError:
            pass

    def _mkdir(self, path: Path) -> None:
        """``path`` (a directory outside the work directory), removed at stop if made here and
        empty then."""
        if not path.exists():
            path.mkdir(parents=True)
            self.made["dirs"].insert(0, str(path))
            self._record()

    # --- parts -----------------------------------------------------------------------------
    def _network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made["bridge"] = self.bridge
        self._record()
        _sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {'mrlctl' if name == 'ctl' else name}\n"
            for name, addr in self.addresses.items())
        for i, name in enumerate(["ctl", *self.nodes]):
            ns = self.ns(name)
            _sh("ip", "netns", "add", ns)
            self.made["namespaces"].append(ns)
            self._record()
            veth = f"{self.tag}v{i}"
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "route", "add", "default", "via", f"{self.net}.1")
            self._mkdir(Path("/etc/netns"))
            etc = Path(f"/etc/netns/{ns}")
            etc.mkdir()
            (etc / "hosts").write_text(hosts)
            (self.workdir / "raytmp" / name).mkdir(parents=True, exist_ok=True)

    def _munge(self) -> None:
        d = self.workdir / "munge"
        d.mkdir(mode=0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = d / "munge.sock"
        _sh("munged", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'seed'}")
        self.made["pids"].append(int((d / "munged.pid").read_text()))
        self._record()

    def _write_conf(self) -> None:
        w = self.workdir
        for sub in ("state", "log", "spool"):
            (w / sub).mkdir(exist_ok=True)
        nodes = "".join(f"NodeName={n} NodeAddr={self.addresses[n]} CPUs={self.cpus} "
                        f"State=UNKNOWN\n" for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=moerl
SlurmctldHost=mrlctl({self.addresses['ctl']})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd.%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
MessageTimeout=5
KillWait=10
InactiveLimit=0
JobRequeue=1
{nodes}PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, hostname: str, argv: list[str]) -> None:
        """Start a daemon inside ``name``'s namespaces: its network, a UTS namespace with its
        hostname, a mount namespace with its /etc/hosts and /tmp/ray."""
        self._mkdir(Path("/tmp/ray"))
        ns = self.ns(name)
        script = (f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && "
                  f"mount --bind {self.workdir / 'raytmp' / name} /tmp/ray && "
                  f"hostname {hostname} && exec {' '.join(argv)}")
        _sh("nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts",
            "--propagation", "private", "sh", "-c", script, env=self.env)

    def _all_idle(self) -> bool:
        out = _sh("sinfo", "-h", "-N", "-o", "%N %t", env=self.env, check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    @staticmethod
    def _wait_for(ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.5)

    # --- what tests do with it ------------------------------------------------------------
    def start_node(self, node: str) -> None:
        """Start (or restart, after :meth:`kill_node`) ``node``'s slurmd."""
        (self.workdir / "spool" / node).mkdir(parents=True, exist_ok=True)
        self._spawn(node, node, ["slurmd", "-N", node])

    def kill_node(self, node: str) -> list[int]:
        """The node dies: SIGKILL to every process in its namespace (slurmd, the job's steps,
        Ray, trainer ranks, engines). Returns the pids killed."""
        pids = _netns_pids(self.ns(node))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def processes(self, node: str) -> list[str]:
        """``"pid command line"`` of every process running in ``node``'s namespace."""
        out = []
        for pid in _netns_pids(self.ns(node)):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            out.append(f"{pid} {cmd.strip()}")
        return out

    def sbatch(self, *args: str, cwd: str | os.PathLike, env: dict | None = None) -> int:
        """Submit a job (``sbatch --parsable ARGS``); its job id."""
        res = _sh("sbatch", "--parsable", *args, cwd=cwd, env={**self.env, **(env or {})})
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, NodeList, ...)."""
        res = _sh("scontrol", "show", "job", "-o", str(job_id), env=self.env, check=False)
        fields = {}
        for part in res.stdout.split():
            if "=" in part:
                k, v = part.split("=", 1)
                fields[k] = v
        return fields

    def wait_job(self, job_id: int, states: set[str], timeout_s: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; its fields."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout_s} s: "
                                   f"{info.get('JobState')} ({info.get('Reason')})")
            time.sleep(1)

    def scontrol(self, *args: str) -> str:
        return _sh("scontrol", *args, env=self.env).stdout
