"""`moe-rl doctor`'s check of SGLang's environment: the interpreter that will serve it
(``rollout.sglang.python``) imports SGLang within moe_rl's range and its ``launch_server`` knows
every flag this config passes."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from moe_rl.config import Config
from moe_rl.engines.sglang.launcher import sglang_argv, sglang_env
from moe_rl.config.supported_versions import in_range, supported_range


FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")


def unknown_flags(flags: list[str], help_text: str) -> list[str]:
    """The ``flags`` that ``help_text`` (``launch_server --help``) does not list as flags of
    their own (``--dtype`` is not listed by ``--kv-cache-dtype``)."""
    known = set(FLAG.findall(help_text))
    return [f for f in flags if f not in known]


def check_sglang_environment(cfg: Config, timeout: float = 600.0) -> tuple[str, str, str]:
    """SGLang imports in the interpreter that will serve it, in moe_rl's range, and its
    ``launch_server`` knows every flag moe_rl passes for this config: (status, detail, fix)."""
    python = cfg.rollout.sglang.python or sys.executable
    spec = supported_range("sglang", "sglang")
    fix = (f"in that environment: pip install 'sglang{spec or '>=0.5.23,<0.6'}'; on CPU "
           f"`moe-rl sglang-cpu-env DIR` builds one; point rollout.sglang.python at its python")
    env = {**os.environ, **sglang_env([], cfg.rollout.sglang.device)}
    try:
        got = subprocess.run([python, "-c", "import sglang; print(sglang.__version__)"],
                             capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ("fail", f"rollout.sglang.python={python}: {exc}", fix)
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or ["no output"])[-1]
        return ("fail", f"`import sglang` fails in {python}: {last}", fix)
    version = got.stdout.strip().splitlines()[-1]
    if not in_range(version, spec):
        return ("fail", f"sglang {version} in {python} is outside moe_rl's range {spec}", fix)
    servers = cfg.rollout.servers
    flags = [a for a in sglang_argv(cfg, "MODEL", servers.host, servers.base_port)
             if a.startswith("--")]
    try:
        helped = subprocess.run([python, "-m", "sglang.launch_server", "--help"],
                                capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ("fail", f"`sglang.launch_server --help` took over {timeout:.0f} s in {python}",
                fix)
    missing = unknown_flags(flags, helped.stdout)
    if missing:
        return ("fail", f"sglang {version}'s launch_server does not know "
                f"{' '.join(missing)}, which this config passes", fix)
    return ("ok", f"sglang {version} in {python}; launch_server knows {len(flags)} flags this "
                  f"config passes", "")
