"""The verification rule: which drafted tokens the target accepts, and the token it adds after them.

One rule for greedy and sampled decoding: at each row the target's own token — the argmax of the penalised
logits, or the Gumbel-max draw with the seed's noise at that position (engine.decoding.sampling) — is what plain
decoding would commit there; a drafted token is accepted while it equals that token, and the first row
where it does not (or the row after the last drafted token) adds the target's token. The committed tokens
are then exactly plain decoding's with the same seed, whatever the draft was. Each row's distribution is the
target's after the sampler chain for the tokens before it, drafted ones included.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling import Floats, PositionNoise, Sampling


def accept(
    drafted: Sequence[int], logits: Floats, sampling: Sampling, noise: PositionNoise, history: Sequence[int]
) -> tuple[int, int]:
    """(number of drafted tokens accepted, the target's token after them).

    logits: [len(drafted) + 1, n_vocab] target logits for the pending token and each drafted token;
    history: the tokens up to and including the pending one (the repetition penalty's window; its length
    is the position of the first row's token)."""
    history = list(history)
    drafted = list(drafted)
    n = 0
    while True:
        token = sampling.token(logits[n], history + drafted[:n], noise)
        if n == len(drafted) or drafted[n] != token:
            return n, token
        n += 1
