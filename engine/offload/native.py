"""The C prefetcher and miss counter (native/s2moe_offload.c), driven by the routing hook."""

from __future__ import annotations

import ctypes
from _ctypes import CFuncPtr

import numpy as np
import numpy.typing as npt

from .mapping import ModelMapping


def _address(fn: CFuncPtr) -> int:
    """Where a C function of a loaded library is, for native code to call it."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    if address is None:  # a symbol the library resolved is never at 0
        raise OSError("a native function has no address")
    return address


class NativePrefetch:
    """The C prefetcher (native/s2moe_offload.c) over a ModelMapping: madvise(WILLNEED) of exact expert
    ranges without Python in the loop. `handle` and `layer_fn_address` let native code (the routing hook)
    call s2_prefetch_layer(handle, layer, ids, n) the moment a layer's top-k ids are known.

    The same call counts, per layer, the experts that are not wholly in memory at that moment (mincore on
    their own ranges): begin() / counted() bracket a decode. With advise=False it only counts. Every
    residency question here costs in proportion to the experts asked about, never to the file's size."""

    def __init__(self, mapping: ModelMapping, *, advise: bool = True):
        from ... import native

        lib = native.library()
        vp, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)
        u8p = ctypes.POINTER(ctypes.c_uint8)
        sigs = {
            "s2_prefetch_new": (vp, [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64p]),
            "s2_prefetch_free": (None, [vp]),
            "s2_prefetch_configure": (None, [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]),
            "s2_prefetch_resident": (ctypes.c_int, [vp, u8p, u8p]),
            "s2_prefetch_expert_resident": (ctypes.c_int, [vp, ctypes.c_int, ctypes.c_int]),
            "s2_prefetch_layer": (ctypes.c_int, [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32), ctypes.c_int]),
            "s2_prefetch_mask": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_uint8)]),
            "s2_prefetch_set_ahead": (None, [vp, ctypes.POINTER(ctypes.c_uint8)]),
            "s2_prefetch_bytes": (ctypes.c_int64, [vp]),
            "s2_prefetch_calls": (ctypes.c_int64, [vp]),
            "s2_fetch_start": (ctypes.c_int, [vp, ctypes.c_char_p, ctypes.c_int, ctypes.c_int64]),
            "s2_fetch_stop": (None, [vp]),
            "s2_fetch_want": (None, [vp, u8p]),
            "s2_fetch_verify": (None, [vp]),
            "s2_fetch_stats": (None, [vp, i64p, ctypes.POINTER(ctypes.c_double)]),
            "s2_fetch_taken_at": (None, [vp, ctypes.POINTER(ctypes.c_int32)]),
            "s2_cache_keep": (
                ctypes.c_int,
                [vp, ctypes.c_char_p, vp, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64, u8p],
            ),
            "s2_cache_stats": (None, [vp, i64p]),
            "s2_cache_resize": (None, [vp, ctypes.c_int64, ctypes.c_int64]),
            "s2_cache_pin": (None, [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
            "s2_cache_lead": (None, [vp, ctypes.c_int]),
            "s2_cache_drop_mapping": (None, [vp, vp, ctypes.c_size_t, ctypes.c_size_t]),
            "s2_prefetch_set_stages": (None, [vp, ctypes.POINTER(ctypes.c_int32), ctypes.c_int64, ctypes.c_int]),
            "s2_prefetch_stage_order": (ctypes.c_int, [vp, ctypes.POINTER(ctypes.c_int32)]),
            "s2_prefetch_stage": (ctypes.c_int, [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
            "s2_prefetch_predicted": (ctypes.c_int, [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32), ctypes.c_int]),
            "s2_prefetch_pregate_stats": (None, [vp, i64p]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib, self.mapping = lib, mapping
        em = mapping.emap
        self._ranges = np.ascontiguousarray(em.ranges, dtype=np.int64)
        self.handle = lib.s2_prefetch_new(
            mapping.addr,
            mapping.size,
            em.n_layer,
            em.n_expert,
            self._ranges.shape[2],
            self._ranges.ctypes.data_as(i64p),
        )
        if not self.handle:
            raise MemoryError("native prefetcher: allocation failed")
        self.misses = np.zeros(em.n_layer, np.int32)
        self.staging = False  # the routing hook calls the prefetcher as each expert matmul runs
        self.stage_room: int | None = None  # past it, a layer's fetched experts are read part by part
        self._shape = (em.n_layer, em.n_expert)
        self.advise = advise
        self.fetching = False
        self.cache_capacity: int | None = None  # bytes of the expert cache kept here (None: the kernel's)

    @property
    def advise(self) -> bool:
        return self._advise

    @advise.setter
    def advise(self, on: bool) -> None:
        self._advise = bool(on)
        self.lib.s2_prefetch_configure(self.handle, int(on), self.misses.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))

    def set_ahead(self, mask: npt.ArrayLike | None) -> None:
        """The experts [n_layer, n_expert] the coming decode is predicted to read (None: no prediction):
        as each layer routes, the next layer's are asked for too."""
        if mask is None:
            self._ahead = None
            self.lib.s2_prefetch_set_ahead(self.handle, None)
            return
        self._ahead = np.ascontiguousarray(mask, dtype=np.uint8)  # the C side reads it: keep it alive
        self.lib.s2_prefetch_set_ahead(self.handle, self._ahead.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))

    def begin(self) -> None:
        """Start counting misses for the next decode (Decoder.miss_counter)."""
        self.misses[:] = 0

    def counted(self) -> npt.NDArray[np.int32]:
        """[n_layer] experts the decode since begin() read that were not wholly in memory as it routed."""
        return self.misses.copy()

    def resident(self, mask: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """[n_layer, n_expert] bool: of the experts set in mask, those whose every page is in memory."""
        m = np.ascontiguousarray(mask, dtype=np.uint8)
        out = np.zeros(self._shape, np.uint8)
        u8p = ctypes.POINTER(ctypes.c_uint8)
        self.lib.s2_prefetch_resident(self.handle, m.ctypes.data_as(u8p), out.ctypes.data_as(u8p))
        return out.astype(bool)

    @property
    def layer_fn_address(self) -> int:
        return _address(self.lib.s2_prefetch_layer)

    @property
    def stage_fn_address(self) -> int:
        """s2_prefetch_stage(handle, layer, kind, ask): the routing hook's call as a layer's up, gate, down
        matmuls run."""
        return _address(self.lib.s2_prefetch_stage)

    def set_stages(self, kind_part: tuple[int, int, int] | None, room: int | None, stream: bool = False) -> None:
        """Ask for a layer's parts in the order its matmuls run (learned from the routing hook's stage calls),
        and read a layer whose fetched experts take more than `room` bytes one part at a time (None: none).
        kind_part: the part indices of its up, gate and down matrices; None: neither. stream: the expert
        ranges of llama.cpp's mapping fault single pages (MADV_RANDOM), so that a part that alone outgrows
        `room` can be streamed: a thread of ours reads it a little ahead of the matmul and drops what the
        matmul has gone past (native/s2moe_offload.c)."""
        i32p = ctypes.POINTER(ctypes.c_int32)
        kp = np.ascontiguousarray(kind_part if kind_part is not None else (-1, -1, -1), np.int32)
        self.lib.s2_prefetch_set_stages(
            self.handle, kp.ctypes.data_as(i32p), -1 if room is None else int(room), int(stream)
        )
        self.staging = kind_part is not None
        self.stage_room = room if kind_part is not None else None

    @property
    def stage_order(self) -> tuple[int, ...]:
        """The kinds (0 up, 1 gate, 2 down) in the order a layer's matmuls ran, as far as learned."""
        out = np.zeros(3, np.int32)
        n = self.lib.s2_prefetch_stage_order(self.handle, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
        return tuple(int(x) for x in out[:n])

    def stage(self, layer: int, kind: int) -> int:
        """As the routing hook calls it once layer's matmul of `kind` (0 up, 1 gate, 2 down) ran: the number
        of experts whose used part was dropped."""
        return int(self.lib.s2_prefetch_stage(self.handle, int(layer), int(kind), 0))

    def wants_stage(self, layer: int, kind: int) -> bool:
        """The routing hook's question before it stops the graph for that call."""
        return bool(self.lib.s2_prefetch_stage(self.handle, int(layer), int(kind), 1))

    @property
    def predict_fn_address(self) -> int:
        """s2_prefetch_predicted(handle, layer, ids, n): the routing hook's pre-gating call with the experts a
        later layer's router predicts for it."""
        return _address(self.lib.s2_prefetch_predicted)

    def predicted(self, layer: int, ids: npt.ArrayLike) -> int:
        """As the routing hook's pre-gating calls it: ask for the experts among ids predicted for layer that
        are not in memory. Returns how many were asked for."""
        asked = np.ascontiguousarray(ids, dtype=np.int32)
        return int(
            self.lib.s2_prefetch_predicted(
                self.handle, int(layer), asked.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(asked)
            )
        )

    def pregate_stats(self) -> dict[str, int]:
        """Experts pre-gating read (and bytes), of them those their layer then used and those it did not
        (read for nothing: a wrong guess, which enters the kept cache at its least recent end)."""
        out = (ctypes.c_int64 * 6)()
        self.lib.s2_prefetch_pregate_stats(self.handle, out)
        return {
            "read": int(out[0]),
            "read_bytes": int(out[1]),
            "used": int(out[2]),
            "used_bytes": int(out[3]),
            "wasted": int(out[4]),
            "wasted_bytes": int(out[5]),
        }

    @property
    def resident_fn_address(self) -> int:
        """s2_prefetch_expert_resident(handle, layer, expert): the routing hook's live residency question."""
        return _address(self.lib.s2_prefetch_expert_resident)

    def layer(self, layer: int, ids: npt.ArrayLike) -> int:
        routed = np.ascontiguousarray(ids, dtype=np.int32)
        return int(
            self.lib.s2_prefetch_layer(
                self.handle, int(layer), routed.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(routed)
            )
        )

    def mask(self, mask: npt.ArrayLike) -> int:
        m = np.ascontiguousarray(mask, dtype=np.uint8)
        return int(self.lib.s2_prefetch_mask(self.handle, m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))))

    def start_fetching(self, workers: int, room_bytes: int) -> None:
        """Start `workers` threads that read, in layer order, the experts want() names for the coming
        verification, keeping at most room_bytes read ahead of the layer it has reached."""
        path = str(self.mapping.emap.path).encode()
        if self.lib.s2_fetch_start(self.handle, path, int(workers), int(room_bytes)) != 0:
            raise OSError(f"cannot start {workers} expert reader threads on {self.mapping.emap.path}")
        self.fetching = True

    def want(self, mask: npt.ArrayLike) -> None:
        """The experts [n_layer, n_expert] newly predicted for the coming verification (the first call after
        a verification starts the next proposal's list)."""
        m = np.ascontiguousarray(mask, dtype=np.uint8)
        self.lib.s2_fetch_want(self.handle, m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))

    def verification_starts(self) -> None:
        """From now on the layers the routing hook reports are the verification's progress."""
        self.lib.s2_fetch_verify(self.handle)

    def fetch_stats(self) -> dict[str, float]:
        """Experts the reader threads read, found already in memory, or never reached before their layer
        passed; bytes read and seconds spent reading (summed over threads)."""
        out = (ctypes.c_int64 * 4)()
        seconds = ctypes.c_double(0.0)
        self.lib.s2_fetch_stats(self.handle, out, ctypes.byref(seconds))
        return {
            "read": int(out[0]),
            "resident": int(out[1]),
            "late": int(out[2]),
            "bytes": int(out[3]),
            "seconds": float(seconds.value),
        }

    def fetch_taken_at(self) -> npt.NDArray[np.int32]:
        """[n_layer, n_expert]: how many layers the verification had routed when a reader thread took each
        expert (-1: before the verification started; -2: not taken since it was wanted)."""
        out = np.full(self._shape, -2, np.int32)
        self.lib.s2_fetch_taken_at(self.handle, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
        return out

    def keep_cache(self, llama_addr: int, file_lo: int, file_hi: int, capacity: int, pinned: npt.ArrayLike) -> None:
        """Keep the expert cache here instead of leaving it to the kernel: the routed experts in a
        least-recently-used list of `capacity` bytes, what falls off it unmapped from llama.cpp's mapping
        (at llama_addr, covering file offsets file_lo..file_hi) and dropped from the page cache.
        pinned [n_layer, n_expert]: never counted or dropped (the C side keeps a copy)."""
        mask = np.ascontiguousarray(pinned, dtype=np.uint8)
        path = str(self.mapping.emap.path).encode()
        if (
            self.lib.s2_cache_keep(
                self.handle,
                path,
                llama_addr,
                file_lo,
                file_hi,
                int(capacity),
                mask.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
            )
            != 0
        ):
            raise OSError(f"cannot keep an expert cache over {self.mapping.emap.path}")
        self.cache_capacity = int(capacity)

    def resize_cache(self, capacity: int, stage_room: int | None) -> None:
        """The kept cache holds `capacity` bytes from now on (its least recent experts leave memory at once), and
        a layer is read in stages past `stage_room` bytes (where layers are staged at all)."""
        if self.cache_capacity is None:
            return
        room = -1 if stage_room is None or self.stage_room is None else int(stage_room)
        self.lib.s2_cache_resize(self.handle, int(capacity), room)
        self.cache_capacity = int(capacity)
        if room >= 0:
            self.stage_room = room

    def set_pinned(self, layer: int, expert: int, pinned: bool) -> None:
        """A pinned expert gives way to the process's growth (its pages leave memory here, once the caller's
        own mapping no longer locks them), or is pinned again (the cache stops counting it)."""
        if self.cache_capacity is not None:
            self.lib.s2_cache_pin(self.handle, int(layer), int(expert), int(pinned))

    def drop_mapping(self, addr: int, file_lo: int, file_hi: int) -> None:
        """Unmap the experts from another mapping of the model file (at addr, covering file offsets
        file_lo..file_hi) and drop from memory what only it mapped; the kept cache's experts stay."""
        self.lib.s2_cache_drop_mapping(self.handle, addr, file_lo, file_hi)

    def cache_stats(self) -> dict[str, int]:
        """Bytes the kept expert cache holds, experts evicted from it, evictions the kernel refused part of,
        experts it held that the kernel had reclaimed all the same when they were routed (the budget's
        reclaim reaching into the cache), layers read part by part and parts of theirs streamed (set_stages),
        experts entered at the least recent end (read only by a verification's drafted rows: lead), streamed
        parts dropped once the matmul had gone past them."""
        out = (ctypes.c_int64 * 8)()
        self.lib.s2_cache_stats(self.handle, out)
        return {
            "held": int(out[0]),
            "evicted": int(out[1]),
            "refused": int(out[2]),
            "lost": int(out[3]),
            "staged": int(out[4]),
            "streamed": int(out[5]),
            "behind": int(out[6]),
            "dropped_behind": int(out[7]),
        }

    def lead(self, ids: int) -> None:
        """The first `ids` of each routed layer's ids from now on are a verification's first row, whose output
        is kept whatever it decides: only the experts they read become the kept cache's most recent; those
        only the drafted rows read enter at its least recent end. 0: every id counts (a plain step)."""
        self.lib.s2_cache_lead(self.handle, int(ids))

    @property
    def bytes_advised(self) -> int:
        return int(self.lib.s2_prefetch_bytes(self.handle))

    def close(self) -> None:
        if getattr(self, "handle", None):
            self.lib.s2_prefetch_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
