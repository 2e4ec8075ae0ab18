"""What s2moe learns of drafts copied from the context: how often the target accepts a copied token, by n-gram
length and kind; what a copy's rows add to a verification's experts; and how much of what plain steps read they
fetch. The utility rule keeps one across generations (UtilityStop.copies); CopyPlanner decides with it.
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
    accepted) plus `prior` pseudo-tokens at `rate`. A copy's tokens are priced by the chain
    of their estimates, and the prior's rate chained over a long copy expects little of it: a rule that had seen few
    copies made short ones only, and so never learned that the long ones were accepted. So where plain steps fetch
    most of the experts they read (`cache_serves_little`), an estimate is raised by its share's standard error: seen
    little, it hopes for more, and it comes down to the share as copies are verified. Not where the cache serves
    plain steps most of theirs: there the copies that hope buys evict what the plain steps between them would have
    found (below).

    What a copy's rows add to the verification's experts, by their number (`added`): consecutive tokens share
    experts, so a verification's distinct experts grow ever more slowly with its rows, and a copy of eight rows
    adds far less than eight times what a copy of one adds. The rows are modelled as drawing their experts from a
    pool, each repeating a share q of the one before's (over layers, the pending row's K experts): r rows add
    (K/q)(1 − (1 − q)^(r+1)) − K. Every verified copy, whatever its length, gives an estimate of q, and the
    running mean prices copies of every length. Priced by a mean row instead, what a copy teaches would depend
    on its length: long copies would make rows look cheap, short ones dear.

    Under a memory budget copies also change which experts stay in memory: where the kept cache serves plain
    steps most of their experts, copies leave the plain steps between them fetching more, and the session runs
    slower than without copies though each copy looks as if it paid. What copies can disturb is what plain steps
    find in memory, so the experts a plain step reads and fetches are counted (`fetched`), and estimates are
    hoped above their shares only where plain steps fetch most of what they read (`cache_serves_little`)."""

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
        self.overlap: float | None = None  # running mean of q, the share of a row's experts the next repeats
        self.pending_experts = 0.0  # K: the experts a verification's pending row reads, over layers
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

    def verified(self, rows: int, added: float, pending: float) -> float:
        """A copy of `rows` rows was verified: they added `added` experts (over layers) to the `pending` ones of
        its pending row. Returns what its first row added, as the pool it teaches has it (without a pending row's
        count, the rows' mean)."""
        if pending <= 0:
            return added / rows
        q = copy_overlap(rows, added, pending)
        self.overlap = q if self.overlap is None else self.overlap + self.smoothing * (q - self.overlap)
        self.pending_experts = float(pending)
        return copy_added(q, 1, pending)

    def added(self, rows: int, per_row: float) -> float:
        """The experts a copy of `rows` rows is expected to add to its pending row's, over layers: by the pool
        of experts the verified copies share; before any was verified, `per_row` each."""
        if self.overlap is None:
            return rows * per_row
        return copy_added(self.overlap, rows, self.pending_experts)

    def fetched(self, fetched: int, read: int) -> None:
        """A plain step under a memory budget fetched `fetched` of the `read` experts it read."""
        self._plain_fetched *= 1.0 - self.smoothing
        self._plain_fetched += (fetched, read)

    def cache_serves_little(self) -> bool:
        """Whether plain steps fetched at least half the experts they read (False where nothing was counted:
        without a memory budget, or before a plain step)."""
        fetched, read = self._plain_fetched
        return bool(read > 0 and fetched >= read / 2)


def copy_added(overlap: float, rows: int, pending: float) -> float:
    """The experts `rows` rows add to a pending row's `pending` ones, each row repeating a share `overlap` of
    the one before's experts from a pool they share (CopyLearner)."""
    if overlap < 1e-9:
        return rows * pending
    return pending / overlap * (1.0 - (1.0 - overlap) ** (rows + 1)) - pending


def copy_overlap(rows: int, added: float, pending: float) -> float:
    """The share q for which `rows` rows add `added` experts to the pending row's (copy_added's inverse: it
    falls from rows·pending at q = 0 to 0 at q = 1)."""
    if added >= rows * pending:
        return 0.0
    if added <= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if copy_added(mid, rows, pending) > added:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
