"""Folders moe_rl writes and may later replace or remove carry a mark, written when moe_rl
creates them and naming the folder it was written in (its inode and its name): a folder without
the mark, or a copy of one under another name (``cp -r weights/v3 weights/keep`` carries the
mark into a new folder), is never removed, and files moe_rl did not write are never deleted to
make room (an export into a folder that holds them is refused). A folder moe_rl renamed keeps
its inode, a run directory copied whole keeps its folders' names: both stay moe_rl's. Files
moe_rl rewrites are replaced whole (:func:`write_atomic`)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time

from moe_rl.errors import UserError

MARK = ".written_by_moe_rl"
MARK_MAX_BYTES = 4096


def owned(path: str) -> bool:
    """Whether moe_rl created ``path``: a folder (not a link) holding the mark as a regular
    file, written for this folder (its inode, or its name: a mark naming neither came with a
    copy under another name; a mark of an earlier release names none and is trusted)."""
    mark = os.path.join(path, MARK)
    try:
        if os.path.islink(path) or not stat.S_ISREG(os.lstat(mark).st_mode):
            return False
        with open(mark, encoding="utf-8") as fh:
            written = json.loads(fh.read(MARK_MAX_BYTES))
    except (OSError, ValueError):
        return False
    if not isinstance(written, dict):
        return False
    if "inode" not in written and "name" not in written:
        return True
    here = os.path.basename(os.path.normpath(path))
    return written.get("inode") == os.lstat(path).st_ino or written.get("name") == here


def check_claimable(path: str) -> None:
    """Refuse (UserError) a ``path`` that holds files moe_rl did not write."""
    if os.path.isdir(path) and not owned(path) and os.listdir(path):
        held = ", ".join(sorted(os.listdir(path))[:3])
        raise UserError(f"{path}: holds files moe_rl did not write ({held}); moe_rl writes only "
                        f"into new or empty folders or its own: move them or choose another "
                        f"logging.dir / output folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path}: is a file; moe_rl needs a folder there")


def claim(path: str) -> str:
    """Create ``path`` for moe_rl's output (or take back one it made earlier) and mark it;
    refused (UserError) when it holds files moe_rl did not write."""
    check_claimable(path)
    os.makedirs(path, exist_ok=True)
    if not owned(path):
        write_atomic(os.path.join(path, MARK), json.dumps(
            {"pid": os.getpid(), "time": time.time(), "inode": os.lstat(path).st_ino,
             "name": os.path.basename(os.path.normpath(path))}))
    return path


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written beside it first, then renamed over
    it, so a stop at any moment leaves the old content or the new, and a link at ``path`` is
    replaced, never written through."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_owned(path: str) -> bool:
    """Remove ``path`` if moe_rl made it (True); leave anything else untouched (False)."""
    if not owned(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
