"""What watches a decoder's verifications: the observer protocol (offloading implements it) and the residency it
reports, and the sampler that takes those residency reports no more often than they are worth.

Apart from the decode loop so that an observer's side (engine.offload, test fakes) reads what it must provide
without the loop around it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..events import ResidencySnapshot

if TYPE_CHECKING:
    from .decoder import Decoder


class VerifyObserver(Protocol):
    """What the decode loop tells an observer of its verifications (offloading), and asks of it.
    Given with Decoder.attach."""

    def predicted(self, experts: np.ndarray) -> None:
        """Experts [n_layer, n_expert] (bool) the coming verification will read as a draft pass just predicted
        them (each told once, as soon as it is known, while the draft goes on)."""

    def verifying(self, predicted: np.ndarray | None, first_row_ids: int) -> None:
        """A verification is about to run; predicted: the experts [n_layer, n_expert] its draft predicted it
        will read (None for a plain step). first_row_ids: how many of each layer's routed ids belong to its
        first row, the one whose output is kept whatever it decides (0 for a plain step: all of them)."""

    def verified(self) -> None:
        """The verification told by `verifying` ran (or failed)."""

    def start_counting(self) -> None:
        """Decodes that route through the hook start (the draft passes, then the verification)."""

    def misses(self) -> np.ndarray:
        """[n_layer] experts the decodes since start_counting read that were not in memory as they routed."""

    def residency(self) -> Residency:
        """A residency snapshot (a walk over the model's pages: sampled, see Decoder.residency_share)."""

    def draft_allowed(self) -> np.ndarray:
        """[n_layer, n_expert] bool: the experts a draft from resident experts may read, provided they are
        wholly in memory as its layer routes (the routing hook asks the observer's prefetcher then)."""

    def drafted_elsewhere(self, mappings: list[tuple[int, int, int]]) -> None:
        """A draft just ran on weights of its own: `mappings` (address, length, file offset) of the model file,
        read outside the routing hook. What it read is the observer's to let go of."""


class Residency(Protocol):
    @property
    def resident(self) -> np.ndarray: ...  # [n_layer, n_expert] fraction of each expert's pages in memory

    @property
    def pinned(self) -> np.ndarray: ...  # [n_layer, n_expert] bool

    @property
    def hit_rate(self) -> np.ndarray: ...  # [n_layer]


class ResidencySampler:
    """Takes the observer's residency snapshots every `residency_every` iterations, and less often where
    they would cost more than `residency_share` of the generation's time so far."""

    def __init__(self, decoder: Decoder, t_start: float) -> None:
        self.decoder, self.t_start, self.seconds = decoder, t_start, 0.0

    def sample(self, iteration: int) -> ResidencySnapshot | None:
        d = self.decoder
        if d.observer is None or iteration % d.residency_every != 1:
            return None
        if self.seconds > d.residency_share * (time.perf_counter() - self.t_start):
            return None
        t0 = time.perf_counter()
        r = d.observer.residency()
        self.seconds += time.perf_counter() - t0
        return ResidencySnapshot(iteration, r.resident, r.pinned, r.hit_rate)
