"""The cost constants a decoder's drafting rules decide with: measured at start-up once per (k_d, draft cap),
remembered between runs under a memory budget, assumed (not measured) in a warm-up.

A part of Decoder (its base class), apart so that the decode loop and how its constants come about read
separately.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager

from ..events import CostConstants, MeasuringCosts
from ..measure.costmodel import iter_cost_constants
from ..model_info import ModelInfo
from .generation_config import GenerationConfig, defaults_for
from .observer import VerifyObserver
from .runtime import LlamaRuntime

# A warm-up's constants (Decoder.untimed_costs): a token always pays for its draft pass and its verified row
WARM_UP_COST = CostConstants(
    t_ar=1.0, c_draft=0.0, t_exp=0.0, t_tok=0.0, intercept=0.0, source="warm-up: drafting always pays, nothing timed"
)
# Under a memory budget the start-up measurement takes about this long (fewer samples where a step is slow),
# and says how it goes once it has taken SLOW_MEASURE_S.
BUDGET_MEASURE_S = 20.0
SLOW_MEASURE_S = 2.0
# The least R² of the verification cost fit that a measurement needs to be remembered: other jobs running beside
# it spoil the fit (docs/offloading.md), and a spoilt one would otherwise be read back run after run.
REMEMBER_MIN_R2 = 0.8


class CostConstantsMixin:
    """Decoder's cost constants (see the module's docstring); the decoder provides the attributes below."""

    rt: LlamaRuntime
    info: ModelInfo
    n_threads: int | None
    _observer: VerifyObserver | None
    _context: list[int] | None

    def __init__(self) -> None:
        self._measured: dict[tuple[int, int], CostConstants] = {}
        self._untimed = False  # inside untimed_costs(): a warm-up, whose constants would be thrown away
        self._remember_as: str | None = None  # see forget_cost_constants

    def _cost_constants(self, cfg: GenerationConfig) -> Generator[MeasuringCosts, None, CostConstants]:
        """Generator: returns the constants a generation decides with; yields MeasuringCosts while it measures
        them, once that has taken SLOW_MEASURE_S."""
        if cfg.cost is not None:
            return cfg.cost
        if self._untimed:
            return WARM_UP_COST
        assert cfg.draft_topk is not None and cfg.draft_max is not None  # a generation's config comes resolved
        key = (cfg.draft_topk, cfg.draft_max)
        if key not in self._measured:
            self._measured[key] = yield from self._measure_costs(cfg)
        return self._measured[key]

    def _measure_costs(self, cfg: GenerationConfig) -> Generator[MeasuringCosts, None, CostConstants]:
        from ..measure import remembered_costs
        from .llama_process import llama_build_id

        assert cfg.draft_topk is not None and cfg.draft_max is not None  # a generation's config comes resolved
        self._context = None
        under_budget = self._remember_as is not None
        if self._remember_as is not None:
            recall_key = "|".join(
                (
                    self.info.fingerprint,
                    f"k_d {cfg.draft_topk}",
                    f"cap {cfg.draft_max}",
                    self._remember_as,
                    f"threads {self.n_threads}",
                    llama_build_id(),
                )
            )
            remembered = remembered_costs.recall(recall_key)
            if remembered is not None:
                return remembered
        # under a budget, also what a draft from resident experts costs (it fetches nothing)
        allowed = None if self._observer is None else self._observer.draft_allowed
        gen = iter_cost_constants(
            self.rt,
            cfg.draft_topk,
            cfg.draft_max,
            seed=cfg.seed,
            draft_allowed=allowed,
            seconds=BUDGET_MEASURE_S if under_budget else None,
        )
        t0 = time.perf_counter()
        while True:
            try:
                fraction = next(gen)
            except StopIteration as e:
                cost: CostConstants = e.value[0]
                break
            if time.perf_counter() - t0 >= SLOW_MEASURE_S:
                yield MeasuringCosts(fraction, time.perf_counter() - t0)
        if under_budget and cost.r2 is not None and cost.r2 >= REMEMBER_MIN_R2:
            # a fit the machine's noise spoilt (another job beside it) is measured again next time, not kept
            remembered_costs.remember(recall_key, cost)
        return cost

    def measured_cost_constants(self, draft_topk: int | None, draft_max: int | None) -> CostConstants | None:
        """The constants this decoder measured at start-up for (k_d, draft cap), if it did (None: the
        model's default, as a generation resolves it)."""
        d = defaults_for(self.info)
        return self._measured.get(
            (d.draft_topk if draft_topk is None else draft_topk, d.draft_max if draft_max is None else draft_max)
        )

    @contextmanager
    def untimed_costs(self) -> Iterator[None]:
        """Generations inside, given no constants, measure none: they draft as if drafting always paid, so
        that they build the graphs of the longest drafts and verifications. For a warm-up before offloading is
        in place, when what a step costs is not yet what it will cost (the budget's limit not yet down, nothing
        pinned or cached). Given constants, they draft by rules of their own, so that what they time never
        teaches the rules of the generations after them."""
        self._untimed = True
        try:
            yield
        finally:
            self._untimed = False

    def forget_cost_constants(self, remember_as: str | None = None) -> None:
        """Measure again at the next generation (e.g. once the memory budget changed what a step costs).
        remember_as: the setting (a memory budget's) under which a measurement is remembered between runs
        (engine.measure.remembered_costs), and measured in about BUDGET_MEASURE_S."""
        self._measured.clear()
        self._remember_as = remember_as
