"""Errors the user can act on. The CLI prints their message on one line and exits with code 2.

An error about one setting names it as the engine does (`draft_topk`, `n_ctx`, …) through `option`; the
CLI and the app word it with their own names for it (a flag, a field) through `worded`.
"""

from __future__ import annotations

import builtins
import functools
import signal
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any, ParamSpec, TypeVar

OPTION = "{option}"  # where a message names its setting
T = TypeVar("T")
P = ParamSpec("P")
# A signal handler that Python code installed (signal.getsignal gives ints for SIG_DFL and SIG_IGN)
Handler = Callable[[int, FrameType | None], Any]


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

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Hold:
    """The hold in force in the main thread: the handlers it replaced, the signals it noted."""

    def __init__(self, previous: dict[int, Handler]):
        self.previous = previous
        self.noted: list[int] = []
        self.importing = 0  # imports under way (imports_held): a signal waits for the outermost one to end

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.noted.append(signum)

    def release(self) -> None:
        global _hold
        _hold = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.noted:
            self.previous[self.noted[0]](self.noted[0], None)


_hold: _Hold | None = None


@contextmanager
def held_signals() -> Iterator[None]:
    """Ctrl-C (and SIGTERM where it raises Terminated) only noted while the block runs, and raised through
    the handler that was there once it ends. Raised anywhere else in the block, it could be dropped:
    - inside llama.cpp's log callback, called from C, ctypes prints it and drops it, and a load or a
      generation goes on as if nothing happened;
    - inside an import, CPython's import machinery drops it when it lands in the weakref callback that
      frees a module's lock (called from C), and a C extension's initialisation can lose it.
    Inside another hold, the outer one notes the signal, and it is raised as soon as this block ends: one
    hold over many short ones (a generation step's decodes) swaps the handlers once, and a Ctrl-C still
    comes right after the llama.cpp call it landed in. A signal with no Python handler (ignored, or the
    default action) is left alone. Elsewhere than the main thread (signals reach only it) a no-op."""
    global _hold
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _hold is not None:
        yield
        if _hold is not None and _hold.noted and not _hold.importing:
            _hold.release()
        return
    hold = _hold = _Hold({sig: h for sig in (signal.SIGINT, signal.SIGTERM) if callable(h := signal.getsignal(sig))})
    for sig in hold.previous:
        signal.signal(sig, hold.note)
    try:
        yield
    finally:
        if _hold is hold:
            hold.release()


@contextmanager
def imports_held() -> Iterator[None]:
    """Every import statement run while the block runs (in any module, the first time it loads a module or
    again) does so inside held_signals, and a signal noted in a nested import waits for the outermost one to
    end: commands, libraries and the engine import lazily, so that a Ctrl-C can land in an import at any
    moment. (importlib.import_module does not go through import statements: hold around it.)"""
    original = builtins.__import__

    def held_import(
        name: str,
        globals: Mapping[str, object] | None = None,
        locals: Mapping[str, object] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        if threading.current_thread() is not threading.main_thread():
            return original(name, globals, locals, fromlist, level)
        with held_signals():
            hold = _hold
            assert hold is not None  # held_signals holds in the main thread
            hold.importing += 1
            try:
                return original(name, globals, locals, fromlist, level)
            finally:
                hold.importing -= 1

    builtins.__import__ = held_import
    try:
        yield
    finally:
        builtins.__import__ = original


def held_steps(generator_function: Callable[P, Iterator[T]]) -> Callable[P, Iterator[T]]:
    """A generator function whose every step (the work up to its next item) runs inside one held_signals
    block, and whose caller's work between items does not."""

    @functools.wraps(generator_function)
    def steps(*args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        items = generator_function(*args, **kwargs)
        try:
            while True:
                with held_signals():
                    try:
                        item = next(items)
                    except StopIteration:
                        return
                yield item
        finally:
            if isinstance(items, Generator):  # its own clean-up runs now, not when it is collected
                items.close()

    return steps
