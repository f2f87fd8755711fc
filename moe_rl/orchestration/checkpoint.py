"""Run checkpoints: one directory per saved step (``iter_0000100/``), written under a temporary
name and renamed when complete, then the tracker file (``latest_checkpointed_iteration.txt``)
replaced atomically; the last ``trainer.checkpoint.keep`` are kept. A directory holds the
trainer state (``trainer/dist``: weights, Adam state and EMA as megatron-core ``dist_checkpointing``
shards that any parallel layout can load; ``trainer/rank{r}.pt``: each rank's scheduler, counters
and RNG states), the loop state (step, data sampler), the resolved config, the model and layout
that wrote it, and a manifest of every file with its size and SHA-256, which a load checks
first (a truncated, damaged, edited or missing file is refused naming it; ``--resume`` then takes
the previous complete step and says so). A step saved again (after a resume) replaces its
directory only once the new one is complete: the old one is set aside and removed after."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

from moe_rl.config import Config, dump_config
from moe_rl.errors import UserError
from moe_rl.owned_dirs import check_claimable, claim, owned, remove_owned

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
LOOP_STATE = "loop_state.json"
_ITER = re.compile(r"^iter_(\d{7})$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is incomplete, corrupted or from another model or layout."""


def iteration_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"iter_{step:07d}")


def _layout(cfg: Config) -> dict:
    """What a checkpoint records of the run that wrote it: the model, the optimizer's dtype and
    whether it has an EMA (a loading run must share them) and the parallel layout (it may
    differ: the state is resharded)."""
    t = cfg.trainer
    with open(os.path.join(cfg.model.path, "config.json"), encoding="utf-8") as fh:
        model = json.load(fh)
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts",
            "n_routed_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "num_attention_heads", "num_key_value_heads")
    return {"model": {k: model[k] for k in keys if k in model},
            "optimizer_dtype": cfg.model.dtype, "ema": t.ema.decay is not None,
            "parallel": {"trainer_workers": cfg.cluster.trainer_workers,
                         "tensor_parallel": t.parallel.tensor,
                         "expert_parallel": t.parallel.expert,
                         "pipeline_parallel": t.parallel.pipeline}}


def save(trainers, loop_state: dict, cfg: Config, ckpt_dir: str, step: int) -> str:
    """Write the checkpoint of ``step`` (every trainer rank's file, the loop state, the config,
    the manifest), publish it, prune old ones; returns its directory. An error (for example no
    space left) leaves the previous checkpoint and the tracker as they were and is raised as a
    CheckpointError saying so (``moe-rl train`` stops with it, exit 2)."""
    final = iteration_dir(ckpt_dir, step)
    tmp = final + ".tmp"
    remove_owned(tmp)   # a save cut short earlier
    claim(tmp)
    if os.path.isdir(final) and not _is_checkpoint(final):
        check_claimable(final)   # a folder of that name that moe_rl did not write: refused
    try:
        trainers.save(os.path.join(tmp, "trainer"))
        _write_json(os.path.join(tmp, LOOP_STATE), loop_state)
        _write_json(os.path.join(tmp, "layout.json"), _layout(cfg))
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as fh:
            fh.write(dump_config(cfg))
        _write_json(os.path.join(tmp, MANIFEST), {"step": step, "files": _file_records(tmp)})
        replaced = final + ".old"   # a step saved again: set aside, removed once replaced (a
        _remove_checkpoint(replaced)   # kill in between: latest() takes it back)
        if os.path.isdir(final):
            os.replace(final, replaced)
        os.replace(tmp, final)
        _remove_checkpoint(replaced)
        tracker_tmp = os.path.join(ckpt_dir, TRACKER + ".tmp")
        with open(tracker_tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{step}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tracker_tmp, os.path.join(ckpt_dir, TRACKER))
    except Exception as exc:   # from a trainer actor too (its error's last line says what)
        remove_owned(tmp)
        cause = [line for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
        raise CheckpointError(f"saving step {step} to {final} failed: {cause[-1].strip()}; "
                              f"the previous checkpoint ({latest(ckpt_dir) or 'none'}) and "
                              f"the tracker are untouched") from exc
    except BaseException:
        remove_owned(tmp)
        raise
    _prune(ckpt_dir, cfg.trainer.checkpoint.keep, step)
    return final


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _is_checkpoint(path: str) -> bool:
    """A folder moe_rl saved: marked when its save began, or (saved before the mark) holding
    the manifest every save writes."""
    return owned(path) or os.path.isfile(os.path.join(path, MANIFEST))


def _remove_checkpoint(path: str) -> None:
    if _is_checkpoint(path):
        shutil.rmtree(path, ignore_errors=True)


def _prune(ckpt_dir: str, keep: int, latest: int) -> None:
    """Remove the checkpoints before the newest ``keep`` and the leftovers of saves cut short:
    only folders moe_rl saved (a user's folder of the same name stays)."""
    steps = sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(ckpt_dir)) if m)
    for s in steps[:-keep] if keep else []:
        if s != latest:
            _remove_checkpoint(iteration_dir(ckpt_dir, s))
    for name in os.listdir(ckpt_dir):   # leftovers of saves interrupted by a crash
        if name.endswith(".tmp") and name.startswith("iter_"):
            remove_owned(os.path.join(ckpt_dir, name))


