"""Checks of one node before a run (``moe-rl doctor``): the Python, the working directory (no
folder hiding an installed package), torch and CUDA, the GPUs the config asks for, megatron-core,
Transformer Engine and the rollout engine's environment against the versions moe_rl supports,
NCCL, the free disk under ``logging.dir``, a shared filesystem for multi-node runs, and the
engine ports. Each check returns a :class:`Finding` with the fix when something is wrong."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import sys
from dataclasses import asdict, dataclass

from moe_rl.config import Config
from moe_rl.config.schema import ClusterConfig, ModelConfig, ParallelConfig, ServersConfig
from moe_rl.config.supported_versions import in_range, supported_range
from moe_rl.safe_path import describe, shadowed_packages

# filesystems every node of a cluster sees (read from /proc/mounts); a local one under a
# multi-node run's logging.dir leaves the other nodes without checkpoints and weights
SHARED_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "cifs",
                      "smb3", "glusterfs", "fuse.glusterfs", "fuse.weka", "wekafs", "pvfs2",
                      "orangefs", "fuse.juicefs", "virtiofs", "9p"}
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs",
                     "vfat", "ramfs"}
# a checkpoint holds float32 master weights and Adam's two moments (12 bytes a parameter); an
# exported HF model 2 bytes a parameter (bfloat16) or 4 (float32)
CHECKPOINT_BYTES_PER_PARAM = 12
PORT_WINDOW = 200   # servers take free ports from rollout.servers.base_port up: the check's reach


@dataclass
class Finding:
    check: str
    status: str   # ok | warn | fail | skip
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _gpu_run(cluster: ClusterConfig) -> bool:
    return cluster.gpus_per_node > 0


def check_python(version: tuple[int, int, int] | None = None) -> Finding:
    v = tuple(version or sys.version_info[:3])
    text = f"{'.'.join(map(str, v))} ({sys.executable})"
    if v < (3, 11):
        return Finding("python", "fail", text, "moe_rl needs Python >= 3.11")
    return Finding("python", "ok", text)


def check_torch(cluster: ClusterConfig) -> Finding:
    import torch
    cuda = torch.version.cuda
    text = f"torch {torch.__version__}, CUDA build {cuda or 'none'}"
    if not _gpu_run(cluster):
        return Finding("torch", "ok", text + "; CPU run (cluster.gpus_per_node=0)")
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if cuda is None
               else "the CUDA driver or devices are not reachable")
        return Finding("torch", "fail", f"{text}: CUDA unavailable ({why}) but "
                       f"cluster.gpus_per_node={cluster.gpus_per_node}",
                       "install a CUDA build of torch matching the driver (nvidia-smi shows its "
                       "CUDA version), or set cluster.gpus_per_node=0 for a CPU run")
    return Finding("torch", "ok", text)


def check_gpus(cluster: ClusterConfig) -> Finding:
    import torch
    want = cluster.gpus_per_node
    if want == 0:
        return Finding("gpus", "skip", "CPU run (cluster.gpus_per_node=0)")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [f"{torch.cuda.get_device_name(i)} "
             f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
             for i in range(have)]
    text = f"{have} visible: {', '.join(names) or 'none'}"
    if have < want:
        return Finding("gpus", "fail", f"{text}; the config asks for cluster.gpus_per_node="
                       f"{want}", f"set cluster.gpus_per_node={have} (and the parallel sizes "
                       f"to fit), or check CUDA_VISIBLE_DEVICES and the job's GPU allocation")
    if have > want:
        return Finding("gpus", "warn", f"{text}; the config uses {want}",
                       f"cluster.gpus_per_node={have} would use them all")
    return Finding("gpus", "ok", text)


def check_package(check: str, module: str, dist: str, *, required: bool,
                  extra: str | None = None, install: str = "") -> Finding:
    """``module`` importable and its distribution ``dist`` in moe_rl's supported range."""
    spec = supported_range(dist, extra)
    wanted = f" (moe_rl supports {dist}{spec})" if spec else ""
    if importlib.util.find_spec(module) is None:
        return Finding(check, "fail" if required else "warn", f"{dist} is not installed{wanted}",
                       install or f"pip install '{dist}{spec or ''}'")
    version = importlib.metadata.version(dist)
    if not in_range(version, spec):
        return Finding(check, "fail", f"{dist} {version} is outside moe_rl's range {spec}",
                       f"pip install '{dist}{spec}'")
    return Finding(check, "ok", f"{dist} {version}" + ("" if spec else
                                                        " (moe_rl not installed: range unchecked)"))


