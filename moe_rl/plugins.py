"""Loading user code named in the configuration (``module:name``), with errors naming the key."""
from __future__ import annotations

import importlib


def load_named(spec: str, key: str, builtin: dict, form: str):
    """A built-in entry of ``builtin`` (an object, or a ``module:name`` string resolved in turn)
    or ``module:name`` imported; ValueError naming ``key`` otherwise (``form`` says what the
    key takes, e.g. "module:function")."""
    target = builtin.get(spec, spec)
    if not isinstance(target, str):
        return target
    if ":" not in target:
        raise ValueError(f"{key}: expected one of {sorted(builtin)} or {form}, got {spec!r}")
    module, name = target.split(":", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}: cannot load {spec!r}: {exc}") from None
