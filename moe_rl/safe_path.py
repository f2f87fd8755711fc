"""Folders that would hide an installed package: a regular package (a folder with an
``__init__.py``) or a module (``name.py``) at the top of a directory on ``sys.path`` is found
before site-packages when that directory comes first (the working directory of ``python -m``,
pytest's root, a Ray worker's copy of its driver's directory). moe_rl's checkout keeps only
``moe_rl``, ``tests`` and ``benchmarks`` as packages at its root; ``kernels/`` and ``configs/``
hold no ``__init__.py``, so they can never hide one. Every Python process moe_rl starts runs with
:data:`SAFE_PATH_ENV`, which keeps its working directory off ``sys.path``."""
from __future__ import annotations

import importlib.metadata
import os

# PYTHONSAFEPATH=1 (Python 3.11+): neither the working directory (``-m``, ``-c``) nor a
# script's folder is put on sys.path
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}
# the distribution a checkout of moe_rl installs (editable): its own names are not shadowed
OWN_DISTRIBUTION = "moe_rl"


def importable_names(folder: str) -> set[str]:
    """Top-level names ``folder`` answers as a regular package or a module (a folder without
    ``__init__.py`` is a namespace portion, found only when nothing else has the name)."""
    names = set()
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
            names.add(entry)
        elif entry.endswith(".py") and os.path.isfile(path):
            names.add(entry[:-3])
    return {n for n in names if n.isidentifier()}


def shadowed_packages(folder: str) -> dict[str, list[str]]:
    """{name: the installed distributions providing it} for every name ``folder`` would hide."""
    provided = importlib.metadata.packages_distributions()
    found = {}
    for name in sorted(importable_names(folder)):
        dists = sorted(d for d in provided.get(name, []) if d.replace("-", "_") !=
                       OWN_DISTRIBUTION)
        if dists:
            found[name] = dists
    return found


def describe(found: dict[str, list[str]], folder: str) -> str:
    """One line naming what ``folder`` hides."""
    return "; ".join(f"{folder}/{name} hides the installed {name} ({', '.join(dists)})"
                     for name, dists in found.items())
