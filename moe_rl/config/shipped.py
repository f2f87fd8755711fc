"""The configs that ship with moe_rl (the top-level ``configs/`` folder, installed as the data
folder ``moe_rl/configs``): ``--config tiny_cpu.yaml`` (or ``tiny_cpu``) names one of them when
no such file exists where you are, so a wheel installed anywhere runs ``moe-rl demo``."""
from __future__ import annotations

import os
from importlib import resources

DEFAULT_CONFIG = "tiny_cpu.yaml"


def shipped_configs() -> dict[str, str]:
    """{file name: path} of every shipped config."""
    folder = _configs_folder()
    return {p.name: str(p) for p in folder.iterdir() if p.name.endswith(".yaml")}


def _configs_folder():
    """A wheel holds the folder inside the package (``moe_rl/configs``); a checkout (an editable
    install) beside it. Not an import package: a top-level folder with an ``__init__.py`` would
    hide an installed package of its name from processes started at the checkout's root."""
    package = resources.files("moe_rl")
    inside = package / "configs"
    return inside if inside.is_dir() else package.parent / "configs"


def config_path(name: str) -> str:
    """``name`` itself when it is a file there; else the shipped config it names (with or
    without ``.yaml``); else ``name`` unchanged (the loader says it is not found)."""
    if os.path.exists(name) or os.sep in name:
        return name
    shipped = shipped_configs()
    return shipped.get(name) or shipped.get(f"{name}.yaml") or name
