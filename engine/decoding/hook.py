"""Python side of the native routing hook: numpy buffers the C callback fills in place."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ... import native
from ..model_info import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, ModelInfo

if TYPE_CHECKING:
    from ..offload.native import NativePrefetch

SCORE_RAW, SCORE_LOG, SCORE_LOGIT = 0, 1, 2
PREGATE_MAX = 4  # layers ahead pre-gating may look (native/s2moe_hook.c)


def _ptr(array: npt.NDArray[Any], ctype: type[ctypes._SimpleCData[Any]]) -> Any:
    return array.ctypes.data_as(ctypes.POINTER(ctype))


@dataclass(frozen=True)
class Routing:
    """Routing recorded by one decode. Arrays are copies, safe to keep.

    orig/used: [n_layer, rows, k] expert ids (router's choice / what the matmuls read); -1 where a
    layer was not seen. weight: mixing weights of `used` before any norm.
    """

    orig: npt.NDArray[np.int32]
    used: npt.NDArray[np.int32]
    weight: npt.NDArray[np.float32]
    rows: npt.NDArray[np.int32]  # [n_layer] rows per layer (last layer: output rows only)
    preferred: list[npt.NDArray[np.int32]]  # per layer E* of a gated decode (empty otherwise)

    def distinct_used(self, n_expert: int) -> npt.NDArray[np.int_]:
        """Distinct experts read per layer."""
        return distinct_per_layer(self.used, self.rows, n_expert)

    def used_mask(self, n_expert: int) -> npt.NDArray[np.bool_]:
        """[n_layer, n_expert] bool: the experts read in each layer."""
        return used_mask(self.used, self.rows, n_expert)


@dataclass(frozen=True)
class PregateStats:
    """Pre-gating's predictions, counted as their layers routed. Index: the distance (layers ahead; 0: a
    layer's own router, counted only with check_self)."""

    hits: npt.NDArray[np.int64]  # predicted experts the layer then read
    total: npt.NDArray[np.int64]  # experts read by layers that had a prediction at that distance
    decodes: int  # decodes that pre-gated

    def recall(self, distance: int) -> float:
        """Of the experts layers read, the share predicted `distance` layers ahead (nan: no prediction)."""
        return float(self.hits[distance] / self.total[distance]) if self.total[distance] else float("nan")


def used_mask(
    ids: npt.NDArray[np.integer[Any]], rows: npt.NDArray[np.integer[Any]], n_expert: int
) -> npt.NDArray[np.bool_]:
    n_layer, max_rows, k = ids.shape
    mask = np.zeros((n_layer, n_expert + 1), dtype=bool)
    valid = np.arange(max_rows)[None, :] < rows[:, None]  # [n_layer, rows]
    safe = np.where(valid[:, :, None], ids, n_expert)  # invalid rows hit a spare column
    layer_idx = np.broadcast_to(np.arange(n_layer)[:, None, None], safe.shape)
    mask[layer_idx.ravel(), safe.ravel()] = True
    return mask[:, :n_expert]


def distinct_per_layer(
    ids: npt.NDArray[np.integer[Any]], rows: npt.NDArray[np.integer[Any]], n_expert: int
) -> npt.NDArray[np.int_]:
    distinct: npt.NDArray[np.int_] = used_mask(ids, rows, n_expert).sum(axis=1)
    return distinct


class RoutingHook:
    """Owns the C hook state and its output buffers for one llama_context."""

    def __init__(self, info: ModelInfo, max_rows: int, cap_max: int):
        self.lib = native.library()
        self.n_layer, self.n_expert, self.k = info.n_layer, info.n_expert, info.n_expert_used
        self.max_rows = max_rows
        self.cap_max = max(cap_max, self.k)
        shape = (self.n_layer, max_rows, self.k)
        self.orig = np.zeros(shape, np.int32)
        self.used = np.zeros(shape, np.int32)
        self.weight = np.zeros(shape, np.float32)
        self.rows = np.zeros(self.n_layer, np.int32)
        self.preferred = np.zeros((self.n_layer, self.cap_max), np.int32)
        self.n_preferred = np.zeros(self.n_layer, np.int32)
        self.row_weight = np.ones(max_rows, np.float32)
        self.skip_expert = np.full(self.n_layer, -1, np.int32)
        self.draft_mask = np.ones((self.n_layer, self.n_expert), np.uint8)  # the C side reads it in draft passes
        self.memory_mask = np.zeros((self.n_layer, self.n_expert), np.uint8)  # read in gated decodes, when given
        # [distance, layer, k] the experts pre-gating predicted for each layer in the last decode (-1: none)
        self.predicted = np.full((PREGATE_MAX + 1, self.n_layer, self.k), -1, np.int32)
        self.pregate_depth = 0
        self.pregate_width = self.k
        self.handle = self.lib.s2_hook_new(self.n_layer, self.n_expert, self.k, max_rows, self.cap_max)
        if not self.handle:
            raise MemoryError("native routing hook: allocation failed")
        self.lib.s2_hook_bind(
            self.handle,
            _ptr(self.orig, ctypes.c_int32),
            _ptr(self.used, ctypes.c_int32),
            _ptr(self.weight, ctypes.c_float),
            _ptr(self.rows, ctypes.c_int32),
            _ptr(self.preferred, ctypes.c_int32),
            _ptr(self.n_preferred, ctypes.c_int32),
        )
        if info.biased_selection:
            space = SCORE_RAW
        else:
            space = {GATING_SOFTMAX: SCORE_LOG, GATING_SIGMOID: SCORE_LOGIT, GATING_SOFTMAX_WEIGHT: SCORE_RAW}.get(
                info.gating, SCORE_RAW
            )
        # Where a softmax over the kept weights follows (gpt-oss), a dropped slot needs -inf, not 0.
        drop = float("-inf") if info.gating == GATING_SOFTMAX_WEIGHT else 0.0
        self.lib.s2_hook_configure(self.handle, drop, space, int(info.biased_selection))
        self.mode = "off"
        self._route: NativePrefetch | None = None

    @property
    def callback(self) -> int:
        return native.eval_callback_address()

    @property
    def user_data(self) -> int:
        address = ctypes.cast(self.handle, ctypes.c_void_p).value
        if address is None:
            raise ValueError("the routing hook is closed")
        return address

    def begin(self) -> None:
        self.rows[:] = 0
        self.n_preferred[:] = 0
        if self.pregate_depth:
            self.predicted[:] = -1

    def end(self) -> None:
        """After every decode, returned or failed: no ids view stays narrowed into the graph's next use."""
        self.lib.s2_hook_end(self.handle)

    def off(self) -> None:
        self.lib.s2_hook_off(self.handle)
        self.mode = "off"

    def observe(self) -> None:
        self.lib.s2_hook_observe(self.handle)
        self.mode = "observe"

    def draft(self, k_draft: int, allowed: npt.NDArray[np.bool_] | None = None) -> None:
        """Draft with the top-k_d experts of each layer; with `allowed` ([n_layer, n_expert] bool), the
        router's best-ranked among those only (the router's own next choices where a layer has too few
        allowed: counted in mask_fallbacks). With a prefetcher routed (set_route), an allowed expert must
        also be in memory as its layer routes (refusals counted in mask_evicted)."""
        if allowed is None:
            self.lib.s2_hook_draft(self.handle, int(k_draft))
        else:
            self.draft_mask[:] = allowed
            self.lib.s2_hook_draft_masked(self.handle, int(k_draft), _ptr(self.draft_mask, ctypes.c_uint8))
        self.mode = "draft"

    def skip(self, layers: Iterable[int], expert: int = 0) -> None:
        """Skip the routed experts of the given layers: each slot there reads `expert` with weight 0."""
        self.skip_expert[:] = -1
        self.skip_expert[list(layers)] = expert
        self.lib.s2_hook_skip(self.handle, _ptr(self.skip_expert, ctypes.c_int32))
        self.mode = "skip"

    @contextmanager
    def uniform(self) -> Iterator[None]:
        """Inside, whatever the mode, every slot of every layer reads expert 0 with weight 0: for a warm-up
        that builds graphs and touches buffers, without reading a model larger than memory whole."""
        self.lib.s2_hook_uniform(self.handle, 1)
        try:
            yield
        finally:
            self.lib.s2_hook_uniform(self.handle, 0)

    def gate(
        self,
        alpha: float,
        cap: int,
        row_weights: Sequence[float] | npt.NDArray[np.floating[Any]],
        memory: float = 0.0,
        in_memory: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """Reuse-aware gating: bias each row's selection toward the batch's E* (cap experts; batches of two
        rows or more) by alpha times the row's margin, and with memory > 0 toward the experts in memory by
        memory times it, in every gated decode, a single row's too. `in_memory` ([n_layer, n_expert] bool)
        names those; without it the routed prefetcher is asked as each layer routes (set_route), and with
        neither nothing counts as in memory."""
        n = len(row_weights)
        self.row_weight[:n] = row_weights
        self.row_weight[n:] = 0.0
        if in_memory is None:
            self.lib.s2_hook_prefer_memory(self.handle, float(memory), None)
        else:
            self.memory_mask[:] = in_memory
            self.lib.s2_hook_prefer_memory(self.handle, float(memory), _ptr(self.memory_mask, ctypes.c_uint8))
        self.lib.s2_hook_gate(self.handle, float(alpha), int(cap), _ptr(self.row_weight, ctypes.c_float))
        self.mode = "gate"

    def pregate(self, depth: int, width: int = 0, check_self: bool = False) -> None:
        """Pre-gating: in one-row decodes (not drafts), as each layer routes, apply the routers of the next
        `depth` layers to its input hidden state and hand the `width` best ranked of each one's k predicted
        experts (0: all k) to the routed prefetcher (set_route), which reads them while this layer computes; depth
        0 turns it off. The recall counts all k. check_self: each layer's own router too (distance 0), a check
        that the prediction is computed as the router computes. Never changes routing."""
        if not 0 <= depth <= PREGATE_MAX:
            raise ValueError(f"pre-gating looks 0 to {PREGATE_MAX} layers ahead, not {depth}")
        if not 0 <= width <= self.k:
            raise ValueError(f"pre-gating reads 1 to {self.k} predicted experts a layer (0: all), not {width}")
        self.pregate_depth = depth
        self.pregate_width = width or self.k
        self.predicted[:] = -1
        self.lib.s2_hook_pregate(
            self.handle, int(depth), int(width), int(check_self), _ptr(self.predicted, ctypes.c_int32)
        )

    def pregate_stats(self) -> PregateStats:
        """Since creation: per distance, the predicted experts the layer then read and the experts it read."""
        hits = (ctypes.c_int64 * (PREGATE_MAX + 1))()
        total = (ctypes.c_int64 * (PREGATE_MAX + 1))()
        decodes = self.lib.s2_hook_pregate_stats(self.handle, hits, total)
        return PregateStats(np.array(hits[:], np.int64), np.array(total[:], np.int64), int(decodes))

    def set_route(self, prefetcher: NativePrefetch) -> None:
        """Have the C hook call prefetcher's native layer function with each layer's final expert ids.
        The hook keeps the prefetcher alive for as long as it may call it."""
        self._route = prefetcher
        self.lib.s2_hook_set_route(self.handle, prefetcher.layer_fn_address, prefetcher.handle)
        self.lib.s2_hook_set_resident(self.handle, prefetcher.resident_fn_address, prefetcher.handle)
        self.lib.s2_hook_set_stage(
            self.handle, prefetcher.stage_fn_address if prefetcher.staging else None, prefetcher.handle
        )
        self.lib.s2_hook_set_predict(self.handle, prefetcher.predict_fn_address, prefetcher.handle)

    def clear_route(self, prefetcher: NativePrefetch | None = None) -> None:
        """Stop calling the prefetcher (only `prefetcher`'s route, when one is named)."""
        if prefetcher is not None and self._route is not prefetcher:
            return
        if self.handle:
            self.lib.s2_hook_set_route(self.handle, None, None)
            self.lib.s2_hook_set_resident(self.handle, None, None)
            self.lib.s2_hook_set_stage(self.handle, None, None)
            self.lib.s2_hook_set_predict(self.handle, None, None)
        self._route = None

    @property
    def route(self) -> NativePrefetch | None:
        """The prefetcher the hook hands each layer's ids to, or None."""
        return self._route

    def force_backend_copy(self, on: bool = True) -> None:
        """Move routing data with ggml_backend_tensor_get/set even where the buffers are host memory: the
        code path of GPU-resident activations, exercised on machines without a GPU."""
        self.lib.s2_hook_set_backend_copy(self.handle, int(on))

    def distinct_from(self, min_rows: int) -> None:
        """Never name one expert twice in a row of a batch of at least min_rows rows (0: only where the ids
        live in a device buffer). CUDA's MUL_MAT_ID aborts on a repeated id, and with op offload a batch
        of GGML_OP_OFFLOAD_MIN_BATCH rows runs there even when the layer is on the CPU."""
        self.lib.s2_hook_set_distinct_min_rows(self.handle, int(min_rows))

    def hooked(self) -> int:
        return int(self.lib.s2_hook_hooked(self.handle))

    def skipped(self) -> int:
        return int(self.lib.s2_hook_skipped(self.handle))

    def mask_fallbacks(self) -> int:
        """Kept draft slots, since creation, that a residency mask could not fill from the experts it
        allows (each reads the router's own choice, which may have to be fetched)."""
        return int(self.lib.s2_hook_mask_fallbacks(self.handle))

    def narrowed(self) -> int:
        """Draft layers, since creation, whose expert matmuls ran on k_d slots instead of k (CPU only: the
        dropped slots then cost no compute, where repeated ids would be computed again)."""
        return int(self.lib.s2_hook_narrowed(self.handle))

    def unwidened(self) -> int:
        """Narrowed ids views, since creation, whose down matmul never reached the hook (restored by end())."""
        return int(self.lib.s2_hook_unwidened(self.handle))

    def mask_evicted(self) -> int:
        """Experts, since creation, that a draft's mask allowed but that were out of memory when their layer
        routed (pages evicted since the mask was made, or never in memory where the mask allows any)."""
        return int(self.lib.s2_hook_mask_evicted(self.handle))

    def snapshot(self, n_rows: int) -> Routing:
        rows = np.minimum(self.rows, n_rows).astype(np.int32)
        orig = self.orig[:, :n_rows].copy()
        used = self.used[:, :n_rows].copy()
        invalid = np.arange(n_rows)[None, :] >= rows[:, None]
        orig[invalid] = -1
        used[invalid] = -1
        preferred = [self.preferred[layer, : self.n_preferred[layer]].copy() for layer in range(self.n_layer)]
        return Routing(orig, used, self.weight[:, :n_rows].copy(), rows, preferred)

    def close(self) -> None:
        if self.handle:
            self.lib.s2_hook_free(self.handle)
            self.handle = None
        self._route = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
