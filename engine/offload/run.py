"""The two ways into a memory budget that every command uses.

- run_in_budget: start a command in a fresh memory cgroup limited to the budget, after dropping the
  model file from the page cache, so that its experts page in from storage;
- offload_decoder: inside that process, warm up, pin, plan and attach offloading to a decoder, then lower
  the limit to the budget (for `auto`, sized from what the warmed-up process holds).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, sigterm_raises_terminated
from ..slow import said_if_slow
from .budget import (
    AUTO_EXPERT_SHARE,
    AUTO_START_LIMIT,
    Budget,
    BudgetPlan,
    auto_budget_bytes,
    auto_floor,
    check_within_memory,
    current_budget,
    fit_to_available,
    plan_budget,
)
from .cgroup import MemoryCgroup
from .experts import expert_map, rank_counts, select_hot_experts
from .libc import drop_file_cache, end_process
from .mapping import ModelMapping
from .offloader import Offloader
from .procfs import process_anon_bytes, read_ahead_bytes
from .sizes import fmt_bytes

if TYPE_CHECKING:
    from ..decoding.decoder import Decoder
    from .experts import ExpertMap


@dataclass
class BudgetRun:
    """A command running inside its budget cgroup."""

    proc: subprocess.Popen[Any]
    cgroup: MemoryCgroup
    budget: Budget

    def out_of_memory(self) -> bool:
        return self.cgroup.oom_kills() > 0

    def wait(self) -> int:
        """Its exit status; a run the kernel killed for want of memory is an error that says so."""
        rc = self.proc.wait()
        if rc < 0 and self.out_of_memory():
            raise ConfigError(
                f"the memory budget ({self.budget.describe()}) is too small: the decoding process was "
                f"killed when out of memory (peak {fmt_bytes(self.cgroup.peak())}); raise the budget"
            )
        return rc


@contextmanager
def run_in_budget(
    argv: list[str], budget: Budget, model_path: str | os.PathLike[str], *, tag: str = "run", **popen_kw: Any
) -> Iterator[BudgetRun]:
    """Run argv in a fresh memory cgroup limited to the budget (an auto budget starts under a generous
    limit and lowers it itself; one of a given size that warms up raises it for the warm-up: see
    offload_decoder), with the model file dropped from the page cache. On leaving, a child still running
    is terminated and the cgroup removed, also on Ctrl-C or SIGTERM.
    Raises BudgetUnavailable (a ConfigError) when no cgroup can be made here."""
    from ... import native

    # Built here if it must be: a compiler run inside the cgroup leaves its files' pages charged there, and
    # an auto budget, sized from what the cgroup holds, would count them as the process's own.
    native.build()
    cg = MemoryCgroup.create(budget.start_limit, tag)
    proc = None
    try:
        with sigterm_raises_terminated():
            drop_file_cache(model_path)
            proc = cg.popen(argv, str(budget), **popen_kw)
            yield BudgetRun(proc, cg, budget)
    finally:
        if proc is not None:
            end_process(proc, 5)
        cg.remove()


@dataclass(frozen=True)
class Pinning:
    """What offload_decoder pins and prefetches. The defaults are what decoding uses; offload_bench
    compares the others."""

    base: bool = True  # non-expert weights
    code: bool = True  # llama/ggml library code pages
    hot: bool = True  # the ranked hot experts that fit the budget's plan
    jit_prefetch: bool = True  # the routing hook asks for each layer's experts as soon as its ids are final
    predicted_prefetch: bool = False  # WILLNEED each draft pass's predicted experts while the draft goes on
    # (measured slower: docs/results.md)
    lookahead: bool = False  # in a verification, ask for layer L+1's predicted experts when layer L routes
    fetch_workers: int = 0  # threads that read each verification's predicted experts while the draft goes on
    fetch_room_share: float = 0.5  # of the expert cache, what they may read ahead of the verification
    own_cache: bool = True  # under a budget plan, keep the expert cache here (an LRU whose evictions leave
    # memory at once) instead of leaving it to the kernel's reclaim
    parts_in_order: bool = True  # ask for a layer's experts part by part in the order its matmuls use them
    staged_reads: bool = True  # with that and the kept cache, read a layer that does not fit one part at a
    # time (_stage_room)
    pregate: int = 0  # in a one-row decode, as each layer routes, apply the next this many layers' routers
    # to its hidden state and read the experts they predict while it computes (off until
    # measured faster: docs/offloading.md)
    pregate_width: int = 0  # of each layer's k predicted experts, read the best ranked this many (0: all k)


def offload_decoder(
    decoder: Decoder,
    budget: Budget | None,
    hot_ranked: Sequence[Sequence[int]] = (),
    *,
    warm_up: Callable[[], None] | None = None,
    pinning: Pinning = Pinning(),
    say: Callable[[str], None] | None = None,
) -> Offloader:
    """Set a decoder up for offloading under `budget` (None: pin and observe without a budget plan).

    `warm_up` runs every graph shape, buffer and runtime the run will need, before the budget is planned.
    An auto budget needs the process to run inside its budget cgroup (run_in_budget): it is sized from what
    the cgroup holds after the warm-up (auto_budget_bytes), and the limit lowered to it once pinning is in
    place. A budget of a given size, inside its cgroup, warms up the same way, under the generous limit an
    auto budget starts with: under its own limit, with nothing yet pinned or cached, the warm-up decoded as
    llama.cpp alone would, slowly and before every run. The offloader's budget_bytes says what the budget
    came to. `say` hears a line for each stage that takes a while (engine.slow)."""
    if pinning.pregate_width > decoder.info.n_expert_used:
        raise ConfigError(
            f"pre-gating reads at most the {decoder.info.n_expert_used} experts a layer of this model "
            f"routes to, not {pinning.pregate_width}"
        )
    emap = expert_map(decoder.info.path)
    size = None if budget is None else budget.size
    auto = budget is not None and budget.auto
    inside = current_budget() if budget is not None else None
    if auto and inside is None:
        raise ConfigError("an auto memory budget is sized inside its own memory cgroup, and this process runs in none")
    # the cgroup whose limit this process lowers itself once warmed up and planned
    cg = inside[0] if inside is not None and (auto or warm_up is not None) else None
    if budget is not None:
        mapping = ModelMapping(emap)
        try:
            mapping.willneed_non_expert()  # before the warm-up's first decode faults them in
        finally:
            mapping.close()
    if budget is not None and warm_up is not None:
        if cg is not None and not auto:
            cg.set_limit(AUTO_START_LIMIT)
        # every mode's buffers and runtimes exist before the plan counts the process (a drafter with weights of
        # its own loads a second runtime: planned without it, a tight budget held more than it had); its text is
        # machinery, not the session's, so later copies never draw on it nor a copy cache keep it
        # one expert a layer: a model larger than memory is not read whole for output thrown away
        hook = decoder.rt.hook
        assert hook is not None  # a mixture-of-experts model (expert_map above) decodes through its routing hook
        with (
            decoder.untimed_costs(),
            decoder.apart_from_session(),
            hook.uniform(),
            said_if_slow(say, "warming up: every graph shape and buffer this run needs, before the budget is planned…"),
        ):
            warm_up()
    # What any prompt will need (its prefill chunks) is counted before what the process holds is planned:
    # llama.cpp sizes its compute buffers for the largest batch, but their pages come in only as a batch that
    # large runs. Counted, not touched: touching them decodes a whole batch (11 s on two cores for a 7B model),
    # and the size llama.cpp reports is what touching them adds (194 of 195 MiB on the widened model, measured).
    # Where the warm-up already ran a full batch (a tight budget's small one) they are held and measured.
    untouched = budget is not None and decoder.rt.largest_batch < decoder.rt.n_batch
    reserved = decoder.rt.compute_buffer_bytes if untouched else 0
    room: int | None = None
    share, fitted = AUTO_EXPERT_SHARE, None
    if cg is not None and auto:
        size = auto_budget_bytes(cg, emap, reserved=reserved)  # provisional: sizes the hot-expert plan
        room = int(AUTO_EXPERT_SHARE * emap.total_expert_bytes)
        size, room, fitted = fit_to_available(size, room, process_anon_bytes() + reserved)
        floor = _one_layer_bytes(emap, decoder.info.n_expert_used)
        if fitted is not None and room < floor:
            raise ConfigError(
                f"an auto budget does not fit here: the memory available ({fmt_bytes(fitted)}) holds "
                f"what this process needs but not {fmt_bytes(floor)} of experts beside it (one "
                "layer's); free some memory, or give a size"
            )
        share = room / emap.total_expert_bytes
    # Where the limit comes down after the warm-up the hot experts are pinned only once it has: pinned while
    # the warm-up's whole model is still cached, they left the kernel (cgroup v1) unable to reclaim that
    # cache down to the limit (EBUSY at any step, measured), although the plan had room for them.
    with said_if_slow(say, f"pinning the weights every step reads ({fmt_bytes(sum(n for _, n in emap.pinnable()))})…"):
        off, hot = _attach(
            decoder, emap, size, hot_ranked, pinning, pin_hot=cg is None, expert_room=room, reserved=reserved
        )
    if fitted is not None and room is not None:  # both sized above, with an auto budget
        off.budget_note = (
            f"fitted to the {fmt_bytes(fitted)} of memory available: {fmt_bytes(room)} for experts "
            f"instead of a third of them ({fmt_bytes(int(AUTO_EXPERT_SHARE * emap.total_expert_bytes))})"
        )
    if cg is not None:
        if auto:
            assert room is not None  # sized above: the cgroup under an auto budget
            # Measured again now that the offloader exists: its own memory (the GGUF tensor table, residency
            # buffers) would otherwise come out of the expert cache.
            anon, pinned = process_anon_bytes() + reserved, off.map.locked_bytes
            size = max(
                auto_budget_bytes(cg, emap, share, experts_stay=off.keeps_expert_cache, reserved=reserved),
                auto_floor(
                    anon_bytes=anon,
                    base_bytes=pinned,
                    expert_room=room,
                    one_layer_bytes=_one_layer_bytes(emap, decoder.info.n_expert_used),
                ),
            )
            try:
                check_within_memory(
                    size,
                    f"an auto budget here comes to {fmt_bytes(size)} (the process holds "
                    f"{fmt_bytes(anon)}, pinned {fmt_bytes(pinned)}, the cgroup "
                    f"{fmt_bytes(cg.usage())}, a third of the experts {fmt_bytes(room)})",
                    "give a size, or run without a budget",
                )
            except ConfigError:
                off.close()
                raise
        assert size is not None  # a budget's own size, or an auto budget's as sized above
        try:
            cg.set_limit(size)  # reclaims the warm-up's expert pages down to the budget
        except OSError as e:  # EBUSY: the kernel could not reclaim down to it
            off.close()
            raise ConfigError(
                f"cannot lower the memory limit to the budget {fmt_bytes(size)}: the process "
                f"holds {fmt_bytes(cg.usage())} it cannot give back ({e.strerror}); "
                + ("give the budget a size instead" if auto else "raise the budget")
            ) from None
        cg.reset_peak()  # the warm-up ran before the limit came down: a peak from then would read as a breach
        if hot:
            off.pin(non_expert=False, code=False, hot=hot)  # read in under the limit, evicting cold experts
    if budget is not None:
        # anything measured before (resident) is measured again under the budget, and remembered for it
        setting = "auto" if auto else f"{size} B"
        decoder.forget_cost_constants(
            remember_as=f"budget {setting}, {len(hot)} hot experts, batch {decoder.rt.n_batch}"
        )
    off.budget_bytes = size
    return off


def _one_layer_bytes(emap: ExpertMap, k: int) -> int:
    """What the k experts a layer computes with take at most: a budget holds them, or nothing can be evicted for
    them."""
    return int(k * emap.expert_bytes.max())


def _stage_room(plan: BudgetPlan) -> int:
    """The bytes a layer may fetch at once before it is read part by part: the cache's, and half the slack
    (a layer's own experts stay while it computes, past the cache's size, out of what is free)."""
    return plan.cache_bytes + plan.slack_bytes // 2


def _largest_unpinned_layer(emap: ExpertMap, pinned: Iterable[tuple[int, int]]) -> int:
    """The most bytes one layer's unpinned experts take: what a layer that reads them all fetches."""
    held = np.zeros((emap.n_layer, emap.n_expert), bool)
    for layer, e in pinned:
        held[layer, e] = True
    return int(max(((~held[layer]).sum() * emap.expert_bytes[layer] for layer in emap.moe_layers), default=0))


