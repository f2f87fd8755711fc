"""The refusals a user's own input causes (a config key, a file, a checkpoint): ``moe-rl``
prints them as one line and exits 2, with no traceback; and the one a float16 run ends with."""


class UserError(Exception):
    """Input the user gave is refused; the message names it and what was expected."""


class ConfigError(UserError, ValueError):
    """A configuration problem, with the dotted key it concerns; ``refusals``: each problem,
    when one error reports several found at once (:meth:`of`)."""

    def __init__(self, message: str, refusals: list[str] | None = None):
        super().__init__(message)
        self.refusals = list(refusals or [message])

    @classmethod
    def of(cls, refusals: list[str]) -> "ConfigError":
        """One error naming every refusal (its message the refusal itself when alone)."""
        if len(refusals) == 1:
            return cls(refusals[0])
        return cls(f"{len(refusals)} refusals: " + " ".join(
            f"({i}) {text}" for i, text in enumerate(refusals, 1)), refusals)


class LossScaleCollapsed(RuntimeError):
    """float16: the gradients overflowed at the loss scaler's minimum scale (a trainer rank
    raises it; the run ends with its message, exit 1)."""


def first_line(exc: BaseException) -> str:
    """``exc``'s message cut to its first line (a library's multi-line error in one line)."""
    return (str(exc).strip().splitlines() or [""])[0]
