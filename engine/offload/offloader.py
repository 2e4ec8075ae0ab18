"""The Offloader: pinning, routing-driven prefetch, miss counting and residency for one decoder.

It is what a Decoder is given (Decoder.attach) to see each verification: it counts which predicted
experts were already resident, prefetches where asked, and reports the experts a verification read that
were not in memory (through the native prefetcher the routing hook calls as each layer routes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .budget import BudgetPlan
from .experts import ExpertMap, expert_map
from .libc import MADV_NORMAL, MADV_RANDOM, raise_memlock_limit
from .mapping import ModelMapping
from .native import NativePrefetch
from .procfs import model_mappings, process_anon_bytes
from .sizes import PAGE, fmt_bytes

if TYPE_CHECKING:
    from ..decoding.decoder import Decoder


@dataclass(frozen=True)
class Residency:
    """A residency snapshot, e.g. for the app's heatmap."""

    resident: npt.NDArray[np.float64]  # [n_layer, n_expert] fraction of each expert's pages in memory
    pinned: npt.NDArray[np.bool_]  # [n_layer, n_expert]
    # [n_layer] predicted experts already resident when a verification started (nan: none)
    hit_rate: npt.NDArray[np.float64]
    lookups: int
    prefetched_bytes: int
    locked_bytes: int


@dataclass
class OffloadStats:
    hits: npt.NDArray[np.float64]
    lookups: npt.NDArray[np.float64]
    prefetch_calls: int = 0
    prefetched_bytes: int = 0
    prefetch_seconds: float = 0.0

    def hit_rate(self) -> npt.NDArray[np.float64]:
        with np.errstate(invalid="ignore", divide="ignore"):
            rate: npt.NDArray[np.float64] = np.where(self.lookups > 0, self.hits / np.maximum(self.lookups, 1), np.nan)
        return rate


