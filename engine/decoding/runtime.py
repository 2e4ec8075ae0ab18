"""A thin, typed layer over llama-cpp-python's low-level API: one model, one context, one sequence.

The routing hook is installed as the context's cb_eval, so every decode passes through it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
from _ctypes import CFuncPtr
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Literal, overload

import llama_cpp
import numpy as np

# numpy imports numpy.random on first use; a Ctrl-C that lands in that import (the initialisation of its
# compiled modules) is lost, and the run goes on. Imported here, with the engine, it happens before any
# model is loaded, not in the middle of the first generation.
import numpy.random  # noqa: F401
import numpy.typing as npt

from ..errors import OPTION, ConfigError, ContextError, ModelError, held_signals
from ..measure.device import default_threads, memory_bytes
from ..model_info import ModelInfo
from ..offload.procfs import model_mappings
from ..offload.sizes import fmt_bytes
from .gpu import MIN_BATCH_DEFAULT, MIN_BATCH_ENV, BuftOverrides, Placement, cpu_buffer_type, gpu_backend
from .hook import RoutingHook

# Rows of next-token logits (n_vocab wide), as llama.cpp computes them
Logits = npt.NDArray[np.float32]

_log_tail: deque[str] = deque(maxlen=20)
_log_count = 0  # lines logged so far: which of the tail a call wrote
# llama.cpp says how large a context's compute buffers are only in its log, one line a backend buffer
_COMPUTE_BUFFER = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
_compute_buffers: list[tuple[str, int]] = []  # (buffer type, bytes) logged since the list was last cleared
_log = logging.getLogger("s2moe.llama")

# llama.cpp keeps n_ctx in 32 bits and rounds it up; far below that, a context this large is a typo.
MAX_CTX = 1 << 24
# The start-up cost measurement decodes a 32-token prefix in one batch, and llama.cpp caps a batch at
# the context size asked for.
MIN_CTX = 32
# Tokens per llama.cpp batch (n_batch = n_ubatch): a prompt is prefilled in chunks of this many, and the
# compute buffers are sized for one (llama.cpp's default).
DEFAULT_BATCH = 512
# More threads than this many per CPU only wait for each other (999 threads on two cores did not finish
# four tokens in two minutes); ggml allows at most 512.
THREADS_PER_CPU = 4
GGML_MAX_THREADS = 512


def _log_line(level: int, text: bytes | None, user_data: int | None) -> None:
    # llama.cpp talks a lot on load: its lines go to the debug log, and the tail is kept so that a
    # failure can say why.
    global _log_count
    if text:
        msg = text.decode("utf-8", "replace").rstrip()
        if msg:
            _log_tail.append(msg)
            _log_count += 1
            sized = _COMPUTE_BUFFER.search(msg)
            if sized:
                _compute_buffers.append((sized[1], int(float(sized[2]) * (1 << 20))))
            _log.debug(msg)


_log_sink = llama_cpp.llama_log_callback(_log_line)


_backend_ready = False
_backend_min_batch: str | None = None  # GGML_OP_OFFLOAD_MIN_BATCH as the backend started with


def _init_backend(op_offload_min_batch: int | None = None) -> None:
    """Start llama.cpp's backend once per process. A GPU backend reads GGML_OP_OFFLOAD_MIN_BATCH when its
    devices are registered, once: a value asked for must be in the environment before that, and a later
    request for another value cannot be honoured (ConfigError)."""
    global _backend_ready, _backend_min_batch
    if _backend_ready:
        if op_offload_min_batch is not None and str(op_offload_min_batch) != _backend_min_batch:
            started = _backend_min_batch if _backend_min_batch is not None else f"unset ({MIN_BATCH_DEFAULT})"
            raise ConfigError(
                f"{OPTION} {op_offload_min_batch} comes too late: llama.cpp's backend in this process "
                f"started with {MIN_BATCH_ENV}={started} and reads it only then (start a new "
                "process)",
                option="op_offload_min_batch",
            )
        return
    if op_offload_min_batch is not None:
        os.environ[MIN_BATCH_ENV] = str(op_offload_min_batch)
    _backend_min_batch = os.environ.get(MIN_BATCH_ENV)
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


def max_threads() -> int:
    return min(GGML_MAX_THREADS, THREADS_PER_CPU * default_threads())


def check_threads(n_threads: int | None) -> None:
    """ConfigError for a thread count that cannot help (None: the default)."""
    if n_threads is None:
        return
    if n_threads < 1:
        raise ConfigError(f"{OPTION} must be at least 1", option="n_threads")
    if n_threads > max_threads():
        cpus = default_threads()
        raise ConfigError(
            f"{OPTION} {n_threads} is more than {max_threads()} ({THREADS_PER_CPU} × the {cpus} "
            f"CPU{'s' if cpus != 1 else ''} this process may run on): extra threads only wait for "
            "each other",
            option="n_threads",
        )


def check_ctx(n_ctx: int, min_ctx: int = MIN_CTX) -> None:
    if n_ctx < min_ctx:
        raise ConfigError(
            f"{OPTION} {n_ctx} is too small: the context must hold at least {min_ctx} tokens "
            "(a verification batch and the start-up cost measurement)",
            option="n_ctx",
        )
    if n_ctx > MAX_CTX:
        raise ConfigError(
            f"{OPTION} {n_ctx} is above the largest context s2moe accepts ({MAX_CTX} tokens)", option="n_ctx"
        )


# llama.cpp's default cache type (f16): bytes per K or V value
KV_VALUE_BYTES = 2


def available_memory() -> int | None:
    """Memory the kernel could give this process now (MemAvailable: free plus reclaimable page cache),
    else the physical memory; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return memory_bytes()


