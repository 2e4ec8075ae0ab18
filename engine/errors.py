"""Errors the user can act on. The CLI prints their message on one line and exits with code 2.

An error about one setting names it as the engine does (`draft_topk`, `n_ctx`, …) through `option`; the
CLI and the app word it with their own names for it (a flag, a field) through `worded`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

OPTION = "{option}"  # where a message names its setting


class S2MoEError(Exception):
    """Base for every error whose message is meant for the user."""

    def __init__(self, message: str, *, option: str | None = None):
        super().__init__(message)
        self.message, self.option = message, option

    def worded(self, names: Mapping[str, str] | None = None) -> str:
        """The message with its setting called by `names` (the engine's own name where names has none)."""
        if self.option is None:
            return self.message
        return self.message.replace(OPTION, (names or {}).get(self.option, self.option))

    def __str__(self) -> str:
        return self.worded()


class ModelError(S2MoEError):
    """The model file is missing, not a GGUF, damaged, or unsuitable for the request."""


class ConfigError(S2MoEError):
    """Invalid option values or combinations."""


class ContextError(S2MoEError):
    """The prompt does not fit the context window."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is, so that the same clean-up runs (a budget's cgroup
    and worker, a profile's temporary file); the CLI then exits with 143, the code of death by SIGTERM."""


@contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """SIGTERM raised as Terminated in the main thread while the block runs, so that the clean-up Ctrl-C
    gets (a budget's cgroup and worker, a profile's temporary file) runs for it too, where the process
    would otherwise die on the spot. Elsewhere than the main thread (signals reach only it) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
