"""N-gram indexes of text to copy drafts from: one growing generation's context (NgramIndex) and the session's
earlier generations (EarlierText), kept up to date so that a lookup on every step costs a few dictionary reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class NgramIndex:
    """Where each n-gram (n ≤ max_ngram) of one growing token sequence (a generation's context) last occurred,
    for prompt lookup: the longest n-gram ending the sequence that occurred earlier in it, and what followed its
    most recent earlier occurrence. Kept up to date as the sequence grows, so that a lookup costs a few
    dictionary reads rather than a scan of the context on every step."""

    def __init__(self, max_ngram: int, min_ngram: int = 1, periodic: bool = False):
        self.max_ngram, self.min_ngram, self.periodic = max_ngram, min_ngram, periodic
        self.indexed = 1  # n-grams ending before this index are in `last`
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest indexed occurrence

    def extend(self, seq: list[int]) -> None:
        """Index the n-grams of seq not yet indexed: every one ending before its last token (the one ending it
        must not find itself, and nothing follows it yet)."""
        for end in range(self.indexed, len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.last[tuple(seq[end - n : end])] = end
        self.indexed = max(self.indexed, len(seq))

    def lookup(self, seq: list[int], max_len: int) -> tuple[int, list[int], int]:
        """(n, continuation, period): up to max_len tokens that followed the latest earlier occurrence of the
        longest n-gram ending seq, and how far back that occurrence ends; (0, [], 0) when none of its n-grams
        occurred before. Periodic: where the continuation runs into the end of seq, the context is in a loop of
        that period, and the continuation goes on round it (its tokens from index `period` on)."""
        self.extend(seq)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            end = self.last.get(tuple(seq[-n:]))
            if end is not None:
                period = len(seq) - end
                reach = max_len if self.periodic else min(max_len, period)
                return n, [seq[end + i % period] for i in range(reach)], period
        return 0, [], 0


class EarlierText:
    """The text of this session's earlier generations, prompt and output, for copies where a generation's own
    context has no repeated n-gram (or a shorter one): a model's completions repeat its habits from one prompt to
    the next.

    One entry per prompt, the latest, and a generation never copies from an entry of its own prompt: a second
    run of the same prompt (bench's interleaved modes and repeats, a retry) would copy its own answer. The longest
    n-gram ending the context found in any entry wins; where several entries hold it, what followed it in each
    (its latest occurrence there) votes token by token, ties going to the latest entry: once a session holds
    dozens of generations a common n-gram is followed by several habits, and the latest entry's is often not the
    commonest (`vote` holders at most, the latest, so that a step's lookup stays a few dozen reads). A token every
    one of two or more voters agreed on is far likelier to be the target's (on the shipped model's greedy
    HumanEval completions, 91% of such copied tokens were accepted against 50% where one entry voted and 55%
    where the vote split), so each copied token comes with that standing, for the rule to learn apart. At most
    `keep` entries and `max_tokens` tokens in all (a long chat's every turn holds the whole conversation), the
    oldest dropped first. The indexes take about 500 bytes a token, and under a memory budget that memory comes
    out of the expert cache: the token cap holds 64 prompts of a few hundred tokens, where copies found stop
    growing with more generations kept, in under 10 MiB."""

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 2, keep: int = 64, max_tokens: int = 1 << 14, vote: int = 16
    ):
        self.max_ngram, self.min_ngram, self.keep, self.max_tokens = max_ngram, min_ngram, keep, max_tokens
        self.vote = vote
        self.tokens = 0
        # prompt -> (prompt and output, n-gram -> the index just past its latest occurrence there)
        self.entries: OrderedDict[tuple[int, ...], tuple[list[int], dict[tuple[int, ...], int]]] = OrderedDict()
        # n-gram -> the entries holding it, oldest first: a lookup on every decoding step reads one list rather
        # than every entry's index
        self.holders: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def add(self, prompt: Sequence[int], text: Sequence[int]) -> None:
        """A generation ended: `text` is its prompt and what it committed."""
        seq = list(text)
        index = NgramIndex(self.max_ngram, self.min_ngram)
        index.extend(seq)
        key = tuple(prompt)
        if key in self.entries:
            self._drop(key)
        self.entries[key] = (seq, index.last)
        for gram in index.last:
            self.holders.setdefault(gram, []).append(key)
        self.tokens += len(seq)
        while len(self.entries) > 1 and (len(self.entries) > self.keep or self.tokens > self.max_tokens):
            self._drop(next(iter(self.entries)))

    def generations(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """(prompt, prompt and output) of every entry kept, oldest first: add() them in this order to rebuild."""
        return [(key, seq) for key, (seq, _) in self.entries.items()]

    def _drop(self, key: tuple[int, ...]) -> None:
        seq, last = self.entries.pop(key)
        self.tokens -= len(seq)
        for gram in last:
            holders = self.holders[gram]
            holders.remove(key)
            if not holders:
                del self.holders[gram]

    def lookup(
        self, prompt: Sequence[int], seq: list[int], max_len: int, voters: int | None = None
    ) -> tuple[int, list[int], list[bool]]:
        """(n, continuation, agreed) for a generation of `prompt` whose context is `seq`: up to max_len tokens
        that followed the longest n-gram ending seq in other prompts' entries, voted among them, and for each
        token whether two or more voters were left and all agreed on it; (0, [], []) where none holds one.
        voters: how many of the latest entries holding it vote (None: `vote`; 1: the latest entry's text)."""
        own = tuple(prompt)
        voters = self.vote if voters is None else voters
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            gram = tuple(seq[-n:])
            followed = []  # latest entry first
            for key in reversed(self.holders.get(gram, ())):
                if key != own:
                    text, last = self.entries[key]
                    end = last[gram]
                    followed.append(text[end : end + max_len])
                    if len(followed) == voters:
                        break
            if followed:
                return (n, *_vote(followed))
        return 0, [], []


def _vote(followed: list[list[int]]) -> tuple[list[int], list[bool]]:
    """The continuation most of `followed` agree on, token by token: at each position the commonest next token
    among those that agreed so far (ties to the earliest listed), until none has a next token; and for each
    token whether two or more were left and all had it."""
    if len(followed) == 1:
        return list(followed[0]), [False] * len(followed[0])
    out: list[int] = []
    agreed: list[bool] = []
    while True:
        at = len(out)
        counts: dict[int, int] = {}
        for f in followed:
            if len(f) > at:
                counts[f[at]] = counts.get(f[at], 0) + 1
        if not counts:
            return out, agreed
        token = max(counts, key=counts.__getitem__)  # the first listed among the commonest
        voters = sum(counts.values())
        out.append(token)
        agreed.append(voters >= 2 and counts[token] == voters)
        followed = [f for f in followed if len(f) > at and f[at] == token]
