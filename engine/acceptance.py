"""The verification rule: which drafted tokens the target accepts, and the token it adds after them.

Greedy: the longest prefix of the draft that matches the target's argmax, then the target's own token.
Sampled: standard speculative sampling — accept token d with probability min(1, p(d)/q(d)), and at the
first rejection draw from the normalised residual max(p − q, 0); all accepted: draw from p at the end.
The output distribution is exactly the target's (Leviathan et al., Chen et al.). p is the target's
distribution after the sampler chain (engine.sampling) for the tokens before it, drafted ones included,
as q is the draft's: the guarantee then holds for sampling with those options.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import Sampling


def accept(drafted: Sequence[int], logits: np.ndarray, dists: Sequence[np.ndarray], sampling: Sampling,
           rng: np.random.Generator, history: Sequence[int] = ()) -> tuple[int, int]:
    """(number of drafted tokens accepted, the target's token after them).

    logits: [len(drafted) + 1, n_vocab] target logits for the pending token and each drafted token;
    dists: the processed draft distribution each drafted token was drawn from (unused when greedy);
    history: the tokens up to and including the pending one (the repetition penalty's window)."""
    history = list(history)
    drafted = list(drafted)
    if sampling.greedy:
        n = 0
        while True:
            token = sampling.greedy_token(logits[n], history + drafted[:n])
            if n == len(drafted) or drafted[n] != token:
                return n, token
            n += 1
    for j, d in enumerate(drafted):
        p = sampling.distribution(logits[j], history + drafted[:j])
        q = dists[j]
        if rng.random() < min(1.0, p[d] / max(q[d], 1e-300)):
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return j, int(rng.choice(len(residual), p=residual))
    p = sampling.distribution(logits[len(drafted)], history + drafted)
    return len(drafted), int(rng.choice(len(p), p=p))
