"""Files a user names: models, prompt files, profiles.

Only regular files are opened, and text is read with a bound, so that a FIFO, a device (`/dev/zero`) or a
huge file gives one clear error instead of a hang or an out-of-memory kill.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigError, S2MoEError

# Prompt files (calibrate --prompts, bench --prompts) are read whole: HumanEval's 164 prompts take 0.2 MiB.
MAX_PROMPT_FILE_BYTES = 16 << 20


def open_regular(path: str | os.PathLike, what: str, error: type[S2MoEError] = ConfigError):
    """`path` opened for binary reading if it is a regular file, else `error` saying what it is.

    Opened without blocking and checked on the open descriptor: opening a FIFO would otherwise wait for a
    writer forever, and a check before opening could be raced by a rename."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        reason = "not found" if isinstance(e, FileNotFoundError) else e.strerror
        raise error(f"cannot read {what} {path}: {reason}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise error(f"{what} {path} is not a regular file (a pipe, socket or device)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, what: str, limit: int, error: type[S2MoEError] = ConfigError) -> bytes:
    """A regular file's bytes, at most `limit` of them; `error` when it is larger."""
    with open_regular(path, what, error) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise error(f"cannot read {what} {path}: {e.strerror}") from None
    if len(data) > limit:
        raise error(f"{what} {Path(path).name}: larger than {_size(limit)}")
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"
