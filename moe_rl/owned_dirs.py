"""Folders moe_rl writes and may later replace or remove carry a mark, written when moe_rl
creates them: a folder without the mark is never removed, and files moe_rl did not write are
never deleted to make room (an export into a folder that holds them is refused)."""
from __future__ import annotations

import json
import os
import shutil
import time

from moe_rl.errors import UserError

MARK = ".written_by_moe_rl"


def owned(path: str) -> bool:
    """Whether moe_rl created ``path`` (it holds the mark)."""
    return os.path.isfile(os.path.join(path, MARK))


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
        with open(os.path.join(path, MARK), "w", encoding="utf-8") as fh:
            json.dump({"pid": os.getpid(), "time": time.time()}, fh)
    return path


def remove_owned(path: str) -> bool:
    """Remove ``path`` if moe_rl made it (True); leave anything else untouched (False)."""
    if not owned(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