def _restore_set_aside(ckpt_dir: str) -> None:
    """A step set aside by a save of the same step that was killed before its replacement
    moved in (``iter_N.old`` without ``iter_N``) is put back; one whose replacement landed goes."""
    for name in os.listdir(ckpt_dir):
        m = _ITER.match(name.removesuffix(".old")) if name.endswith(".old") else None
        if m is None:
            continue
        final = os.path.join(ckpt_dir, name.removesuffix(".old"))
        aside = os.path.join(ckpt_dir, name)
        if not _is_checkpoint(aside):
            continue
        if os.path.isdir(final):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def read_json(path: str):
    """A checkpoint's JSON file; CheckpointError naming it when it cannot be read (missing, not
    UTF-8, not JSON, nested too deep)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {why[:200]})") from None


_TRACKED_STEP = re.compile(r"[0-9]{1,12}")


def _tracked_step(path: str) -> int | None:
    """The step the tracker file names: plain ASCII digits (at most 12), else None."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        text = fh.read(64).decode("ascii", errors="replace").strip()
    return int(text) if _TRACKED_STEP.fullmatch(text) else None


def _manifest_problem(manifest) -> str | None:
    """What is wrong with a manifest's shape ({"step": int, "files": {relative name: {"size":
    int, "sha256": str} or a size}}), or None."""
    if not isinstance(manifest, dict):
        return f"expected a JSON object, got {type(manifest).__name__}"
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"'step': expected a non-negative integer, got {step!r:.40}"
    if not isinstance(files, dict):
        return f"'files': expected an object of file records, got {type(files).__name__}"
    for name, record in files.items():
        parts = name.replace("\\", "/").split("/")
        if not name or os.path.isabs(name) or ".." in parts:
            return f"'files': {name!r:.80} is not a file inside the checkpoint"
        size = record.get("size") if isinstance(record, dict) else record
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"'files'[{name!r:.80}]: expected a size in bytes, got {record!r:.60}"
        if isinstance(record, dict) and not isinstance(record.get("sha256", ""), str):
            return f"'files'[{name!r:.80}]: 'sha256' is not a string"
    return None


