"""The refusals a user's own input causes (a config key, a file, a checkpoint): ``moe-rl``
prints them as one line and exits 2, with no traceback; and the one a float16 run ends with."""


class UserError(Exception):
    """Input the user gave is refused; the message names it and what was expected."""


class ConfigError(UserError, ValueError):
    """A configuration problem, with the dotted key it concerns."""


class LossScaleCollapsed(RuntimeError):
    """float16: the gradients overflowed at the loss scaler's minimum scale (a trainer rank
    raises it; the run ends with its message, exit 1)."""


def first_line(exc: BaseException) -> str:
    """``exc``'s message cut to its first line (a library's multi-line error in one line)."""
    return (str(exc).strip().splitlines() or [""])[0]