def _attach(
    decoder: Decoder,
    emap: ExpertMap,
    budget_bytes: int | None,
    hot_ranked: Sequence[Sequence[int]],
    pinning: Pinning,
    *,
    pin_hot: bool = True,
    expert_room: int | None = None,
    reserved: int = 0,
) -> tuple[Offloader, list[tuple[int, int]]]:
    """Pin non-expert weights + library code, then the longest prefix of the ranked hot experts that the
    budget's plan allows (the plan counts the process's anonymous memory and everything pinned). Returns
    the offloader and the hot experts chosen (pinned only with pin_hot: else the caller pins them). `reserved`:
    memory the process will hold that it does not hold yet (its compute buffers' untouched pages)."""
    off = Offloader(decoder.info.path, prefetch=pinning.predicted_prefetch, emap=emap)
    off.lookahead = pinning.lookahead
    if pinning.base:
        off.pin(code=pinning.code, hot=())
    plan: BudgetPlan | None = None
    hot: list[tuple[int, int]] = []
    k = decoder.info.n_expert_used
    anon = process_anon_bytes() + reserved
    if budget_bytes is not None and expert_room is not None:
        # sized around the process: never below what the plan counts it holds, or check_room would refuse it
        budget_bytes = max(
            budget_bytes,
            auto_floor(
                anon_bytes=anon,
                base_bytes=off.map.locked_bytes,
                expert_room=expert_room,
                one_layer_bytes=_one_layer_bytes(emap, k),
            ),
        )
    if pinning.hot and hot_ranked:
        if budget_bytes is not None:
            plan = plan_budget(
                budget_bytes, anon_bytes=anon, base_bytes=off.map.locked_bytes, emap=emap, k=k, expert_room=expert_room
            )
            room = plan.hot_bytes
        else:
            room = emap.total_expert_bytes
        hot = select_hot_experts(rank_counts(hot_ranked, emap), emap.expert_bytes, room)
        if plan is not None:
            plan = plan.with_pinned(sum(int(emap.expert_bytes[layer]) for layer, _ in hot))
        if pin_hot:
            off.pin(non_expert=False, code=False, hot=hot)
    elif budget_bytes is not None:
        plan = plan_budget(
            budget_bytes,
            anon_bytes=anon,
            base_bytes=off.map.locked_bytes,
            emap=emap,
            k=k,
            pin_hot=False,
            expert_room=expert_room,
        )
    if plan is not None and pinning.pregate:
        plan = _reserve_read_ahead(plan, pinning.pregate * _one_layer_bytes(emap, pinning.pregate_width or k))
    off.plan = plan
    if plan is not None:
        try:
            plan.check_room(_one_layer_bytes(emap, k))
        except ConfigError:
            off.close()
            raise
        off.prefetch_bytes = plan.cache_bytes
        # A fault reads a whole read-around window. Where that window dwarfs an expert's slices, each
        # fault drags in many unrelated experts and, in a small cache, evicts the ones in use: fault
        # page by page there instead (prefetch still reads exact ranges ahead).
        slab = int(emap.ranges[..., 1].max())
        window = read_ahead_bytes(emap.path)
        choice = os.environ.get("S2MOE_FAULT_READAHEAD", "auto")  # auto | off | default (experiments)
        if choice != "default":
            off.advise_fault_readahead(random=choice == "off" or slab * 4 <= window)
    stage_room = None
    if plan is not None and pinning.own_cache:
        off.keep_expert_cache(plan.cache_bytes, hot, decoder.rt.file_mappings)
        room = _stage_room(plan)
        if pinning.staged_reads and room < _largest_unpinned_layer(emap, hot):
            stage_room = room
    if pinning.jit_prefetch and pinning.parts_in_order:
        off.read_parts_in_order(stage_room)
    if plan is not None and pinning.fetch_workers > 0:
        off.start_fetching(pinning.fetch_workers, int(pinning.fetch_room_share * plan.cache_bytes))
    off.attach(decoder, jit_prefetch=pinning.jit_prefetch)
    if pinning.pregate:
        off.pregate(pinning.pregate, pinning.pregate_width)
    return off, hot


