"""Run directories are never silently reused: a new run into a directory that holds one is
refused (or, asked, the old run is moved aside), a resumed run must keep the settings that shape
what it learns, and the demo takes a fresh directory each time."""
from __future__ import annotations

import os
import re
import stat

import yaml

from moe_rl.config import Config, ConfigError, dump_config, load_yaml
from moe_rl.config.moved_keys import moved_flat
from moe_rl.config.schema import CheckpointConfig
from moe_rl.errors import UserError
from moe_rl.owned_dirs import check_claimable

# what a run writes into logging.dir first; any of them means the directory holds a run
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "tb", "checkpoints")

# keys a resumed run may change: how long it runs, where and how it is placed, saved, logged and
# served, and time limits; every other key shapes what the run learns and must match the
# checkpoint's (or be named with --allow-change)
RESUMABLE = {
    "trainer.steps", "trainer.checkpoint.interval", "trainer.checkpoint.interval_minutes",
    "trainer.checkpoint.keep", "trainer.checkpoint.dir", "trainer.checkpoint.export_hf",
    "trainer.checkpoint.export_hf_interval", "trainer.checkpoint.stop_grace_s",
    "trainer.parallel.tensor",
    "trainer.parallel.pipeline", "trainer.parallel.expert", "trainer.parallel.context",
    "trainer.parallel.sequence", "trainer.recompute_activations", "trainer.experts",
    "model.path",
    "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",   # same gradient
    "trainer.pack_sequences",
    "rollout.num_servers",
    "rollout.sglang.tp_size", "rollout.sglang.dp_size",
    "rollout.sglang.ep_size", "rollout.sglang.mem_fraction_static", "rollout.sglang.python",
    "data.reward_timeout_s", "data.environment_timeout_s", "data.max_failed_reward_batches",
    "trainer.warmup.steps", "trainer.warmup.lr",   # used before step 0 only
    "data.reward_service.timeout_s", "data.reward_service.max_concurrency",
    "data.reward_service.batch_size", "data.reward_service.max_retries",
    "data.reward_service.api_key_env",
}
RESUMABLE_PREFIXES = ("cluster.", "logging.", "model.init.", "eval.",   # eval never trains
                      "rollout.servers.")


def checkpoint_dir(checkpoint: CheckpointConfig, log_dir: str) -> str:
    """Where the run's checkpoints go (``trainer.checkpoint.dir`` or
    ``<logging.dir>/checkpoints``)."""
    return checkpoint.dir or os.path.join(log_dir, "checkpoints")


