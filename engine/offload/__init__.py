"""Expert-level offloading on stock llama.cpp: byte ranges, pinning, prefetch, residency, memory budgets.

llama.cpp loads the model with mmap (and `use_extra_bufts = false`, so no weights are copied into
anonymous memory): every weight is a page of the model file in the OS page cache, which the kernel
evicts and fetches on demand. We steer that cache from the outside through our own read-only mapping of
the same file (page-cache pages are shared between mappings):

- mlock pins what must never be evicted: the non-expert weights, the llama/ggml library code pages and
  the hot experts (mapping.py);
- the routing hook hands each layer's final expert ids to a native prefetcher (native/s2moe_offload.c)
  that madvise(WILLNEED)s them before the layer's expert matmuls and counts those not in memory
  (native.py); every batch routes through it, a prompt's prefill and a decode with the hook off too;
- under a budget the expert cache is kept by that prefetcher, not by the kernel's reclaim: routed experts
  in a least-recently-used list of the plan's cache bytes, the one that falls off unmapped from
  llama.cpp's mapping and dropped from the page cache at once (native/s2moe_offload.c says why);
- mincore tells which experts are resident, for hit rates and the app's heatmap (offloader.py);
- a memory cgroup (v2, or v1) limits what the decoding process may hold, so the rest pages in from
  storage, after posix_fadvise(DONTNEED) dropped the file from the page cache (cgroup.py, budget.py).

Commands enter a budget through run.py's two functions: run_in_budget starts a process in its cgroup,
offload_decoder sets its decoder up inside it.
"""

from .budget import AUTO_MIN_SLACK, AUTO_START_LIMIT, Budget, BudgetPlan, auto_budget_bytes, current_budget, plan_budget
from .cgroup import BudgetUnavailable, MemoryCgroup, current_budget_cgroup
from .experts import ExpertMap, expert_map, rank_counts, select_hot_experts
from .libc import drop_file_cache
from .mapping import ModelMapping, PinError
from .native import NativePrefetch
from .offloader import Offloader, OffloadStats, Residency
from .procfs import code_ranges, model_mappings, process_anon_bytes, read_ahead_bytes
from .run import BudgetRun, Pinning, offload_decoder, run_in_budget, split_line
from .sizes import PAGE, fmt_bytes, parse_size

__all__ = [
    "AUTO_MIN_SLACK",
    "AUTO_START_LIMIT",
    "Budget",
    "BudgetPlan",
    "BudgetRun",
    "BudgetUnavailable",
    "ExpertMap",
    "MemoryCgroup",
    "ModelMapping",
    "NativePrefetch",
    "OffloadStats",
    "Offloader",
    "PAGE",
    "PinError",
    "Pinning",
    "Residency",
    "auto_budget_bytes",
    "code_ranges",
    "current_budget",
    "current_budget_cgroup",
    "drop_file_cache",
    "expert_map",
    "fmt_bytes",
    "model_mappings",
    "offload_decoder",
    "parse_size",
    "plan_budget",
    "process_anon_bytes",
    "rank_counts",
    "read_ahead_bytes",
    "run_in_budget",
    "select_hot_experts",
    "split_line",
]
