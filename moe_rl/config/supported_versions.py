"""The versions moe_rl supports, read from its own installed metadata (setup.py's ranges)."""
from __future__ import annotations

import importlib.metadata


def supported_range(dist_name: str, extra: str | None = None) -> str | None:
    """moe_rl's own version range for ``dist_name`` (from its installed metadata; ``extra``:
    the range of that optional extra)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    try:
        requires = importlib.metadata.requires("moe_rl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) != dist_name:
            continue
        in_extra = req.marker is not None and "extra" in str(req.marker)
        if (extra is None and not in_extra) or (
                extra is not None and in_extra and req.marker.evaluate({"extra": extra})):
            return str(req.specifier)
    return None


def in_range(version: str, spec: str | None) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    return spec is None or Version(version.split("+")[0]) in SpecifierSet(spec)