def check_ctx_memory(info: ModelInfo, n_ctx: int, on_gpu: bool = False) -> None:
    """ConfigError for a context whose KV cache would take more than half the memory available: the rest
    is for the model's pages, the compute buffers and everything else running. llama.cpp allocates the
    whole cache up front, so a typo in --ctx would otherwise hold gigabytes for nothing. A cache on the
    GPU (-ngl) is llama.cpp's to refuse."""
    available = available_memory()
    need = n_ctx * info.kv_rows * KV_VALUE_BYTES
    if on_gpu or not need or available is None or need <= available // 2:
        return
    trained = info.n_ctx_train * info.kv_rows * KV_VALUE_BYTES
    raise ConfigError(
        f"{OPTION} {n_ctx} needs {fmt_bytes(need)} of KV cache, more than half the "
        f"{fmt_bytes(available)} of memory available; {info.path.name} was trained on a context of "
        f"{info.n_ctx_train} tokens ({fmt_bytes(trained)})",
        option="n_ctx",
    )


class LlamaRuntime:
    def __init__(
        self,
        info: ModelInfo,
        *,
        n_ctx: int = 2048,
        n_batch: int = DEFAULT_BATCH,
        batch_room: int | None = None,
        n_threads: int | None = None,
        max_verify_rows: int = 16,
        cap_max: int = 64,
        placement: Placement = Placement(),
        use_extra_bufts: bool = True,
        int_overrides: dict[str, int] | None = None,
        install_hook: bool = True,
        n_seq_max: int = 1,
    ):
        check_threads(n_threads)
        check_ctx(n_ctx, max(MIN_CTX, max_verify_rows))
        placement.validate(info)
        check_ctx_memory(info, n_ctx, on_gpu=placement.n_gpu_layers != 0)
        _init_backend(placement.op_offload_min_batch)
        self.info = info
        self.placement = placement
        self.use_extra_bufts = use_extra_bufts  # a second load of the same weights takes the same path
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = placement.n_gpu_layers
        # Mapped from the file, whose pages offloading manages; not left to llama.cpp's AUTO. (This struct has
        # load_mode, not use_mmap: assigning use_mmap only made a Python attribute.)
        mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        mparams.use_extra_bufts = use_extra_bufts
        # llama.cpp keeps this pointer in the model and reads it again when a context is made: the array
        # lives as long as the runtime
        self._buft_overrides: BuftOverrides | None = None
        if placement.experts_in_host:
            self._buft_overrides = BuftOverrides(placement.patterns(), cpu_buffer_type())
            mparams.tensor_buft_overrides = self._buft_overrides.address
        if int_overrides:
            # e.g. {"olmoe.expert_used_count": 2}: a model that really uses fewer experts (load time only)
            self._overrides = (llama_cpp.llama_model_kv_override * (len(int_overrides) + 1))()
            for slot, (key, value) in zip(self._overrides, int_overrides.items()):
                slot.key = key.encode()
                slot.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
                slot.value.val_i64 = int(value)
            mparams.kv_overrides = self._overrides
            used_key = f"{info.arch}.expert_used_count"
            if used_key in int_overrides:
                self.info = info = replace(info, n_expert_used=int(int_overrides[used_key]))
        before = set(model_mappings(info.path))
        with held_signals():
            self.model = llama_cpp.llama_model_load_from_file(os.fsencode(info.path), mparams)
        if not self.model:
            raise ModelError(f"llama.cpp could not load {info.path.name}: {last_llama_error()}")
        # (address, length, file offset) of the mappings of the file that this model's load made: offloading
        # manages this model's and no other (a drafter that loads the weights again maps the file again)
        self.file_mappings = sorted(set(model_mappings(info.path)) - before)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

        wants_hook = install_hook and info.is_moe
        self.hook: RoutingHook | None = (
            RoutingHook(info, max_rows=max(max_verify_rows, 1), cap_max=cap_max) if wants_hook else None
        )
        if self.hook is not None and gpu_backend():
            # op_offload is on (below): from this batch size MUL_MAT_ID may run on the GPU
            self.hook.distinct_from(int(_backend_min_batch) if _backend_min_batch else MIN_BATCH_DEFAULT)
        n_threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        # Draft trees put each branch on a sequence of its own. One unified cache holds them all, so that a
        # token can belong to several branches at once (its cell shared, not copied).
        cparams.kv_unified = True
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        # An op on host weights (experts kept in host memory) runs on the GPU from GGML_OP_OFFLOAD_MIN_BATCH
        # tokens, copying only the experts the batch routes to: the GPU regime depends on it being on.
        cparams.op_offload = True
        if self.hook is not None:
            cparams.cb_eval = ctypes.cast(
                ctypes.c_void_p(self.hook.callback), llama_cpp.ggml_backend_sched_eval_callback
            )
            cparams.cb_eval_user_data = ctypes.c_void_p(self.hook.user_data)
        # llama.cpp sizes its compute buffers for one batch; where they may take only batch_room bytes of host
        # memory (a memory budget's share), the batch is halved until they fit, down to MIN_CTX tokens
        n_batch = max(n_batch, max_verify_rows)
        floor = max(MIN_CTX, max_verify_rows)
        while True:
            cparams.n_batch = cparams.n_ubatch = n_batch
            # llama.cpp reserves one output per sequence in a batch: no more sequences than a batch holds
            cparams.n_seq_max = max(1, min(n_seq_max, n_ctx, n_batch))
            _compute_buffers.clear()
            with held_signals():
                self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                llama_cpp.llama_model_free(self.model)
                self.model = None
                raise ModelError(f"llama.cpp could not create a context for {info.path.name}: {last_llama_error()}")
            # host memory only: a GPU's own buffers are not the process's
            self.compute_buffer_bytes = sum(
                size for kind, size in _compute_buffers if kind == "CPU" or kind.endswith("_Host")
            )
            if batch_room is None or self.compute_buffer_bytes <= batch_room or n_batch <= floor:
                break
            with held_signals():
                llama_cpp.llama_free(self.ctx)
            self.ctx = None
            n_batch = max(floor, n_batch // 2)
        n_seq_max = cparams.n_seq_max
        self.n_ctx: int = llama_cpp.llama_n_ctx(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)  # llama.cpp caps n_batch at n_ctx
        if self.n_batch < max_verify_rows:
            raise ModelError(
                f"llama.cpp gave batches of {self.n_batch} tokens, fewer than verification batches of {max_verify_rows}"
            )
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_seq_max = n_seq_max
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, n_seq_max)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._logits_flag = np.ctypeslib.as_array(
            ctypes.cast(b.logits, ctypes.POINTER(ctypes.c_int8)), shape=(self.n_batch,)
        )
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0
        self._nseq[:] = 1
        self._seqs_dirty = 0  # rows a tree decode left with other sequence ids than 0
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    # -- text ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Tokens of text; none for empty text (not even the BOS token). special: control tokens written
        in the text (a chat template's turn markers) are read as those tokens, not as their characters."""
        if not text:
            return []
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes of a command line or file name (surrogates)
            raise ConfigError(
                f"the prompt is not UTF-8 text (undecodable bytes from character {e.start + 1})"
            ) from None
        add = self.add_bos if add_bos is None else add_bos
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        with held_signals():  # llama.cpp logs what it cannot tokenize
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add, special)
            if n < 0:
                cap = -n
                buf = (llama_cpp.llama_token * cap)()
                n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add, special)
        tokens = list(buf[:n])
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise ModelError(
                f"{self.info.path.name}: its tokenizer gave token ids outside its vocabulary of "
                f"{self.n_vocab} for this text"
            )
        return tokens

    def piece(self, token: int) -> bytes:
        with held_signals():  # llama.cpp logs a token it cannot render
            return self._piece(token)

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: Iterable[int]) -> str:
        with held_signals():  # once for all the pieces
            return b"".join(self._piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # -- decoding --------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], pos0: int = 0) -> None:
        """Decode `tokens` at positions pos0.. of sequence 0 for their KV entries alone, n_batch at a time."""
        for i in range(0, len(tokens), self.n_batch):
            self.decode(tokens[i : i + self.n_batch], pos0 + i, "none")

    @overload
    def decode(self, tokens: Sequence[int], pos0: int, outputs: Literal["none"]) -> None: ...

    @overload
    def decode(self, tokens: Sequence[int], pos0: int, outputs: Literal["last", "all"] = "last") -> Logits: ...

    def decode(
        self, tokens: Sequence[int], pos0: int, outputs: Literal["last", "all", "none"] = "last"
    ) -> Logits | None:
        """Decode `tokens` at positions pos0.. of sequence 0; return logits rows ('last', 'all' or 'none')."""
        n = len(tokens)
        if n == 0:
            if outputs != "none":
                raise ValueError("an empty batch has no logits")
            return None
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        if pos0 + n > self.n_ctx:
            raise ContextError(f"context window full: {pos0 + n} > {self.n_ctx} tokens")
        if self._seqs_dirty:
            for i in range(self._seqs_dirty):
                self._batch.seq_id[i][0] = 0
            self._nseq[: self._seqs_dirty] = 1
            self._seqs_dirty = 0
        self._tok[:n] = tokens
        self._pos[:n] = np.arange(pos0, pos0 + n)
        self._logits_flag[:n] = 1 if outputs == "all" else 0
        if outputs == "last":
            self._logits_flag[n - 1] = 1
        self._batch.n_tokens = n
        self._run(n)
        if outputs == "none":
            return None
        return self._logits(n if outputs == "all" else 1)

    def decode_tree(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]]) -> Logits:
        """Decode rows that each belong to the sequences seqs[i] (a row attends to the cells of its first
        sequence), at their own positions; return every row's logits. Draft and verification of a tree."""
        n = len(tokens)
        if n == 0 or n > self.n_batch:
            raise ValueError(f"tree batch of {n} tokens (n_batch {self.n_batch})")
        if max(positions) >= self.n_ctx:
            raise ContextError(f"context window full: {max(positions) + 1} > {self.n_ctx} tokens")
        b = self._batch
        for i, ids in enumerate(seqs):
            if not ids or len(ids) > self.n_seq_max or max(ids) >= self.n_seq_max:
                raise ValueError(f"row {i}: sequence ids {ids} outside 0..{self.n_seq_max - 1}")
            for j, s in enumerate(ids):
                b.seq_id[i][j] = s
            self._nseq[i] = len(ids)
        self._seqs_dirty = max(self._seqs_dirty, n)
        self._tok[:n] = tokens
        self._pos[:n] = positions
        self._logits_flag[:n] = 1
        b.n_tokens = n
        self._run(n)
        return self._logits(n)

    def _run(self, n: int) -> None:
        if self.hook is not None:
            self.hook.begin()
        logged = _log_count
        try:
            with held_signals():  # a decode logs too (a graph reserved anew, a warning)
                rc = llama_cpp.llama_decode(self.ctx, self._batch)
        finally:
            if self.hook is not None:
                self.hook.end()
        if rc != 0:
            raise ModelError(
                f"llama.cpp could not decode a batch of {n} tokens (code {rc}): "
                f"{first_llama_error(_log_count - logged)}"
            )

    def _logits(self, rows: int) -> Logits:
        """The logits of the last decode's first `rows` outputs, copied out of llama.cpp's buffer."""
        ptr = llama_cpp.llama_get_logits(self.ctx)
        logits: Logits = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy()
        if not np.isfinite(logits.sum()) and _broken(logits):
            raise ModelError(
                f"{self.info.path.name}: llama.cpp computed logits that are not numbers (NaN or "
                "infinite): the model's weights or metadata are broken"
            )
        return logits

    def kv_remove_from(self, p0: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, 0, p0, -1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make the cells of sequence src at positions [p0, p1) belong to dst too (-1: open end)."""
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Take sequence seq off its cells at positions [p0, p1); a cell no sequence holds is freed."""
        llama_cpp.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_end(self, seq: int) -> int:
        """pos_max + 1 of a sequence (0: it holds nothing)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, seq)) + 1

    def kv_clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def touch_largest_batch(self) -> None:
        """Decode one batch of n_batch tokens, then forget it. llama.cpp allocates its compute buffers for
        the largest batch, but their pages are touched only as batches that large run: a process measured
        after shorter ones (an auto memory budget) grew later by up to the difference, and a long prompt
        had the budget's cgroup kill it. The routing hook is left off."""
        if self.hook is not None:
            self.hook.off()
        self.kv_clear()
        self.decode([0] * self.n_batch, 0, "last")
        self.kv_clear()

    def kv_end(self) -> int:
        """Number of positions held for sequence 0 (pos_max + 1)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, 0)) + 1

    def close(self) -> None:
        with held_signals():  # freeing a context or model logs
            self._free()

    def _free(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama_cpp.llama_model_free(self.model)
            self.model = None
        hook = getattr(self, "hook", None)  # absent where __init__ failed before making it
        if hook is not None:
            hook.close()
            self.hook = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _broken(logits: Logits) -> bool:
    """Rows no distribution can be made of: a NaN or +inf anywhere, or no finite value at all (−inf alone
    only rules a token out)."""
    return bool(np.isnan(logits).any() or np.isposinf(logits).any() or (~np.isfinite(logits)).all(axis=1).any())
