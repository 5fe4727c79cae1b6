"""Errors a user can cause.

Anything a user can get wrong (a path, a file format, a shape, a config key, a
device) raises :class:`UserError` with one line that says what is wrong and what
to do. The CLI prints that line and exits with status 2; Python callers can
catch it like any other exception.
"""

from __future__ import annotations

import errno
from typing import Sequence


class UserError(Exception):
    """A problem with the user's input, reported as one clear line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DataError(UserError):
    """A data file is missing, unreadable, or not what it should be."""


class ConfigError(UserError):
    """A configuration key or value is wrong."""


class CheckpointError(UserError):
    """A checkpoint is missing, truncated, corrupt or of the wrong kind."""


class DeviceError(UserError):
    """A requested device does not exist or cannot be used."""


class DiskFullError(UserError):
    """The disk (or a quota) filled up while pointforge was writing a file."""


def disk_full_cause(err: BaseException) -> OSError | None:
    """The "no space left" / "quota exceeded" OSError behind ``err``, if that is what it is.

    ``torch.save`` reports a failed write as a RuntimeError ("unexpected pos
    ...") whose context is the OSError, so the chain is followed.
    """
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def raise_problems(problems: Sequence[UserError], refused: str) -> None:
    """Raise every problem a planner collected at once, or nothing when there is none.

    One problem is raised as itself; several as one line, ``refused`` (what did
    not happen, e.g. "plan refused, nothing started") followed by each problem's
    own line, of their common type when they share one (else ConfigError).
    """
    if not problems:
        return
    if len(problems) == 1:
        raise problems[0]
    kinds = {type(p) for p in problems}
    cls = kinds.pop() if len(kinds) == 1 else ConfigError
    raise cls(f"{refused} ({len(problems)} problems): " + "; ".join(str(p) for p in problems))