def holds_run(path: str) -> bool:
    """Whether ``path`` holds (part of) a run: its config, metrics, events or checkpoints."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m))
                                       for m in RUN_MARKERS)


def _has_checkpoints(path: str) -> bool:
    return os.path.isdir(path) and any(n.startswith("iter_") for n in os.listdir(path))


def _aside(path: str) -> str:
    """The first free ``<path>.old-N``."""
    n = 1
    while os.path.exists(f"{path}.old-{n}"):
        n += 1
    return f"{path}.old-{n}"


def prepare(cfg: Config, resume: bool, overwrite: bool) -> None:
    """Check that a new run may write into ``logging.dir`` (and a separate
    ``trainer.checkpoint.dir``). A resumed run continues the run there. Otherwise a directory
    that holds a run is refused (UserError naming ``--resume``, a new ``logging.dir`` and
    ``--overwrite``) or, with ``overwrite``, moved aside to ``<dir>.old-N`` (said on stdout)."""
    run, ckpt = cfg.logging.dir, checkpoint_dir(cfg.trainer.checkpoint, cfg.logging.dir)
    for key, path in (("logging.dir", run), ("trainer.checkpoint.dir", ckpt)):
        _check_writable_dir(key, path)
        check_contents(key, path)
    if resume:
        return
    _check_exports_free(run)
    taken = [p for p in (run,) if holds_run(p)]
    if cfg.trainer.checkpoint.dir and _has_checkpoints(ckpt):
        taken.append(ckpt)
    if not taken:
        return
    if not overwrite:
        what = " and ".join(taken)
        raise UserError(
            f"logging.dir: {what} already holds a run; continue it with --resume, start a new "
            f"one with logging.dir=NEW_DIR, or pass --overwrite to move the old run aside to "
            f"{_aside(taken[0])} (nothing is deleted)")
    for path in taken:
        if path != run and _inside(path, run) and run in taken:
            continue   # moved aside with the run that holds it
        dest = _aside(path)
        os.replace(path, dest)
        print(f"moved the previous run in {path} aside to {dest}", flush=True)


# the folders a run exports into under logging.dir (weights/vN, weights/restart, hf/iter_N,
# final_hf, final_hf_raw): one of these names holding files moe_rl did not write is refused
# before the run starts, not when the export comes
_EXPORT_NAME = re.compile(r"(weights/(v\d+|restart)|hf/iter_\d+|final_hf|final_hf_raw)")


def _check_exports_free(run: str) -> None:
    """UserError when a folder a new run would export into holds files moe_rl did not write."""
    candidates = [os.path.join(run, "final_hf"), os.path.join(run, "final_hf_raw")]
    for sub in ("weights", "hf"):
        folder = os.path.join(run, sub)
        if os.path.isdir(folder):
            candidates += [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
    for path in candidates:
        if _EXPORT_NAME.fullmatch(os.path.relpath(path, run).replace(os.sep, "/")):
            try:
                check_claimable(path)
            except UserError as exc:
                raise UserError(f"logging.dir: {exc}") from None


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_contents(key: str, path: str) -> None:
    """UserError naming ``key`` and the entry when anything inside the folder ``path`` is a
    symbolic link or neither a file nor a folder (a FIFO, a device): a run writes, rewrites and
    deletes only inside its own directory, and reads only files it wrote (a linked
    metrics.jsonl was rewritten at its target, a linked weights/ took exports and lost another
    run's; one on /dev/zero was read until memory ran out). The folder itself may be a link."""
    if not os.path.isdir(path):
        return
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(folder, name)
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                raise UserError(f"{key}: {entry} is a symbolic link (to {os.readlink(entry)}); a "
                                f"run writes only inside its own directory: put the file or "
                                f"folder itself there, or remove the link")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise UserError(f"{key}: {entry} is neither a file nor a folder; a run reads "
                                f"and writes only its own files: remove it")


def _check_writable_dir(key: str, path: str) -> None:
    """``path`` is, or can become, a folder this process writes in (UserError naming ``key``):
    not a file, not a link to nothing, on a writable filesystem."""
    if os.path.islink(path) and not os.path.exists(path):
        raise UserError(f"{key}: {path} is a symbolic link to {os.readlink(path)}, which does "
                        f"not exist")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{key}: {path} is a file, not a folder")
    probe = path
    while not os.path.exists(probe):   # the nearest existing folder it would be made in
        probe = os.path.dirname(os.path.abspath(probe))
    if not os.access(probe, os.W_OK):
        raise UserError(f"{key}: {path} cannot be written ({probe} is read-only here)")


def fresh(path: str) -> str:
    """``path`` when it holds no run, else the first ``<path>-N`` (N >= 2) that holds none."""
    n, out = 2, path
    while holds_run(out):
        out, n = f"{path}-{n}", n + 1
    return out


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes(saved_config: str, cfg: Config) -> list[tuple[str, object, object]]:
    """``(key, saved value, this run's value)`` for every key that shapes the run and differs
    between the config saved at ``saved_config`` (a checkpoint's ``config.yaml``) and ``cfg``."""
    with open(saved_config, encoding="utf-8") as fh:
        try:
            saved = moved_flat(_flat(load_yaml(fh) or {}))   # a run saved with old key names
        except ConfigError as exc:
            raise UserError(f"{saved_config}: {exc}") from None
    now = _flat(yaml.safe_load(dump_config(cfg)))
    return [(k, saved.get(k), v) for k, v in now.items()
            if k in saved and saved[k] != v and k not in RESUMABLE
            and not k.startswith(RESUMABLE_PREFIXES)]


def check_resume(checkpoint: str, cfg: Config, allowed: tuple[str, ...] = ()) -> None:
    """UserError naming the first key that differs between checkpoint ``checkpoint``'s config and
    ``cfg`` (and is not in ``allowed``), with the command that resumes with the saved config;
    the ``allowed`` changes that differ are said on stdout."""
    changes = resume_changes(os.path.join(checkpoint, "config.yaml"), cfg)
    refused = [c for c in changes if c[0] not in allowed]
    if refused:
        key, old, new = refused[0]
        more = f" (and {', '.join(c[0] for c in refused[1:])})" if refused[1:] else ""
        raise UserError(
            f"{key}: the run in {checkpoint} was trained with {old!r}, this command gives "
            f"{new!r}{more}; resume with the saved config (`moe-rl train --config "
            f"{os.path.join(cfg.logging.dir, 'config.yaml')} --resume`), start a new run (a new "
            f"logging.dir), or accept the change with --allow-change {key}")
    for key, old, new in changes:
        print(f"resuming with {key} changed: {old!r} -> {new!r} (--allow-change)", flush=True)
