"""The verification rule on its own: no model, no llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest
from s2moe.engine.decoding.acceptance import accept
from s2moe.engine.decoding.sampling import PositionNoise, Sampling, softmax


def _plain(temperature):
    """Sampling at a temperature and nothing else: p is the softmax these tests compute."""
    return Sampling(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)


def _logits_preferring(tokens, n_vocab=6):
    """Target logits whose argmax at row i is tokens[i]."""
    out = np.zeros((len(tokens), n_vocab))
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


@pytest.mark.parametrize(
    "drafted, target, expected",
    [
        ([], [3], (0, 3)),  # a plain step: the target's token
        ([1, 2, 4], [1, 2, 4, 0], (3, 0)),  # all accepted, then the bonus token
        ([1, 2, 4], [1, 5, 4, 0], (1, 5)),  # the first mismatch is replaced by the target's token
        ([1, 2], [0, 2, 3], (0, 0)),  # a later match does not count after a mismatch
    ],
)
def test_greedy_keeps_the_longest_matching_prefix(drafted, target, expected):
    assert accept(drafted, _logits_preferring(target), _plain(0.0), PositionNoise(0), [7]) == expected


TARGET = np.array([[2.0, 0.5, 0.0, -1.0], [0.0, 1.0, 0.0, 0.5]])
DRAFT_Q = np.array([0.1, 0.6, 0.2, 0.1])  # the draft favours token 1, unlike the target
HISTORY = [3, 1, 2]  # the first row's token sits at position 3


def _plain_tokens(noise) -> list[int]:
    """The two tokens plain sampling commits with this noise (the toy target ignores the tokens before)."""
    s = _plain(1.0)
    return [s.token(TARGET[0], HISTORY, noise), s.token(TARGET[1], HISTORY + [0], noise)]


def test_sampled_verification_commits_plain_samplings_tokens_whatever_the_draft():
    """Whatever the draft proposes — the draft's coupled draw, a fixed token, a token the target never
    samples — the first committed token is the one plain sampling with the same seed commits there, and
    acceptance means exactly that the draft proposed it."""
    hits = 0
    for seed in range(3000):
        noise = PositionNoise(seed)
        plain = _plain_tokens(noise)[0]
        for d in (noise.draw(DRAFT_Q, len(HISTORY)), 1, 3):
            n_acc, token = accept([d], TARGET, _plain(1.0), noise, HISTORY)
            assert (d if n_acc == 1 else token) == plain
            assert n_acc == (d == plain)
        hits += plain == 0
    assert 0.68 < hits / 3000 < 0.74  # p(0) = 0.710: a noise that always drew one token would fail


def test_plain_sampling_with_position_noise_draws_the_target_distribution():
    """Over seeds, the Gumbel-max draw at a position is distributed as the processed distribution, and the
    draws at two positions are independent: the pair's frequencies are the product of the marginals."""
    p = softmax(TARGET[0])
    p1 = softmax(TARGET[1])
    n = 40000
    pairs = np.zeros((4, 4))
    for seed in range(n):
        a, b = _plain_tokens(PositionNoise(seed))
        pairs[a, b] += 1
    assert np.abs(pairs.sum(axis=1) / n - p).max() < 0.01
    assert np.abs(pairs / n - np.outer(p, p1)).max() < 0.01


def test_the_coupled_draft_is_accepted_between_the_gumbel_bound_and_the_best_coupling():
    """The draft draws with the target's noise: it is accepted with probability at most Σ min(p, q) (no
    coupling does better) and at least (1 − TV) / (1 + TV), the Gumbel-max coupling's guarantee — far more
    than independent draws, which agree with probability Σ p·q."""
    p = softmax(TARGET[0])
    overlap = np.minimum(p, DRAFT_Q).sum()
    tv = 1 - overlap
    n = 20000
    accepted = (
        sum(
            accept(
                [PositionNoise(seed).draw(DRAFT_Q, len(HISTORY))], TARGET, _plain(1.0), PositionNoise(seed), HISTORY
            )[0]
            for seed in range(n)
        )
        / n
    )
    assert (1 - tv) / (1 + tv) - 0.01 < accepted < overlap + 0.01
    assert accepted > float(p @ DRAFT_Q) + 0.05


def test_a_draft_identical_to_the_target_is_always_accepted():
    logits = np.array([[1.0, 0.2, -0.5], [0.3, 0.3, 0.3], [0.0, 1.0, 0.0]])
    s = _plain(0.7)
    for seed in range(200):
        noise = PositionNoise(seed)
        d0, _ = s.choose(logits[0], HISTORY, noise)
        d1, _ = s.choose(logits[1], HISTORY + [d0], noise)
        assert accept([d0, d1], logits, s, noise, HISTORY)[0] == 2
