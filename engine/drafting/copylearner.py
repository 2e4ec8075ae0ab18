"""What s2moe learns of drafts copied from the context: how often the target accepts a copied token, by n-gram
length and kind; what a copy's rows add to a verification's experts; and what copies and plain steps cost as
timed. The utility rule keeps one across generations (UtilityStop.copies); CopyPlanner decides with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# what the rule learns a copied token's acceptance by, beside n: where it was copied from (the generation's own
# context, or the session's earlier generations, EarlierText); for the context's, whether it was taken round the
# loop the context is in, past the context's end (once the target has accepted a whole period it nearly always
# goes on: on the shipped model's greedy HumanEval completions 96-99.6% of such tokens against 77-88% of the
# other copied tokens after the first); and for the session's whether two or more of its entries voted and all
# agreed on it
COPY_KINDS = ("context", "context, looped", "session", "session, agreed")


class CopyLearner:
    """What s2moe learns of copied drafts.

    How often the target accepts a copied token after an n-gram match, per n and per kind (COPY_KINDS: from the
    generation's own context, those taken round its loop apart, or from the session's earlier generations, those all
    voters agreed on apart): the accepted share of the copied tokens of that kind verified there (each judged only
    if those before it were accepted) plus `prior` pseudo-tokens at `rate`. A copy's tokens are priced by the chain
    of their estimates, and the prior's rate chained over a long copy expects little of it: a rule that had seen few
    copies made short ones only, and so never learned that the long ones were accepted. So where plain steps fetch
    most of the experts they read (`cache_serves_little`), an estimate is raised by its share's standard error: seen
    little, it hopes for more, and it comes down to the share as copies are verified. Not where the cache serves
    plain steps most of theirs: there the copies that hope buys evict what the plain steps between them would have
    found, a cost no timing of the copies shows (below). A copy the rule declines is verified anyway now and then
    (its first token only), so that an n the estimate has written off is seen again when the text starts repeating
    itself; a rejected probe doubles the wait before the next (up to 16×), an accepted one resets it. Probes are
    counted by the kind of a copy's first token.

    What a copy's rows add to the verification's experts, by their number (`added`): consecutive tokens share
    experts, so a verification's distinct experts grow ever more slowly with its rows, and a copy of eight rows
    adds far less than eight times what a copy of one adds. The rows are modelled as drawing their experts from a
    pool, each repeating a share q of the one before's (over layers, the pending row's K experts): r rows add
    (K/q)(1 − (1 − q)^(r+1)) − K. Every verified copy, whatever its length, gives an estimate of q, and the
    running mean prices copies of every length. Priced by a mean row instead, what a copy teaches would depend
    on its length: long copies would make rows look cheap, short ones (a probe is one row) dear.

    And what copies cost, timed from one proposal to the next (drafting, verification, acceptance, the event's
    consumer): a plain step, and what a copy costs beyond it, timed on copies the target rejected whole. An
    accepted copy's row reads what the next step would have read anyway, so it looks nearly free; a rejected
    one shows what its rows cost on their own (and they evict experts plain steps would have kept: under `auto`,
    pricing rows by every copy's timing left s2moe 3-4% behind plain decoding on HumanEval). The constants
    price a copy by T_tok per row and T_exp per expert it adds, which leaves out what makes a verification with
    drafts dearer than a plain step (the routing hook's stops, the acceptance of each row): a timed copy's cost
    over the constants' price of the same copy (its own rows and experts) is a factor, and once `min_copies`
    rejected copies were timed its running mean scales the constants' prices. Before that the constants price a
    copy, but what a copied token saves is already the plain step as timed here (CopyPlanner).

    Under a memory budget copies also change which experts stay in memory, and the steps timed around them
    show the cache as copies leave it, not as plain decoding would keep it: where the kept cache serves plain
    steps most of their experts, copies leave the plain steps between them fetching more, and both the copies
    and their neighbours then look as if they paid while the session runs slower than without copies. What
    copies can disturb is what plain steps find in memory, so the experts a plain step reads and fetches are
    counted too (`fetched`), and the plain step as timed prices a copied token before copies were timed only
    where plain steps fetch most of what they read (`cache_serves_little`; docs/results.md, "Copies priced where
    the cache serves little", has the measurements at three budgets).

    llama.cpp reuses its last compute graph only for a batch of the same shape, so the step after a batch of
    another shape (a prefill, a copy's verification, a draft) builds its graph anew; on a small model in memory
    that rebuild is a sizeable part of a step, and it belongs to what came before. So a plain step is timed as
    such only after a plain step, and a copy rejected whole is charged, beyond its own time, what the plain step
    after it paid over a plain step's."""

    def __init__(
        self,
        max_ngram: int,
        rate: float = 0.6,
        prior: float = 2.0,
        probe_every: int = 32,
        smoothing: float = 0.1,
        min_copies: int = 3,
    ):
        self.rate, self.prior = rate, prior
        shape = (len(COPY_KINDS), max_ngram + 1)
        self.seen = np.zeros(shape)
        self.accepted = np.zeros(shape)
        self.probe_every = probe_every
        self.probe_interval = np.full(shape, probe_every)
        self._declined = np.zeros(shape, int)
        # the highest estimate of any n and kind: as seen, and raised
        self._likeliest = (rate, float(self._raised(np.array(rate), np.array(0.0))))
        self._hopeless_steps = 0
        self.smoothing, self.min_copies = smoothing, min_copies
        self.plain_s: float | None = None  # running means: a plain step's wall time
        self.scale: float | None = None  # … and a copy's timed cost over the constants' price of it
        self.copies_timed = 0
        self.overlap: float | None = None  # running mean of q, the share of a row's experts the next repeats
        self.pending_experts = 0.0  # K: the experts a verification's pending row reads, over layers
        self._priced: float | None = None  # the constants' price of the copy verified last, until it is timed
        self._after_plain = False  # the iteration timed last was a plain step
        self._rejected: tuple[float, float] | None = None  # a copy rejected whole (seconds, price), until the step
        # after it is timed
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

    def probe(self, n: int, kind: str = "context") -> bool:
        """A copy after an n-gram, its first token of this kind, was declined: whether to verify that token anyway."""
        at = COPY_KINDS.index(kind), n
        self._declined[at] += 1
        if self._declined[at] < self.probe_interval[at]:
            return False
        self._declined[at] = 0
        return True

    def rare_probe_due(self) -> bool:
        """A step at prices where not even a certain copy pays: whether the longest wait is over, so that a copy
        is verified to find out whether the prices changed. Counted in steps, not declined copies: no n-gram
        is looked up while it lasts (on a small model in memory a lookup is a noticeable part of a step)."""
        self._hopeless_steps += 1
        return self._hopeless_steps >= 16 * self.probe_every

    def rare_probe_made(self) -> None:
        self._hopeless_steps = 0

    def learn(self, n: int, kinds: Sequence[str], accepted: int, probe: bool = False) -> None:
        """A copy after an n-gram, its tokens of `kinds`, verified: the target accepted `accepted` of them."""
        for k, kind in enumerate(kinds[: accepted + 1]):
            at = COPY_KINDS.index(kind), n
            self.seen[at] += 1
            self.accepted[at] += k < accepted
        share = self._share(self.accepted, self.seen)
        self._likeliest = (float(share.max()), float(self._raised(share, self.seen).max()))
        if probe and kinds:
            at = COPY_KINDS.index(kinds[0]), n
            self.probe_interval[at] = (
                self.probe_every if accepted else min(2 * self.probe_interval[at], 16 * self.probe_every)
            )

    def began(self) -> None:
        """A generation begins: its first step follows the prefill, a batch of another shape."""
        self._after_plain, self._rejected, self._priced = False, None, None

    def verified(self, rows: int, added: float, pending: float, priced: float) -> float:
        """A copy of `rows` rows was verified: they added `added` experts (over layers) to the `pending` ones of
        its pending row, and the constants price such a copy at `priced` seconds. Returns what its first row
        added, as the pool it teaches has it (without a pending row's count, the rows' mean)."""
        self._priced = priced
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

    def timed(self, seconds: float, rows: int | None, accepted: int = 0) -> None:
        """An iteration's wall time: a plain step (rows 0), a verification of `rows` copied tokens of which the
        target accepted `accepted`, or (rows None) a step of another kind, whose time says nothing of copies."""
        rejected, self._rejected = self._rejected, None
        priced, self._priced = self._priced, None
        if rows == 0:
            if rejected is not None and self.plain_s is not None:
                copy_s, copy_priced = rejected
                self._time_copy((copy_s + seconds - 2 * self.plain_s) / copy_priced)
            elif self._after_plain:
                self.plain_s = (
                    seconds if self.plain_s is None else self.plain_s + self.smoothing * (seconds - self.plain_s)
                )
        elif rows is not None and accepted == 0 and priced:
            self._rejected = (seconds, priced)
        self._after_plain = rows == 0

    def _time_copy(self, factor: float) -> None:
        self.scale = factor if self.scale is None else self.scale + self.smoothing * (factor - self.scale)
        self.copies_timed += 1

    def fetched(self, fetched: int, read: int) -> None:
        """A plain step under a memory budget fetched `fetched` of the `read` experts it read."""
        self._plain_fetched *= 1.0 - self.smoothing
        self._plain_fetched += (fetched, read)

    def cache_serves_little(self) -> bool:
        """Whether plain steps fetched at least half the experts they read (False where nothing was counted:
        without a memory budget, or before a plain step)."""
        fetched, read = self._plain_fetched
        return bool(read > 0 and fetched >= read / 2)

    def price(self) -> tuple[float, float] | None:
        """(a plain step, the factor on the constants' price of a copy) as measured; None until enough copies
        were timed."""
        if self.copies_timed < self.min_copies or self.plain_s is None or self.scale is None:
            return None
        return self.plain_s, self.scale


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
