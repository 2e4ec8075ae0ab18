"""The verification rule on its own: no model, no llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from s2moe.engine.acceptance import accept
from s2moe.engine.sampling import Sampling, softmax


def _plain(temperature):
    """Sampling at a temperature and nothing else: p is the softmax these tests compute."""
    return Sampling(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)


def _logits_preferring(tokens, n_vocab=6):
    """Target logits whose argmax at row i is tokens[i]."""
    out = np.zeros((len(tokens), n_vocab))
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


@pytest.mark.parametrize("drafted, target, expected", [
    ([], [3], (0, 3)),                     # a plain step: the target's token
    ([1, 2, 4], [1, 2, 4, 0], (3, 0)),     # all accepted, then the bonus token
    ([1, 2, 4], [1, 5, 4, 0], (1, 5)),     # the first mismatch is replaced by the target's token
    ([1, 2], [0, 2, 3], (0, 0)),           # a later match does not count after a mismatch
])
def test_greedy_keeps_the_longest_matching_prefix(drafted, target, expected):
    rng = np.random.default_rng(0)
    assert accept(drafted, _logits_preferring(target), [], _plain(0.0), rng) == expected


def test_sampled_verification_reproduces_the_target_distribution():
    """Speculative sampling is lossless: whatever the draft distribution, the first committed token is
    distributed as the target's. A wrong residual (e.g. resampling from p, or not normalising) fails."""
    rng = np.random.default_rng(1)
    temperature = 1.0
    target_logits = np.array([[2.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    p = softmax(target_logits[0], temperature)
    q = np.array([0.1, 0.6, 0.2, 0.1])  # the draft favours token 1, unlike the target
    n = 40000
    first = np.zeros(4)
    accepted_total = 0
    for _ in range(n):
        d = int(rng.choice(4, p=q))
        n_acc, token = accept([d], target_logits, [q], _plain(temperature), rng)
        first[d if n_acc == 1 else token] += 1
        accepted_total += n_acc
    assert np.abs(first / n - p).max() < 0.01
    # acceptance rate is Σ min(p, q) in expectation
    assert accepted_total / n == pytest.approx(np.minimum(p, q).sum(), abs=0.01)


def test_sampled_verification_accepts_a_draft_identical_to_the_target():
    rng = np.random.default_rng(2)
    logits = np.array([[1.0, 0.2, -0.5], [0.3, 0.3, 0.3], [0.0, 1.0, 0.0]])
    dists = [softmax(logits[0], 0.7), softmax(logits[1], 0.7)]
    for _ in range(200):
        n_acc, _token = accept([0, 2], logits, dists, _plain(0.7), rng)
        assert n_acc == 2  # p/q = 1 for every drafted token
