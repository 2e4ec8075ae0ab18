"""A line for a wait that turns out long: said once a stage has taken SLOW_S, not before, so that a fast run
stays quiet and a slow one (a model of gigabytes under a budget) never waits without a word."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SLOW_S = 2.0


@contextmanager
def said_if_slow(say: Callable[[str], None] | None, text: str, after: float = SLOW_S) -> Iterator[None]:
    """Run the body; if it is still running after `after` seconds, say(text) once (from a timer thread: the
    body may be inside llama.cpp). Without `say`, nothing."""
    if say is None:
        yield
        return
    timer = threading.Timer(after, say, args=(text,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
