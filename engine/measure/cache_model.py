"""The expert cache a projection simulates under a memory budget: the plan engine.offload would make for it
(pinned hot experts, the rest a cache of experts), the cache evicting by LRU, FIFO or Belady's rule, and how
well that model stands for the recording's own fetches (cache_check, the cache size fitted to them). Calibrate
sizes the cache the engine held in effect with the same model.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..offload import Budget, ExpertMap, fmt_bytes, plan_budget, rank_counts, select_hot_experts
from ..offload.budget import AUTO_EXPERT_SHARE, plan_slack
from ..profiles import model_block
from .trace import Trace, TraceHeader

# opt: Belady's rule, evicting the expert whose next read lies furthest ahead. No cache can fetch less for the
# same reads, so a projection under it is the ceiling of any eviction policy, not a forecast of the engine's.
CACHE_POLICIES = ("lru", "fifo", "opt")

# expert ids, [..., n_layer, k] (-1: none), as traces and routing snapshots hold them
ExpertIds = npt.NDArray[np.integer[Any]]
Pinned = tuple[tuple[int, int], ...]  # (layer, expert) of each pinned hot expert

_Result = TypeVar("_Result")


class ExpertCache:
    """Experts in memory under a budget: the pinned ones always, the rest `capacity` experts evicted least
    recently used first (lru), first in, first out (fifo), or by what is read next (opt, which needs `future`:
    the reads to come, as `seen` lists them after a pass over the same accesses). capacity None: everything
    resident (no budget). Reads come a layer at a time, as the engine routes them: a layer's own experts are
    never evicted to make room for each other."""

    def __init__(
        self,
        n_expert: int,
        capacity: int | None,
        pinned: Iterable[tuple[int, int]] = (),
        policy: str = "lru",
        future: list[frozenset[int]] | None = None,
    ):
        if policy == "opt" and future is None:
            raise ValueError("the opt policy needs the reads to come")
        self.n_expert = n_expert
        self.capacity = capacity
        self.policy = policy
        self.pinned = {int(layer) * n_expert + int(e) for layer, e in pinned}
        self.held: OrderedDict[int, int] = OrderedDict()  # expert -> its next read (opt) or 0
        self.seen: list[frozenset[int]] = []  # every layer's group of non-pinned reads, in order
        self._reads_at: dict[int, list[int]] = {}
        for i, group in enumerate(future or ()):
            for key in group:
                self._reads_at.setdefault(key, []).append(i)

    def _next_read(self, key: int, after: int) -> int:
        at: Sequence[int] = self._reads_at.get(key, ())
        i = bisect_right(at, after)
        return at[i] if i < len(at) else 1 << 62

    def access(self, ids: ExpertIds) -> int:
        """Read the experts `ids` ([..., n_layer, k] ids, -1 none; each distinct one once); how many missed."""
        if self.capacity is None:
            return 0
        ids = np.asarray(ids)
        misses = 0
        for layer in range(ids.shape[-2]):
            col = ids[..., layer, :]
            group = frozenset((layer * self.n_expert + np.unique(col[col >= 0])).tolist()) - self.pinned
            misses += self._read_layer(group)
        return misses

    def _read_layer(self, group: frozenset[int]) -> int:
        assert self.capacity is not None  # access reads nothing through a cache that holds everything
        now = len(self.seen)
        self.seen.append(group)
        misses = 0
        for key in sorted(group):
            if key in self.held:
                if self.policy == "lru":
                    self.held.move_to_end(key)
                elif self.policy == "opt":
                    self.held[key] = self._next_read(key, now)
                continue
            misses += 1
            if self.capacity > 0:
                self.held[key] = self._next_read(key, now) if self.policy == "opt" else 0
        while len(self.held) > self.capacity:
            others = (k for k in self.held if k not in group)
            victim = (
                max(others, key=self.held.__getitem__, default=None) if self.policy == "opt" else next(others, None)
            )
            if victim is None:
                break
            del self.held[victim]
        return misses


def with_cache(
    run: Callable[[ExpertCache], _Result], plan: CachePlan, n_expert: int, policy: str, rounds: int = 4
) -> _Result:
    """run(cache) under the plan's cache. For opt, `run` goes once under LRU to learn its reads and again under
    Belady's rule over them; where the reads follow the fetches (cascade's trials follow its timings) it goes on
    until a pass reads what the one before it did, or `rounds` passes, the last standing."""
    if policy != "opt" or plan.capacity is None:
        return run(plan.cache(n_expert, policy))
    seen = plan.cache(n_expert, "lru")
    run(seen)
    for _ in range(rounds):
        cache = plan.cache(n_expert, "opt", seen.seen)
        out = run(cache)
        if cache.seen == seen.seen:
            break
        seen = cache
    return out


@dataclass(frozen=True)
class CachePlan:
    capacity: int | None  # LRU experts (None: no budget, all resident)
    pinned: Pinned  # (layer, expert) pinned hot experts
    label: str

    def cache(self, n_expert: int, policy: str = "lru", future: list[frozenset[int]] | None = None) -> ExpertCache:
        return ExpertCache(n_expert, self.capacity, self.pinned, policy, future)


def cache_plan(budget: str | None, header: TraceHeader, profile: dict[str, Any], expert_bytes: float) -> CachePlan:
    """How a budget splits between pinned hot experts and the expert cache, as engine.offload plans it
    (plan_budget, select_hot_experts). The budget a trace was recorded under (auto, or the same size): the plan
    that run made. Another budget: the room the process would leave for experts, with what a run under a budget
    held beside its experts (heap, llama.cpp's buffers, pinned weights: process_held) held again; without such
    a run, the budget less the non-expert weights. `auto` gives the experts a third of their bytes
    (AUTO_EXPERT_SHARE), as `--budget auto` gives the expert cache."""
    if budget is None or budget == "none":
        return CachePlan(None, (), "none (all resident)")
    b = Budget.parse(budget)
    n_moe = header.n_layer  # layers without experts are never read: their share of the plan stays unused
    total = header.n_expert * n_moe * expert_bytes
    recorded = header.budget
    if recorded is not None and (recorded.get("auto") if b.auto else recorded["budget_bytes"] == b.size):
        # the budget the trace ran under: the plan that run made (for the process it measured, not a model of it)
        cap = int(recorded["cache_bytes"] // header.expert_bytes)
        return CachePlan(
            cap,
            tuple(tuple(p) for p in recorded["pinned"]),
            f"{'auto' if b.size is None else fmt_bytes(b.size)} as recorded "
            f"({fmt_bytes(recorded['budget_bytes'])}: "
            f"{len(recorded['pinned'])} hot experts pinned, cache of {cap} experts)",
        )
    block = model_block(profile, header.fingerprint) or {}
    hot_ranked = list(block.get("hot_experts") or [])
    # all plan_budget reads of a map
    sizes: ExpertMap = SimpleNamespace(expert_bytes=np.full(header.n_layer, expert_bytes))  # type: ignore[assignment]
    measured = process_held(header, block, expert_bytes)
    if measured is not None:
        held, whose = measured
        room: int | None
        if b.size is None:
            room = int(AUTO_EXPERT_SHARE * total)
            size = held + room + plan_slack(held + room)
        else:  # plan_budget's room: what held and slack leave
            room, size = None, b.size
        plan = plan_budget(
            size, anon_bytes=held, base_bytes=0, emap=sizes, k=header.k, pin_hot=bool(hot_ranked), expert_room=room
        )
        plan.check_room(int(header.k * expert_bytes))  # a budget the process would not run in, as decoding says
        besides = f", the process holding {fmt_bytes(held)} beside its experts as {whose} did"
    else:
        size = int(header.non_expert_bytes + AUTO_EXPERT_SHARE * total) if b.size is None else b.size
        plan = plan_budget(
            size, anon_bytes=0, base_bytes=header.non_expert_bytes, emap=sizes, k=header.k, pin_hot=bool(hot_ranked)
        )
        besides = ", the process's own memory not counted (no run under a budget measured it)"
    pinned: Pinned = ()
    if hot_ranked:
        shape: ExpertMap = SimpleNamespace(n_layer=header.n_layer, n_expert=header.n_expert)  # type: ignore[assignment]
        counts = rank_counts(hot_ranked, shape)  # reads only those two of a map
        pinned = tuple(select_hot_experts(counts, expert_bytes, plan.hot_bytes))
    plan = plan.with_pinned(int(len(pinned) * expert_bytes))
    cap = int(plan.cache_bytes // expert_bytes)
    label = (
        f"{'auto' if b.auto else fmt_bytes(size)}: {len(pinned)} hot experts pinned, cache of {cap} experts"
        f" ({fmt_bytes(cap * expert_bytes)}){besides}"
    )
    priced_staged = (block.get("cache_fit") or {}).get("planned_experts", header.k) < header.k
    if cap < header.k and not priced_staged:
        # the fetches are still counted right; their price, measured where a layer fit, is not (docs/calibration.md)
        label += (
            f"; a layer's {header.k} experts do not fit the cache, so decoding reads every layer in stages,"
            f" each fetch dearer than where a layer fits (calibrate under this budget to price it)"
        )
    return CachePlan(cap, pinned, label)


def process_held(header: TraceHeader, block: dict[str, Any], expert_bytes: float) -> tuple[int, str] | None:
    """What a decoding process held under a budget beside its experts, and whose run measured it: the trace's
    own run where it was recorded under a budget, else the profile's calibration under one (its cold
    worker's plan: pinned and cached experts at the budget it measured). None where neither ran."""
    recorded = header.budget
    if recorded is not None:
        experts = recorded["hot_bytes"] + recorded["cache_bytes"]
        budget, whose = recorded["budget_bytes"], "the recorded run"
    else:
        fit, budget = block.get("cache_fit"), (block.get("measured") or {}).get("budget_bytes")
        if not fit or not budget:
            return None
        experts, whose = (fit["planned_experts"] + (fit.get("pinned") or 0)) * expert_bytes, "the calibrated run"
    return max(0, int(budget - plan_slack(budget) - experts)), whose


def draft_pass_misses(cache: ExpertCache, passes: Sequence[ExpertIds], header: TraceHeader) -> int:
    """Experts the draft passes fetch: those of each pass outside the cache, where the drafts read the router's
    choice; none where they read only experts in memory."""
    if header.draft_experts == "resident":
        return 0
    return sum(cache.access(p) for p in passes)


def cache_check(traces: list[Trace], plan: CachePlan, policy: str) -> tuple[int, int] | None:
    """(experts the recording run fetched, by its own count; the same run's reads through the simulated cache):
    how well the cache model stands for the engine's offloading. None: the traces were not recorded under a
    budget."""
    recorded = 0
    for tr in traces:
        for s in tr.steps:
            if s.verify_misses is None or s.draft_misses is None:
                return None
            recorded += s.verify_misses + s.draft_misses

    def simulated(cache: ExpertCache) -> int:
        fetched = 0
        for tr in traces:
            kd = tr.header.k_d
            for s in tr.steps:
                if s.drafted:  # the recording drafted to the cap: a pass for the pending token and each drafted one
                    assert s.pending is not None  # a trace's drafting step holds it (read_trace refuses one without)
                    passes = [s.pending[:, :kd]] + [d.predicted[:, :kd] for d in s.drafted]
                    fetched += draft_pass_misses(cache, passes, tr.header)
                fetched += cache.access(s.gated)
        return fetched

    return recorded, with_cache(simulated, plan, traces[0].header.n_expert, policy)


def _smallest_capacity(fetched: Callable[[int], int], target: int, most: int) -> int:
    """The smallest cache size in 0..most at which fetched(size) is at most `target` (fetches fall as the cache
    grows, for LRU and here for FIFO alike: bisection)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        if fetched(mid) > target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def capacity_fetching(
    ids: list[ExpertIds], counted: int, plan: CachePlan, n_expert: int, warm: int = 0, policy: str = "lru"
) -> int:
    """The cache size (beside the plan's pinned experts) at which the steps `ids` (each [n_layer, k]) fetch
    `counted` experts after the first `warm`."""

    def fetched(capacity: int) -> int:
        return with_cache(
            lambda cache: sum(cache.access(x) * (i >= warm) for i, x in enumerate(ids)),
            CachePlan(capacity, plan.pinned, plan.label),
            n_expert,
            policy,
        )

    return _smallest_capacity(fetched, counted, ids[0].shape[0] * n_expert if ids else 0)


def fitted_capacity(traces: list[Trace], plan: CachePlan, policy: str) -> int | None:
    """The cache size at which the simulated cache fetches what the recording counted for its own reads. None
    without a recorded count."""
    check = cache_check(traces, plan, policy)
    if check is None:
        return None
    h = traces[0].header

    def simulated(size: int) -> int:
        fit = cache_check(traces, CachePlan(size, plan.pinned, plan.label), policy)
        assert fit is not None  # the same traces counted their fetches above
        return fit[1]

    return _smallest_capacity(simulated, check[0], h.n_layer * h.n_expert)