def latest(ckpt_dir: str) -> str | None:
    """The checkpoint to resume from: the one the tracker names; if that one is not complete
    (its directory lost or damaged after it was published) the newest complete one. None when
    nothing was saved."""
    path = os.path.join(ckpt_dir, TRACKER)
    if not os.path.isdir(ckpt_dir):
        return None
    _restore_set_aside(ckpt_dir)
    candidates = sorted((int(m.group(1)) for m in map(_ITER.match, os.listdir(ckpt_dir)) if m),
                        reverse=True)
    tracked = _tracked_step(path)
    if tracked is not None:
        candidates.insert(0, tracked)
    skipped = []
    for step in dict.fromkeys(candidates):
        problem = _check_files(iteration_dir(ckpt_dir, step))
        if problem is None:
            for why in skipped:   # never silently: the user learns which step was passed over
                print(f"checkpoint skipped: {why}; resuming from "
                      f"{iteration_dir(ckpt_dir, step)} instead", file=sys.stderr, flush=True)
            return iteration_dir(ckpt_dir, step)
        if os.path.isdir(iteration_dir(ckpt_dir, step)):
            skipped.append(problem)
    for why in skipped:
        print(f"checkpoint skipped: {why}", file=sys.stderr, flush=True)
    return None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_records(root: str) -> dict[str, dict]:
    """Every file under ``root``: its size and SHA-256 (hashed on several threads)."""
    paths = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    with ThreadPoolExecutor(max_workers=8) as pool:
        digests = list(pool.map(_sha256, paths))
    return {os.path.relpath(p, root): {"size": os.path.getsize(p), "sha256": h}
            for p, h in zip(paths, digests)}


def _check_files(path: str) -> str | None:
    """None when every file of the manifest is there with its size and SHA-256 (and the loop
    state names the manifest's step); else what is wrong, naming the file. Manifests written
    before SHA-256s were recorded hold sizes only, which are checked."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return f"{path}: not a complete checkpoint (no {MANIFEST})"
    try:
        manifest = read_json(manifest_path)
    except CheckpointError as exc:
        return str(exc)
    problem = _manifest_problem(manifest)
    if problem is not None:
        return f"{manifest_path}: {problem}"
    files, step = manifest["files"], manifest["step"]
    for name, record in files.items():
        file = os.path.join(path, name)
        size = record["size"] if isinstance(record, dict) else record
        if not os.path.isfile(file):
            return f"{file}: missing from the checkpoint"
        if os.path.getsize(file) != size:
            return (f"{file}: {os.path.getsize(file)} bytes, the manifest says {size} "
                    f"(truncated or corrupted)")
        if isinstance(record, dict) and _sha256(file) != record.get("sha256"):
            return f"{file}: its SHA-256 differs from the manifest's (damaged or edited)"
    try:
        loop_step = read_json(os.path.join(path, LOOP_STATE))["step"]
    except CheckpointError as exc:
        return str(exc)
    except (KeyError, TypeError) as exc:
        return f"{os.path.join(path, LOOP_STATE)}: unreadable (no step: {exc})"
    if loop_step != step:
        return (f"{os.path.join(path, LOOP_STATE)}: step {loop_step}, but the checkpoint is of "
                f"step {step}")
    return None


def verify(path: str) -> None:
    """CheckpointError naming the file when checkpoint ``path`` is not complete."""
    problem = _check_files(path)
    if problem is not None:
        raise CheckpointError(problem)


def open_checkpoint(path: str, cfg: Config) -> dict:
    """Check checkpoint ``path`` against its manifest and the run's model and layout; returns
    its loop state (CheckpointError naming the file or the difference otherwise)."""
    verify(path)
    saved = read_json(os.path.join(path, "layout.json"))
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}/layout.json: expected a JSON object")
    now = _layout(cfg)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {now[k]!r}" for k in now
            if k != "parallel" and saved.get(k) != now[k]]
    if diff:
        raise CheckpointError(f"{path}: written by another model or optimizer: " +
                              "; ".join(diff))
    if saved.get("parallel") != now["parallel"]:
        print(f"resharding {path}: written with {saved.get('parallel')}, loaded with "
              f"{now['parallel']}", flush=True)
    return read_json(os.path.join(path, LOOP_STATE))
