"""llama.cpp's process-wide side: its backend, started once; its log, captured; its aborts, reported.

llama.cpp says much only in its log (why a load failed, how large a context's compute buffers are) and
stops the process on a failed check or an uncaught C++ exception. This module holds what is kept of the
log, turns those stops into one call of a handler, and starts the backend (with the log sink) once per
process, apart from the runtime that loads models on it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from _ctypes import CFuncPtr
from collections import deque
from collections.abc import Callable
from functools import lru_cache

import llama_cpp

from ..errors import OPTION, ConfigError, held_signals
from .gpu import MIN_BATCH_DEFAULT, MIN_BATCH_ENV

_log_tail: deque[str] = deque(maxlen=20)
log_count = 0  # lines logged so far: which of the tail a call wrote
# llama.cpp says how large a context's compute buffers are only in its log, one line a backend buffer
_COMPUTE_BUFFER = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
compute_buffers: list[tuple[str, int]] = []  # (buffer type, bytes) logged since the list was last cleared
_log = logging.getLogger("s2moe.llama")


def _log_line(level: int, text: bytes | None, user_data: int | None) -> None:
    # llama.cpp talks a lot on load: its lines go to the debug log, and the tail is kept so that a
    # failure can say why.
    global log_count
    if text:
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            _log_tail.append(msg)
            log_count += 1
            sized = _COMPUTE_BUFFER.search(msg)
            if sized:
                compute_buffers.append((sized[1], int(float(sized[2]) * (1 << 20))))
            _log.debug(msg)


_log_sink = llama_cpp.llama_log_callback(_log_line)


_backend_ready = False
backend_min_batch: str | None = None  # GGML_OP_OFFLOAD_MIN_BATCH as the backend started with


def init_backend(op_offload_min_batch: int | None = None) -> None:
    """Start llama.cpp's backend once per process. A GPU backend reads GGML_OP_OFFLOAD_MIN_BATCH when its
    devices are registered, once: a value asked for must be in the environment before that, and a later
    request for another value cannot be honoured (ConfigError)."""
    global _backend_ready, backend_min_batch
    if _backend_ready:
        if op_offload_min_batch is not None and str(op_offload_min_batch) != backend_min_batch:
            started = backend_min_batch if backend_min_batch is not None else f"unset ({MIN_BATCH_DEFAULT})"
            raise ConfigError(
                f"{OPTION} {op_offload_min_batch} comes too late: llama.cpp's backend in this process "
                f"started with {MIN_BATCH_ENV}={started} and reads it only then (start a new "
                "process)",
                option="op_offload_min_batch",
            )
        return
    if op_offload_min_batch is not None:
        os.environ[MIN_BATCH_ENV] = str(op_offload_min_batch)
    backend_min_batch = os.environ.get(MIN_BATCH_ENV)
    with held_signals():  # the backend and its devices log as they start
        llama_cpp.llama_log_set(_log_sink, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        # Register the devices now (the variable is read there), not at whichever call happens to come first.
        llama_cpp.llama_supports_gpu_offload()
    _backend_ready = True


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_TERMINATE_HANDLER = ctypes.CFUNCTYPE(None)
_abort_hooks: tuple[CFuncPtr, ...] = ()  # the installed callbacks, kept alive
# Standard exceptions (mangled type names) whose message what() may be called for: std::exception's vtable
# holds two destructors, then what() (the Itanium C++ ABI).
_STD_EXCEPTIONS = {
    b"St9exception",
    b"St13runtime_error",
    b"St11logic_error",
    b"St12out_of_range",
    b"St16invalid_argument",
    b"St12length_error",
    b"St12domain_error",
    b"St11range_error",
    b"St14overflow_error",
    b"St15underflow_error",
    b"St9bad_alloc",
    b"St20bad_array_new_length",
    b"St12system_error",
}


def on_llama_abort(handler: Callable[[str], None]) -> None:
    """Call handler(message) when llama.cpp cannot go on: ggml stops the process on a failed internal check
    (GGML_ASSERT), or a C++ exception leaves its C API (a throw that nothing in llama.cpp catches ends in
    std::terminate) — instead of ggml's debugger backtrace on stdout or the C++ runtime's lines. The process
    still ends when handler returns: neither can be returned from. The message names the check, its file and
    line (without the build's path), or the exception's type and message."""
    global _abort_hooks
    from llama_cpp import _ggml

    def call(message: bytes | None) -> None:
        text = (message or b"").decode("utf-8", "replace").strip()
        handler(re.sub(r"^\S*/(?=\S+:\d+: )", "", text))

    abort_hook = _ABORT_CALLBACK(call)
    _ggml.libggml.ggml_set_abort_callback.argtypes = [_ABORT_CALLBACK]
    _ggml.libggml.ggml_set_abort_callback.restype = _ABORT_CALLBACK
    _ggml.libggml.ggml_set_abort_callback(abort_hook)
    try:
        cxx = ctypes.CDLL("libstdc++.so.6")  # llama.cpp's C++ runtime where it is GNU's (Linux)
    except OSError:
        _abort_hooks = (abort_hook,)
        return

    def terminate() -> None:
        handler(f"an uncaught C++ exception, {_cxx_exception_text(cxx)}")

    terminate_hook = _TERMINATE_HANDLER(terminate)
    cxx._ZSt13set_terminatePFvvE.argtypes = [ctypes.c_void_p]
    cxx._ZSt13set_terminatePFvvE.restype = ctypes.c_void_p
    cxx._ZSt13set_terminatePFvvE(ctypes.cast(terminate_hook, ctypes.c_void_p))
    _abort_hooks = (abort_hook, terminate_hook)


def _cxx_exception_text(cxx: ctypes.CDLL) -> str:
    """'type: message' of the C++ exception std::terminate is handling. The message is read for standard
    exceptions on x86-64 only: std::current_exception returns its pointer through a hidden first argument
    there, where AArch64 passes that address in x8, out of reach of a ctypes call."""
    cxx.__cxa_current_exception_type.restype = ctypes.c_void_p
    info = cxx.__cxa_current_exception_type()
    if not info:
        return "of no known type"
    word = ctypes.sizeof(ctypes.c_void_p)
    mangled = ctypes.c_char_p.from_address(info + word).value or b"?"  # std::type_info: vtable, then name
    cxx.__cxa_demangle.restype = ctypes.c_char_p
    cxx.__cxa_demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    name = (cxx.__cxa_demangle(mangled, None, None, ctypes.byref(ctypes.c_int())) or mangled).decode("utf-8", "replace")
    if mangled not in _STD_EXCEPTIONS or platform.machine() not in ("x86_64", "AMD64"):
        return name
    slot = (ctypes.c_void_p * 1)()
    current_exception = ctypes.cast(cxx._ZSt17current_exceptionv, ctypes.c_void_p).value
    if not current_exception:
        return name
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(current_exception)(ctypes.addressof(slot))
    if not slot[0]:
        return name
    vtable = ctypes.c_void_p.from_address(slot[0]).value
    what_address = ctypes.c_void_p.from_address(vtable + 2 * word).value if vtable else None
    if not what_address:
        return name
    what = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(what_address)
    return f"{name}: {(what(slot[0]) or b'').decode('utf-8', 'replace')}"


@lru_cache(maxsize=1)
def llama_build_id() -> str:
    """llama-cpp-python's version and llama.cpp's system line: what a measurement made with this llama.cpp
    is only valid for."""
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    return f"{getattr(llama_cpp, '__version__', '?')}|{' '.join(info.split())}"


def last_llama_error() -> str:
    """llama.cpp's own reason for the last failure, from its log: the line it reports the error on
    (without its function-name prefix), else the last line that sounds like one."""
    for line in reversed(_log_tail):
        marker = line.find("error loading model: ")
        if marker >= 0:
            return " ".join(line[marker + len("error loading model: ") :].split())
    for line in reversed(_log_tail):
        low = line.lower()
        if "error" in low or "failed" in low or "invalid" in low or "insufficient" in low:
            return " ".join(re.sub(r"^[A-Za-z_][\w:]*: ", "", line).split())
    return _log_tail[-1] if _log_tail else "no details"


def first_llama_error(recent: int) -> str:
    """The first line of the `recent` last ones llama.cpp logged that reports a problem: where a failure
    started, before the lines that only pass it on."""
    lines = list(_log_tail)[-recent:] if recent > 0 else []
    for line in lines:
        low = line.lower()
        if "error" in low or "fail" in low or "invalid" in low or "must" in low:
            return " ".join(re.sub(r"^[A-Za-z_][\w:]*: ", "", line).split())
    return last_llama_error()
