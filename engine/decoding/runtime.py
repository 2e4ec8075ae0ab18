"""A thin, typed layer over llama-cpp-python's low-level API: one model, one context, one sequence.

The routing hook is installed as the context's cb_eval, so every decode passes through it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Literal, overload

import llama_cpp
import numpy as np

# numpy imports numpy.random on first use; a Ctrl-C that lands in that import (the initialisation of its
# compiled modules) is lost, and the run goes on. Imported here, with the engine, it happens before any
# model is loaded, not in the middle of the first generation.
import numpy.random  # noqa: F401
import numpy.typing as npt

from ..errors import ConfigError, ContextError, ModelError, held_signals
from ..measure.device import default_threads
from ..model_info import ModelInfo
from ..offload.procfs import model_mappings
from . import llama_process
from .gpu import MIN_BATCH_DEFAULT, BuftOverrides, Placement, cpu_buffer_type, gpu_backend
from .hook import RoutingHook
from .llama_process import compute_buffers, first_llama_error, init_backend, last_llama_error
from .runtime_settings import DEFAULT_BATCH, MIN_CTX, check_ctx, check_ctx_memory, check_threads

# Rows of next-token logits (n_vocab wide), as llama.cpp computes them
Logits = npt.NDArray[np.float32]


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
        init_backend(placement.op_offload_min_batch)
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
            self.hook.distinct_from(
                int(llama_process.backend_min_batch) if llama_process.backend_min_batch else MIN_BATCH_DEFAULT
            )
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
            compute_buffers.clear()
            with held_signals():
                self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                llama_cpp.llama_model_free(self.model)
                self.model = None
                raise ModelError(f"llama.cpp could not create a context for {info.path.name}: {last_llama_error()}")
            # host memory only: a GPU's own buffers are not the process's
            self.compute_buffer_bytes = sum(
                size for kind, size in compute_buffers if kind == "CPU" or kind.endswith("_Host")
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
        # the most rows one decode has run: llama.cpp's compute buffers are touched in full only once a batch
        # of n_batch rows ran (a memory budget counts what is not touched yet)
        self.largest_batch = 0
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
        self.largest_batch = max(self.largest_batch, n)
        if self.hook is not None:
            self.hook.begin()
        logged = llama_process.log_count
        try:
            with held_signals():  # a decode logs too (a graph reserved anew, a warning)
                rc = llama_cpp.llama_decode(self.ctx, self._batch)
        finally:
            if self.hook is not None:
                self.hook.end()
        if rc != 0:
            raise ModelError(
                f"llama.cpp could not decode a batch of {n} tokens (code {rc}): "
                f"{first_llama_error(llama_process.log_count - logged)}"
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
