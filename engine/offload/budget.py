"""A memory budget: `auto` or a size, how it splits between the process, pins and the expert cache, and
how `auto` is sized from what a loaded, warmed-up process holds."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .cgroup import ENV_BUDGET, MemoryCgroup, current_budget_cgroup
from .experts import ExpertMap
from .mapping import ModelMapping
from .procfs import meminfo
from .sizes import fmt_bytes, parse_size

# An `auto` run starts under this limit (a guard against runaways only), then sizes its own budget once
# loaded and warmed up, and lowers the limit to it. A run of a given size that warms up raises its limit to
# this for the warm-up (offload.run.offload_decoder).
AUTO_START_LIMIT = 64 << 30
AUTO_EXPERT_SHARE = 1 / 3
AUTO_MIN_SLACK = 8 << 20
# Under a budget of a given size llama.cpp's compute buffers may take at most this share of it. They are sized
# for one prefill batch, and where experts are wide that can be hundreds of MiB the expert cache would otherwise
# hold (docs/offloading.md, "The plan"); a smaller batch only prefills a prompt in more passes,
# while decoding runs batches of a few tokens either way.
PREFILL_BUFFER_SHARE = 1 / 8


@dataclass(frozen=True)
class Budget:
    """A memory budget for one decoding process: `size` bytes, or None for auto (what the process holds
    once loaded and warmed up, plus a share of the expert bytes as the expert cache)."""

    size: int | None = None

    @classmethod
    def parse(cls, text: str | int) -> Budget:
        if isinstance(text, str) and text.strip().lower() == "auto":
            return cls(None)
        return cls(parse_size(text))

    @property
    def auto(self) -> bool:
        return self.size is None

    @property
    def start_limit(self) -> int:
        """The limit the process starts under."""
        return AUTO_START_LIMIT if self.size is None else self.size

    def __str__(self) -> str:
        """The form `parse` reads back (handed to the process started inside the budget)."""
        return "auto" if self.size is None else str(self.size)

    def check_fits_machine(self) -> None:
        """ConfigError where the size is more than this machine's memory (check_within_memory). Auto is sized
        in its process, and checked there."""
        if self.size is not None:
            check_within_memory(
                self.size, f"the memory budget {fmt_bytes(self.size)}", "give a smaller one, or run without a budget"
            )

    def describe(self, sized: int | None = None) -> str:
        """'auto (83.3 MiB)' once an auto budget is sized, else the size."""
        if self.size is not None:
            return fmt_bytes(self.size)
        return "auto" if sized is None else f"auto ({fmt_bytes(sized)})"


def current_budget() -> tuple[MemoryCgroup, Budget] | None:
    """(the cgroup, the budget) this process was started inside by run_in_budget, or None."""
    cg = current_budget_cgroup()
    if cg is None:
        return None
    return cg, Budget.parse(os.environ.get(ENV_BUDGET) or str(cg.limit()))


def prefill_batch_room() -> int | None:
    """The most bytes llama.cpp's compute buffers may take in this process: PREFILL_BUFFER_SHARE of the budget
    it runs under where that has a size; None (no limit) outside a budget and under auto, which is sized around
    the process as it is."""
    inside = current_budget()
    size = None if inside is None else inside[1].size  # None: no budget, or auto
    if size is None:
        return None
    return int(size * PREFILL_BUFFER_SHARE)


@dataclass(frozen=True)
class BudgetPlan:
    """How a memory budget splits: what the process holds anyway, what is pinned, what caches experts."""

    budget_bytes: int
    anon_bytes: int  # the process's own memory (interpreter, llama.cpp buffers, KV cache)
    base_bytes: int  # pinned non-expert weights + library code
    hot_bytes: int  # room for pinned hot experts
    cache_bytes: int  # left for cold experts in the page cache
    slack_bytes: int = 0  # kept free for the process's memory to grow (buffers, Python objects)

    def check_room(self, one_layer_bytes: int) -> None:
        """ConfigError unless the budget holds the process, the pinned weights and one layer's k experts:
        with less, the first decode has nothing to evict and the cgroup kills the process. (The slack may
        be eaten into: a small model's experts fit in it. The size suggested keeps it.)"""
        held = self.anon_bytes + self.base_bytes + one_layer_bytes
        if self.budget_bytes >= held:
            return
        roomy = budget_holding(held)
        raise ConfigError(
            f"the memory budget {fmt_bytes(self.budget_bytes)} leaves "
            f"{fmt_bytes(self.hot_bytes + self.cache_bytes)} for experts (the process holds "
            f"{fmt_bytes(self.anon_bytes)} with its largest batches, pinned weights "
            f"{fmt_bytes(self.base_bytes)}, slack {fmt_bytes(self.slack_bytes)}): give at least "
            f"{fmt_bytes(held, round_up=True)} ({fmt_bytes(roomy, round_up=True)} keeps "
            f"{fmt_bytes(roomy - held)} free for the process to grow)"
        )

    def with_pinned(self, pinned_bytes: int) -> BudgetPlan:
        """The plan once `pinned_bytes` of hot experts are chosen: what they leave of their room (fewer ranked
        than fit, or sizes that do not add up to it) goes to the cache."""
        pinned_bytes = min(pinned_bytes, self.hot_bytes)
        return replace(self, hot_bytes=pinned_bytes, cache_bytes=self.cache_bytes + self.hot_bytes - pinned_bytes)

    def describe(self) -> str:
        return (
            f"budget {fmt_bytes(self.budget_bytes)} = process {fmt_bytes(self.anon_bytes)} + slack "
            f"{fmt_bytes(self.slack_bytes)} + pinned weights {fmt_bytes(self.base_bytes)} + hot experts "
            f"{fmt_bytes(self.hot_bytes)} + expert cache {fmt_bytes(self.cache_bytes)}"
        )


def plan_slack(budget_bytes: int) -> int:
    """What a planned budget keeps free for the process's memory to grow."""
    return min(32 << 20, max(4 << 20, budget_bytes // 20))


def budget_holding(held_bytes: int) -> int:
    """The least budget, in whole pages, that holds `held_bytes` and keeps its slack (plan_slack) free besides."""
    need = held_bytes
    for _ in range(8):  # the slack grows with the budget: its fixed point, from below
        need = held_bytes + plan_slack(need)
    while need - plan_slack(need) < held_bytes:  # the last bytes short of it
        need += 1
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-need // page) * page


def auto_floor(*, anon_bytes: int, base_bytes: int, expert_room: int, one_layer_bytes: int) -> int:
    """The least an auto budget comes to, counted from the process (its anonymous memory, what it pinned) where
    auto_budget_bytes counts from its cgroup, with the room for experts (at least one layer's k) and the slack.
    A cgroup is charged for a page by the process that brought it into memory first: where another process
    had read the model or the libraries (a second auto run started beside the first, a resident run, a copy),
    those pages are charged to it, and the experts among them were counted out of this cgroup although it
    never held them. Sized from its cgroup alone, such a budget fell short of what its own plan counts, and
    refused itself (BudgetPlan.check_room)."""
    return budget_holding(anon_bytes + base_bytes + max(expert_room, one_layer_bytes))


# An auto budget fitted to the memory available leaves the rest of the machine at least this much of it, or a
# twentieth of the machine's memory where that is more.
AUTO_KEEP_FREE = 256 << 20


def fit_to_available(size: int, expert_room: int, anon_bytes: int) -> tuple[int, int, int | None]:
    """An auto budget of `size` with `expert_room` for experts, lowered where the machine cannot give it: the
    memory available (MemAvailable, which counts the page cache as free, this process's own too) plus the
    anonymous memory the process already holds, less what the rest of the machine keeps (AUTO_KEEP_FREE).
    Returns (size, expert room, the memory available where it lowered them, else None). On an 8 GB device a
    third of a 17 GB file's experts alone is more than the device holds."""
    info = meminfo()
    available = info.get("MemAvailable")
    if not available:
        return size, expert_room, None
    ceiling = available + anon_bytes - max(AUTO_KEEP_FREE, info.get("MemTotal", 0) // 20)
    if size <= ceiling:
        return size, expert_room, None
    cut = size - ceiling
    return size - cut, expert_room - cut, available


def check_within_memory(size: int, what: str, instead: str) -> None:
    """ConfigError where a budget is more than the machine's memory: a limit that large never binds, and its
    plan counts on memory that is not there (an expert cache and hot experts as large as it allows).
    `what` says what the budget is, `instead` what to do."""
    total = meminfo().get("MemTotal", 0)
    if total and size > total:
        raise ConfigError(
            f"{what} is more than this machine's memory ({fmt_bytes(total)}): a budget that large "
            f"limits nothing; {instead}"
        )


def plan_budget(
    budget_bytes: int,
    *,
    anon_bytes: int,
    base_bytes: int,
    emap: ExpertMap,
    k: int,
    pin_hot: bool = True,
    expert_room: int | None = None,
) -> BudgetPlan:
    """Split a budget's room for experts between pinned hot experts and the cache for the rest.

    Decoding reads its layers in turn, token after token, so the cache sees one cycle of reads a token: a
    least-recently-used cache smaller than a token's reads evicts each expert before the next token comes
    back to its layer, and holds nothing that is read again. So where the room holds a token's experts (k
    per layer) the cache gets half the room, never less than that, and the hot experts the rest (a larger
    cache holds more of a verification's union; plain decoding fetches about as much either way); where it
    does not, the cache keeps only the k experts a layer computes with, and everything else is pinned (the
    most routed experts, read again whatever the order). Without hot experts to pin (`pin_hot` False) the
    cache gets the whole room.
    expert_room: the room for experts where the budget was sized around it (auto: its share of the expert
    bytes; what the process holds besides was measured in the cgroup, which the anonymous and pinned
    bytes here undercount or overcount)."""
    slack = plan_slack(budget_bytes)
    room = max(0, budget_bytes - anon_bytes - base_bytes - slack) if expert_room is None else expert_room
    per_token = int(k * emap.expert_bytes.sum())
    one_layer = int(k * emap.expert_bytes.max())
    if not pin_hot:
        cache = room
    elif room >= per_token:
        cache = max(per_token, room // 2)
    else:
        cache = min(room, one_layer)
    return BudgetPlan(budget_bytes, anon_bytes, base_bytes, room - cache, cache, slack)


def auto_budget_bytes(
    cg: MemoryCgroup,
    emap: ExpertMap,
    share: float = AUTO_EXPERT_SHARE,
    *,
    experts_stay: bool = False,
    reserved: int = 0,
) -> int:
    """`--budget auto` for a process already running inside `cg`, loaded and warmed up: everything the
    cgroup holds now except the model's expert pages (anonymous memory, pinned weights, library and
    Python file pages), plus `share` of the expert bytes as the expert cache, plus a little slack.
    experts_stay: the expert pages in memory now stay there and count as held. So it is once the offloader
    keeps the expert cache: starting, the cache dropped every expert page it could, and what remains shares
    the page cache's large folios with pinned weights. Left out, those pages ate the slack, and the budget's
    reclaim took a verification's experts as it read them (docs/offloading.md). `reserved`: memory the
    process will hold that the cgroup does not yet (its compute buffers' untouched pages).

    Counting what the cgroup really holds matters: a budget built from the anonymous memory alone left
    the expert cache near zero (every expert missed on every token, measured) because the interpreter's
    and libraries' file pages are charged to the same cgroup."""
    resident = 0.0
    if not experts_stay:
        mapping = ModelMapping(emap)
        try:
            resident = float((mapping.expert_residency() * emap.expert_bytes[:, None]).sum())
        finally:
            mapping.close()
    held = max(0, cg.usage() - int(resident)) + reserved
    # the slack absorbs what the heap still grows by in the first real generations after a warm-up, so
    # that the expert cache keeps its share; 2 MiB was too little: a module the first generation imported
    # (2.2 MiB) had a session under auto killed by the cgroup's OOM killer
    size = int(held + share * emap.total_expert_bytes + max(AUTO_MIN_SLACK, held // 50))
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-size // page) * page  # the kernel keeps a limit in whole pages: the budget is the limit it sets