class Offloader:
    """Pinning, routing-driven prefetch and residency metrics for one decoder. Made by offload_decoder,
    which pins, plans the budget and attaches it to the decoder (it implements the decoder's
    VerifyObserver: predicted, verifying, start_counting, misses, residency)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        prefetch: bool = True,
        emap: ExpertMap | None = None,
        prefetch_bytes: int | None = None,
    ):
        self.emap = emap or expert_map(model_path)
        self.map = ModelMapping(self.emap)
        self.prefetch = prefetch
        # At most this many bytes are asked for per verification (None: no limit). Prefetching more than
        # the expert cache holds evicts what was fetched before it is used.
        self.prefetch_bytes = prefetch_bytes
        n = self.emap.n_layer
        self.stats = OffloadStats(np.zeros(n), np.zeros(n))
        self.pinned_split = {"non_expert": 0, "code": 0, "hot_experts": 0}
        self.fault_readahead = "default"
        # counts misses for the routing hook (and prefetches just in time when offload_decoder says so)
        self.native = NativePrefetch(self.map, advise=False)
        self._room = prefetch_bytes if prefetch_bytes is not None else 1 << 62
        self.lookahead = False  # as each layer of a verification routes, ask for the next layer's predicted experts
        self.budget_bytes: int | None = None  # the budget it was planned for (auto: as sized)
        self.budget_note: str | None = None  # how an auto budget was sized where it is not the usual way
        self.plan: BudgetPlan | None = None  # when a budget was given
        self._decoder: Decoder | None = None  # the decoder it is attached to
        self._cache_mapping: tuple[int, int] | None = None  # (address, length): the mapping the kept cache manages
        self._every: npt.NDArray[np.bool_] | None = None  # every expert: what a draft may read if in memory
        self._lead = False  # the native cache was told a verification's first row (NativePrefetch.lead)
        self._planned_stage_room: int | None = None  # read in stages past it, as planned (read_parts_in_order)
        self.fit_every_s = 0.5  # how often a decode step looks at what the process holds (fit_cache_to_process)
        self._fitted_at = float("-inf")
        self.hot: list[tuple[int, int]] = []  # the pinned hot experts, most routed first
        self.hot_given = 0  # how many of the last of them gave way to the process's growth

    def attach(self, decoder: Decoder, *, jit_prefetch: bool) -> None:
        """Observe decoder's verifications; the routing hook hands every layer's final ids to the native
        prefetcher, which counts the experts not in memory at that moment and, with jit_prefetch, asks
        the OS for them before the layer's expert matmuls run."""
        self.native.advise = jit_prefetch
        if decoder.rt.hook is not None:
            decoder.rt.hook.set_route(self.native)
        decoder.attach(self)
        self._decoder = decoder

    def start_fetching(self, workers: int, room_bytes: int) -> None:
        """Have `workers` threads read each verification's predicted experts as the draft predicts them, at
        most room_bytes ahead of the verification's progress (see native/s2moe_offload.c)."""
        self.native.start_fetching(workers, room_bytes)

    def pregate(self, depth: int, width: int = 0) -> None:
        """Pre-gate the attached decoder's one-row decodes `depth` layers ahead, reading the `width` best ranked
        of each layer's predicted experts (RoutingHook.pregate), until this offloader closes."""
        hook = self._decoder.rt.hook if self._decoder is not None else None
        if hook is not None:
            hook.pregate(depth, width)

    def fetch_stats(self) -> dict[str, float] | None:
        return self.native.fetch_stats() if self.native.fetching else None

    def pin(self, *, non_expert: bool = True, code: bool = True, hot: Sequence[tuple[int, int]] = ()) -> dict[str, int]:
        raise_memlock_limit()
        if non_expert:
            self.pinned_split["non_expert"] += self.map.pin_non_expert()
        if code:
            self.pinned_split["code"] += self.map.pin_code()
        if hot:
            self.pinned_split["hot_experts"] += self.map.pin_experts(hot)
            self.hot += [(int(layer), int(e)) for layer, e in hot]
        return dict(self.pinned_split)

    def unpinned_non_expert(self) -> list[tuple[int, int]]:
        """File ranges of non-expert tensors that pinning leaves to the page cache (the token embedding
        table when a separate output matrix exists): read one row per token, at random."""
        pinned = set(self.emap.pinnable())
        return [r for r in self.emap.non_expert if r not in pinned and r[1] > 0]

    def advise_fault_readahead(self, random: bool) -> int:
        """madvise llama.cpp's mapping of the model so that a page fault reads only the faulting page
        (MADV_RANDOM) instead of a read-around window (read_ahead_kb, up to MiBs): on the unpinned
        embedding table always — one token's row is a few hundred bytes, and a window around it reads
        (and makes room for) MiBs of neighbouring experts every step; on the expert tensors when
        `random`, else they get MADV_NORMAL back. Returns the bytes advised RANDOM."""
        lo = int(self.emap.ranges[..., 0][self.emap.ranges[..., 1] > 0].min())
        hi = int((self.emap.ranges[..., 0] + self.emap.ranges[..., 1]).max())
        spans = [(o, o + n, MADV_RANDOM) for o, n in self.unpinned_non_expert()]
        spans.append((lo, hi, MADV_RANDOM if random else MADV_NORMAL))
        total = 0
        for addr, length, foff in model_mappings(self.emap.path, exclude=(self.map.addr, self.map.size)):
            for s_lo, s_hi, advice in spans:
                a, b = max(s_lo, foff), min(s_hi, foff + length)
                if b <= a:
                    continue
                # whole pages only, and only inside the span: a page shared with a pinned tensor is resident
                start_al = (addr + (a - foff) + PAGE - 1) // PAGE * PAGE
                end_al = (addr + (b - foff)) // PAGE * PAGE
                if (
                    end_al > start_al
                    and self.map.c.lib.madvise(start_al, end_al - start_al, advice) == 0
                    and advice == MADV_RANDOM
                ):
                    total += end_al - start_al
        self.fault_readahead = "off" if random else ("embeddings-off" if total else "default")
        return total

    def keep_expert_cache(
        self, capacity: int, pinned: Iterable[tuple[int, int]] = (), llama_mappings: Iterable[tuple[int, int, int]] = ()
    ) -> bool:
        """Keep a least-recently-used cache of `capacity` bytes of routed experts (the `pinned` (layer,
        expert) pairs aside), dropping from memory what falls off it (native/s2moe_offload.c says why the
        kernel's choice is worse). llama_mappings: (address, length, file offset) of the mappings the
        decoder's model made (LlamaRuntime.file_mappings). False where none covers every expert in one piece
        (the kernel keeps the cache then)."""
        lo = int(self.emap.ranges[..., 0][self.emap.ranges[..., 1] > 0].min())
        hi = int((self.emap.ranges[..., 0] + self.emap.ranges[..., 1]).max())
        for addr, length, foff in llama_mappings:
            if foff <= lo and hi <= foff + length:
                mask = np.zeros((self.emap.n_layer, self.emap.n_expert), np.uint8)
                for layer, e in pinned:
                    mask[layer, e] = 1
                self.native.keep_cache(addr, foff, foff + length, capacity, mask)
                self._cache_mapping = (addr, length)
                self._drop_other_mappings(addr, length)  # a second load's warm-up reads would stay beside the cache
                return True
        return False

    def read_parts_in_order(self, stage_room: int | None = None) -> bool:
        """Ask for each layer's experts part by part in the order its matmuls run (up, gate, down, learned
        from the first layer): a matmul runs its experts in id order, so it starts on the first expert's part
        while the others' are still read. Past `stage_room` bytes (None: never), a layer's fetched experts
        are read one part at a time, each part dropped once used: asked for all at once, what does not fit is
        reclaimed before its matmul reads it, and faulted back a page at a time; a part that alone is larger
        (a prompt's prefill) is streamed where faults read single pages (advise_fault_readahead first). False
        where the experts are not separate up, gate and down tensors alike in every layer."""
        kinds: set[tuple[int | None, ...]] = set()
        for names in self.emap.parts:
            kinds.add(
                tuple(
                    next((j for j, n in enumerate(names) if f"ffn_{kind}_exps" in n), None)
                    for kind in ("up", "gate", "down")
                )
            )
        if len(kinds) != 1:
            return False
        up, gate, down = next(iter(kinds))
        if up is None or gate is None or down is None:
            return False
        self.native.set_stages((up, gate, down), stage_room, stream=self.fault_readahead == "off")
        self._planned_stage_room = stage_room
        return True

    def fit_cache_to_process(self) -> None:
        """Under a budget plan whose expert cache is kept here, the cache gives way to what the process has
        grown past the plan's count of it, in whole MiBs (the stage room with it). The budget is fixed, and the
        process does grow: its heap fragments over a run's generations, and the slack is largely taken by file
        pages the plan does not count. Left as planned, the cache and the reads asked for would outgrow the
        budget, and its reclaim would take pages asked for before their matmuls read them, each then faulted
        again a page at a time. Past what the cache holds the pinned hot experts give way, the least routed
        first, whole experts; they are pinned again once the process has shrunk a MiB below the room they need
        (so that a process at the edge does not read one in and out every look)."""
        plan = self.plan
        if plan is None or self.native.cache_capacity is None:
            return
        grown = max(0, process_anon_bytes() - plan.anon_bytes) >> 20 << 20
        self._give_hot(grown - plan.cache_bytes)
        capacity = max(0, plan.cache_bytes - grown)
        if capacity == self.native.cache_capacity:
            return
        given = plan.cache_bytes - capacity
        stage_room = None if self._planned_stage_room is None else max(0, self._planned_stage_room - given)
        self.native.resize_cache(capacity, stage_room)

    def _give_hot(self, beyond: int) -> None:
        """As many of the last pinned hot experts give way as free `beyond` bytes (none where it is not positive)."""

        def last_freeing(n_bytes: int) -> int:
            n = freed = 0
            while freed < n_bytes and n < len(self.hot):
                n += 1
                freed += int(self.emap.expert_bytes[self.hot[-n][0]])
            return n

        want = max(last_freeing(beyond), min(self.hot_given, last_freeing(beyond + (1 << 20))))
        while self.hot_given < want:
            self.hot_given += 1
            layer, e = self.hot[-self.hot_given]
            self.pinned_split["hot_experts"] -= self.map.unpin_expert(layer, e)
            self.native.set_pinned(layer, e, False)
        while self.hot_given > want:
            layer, e = self.hot[-self.hot_given]
            self.hot_given -= 1
            self.native.set_pinned(layer, e, True)
            self.pinned_split["hot_experts"] += self.map.pin_experts([(layer, e)])

    def pregate_text(self) -> str:
        """One phrase on pre-gating (the routing hook's pregate): its recall at each distance, what it read and
        what of that for nothing, a token; empty where it is off."""
        hook = self._decoder.rt.hook if self._decoder is not None else None
        if hook is None or not hook.pregate_depth:
            return ""
        stats, read = hook.pregate_stats(), self.native.pregate_stats()
        depth = hook.pregate_depth
        recall = ", ".join(f"{d} ahead {stats.recall(d):.0%}" for d in range(1, depth + 1))
        tokens = max(stats.decodes, 1)
        width = f", the best {hook.pregate_width} of {hook.k} read" if hook.pregate_width < hook.k else ""
        return (
            f"pre-gating {depth} layer{'s' if depth > 1 else ''} ahead{width}: recall {recall}; read ahead "
            f"{fmt_bytes(read['read_bytes'] / tokens)} a token, {fmt_bytes(read['wasted_bytes'] / tokens)} of it "
            f"for nothing ({stats.decodes} one-row decodes)"
        )

    @property
    def keeps_expert_cache(self) -> bool:
        return self._cache_mapping is not None

    # -- VerifyObserver ------------------------------------------------------------------------------
    def drafted_elsewhere(self, mappings: Iterable[tuple[int, int, int]]) -> None:
        """A draft ran on other mappings of the model file: what it read leaves memory (the kept cache's
        experts aside), so that its reads do not sit beside the cache until reclaim takes the cache's."""
        if self._cache_mapping is not None:
            for addr, length, foff in mappings:
                self.native.drop_mapping(addr, foff, foff + length)

    def _drop_other_mappings(self, start: int, size: int) -> None:
        """Every mapping of the file but llama.cpp's the cache manages (at start, size bytes) and ours (mlock
        and madvise split a mapping into several areas: those inside it are its own)."""
        self.drafted_elsewhere(
            [
                (addr, length, foff)
                for addr, length, foff in model_mappings(self.emap.path, exclude=(self.map.addr, self.map.size))
                if not start <= addr < start + size
            ]
        )

    def predicted(self, predicted: npt.ArrayLike) -> None:
        """Experts the next verification will read, as the draft predicts them: count those already
        resident; with `prefetch`, WILLNEED the others while the draft goes on."""
        t0 = time.perf_counter()
        mask = np.asarray(predicted, bool)
        hit = self.native.resident(mask)  # looks at the predicted experts' pages only
        if self.native.fetching:
            self.native.want(mask)
        self.stats.lookups += mask.sum(axis=1)
        self.stats.hits += (mask & hit).sum(axis=1)
        if self.prefetch:
            eb = self.emap.expert_bytes
            for layer, expert in zip(*np.nonzero(mask & ~hit)):  # layer order: earliest needed first
                if eb[layer] > self._room:
                    break
                self._room -= int(eb[layer])
                self.stats.prefetched_bytes += self.map.willneed(int(layer), int(expert))
            self.stats.prefetch_calls += 1
        self.stats.prefetch_seconds += time.perf_counter() - t0

    def verifying(self, predicted: npt.NDArray[np.bool_] | None, first_row_ids: int) -> None:
        now = time.monotonic()
        if now - self._fitted_at >= self.fit_every_s:
            self._fitted_at = now
            self.fit_cache_to_process()
        if self.native.fetching:
            self.native.verification_starts()
        if self.lookahead:
            self.native.set_ahead(predicted)
        if first_row_ids:
            self.native.lead(first_row_ids)
            self._lead = True

    def verified(self) -> None:
        if self._lead:  # a plain step never set it
            self.native.lead(0)
            self._lead = False

    def start_counting(self) -> None:
        self.native.begin()
        # what one draft may prefetch for its verification: more than the expert cache holds evicts what
        # was fetched before it is used
        self._room = self.prefetch_bytes if self.prefetch_bytes is not None else 1 << 62

    def misses(self) -> npt.NDArray[np.int32]:
        return self.native.counted()

    def draft_allowed(self) -> npt.NDArray[np.bool_]:
        """[n_layer, n_expert] bool: every expert. A draft reads only what is in memory as its layer routes:
        the routing hook asks the native prefetcher about each candidate then (mincore of its own ranges),
        which costs less than a snapshot of every expert per proposal and cannot go stale between the
        proposal's draft passes."""
        if self._every is None:
            self._every = np.ones((self.emap.n_layer, self.emap.n_expert), bool)
        return self._every

    def residency(self) -> Residency:
        return Residency(
            self.map.expert_residency(),
            self.map.pinned,
            self.stats.hit_rate(),
            int(self.stats.lookups.sum()),
            self.stats.prefetched_bytes,
            self.map.locked_bytes,
        )

    def close(self) -> None:
        """Release the mapping and pins, and detach from the decoder: the C hook must not call into a
        freed prefetcher, nor the decoder into a closed offloader."""
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            if decoder.rt.hook is not None:
                decoder.rt.hook.clear_route(self.native)
                decoder.rt.hook.pregate(0)  # its predictions would go nowhere
            decoder.detach(self)
        self.native.close()
        self.map.close()
