"""Files a user names: models, prompt files, profiles, copy caches, traces, the app's state.

Only regular files are opened, and text is read with a bound, so that a FIFO, a device (`/dev/zero`) or a
huge file gives one clear error instead of a hang or an out-of-memory kill. JSON is parsed by one function
(parse_json), so that no reader meets nesting, numbers or bytes that json.loads turns into a traceback.
Files are written by one function (write_atomic): a reader sees the old file or the new one, a symbolic
link is written through, and what a killed write left behind is removed by the next.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any, BinaryIO

from .errors import ConfigError, S2MoEError

# Prompt files (calibrate --prompts, bench --prompts) are read whole: HumanEval's 164 prompts take 0.2 MiB.
MAX_PROMPT_FILE_BYTES = 16 << 20


def state_dir() -> Path:
    """XDG state of s2moe: what it remembers between runs (the app's settings, crash records, …)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "s2moe"


def open_regular(path: str | os.PathLike[str], what: str, error: type[S2MoEError] = ConfigError) -> BinaryIO:
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


def read_bounded(path: str | os.PathLike[str], what: str, limit: int, error: type[S2MoEError] = ConfigError) -> bytes:
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


def parse_json(data: bytes | str, what: str, error: type[S2MoEError] = ConfigError) -> Any:
    """JSON text (bytes: UTF-8) parsed, or `error` saying in one line why not, `what` first (e.g. "copy cache
    PATH", "trace PATH line 3"). json.loads itself raises RecursionError for arrays nested some thousand deep
    and a bare ValueError for an integer of more digits than Python converts (4,300)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{what}: not UTF-8 text (an invalid byte at offset {e.start})") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise error(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{what}: nested too deeply") from None
    except ValueError:
        raise error(f"{what}: a number too long to read") from None


def read_json(path: str | os.PathLike[str], what: str, limit: int, error: type[S2MoEError] = ConfigError) -> Any:
    """A regular file of at most `limit` bytes parsed as JSON (parse_json); `error` naming it otherwise."""
    return parse_json(read_bounded(path, what, limit, error), f"{what} {path}", error)


# A write takes milliseconds; a temporary file of a write this much older was left by a killed process.
STALE_TMP_SECONDS = 600


def write_target(path: str | os.PathLike[str], what: str, error: type[S2MoEError] = ConfigError) -> Path:
    """The file a write to `path` replaces: the path, or where its symbolic link leads (written through, as a
    shell's `>` does: replacing the link by a file would leave what it points at as it was). A link that
    leads round in a loop is `error`."""
    path = Path(path)
    if not path.is_symlink():
        return path
    real = Path(os.path.realpath(path))
    if real.is_symlink():
        raise error(f"cannot write {what} {path}: its symbolic link leads round in a loop")
    return real


def check_writable(path: str | os.PathLike[str], what: str, error: type[S2MoEError] = ConfigError) -> Path:
    """Where write_atomic(path) will write (write_target), checked by doing it before the work whose result
    goes there: its folder exists and takes a new file (tried: root ignores permission bits, a read-only
    mount does not), and it is no folder. `error` otherwise."""
    target = write_target(path, what, error)
    if target.is_dir():
        raise error(f"cannot write {what} {path}: it is a folder")
    if not target.parent.is_dir():
        raise error(f"cannot write {what} {path}: there is no folder {target.parent}")
    probe = _tmp_name(target)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        raise error(f"cannot write {what} {path}: {e.strerror} in {target.parent}") from None
    os.unlink(probe)
    return target


def write_atomic(
    path: str | os.PathLike[str], text: str, what: str = "file", error: type[S2MoEError] = ConfigError
) -> Path:
    """`text` written to `path` (write_target: through a symbolic link) in one step: a temporary file beside
    it, synced, then renamed over it, so that a reader, or a process stopped at any moment, sees the old file
    or the new one. The file keeps its permissions. Temporary files of this file that killed writes left
    (SIGKILL runs no clean-up) are removed first. `error` naming `what` when it cannot be written. The file
    written."""
    target = write_target(path, what, error)
    _remove_stale_tmp(target)
    tmp = None
    try:
        name = _tmp_name(target)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        tmp = name  # ours to remove from here on
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            try:
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
            except FileNotFoundError:
                pass  # a new file: the mode the umask leaves, as any other new file
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(e, OSError):
            raise error(f"cannot write {what} {path}: {e.strerror or e}") from None
        raise
    return target


def _tmp_name(target: Path) -> Path:
    """A fresh temporary name beside `target` that _remove_stale_tmp knows as one of its."""
    return target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")


def _remove_stale_tmp(target: Path) -> None:
    """Temporary files of earlier writes of `target` that a killed process left behind; those of a write
    running now in another process are younger than STALE_TMP_SECONDS and stay."""
    cutoff = time.time() - STALE_TMP_SECONDS
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        try:
            if tmp.is_file() and not tmp.is_symlink() and tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except OSError:  # gone already, or not ours to remove
            pass
