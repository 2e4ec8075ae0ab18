"""The verification rule: which drafted tokens the target accepts, and the token it adds after them.

Greedy: the longest prefix of the draft that matches the target's argmax, then the target's own token.
Sampled: standard speculative sampling — accept token d with probability min(1, p(d)/q(d)), and at the
first rejection draw from the normalised residual max(p − q, 0); all accepted: draw from p at the end.
The output distribution is exactly the target's (Leviathan et al., Chen et al.).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .policies import softmax


def accept(drafted: Sequence[int], logits: np.ndarray, dists: Sequence[np.ndarray], temperature: float,
           rng: np.random.Generator) -> tuple[int, int]:
    """(number of drafted tokens accepted, the target's token after them).

    logits: [len(drafted) + 1, n_vocab] target logits for the pending token and each drafted token;
    dists: the draft distribution each drafted token was drawn from (unused when greedy);
    temperature 0 is greedy."""
    if temperature == 0:
        target = np.argmax(logits, axis=1)
        n = 0
        while n < len(drafted) and drafted[n] == int(target[n]):
            n += 1
        return n, int(target[n])
    for j, d in enumerate(drafted):
        p = softmax(logits[j], temperature)
        q = dists[j]
        if rng.random() < min(1.0, p[d] / max(q[d], 1e-300)):
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return j, int(rng.choice(len(residual), p=residual))
    p = softmax(logits[len(drafted)], temperature)
    return len(drafted), int(rng.choice(len(p), p=p))
