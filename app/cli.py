"""The `s2moe` command line. Decoding logic lives in s2moe.engine; this module parses, runs, prints."""

from __future__ import annotations

import os
import signal
import sys
import threading

from ..engine.errors import S2MoEError, Terminated, held_signals, imports_held, sigterm_raises_terminated
from .model_runs import say
from .options import FLAGS
from .parser import LLAMA_COMMANDS, build_parser


def one_line(text: str) -> str:
    """text with its control characters (a line break or carriage return in a file name, say) written as
    escapes: an error stays one line, and cannot move the terminal's cursor."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _abort_line(message: str) -> None:
    """llama.cpp stopped on a failed internal check: the process cannot go on, but it can say so in one line
    (ggml would print a debugger backtrace, on stdout) and exit as for bad input."""
    sys.stderr.write(
        f"error: llama.cpp stopped on a failed check ({one_line(message)}): the model file or a "
        "setting is not one it supports\n"
    )
    sys.stderr.flush()
    os._exit(2)


def _say_interrupted(word: str = "interrupted") -> None:
    """'interrupted' (or 'terminated'), once: a second signal while saying it (or one a budget's parent
    passes on) is ignored rather than raised in the middle of the handler as a traceback."""
    if threading.current_thread() is not threading.main_thread():
        print(word, file=sys.stderr)
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(word, file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None, *, watch: bool = False) -> int:
    """The CLI; `watch`: record the run so that a crash in native code is reported by the next one
    (engine.crashes), for a process of its own (the console script), not a caller's."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Inside an import CPython can drop a Ctrl-C (engine.errors.held_signals): every import is held, and
        # the command modules, which are imported by name, are held by hand.
        with sigterm_raises_terminated(), imports_held():
            with held_signals():
                parser = build_parser()
                if not argv:
                    argv = ["app"]  # the main job
                args = parser.parse_args(argv)
                args._argv = list(argv)  # `generate --budget` reruns the command inside a memory cgroup
                if args.version:
                    from importlib.metadata import version

                    print(f"s2moe {version('s2moe')}")
                    return 0
                if getattr(args, "run", None) is None:
                    parser.print_help()
                    return 2
                if args.command in LLAMA_COMMANDS:
                    from ..engine.crashes import earlier_crashes
                    from ..engine.decoding.cpu_buffers import AMX_ENV
                    from ..engine.decoding.llama_process import on_llama_abort

                    on_llama_abort(_abort_line)
                    if args.amx:
                        os.environ[AMX_ENV] = "1"  # the budget's and bench's child processes inherit it
                    for line in earlier_crashes():
                        say(line)
            if watch and args.command in LLAMA_COMMANDS:
                from ..engine.crashes import watched

                with watched(args.command, getattr(args, "model", None)):
                    return args.run(args)
            return args.run(args)
    except S2MoEError as e:
        print(f"error: {one_line(e.worded(FLAGS))}", file=sys.stderr)
        return 2
    except Terminated:
        _say_interrupted("terminated")
        return 143
    except KeyboardInterrupt:
        _say_interrupted()
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """The console script: main's exit code, which a Ctrl-C that Python gets round to only while the
    interpreter shuts down must not turn into death by SIGINT."""
    code = main(watch=True)
    if code in (130, 143):
        # A KeyboardInterrupt that passed through a module run from C (an import in the middle of a Ctrl-C)
        # leaves CPython marked as interrupted even though main caught it: its shutdown would then end the
        # process by SIGINT, after "interrupted" was said. Every clean-up has run by now (finally blocks).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
