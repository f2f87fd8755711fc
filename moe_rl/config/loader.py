"""From YAML and ``key.sub=value`` overrides to a typed, validated :class:`Config`: names, types
and ranges checked here (the cross-field rules in :mod:`moe_rl.config.checks`); the YAML dump;
the table of every key."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Literal

import yaml

from moe_rl.config.checks import validate
from moe_rl.config.fields import ConfigError, as_dict
from moe_rl.config.moved_keys import move_keys, moved_key
from moe_rl.config.schema import Config
from moe_rl.config.shipped import config_path, shipped_configs


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if _is_dataclass_type(tp):
        return "{" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on as false/true
            value = {False: "off", True: "on"}[value]
        if value in typing.get_args(tp):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{hint}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (arg,) = typing.get_args(tp)
        if _is_dataclass_type(arg):   # a list of sections (data.sets, eval.sets)
            return [_build(arg, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a boolean (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:   # an integer past float's range (~1.8e308)
                raise ConfigError(f"{key}: expected a finite number, got an integer of "
                                  f"{len(str(abs(value)))} digits") from None
        elif isinstance(value, str):  # PyYAML reads "1e-5" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover - schema error


# the top of a numeric key whose schema names none: every size, count and time fits a 32-bit
# count or a billion (a run's seconds, a bound, a scale), and past them the libraries moe_rl
# hands a value to overflow (setitimer, socket timeouts, float32 scales, range())
DEFAULT_INT_MAX = 2 ** 31 - 1
DEFAULT_FLOAT_MAX = 1e9


def _check_range(value: Any, meta: dict, key: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    lo, hi, lo_open, hi_open = meta.get("range", (None, None, False, False))
    if hi is None:
        hi, hi_open = (DEFAULT_INT_MAX if isinstance(value, int) else DEFAULT_FLOAT_MAX), False
        meta = {**meta, "range_why": meta.get("range_why", "no key needs more; past it the "
                                                           "libraries moe_rl calls overflow")}
    bad = ((lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and (value >= hi if hi_open else value > hi)))
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else repr(lo)
        hi_s = "inf" if hi is None else repr(hi)
        why = f" ({meta['range_why']})" if "range_why" in meta else ""
        raise ConfigError(f"{key}: {_shown(value)} is out of range, expected a value in "
                          f"{left}{lo_s}, {hi_s}{right}{why}")


def _shown(value: Any) -> str:
    """``value`` as a refusal names it: a huge integer by its size (Python refuses to print one
    of more than 4,300 digits, and a line of hundreds says nothing)."""
    if isinstance(value, int) and abs(value) >= 10 ** 18:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def _unknown_key(cls: type, name: str, prefix: str) -> ConfigError:
    """The refusal of key ``name`` under ``prefix``, suggesting the closest key of this section
    or of one of its sections (a key that moved into one: ``rollout.temprature`` ->
    ``rollout.sampling.temperature``)."""
    names = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    paths = {n: n for n in names}   # a key's name -> its path from here, this section's first
    for n in names:
        if dataclasses.is_dataclass(hints[n]):
            for sub in dataclasses.fields(hints[n]):
                paths.setdefault(sub.name, f"{n}.{sub.name}")
    close = difflib.get_close_matches(name, list(paths), n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{paths[close[0]]}'?" if close else ""
    return ConfigError(f"unknown config key '{prefix}{name}'{hint} "
                       f"(valid keys under '{prefix or '<top>'}': {', '.join(names)})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and value."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, refusals = {}, []
    for name, value in data.items():   # every key's refusal collected: one error names all
        try:
            if name not in fields:
                raise _unknown_key(cls, str(name), prefix)
            tp = hints[name]
            key = prefix + name
            if _is_dataclass_type(tp):
                kwargs[name] = _build(tp, value, key + ".")
            else:
                kwargs[name] = _coerce(value, tp, key)
                _check_range(kwargs[name], fields[name].metadata, key)
        except ConfigError as exc:
            refusals.extend(exc.refusals)
    if refusals:
        raise ConfigError.of(refusals)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``a.b.c``, validating names against the schema."""
    parts = dotted.split(".")
    cls: type = Config
    node = tree
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key(cls, part, prefix)
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            if _is_dataclass_type(tp) and not isinstance(value, dict):
                raise ConfigError(f"{dotted}: is a section; set one of its keys, e.g. "
                                  f"{dotted}.{dataclasses.fields(tp)[0].name}=...")
            node[part] = value
            return
        if not _is_dataclass_type(tp):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, not a section "
                              f"(cannot set '{dotted}')")
        cls = tp
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: expected a mapping, got {node[part]!r}")
        node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value``; the value is parsed as YAML (numbers, booleans, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    return key, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently) and every alias (``*name``): a few hundred bytes of nested aliases expand to
    billions of nodes when the config is copied or dumped."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(f"YAML aliases (*name) are not accepted (line {mark.line + 1}, "
                              f"column {mark.column + 1}): write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"key {key!r} is given twice in one mapping "
                                  f"(line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a value seen twice out again (never an alias, which :func:`load_yaml` refuses)."""

    def ignore_aliases(self, data):
        return True


def load_yaml(stream):
    """YAML text or an open file as Python values, by the safe loader, without aliases or
    repeated keys (ConfigError); a number of more than 4,300 digits (Python refuses to read
    one) or nesting deeper than Python's recursion limit is a ConfigError too."""
    try:
        return yaml.load(stream, Loader=_UniqueKeyLoader)
    except (ConfigError, UnicodeDecodeError):   # said by the callers, naming the file
        raise
    except ValueError as exc:
        why = ("a number of more than 4,300 digits, which no key takes" if "digits" in str(exc)
               else str(exc).splitlines()[0])
        raise ConfigError(why) from None
    except RecursionError:
        raise ConfigError("values nested deeper than Python's recursion limit, which no key "
                          "takes") from None


def load_config(path: str | os.PathLike | None = None,
                overrides: list[str] | None = None) -> Config:
    """Read YAML ``path`` (optional), apply ``overrides`` and return a validated :class:`Config`."""
    tree: dict = {}
    if path is not None:
        path = config_path(os.fspath(path))
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path} (shipped configs, usable by name: "
                              f"{', '.join(sorted(shipped_configs()))})")
        if os.path.isdir(path):
            raise ConfigError(f"config file {path}: is a directory; give a YAML file")
        try:
            with open(path, encoding="utf-8") as fh:
                tree = load_yaml(fh) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path}: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    move_keys(tree)
    given: dict[str, str] = {}   # each override's key, by its current name
    for item in overrides or []:
        key, value = parse_override(item)
        new = moved_key(key)
        if new in given and given[new] != key:
            old = key if key != new else given[new]
            raise ConfigError(f"{old} and {new}: the same key under its old and new names; "
                              f"keep {new}")
        given[new] = key
        _set_dotted(tree, new, value)
    cfg = _build(Config, tree, "")
    resolve_paths(cfg, os.path.dirname(os.path.abspath(path)) if path is not None else None)
    validate(cfg)
    return cfg


