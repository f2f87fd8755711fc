"""How the schema declares a key: a field with its default, one-line meaning and range; a
section as a plain dict. Every configuration refusal raises :class:`ConfigError`."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from moe_rl.errors import ConfigError  # noqa: F401  (the config package's error)


def _rng(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False, why: str | None = None) -> dict:
    """A key's range; ``why``: the reason for its upper bound (said when refused)."""
    return {"range": (lo, hi, lo_open, hi_open), **({"range_why": why} if why else {})}


def _f(default: Any, doc: str, **meta: Any) -> Any:
    """A dataclass field with a default, a one-line doc (for README) and optional range."""
    meta = dict(meta)
    meta["doc"] = doc
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _sub(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


def as_dict(obj: Any) -> dict:
    """A config (or one of its sections) as plain nested dicts."""
    return dataclasses.asdict(obj)