def _reserve_read_ahead(plan: BudgetPlan, read_ahead: int) -> BudgetPlan:
    """Pre-gating's reads sit in memory from their prediction until their layer routes, counted by no cache: the
    expert cache gives them room, as slack."""
    given = min(read_ahead, plan.cache_bytes)
    return replace(plan, cache_bytes=plan.cache_bytes - given, slack_bytes=plan.slack_bytes + given)


def split_line(cg: MemoryCgroup, offloader: Offloader | None = None) -> str:
    """One line on what the budget cgroup holds and what is pinned."""
    s = cg.split()
    limit, peak = cg.limit(), cg.peak()
    # above the limit only where the limit came down after a warm-up and the kernel kept that peak
    when = " (the warm-up's, before the limit came down)" if peak > limit else ""
    parts = [
        f"memory budget {fmt_bytes(limit)}: peak {fmt_bytes(peak)}{when}, now anonymous "
        f"{fmt_bytes(s['anon'])} · file pages {fmt_bytes(s['file'])} (locked {fmt_bytes(s['locked'])})"
    ]
    if offloader is not None:
        p = offloader.pinned_split
        parts.append(
            f"pinned: weights {fmt_bytes(p['non_expert'])}, code {fmt_bytes(p['code'])}, "
            f"hot experts {fmt_bytes(p['hot_experts'])}"
        )
        cap = offloader.native.cache_capacity
        if cap is not None:
            c = offloader.native.cache_stats()
            parts.append(
                f"expert cache kept here: {fmt_bytes(c['held'])} of {fmt_bytes(cap)} held, "
                f"{c['evicted']} evicted, {c['lost']} reclaimed by the kernel before reuse"
                + (
                    f", {c['staged']} layers read part by part ({c['streamed']} parts streamed)"
                    if offloader.native.stage_room is not None
                    else ""
                )
            )
        pregating = offloader.pregate_text()
        if pregating:
            parts.append(pregating)
        hr = offloader.stats.hit_rate()
        if np.isfinite(hr).any():
            parts.append(f"predicted-expert hit rate {np.nanmean(hr):.0%}")
    return " · ".join(parts)