def check_transformer_engine(cluster: ClusterConfig, parallel: ParallelConfig) -> Finding:
    if not _gpu_run(cluster):
        return Finding("transformer-engine", "skip", "CPU run: megatron's local layers")
    found = check_package("transformer-engine", "transformer_engine", "transformer-engine",
                          required=parallel.context > 1, extra="te",
                          install="pip install 'moe_rl[te]' (Transformer Engine builds against "
                                  "the CUDA toolkit: use the NGC PyTorch image's own TE)")
    if found.status == "warn":
        found.detail += "; megatron's local layers are used (slower; context parallel needs TE)"
    return found


def check_engine(cfg: Config) -> Finding:
    """The rollout engine's own environment (SGLang: its interpreter, version and flags)."""
    from moe_rl.engines.factory import engine_kind
    status, detail, fix = engine_kind(cfg).check_node()
    return Finding("engine", status, detail, fix)


def check_collectives(cluster: ClusterConfig) -> Finding:
    import torch
    import torch.distributed as dist
    if not _gpu_run(cluster):
        ok = dist.is_available() and dist.is_gloo_available()
        return Finding("collectives", "ok" if ok else "fail",
                       f"gloo {'available' if ok else 'missing'} (CPU run)",
                       "" if ok else "install a torch build with torch.distributed (gloo)")
    if not (dist.is_available() and dist.is_nccl_available()):
        return Finding("collectives", "fail", "this torch has no NCCL backend",
                       "install a CUDA build of torch from pytorch.org (it ships NCCL)")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Finding("collectives", "ok", f"NCCL {version}")


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _model_params(model_path: str) -> int | None:
    """Parameters of the safetensors under ``model_path`` (their headers only); ValueError
    naming a file that is not a readable safetensors file (a FIFO there is never opened)."""
    if not os.path.isdir(model_path):
        return None
    from safetensors import SafetensorError, safe_open
    total = 0
    for name in sorted(os.listdir(model_path)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_path, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: not a regular file")
        try:
            with safe_open(path, "np") as fh:
                for key in fh.keys():
                    n = 1
                    for d in fh.get_slice(key).get_shape():
                        n *= d
                    total += n
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    return total or None


def check_disk(log_dir: str, model: ModelConfig, keep: int) -> Finding:
    """Free space under logging.dir for ``trainer.checkpoint.keep`` + 1 checkpoints (one is
    written before the oldest goes) and the HF exports."""
    where = _existing(log_dir)
    free = shutil.disk_usage(where).free
    try:
        params = _model_params(model.path)
    except ValueError as exc:
        return Finding("disk", "fail", f"model.path: {exc}", "replace the damaged file with "
                       "the checkpoint's own")
    if params is None:
        return Finding("disk", "ok", f"{free / 2**30:.1f} GiB free at {where} (model.path has "
                       f"no safetensors yet: need unknown)")
    export = 4 if model.dtype == "float32" else 2
    need = params * ((keep + 1) * CHECKPOINT_BYTES_PER_PARAM + 2 * export)
    text = (f"{free / 2**30:.1f} GiB free at {where}; {keep + 1} "
            f"checkpoints and 2 exports of {params / 1e9:.3g}B parameters need "
            f"~{need / 2**30:.1f} GiB")
    if free < need:
        return Finding("disk", "fail", text, "free space there, point logging.dir elsewhere, or "
                       "lower trainer.checkpoint.keep")
    return Finding("disk", "ok", text)


def filesystem_type(path: str, mounts_file: str = "/proc/mounts") -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    path = os.path.realpath(_existing(path))
    best, kind = "", "unknown"
    with open(mounts_file, encoding="utf-8") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


def check_shared_filesystem(cluster: ClusterConfig, log_dir: str,
                            mounts_file: str = "/proc/mounts") -> Finding:
    if cluster.num_nodes == 1:
        return Finding("shared-filesystem", "skip", "one node (cluster.num_nodes=1)")
    kind = filesystem_type(log_dir, mounts_file)
    text = f"logging.dir={log_dir} is on {kind}"
    fix = ("put logging.dir (and model.path) on a filesystem every node mounts (NFS, Lustre, "
           "GPFS, ...): checkpoints and disk weight syncs are read from other nodes")
    if kind in LOCAL_FILESYSTEMS:
        return Finding("shared-filesystem", "fail", f"{text}, a local filesystem, with "
                       f"cluster.num_nodes={cluster.num_nodes}", fix)
    if kind not in SHARED_FILESYSTEMS:
        return Finding("shared-filesystem", "warn", f"{text}: not known as shared", fix)
    return Finding("shared-filesystem", "ok", text)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(servers: ServersConfig, num_servers: int) -> Finding:
    """The engine servers take free ports from rollout.servers.base_port up on
    rollout.servers.host."""
    host, base = servers.host, servers.base_port
    fix = "set rollout.servers.host to an address of this node (127.0.0.1 for one node)"
    try:
        socket.getaddrinfo(host, base, type=socket.SOCK_STREAM)
    except OSError as exc:
        return Finding("ports", "fail", f"rollout.servers.host {host!r} does not resolve ({exc})",
                       fix)
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError as exc:
            return Finding("ports", "fail", f"rollout.servers.host {host!r} is not an address "
                           f"of this node ({exc.strerror})", fix)
    window = range(base, min(base + PORT_WINDOW, 65536))
    busy = [p for p in window if not _port_free(host, p)]
    free = len(window) - len(busy)
    if free < num_servers:
        return Finding("ports", "fail", f"{free} free of ports {base}-{window[-1]} on {host} for "
                       f"{num_servers} servers", "set rollout.servers.base_port to a free range")
    if base in busy:
        return Finding("ports", "warn", f"rollout.servers.base_port {base} on {host} is in use "
                       f"({len(busy)} busy of the next {len(window)}); the servers skip to "
                       f"free ones", "another server may be left from an earlier run")
    return Finding("ports", "ok", f"{host}:{base} free ({len(busy)} busy of the next "
                   f"{len(window)})")


def check_working_directory(folder: str | None = None) -> Finding:
    """No folder of the directory commands start in hides an installed package (``python -m``
    and pytest put it first on ``sys.path``; moe_rl's own processes keep it off)."""
    folder = folder or os.getcwd()
    found = shadowed_packages(folder)
    if found:
        return Finding("working-directory", "fail", describe(found, folder),
                       "start from another directory, or rename the folder (or remove its "
                       "__init__.py)")
    return Finding("working-directory", "ok", f"{folder}: no folder hides an installed package")


def check_model(cfg: Config, named: bool = True) -> Finding:
    """``model.path`` holds a checkpoint on this node (its config.json); not checked when the
    run's model was not named (doctor without --config or model.path)."""
    path = cfg.model.path
    if os.path.isfile(os.path.join(path, "config.json")):
        weights = [n for n in os.listdir(path) if n.endswith(".safetensors")]
        return Finding("model", "ok", f"{path}: config.json, {len(weights)} safetensors file(s)")
    if not named:
        return Finding("model", "skip", f"no --config: the default model.path ({path}) is not "
                       f"checked")
    return Finding("model", "fail", f"model.path={path}: no checkpoint (config.json) on this "
                   f"node", "copy the checkpoint to this path on every node (or put it on a "
                   "shared filesystem), or write the tiny model with `moe-rl init-model "
                   "--config FILE`")


def run_checks(cfg: Config, model_named: bool = True) -> list[Finding]:
    """Every check, in the order a node is set up (``model_named``: the run's model.path was
    given, so a missing checkpoint fails)."""
    return [check_python(), check_working_directory(), check_torch(cfg.cluster),
            check_gpus(cfg.cluster),
            check_model(cfg, model_named),
            check_package("megatron-core", "megatron.core", "megatron-core", required=True),
            check_package("transformers", "transformers", "transformers", required=True),
            check_transformer_engine(cfg.cluster, cfg.trainer.parallel), check_engine(cfg),
            check_collectives(cfg.cluster),
            check_disk(cfg.logging.dir, cfg.model, cfg.trainer.checkpoint.keep),
            check_shared_filesystem(cfg.cluster, cfg.logging.dir),
            check_ports(cfg.rollout.servers, cfg.rollout.num_servers)]