# file and folder keys; relative ones resolve against the current directory when the config is
# loaded (so every process of the run, on every node, sees the same absolute path)
PATH_KEYS = ("model.path", "data.path", "logging.dir", "trainer.checkpoint.dir",
             "data.sets[].path", "eval.sets[].path")
# the data files among them: one not found under the current directory is looked for beside
# the config file (a shipped config's data, wherever the package is installed)
DATA_FILE_KEYS = ("data.path", "data.sets[].path", "eval.sets[].path")


def resolve_paths(cfg: Config, config_dir: str | None = None) -> None:
    """Make the :data:`PATH_KEYS` of ``cfg`` absolute (``~`` expanded; relative to the current
    directory, or for a :data:`DATA_FILE_KEYS` file that is not there, to ``config_dir`` when
    it is there); ``sets[]`` stands for every entry of the list ``sets``."""
    def absolute(key: str, value: str) -> str:
        value = os.path.expanduser(value)
        here = os.path.abspath(value)
        if (key in DATA_FILE_KEYS and config_dir and not os.path.isabs(value)
                and not os.path.exists(here) and os.path.isfile(os.path.join(config_dir, value))):
            return os.path.join(config_dir, value)
        return here

    def resolve(node: Any, parts: list[str], key: str) -> None:
        head, rest = parts[0], parts[1:]
        if head.endswith("[]"):
            for entry in getattr(node, head[:-2]):
                resolve(entry, rest, key)
        elif rest:
            resolve(getattr(node, head), rest, key)
        elif getattr(node, head):
            setattr(node, head, absolute(key, getattr(node, head)))
    for key in PATH_KEYS:
        resolve(cfg, key.split("."), key)


def config_from_dict(tree: dict) -> Config:
    """Build and validate a :class:`Config` from a plain nested dict (old key names moved to
    their sections, with a warning: :mod:`moe_rl.config.moved_keys`)."""
    cfg = _build(Config, move_keys(copy.deepcopy(tree)), "")
    validate(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved configuration as YAML (printed at start, saved in the run directory)."""
    return yaml.dump(as_dict(cfg), Dumper=_NoAliasDumper, sort_keys=False,
                     default_flow_style=False)


def iter_keys(cls: type = Config, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted key, type name, default, doc) for every leaf key: README's table."""
    default_obj = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            yield from iter_keys(tp, prefix + f.name + ".")
        else:
            yield (prefix + f.name, _type_name(tp), getattr(default_obj, f.name),
                   f.metadata.get("doc", ""))
