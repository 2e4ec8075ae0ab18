"""What s2moe learns of drafts copied from the context: how often the target accepts a copied token, by n-gram
length and kind, and how much of what plain steps read they fetch. The utility rule keeps one across generations
(UtilityStop.copies); CopyPlanner decides with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# what the rule learns a copied token's acceptance by, beside n: where it was copied from (the generation's own
# context, or the session's earlier generations, EarlierText); for the context's, whether it was taken round the
# loop the context is in, past the context's end (once the target has accepted a whole period it nearly always
# goes on: on the shipped model's greedy HumanEval completions 96-99.6% of such tokens against 77-88% of the
# other copied tokens after the first)
COPY_KINDS = ("context", "context, looped", "session")


class CopyLearner:
    """What s2moe learns of copied drafts.

    How often the target accepts a copied token after an n-gram match, per n and per kind (COPY_KINDS: from the
    generation's own context, those taken round its loop apart, or from the session's earlier generations): the
    accepted share of the copied tokens of that kind verified there (each judged only if those before it were
    accepted) plus `prior` pseudo-tokens at `rate`. A copy's tokens are priced by the chain of their estimates, and
    the prior's rate chained over a long copy expects little of it: a rule that had seen few copies made short ones
    only, and so never learned that the long ones were accepted. So where plain steps fetch most of the experts
    they read (`cache_serves_little`), an estimate is raised by its share's standard error: seen little, it hopes
    for more, and it comes down to the share as copies are verified.

    Not where the cache serves plain steps most of theirs: under a memory budget copies also change which experts
    stay in memory, and there the copies that hope buys leave the plain steps between them fetching more, so that
    the session runs slower than without copies though each copy looks as if it paid. So the experts a plain step
    reads and fetches are counted (`fetched`)."""

    def __init__(
        self,
        max_ngram: int,
        rate: float = 0.6,
        prior: float = 2.0,
        smoothing: float = 0.1,
    ):
        self.rate, self.prior = rate, prior
        shape = (len(COPY_KINDS), max_ngram + 1)
        self.seen = np.zeros(shape)
        self.accepted = np.zeros(shape)
        # the highest estimate of any n and kind: as seen, and raised
        self._likeliest = (rate, float(self._raised(np.array(rate), np.array(0.0))))
        self.smoothing = smoothing
        self._plain_fetched = np.zeros(2)  # decayed sums over plain steps: experts fetched, experts read

    def estimate(self, n: int, kind: str = "context", hope: bool = True) -> float:
        """hope False: the share as seen, never raised (the copy rule without that refinement)."""
        at = COPY_KINDS.index(kind), n
        share = self._share(self.accepted[at], self.seen[at])
        return float(self._raised(share, self.seen[at]) if hope and self.cache_serves_little() else share)

    def likeliest(self, hope: bool = True) -> float:
        """The highest estimate of any n and kind."""
        return self._likeliest[hope and self.cache_serves_little()]

    def _share(self, accepted: npt.NDArray[np.float64], seen: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return (self.prior * self.rate + accepted) / (self.prior + seen)

    def _raised(self, share: npt.NDArray[np.float64], seen: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.minimum(1.0, share + np.sqrt(share * (1 - share) / (self.prior + seen)))

    def learn(self, n: int, kinds: Sequence[str], accepted: int) -> None:
        """A copy after an n-gram, its tokens of `kinds`, verified: the target accepted `accepted` of them."""
        for k, kind in enumerate(kinds[: accepted + 1]):
            at = COPY_KINDS.index(kind), n
            self.seen[at] += 1
            self.accepted[at] += k < accepted
        share = self._share(self.accepted, self.seen)
        self._likeliest = (float(share.max()), float(self._raised(share, self.seen).max()))

    def fetched(self, fetched: int, read: int) -> None:
        """A plain step under a memory budget fetched `fetched` of the `read` experts it read."""
        self._plain_fetched *= 1.0 - self.smoothing
        self._plain_fetched += (fetched, read)

    def cache_serves_little(self) -> bool:
        """Whether plain steps fetched at least half the experts they read (False where nothing was counted:
        without a memory budget, or before a plain step)."""
        fetched, read = self._plain_fetched
        return bool(read > 0 and fetched >= read / 2)
