"""How a row of logits becomes the distribution a token is drawn from: llama.cpp's sampler chain.

One processing for every mode and both sides of speculative decoding, each computed for the tokens before
it (drafted ones included).

A sampled token is the Gumbel-max draw: the kept token of largest log-probability plus noise that depends
only on the seed, the token's position in the context and the token id (PositionNoise, as an exponential
race). Given the tokens before it, that is an exact draw from the processed distribution, and a fresh one
at every position. Because the noise is fixed per position, the token plain decoding would sample at a
position is known to whoever holds the target's logits there: verification accepts a drafted token exactly
when it is that token, so a speculative generation commits the very tokens plain sampling with the same
seed commits, whatever was drafted, by which drafter, and whether a timing-driven rule drafted at all. The
draft draws with the same noise, which couples its tokens to the target's (the closer the two
distributions, the likelier they agree).

The order and the rules are llama.cpp's default chain (common/sampling.cpp): repetition penalty over the
last `repeat_last_n` tokens (the prompt included), top-k, top-p and min-p (both at temperature 1),
temperature, then a draw. Temperature 0 is greedy: the argmax of the penalised logits, which top-k, top-p
and min-p never change.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import OPTION, ConfigError

# llama.cpp's defaults (common.h: top_k 40, top_p 0.95, min_p 0.05, penalty_repeat 1, penalty_last_n 64)
TOP_K = 40
TOP_P = 0.95
MIN_P = 0.05
REPEAT_PENALTY = 1.0
REPEAT_LAST_N = 64
RANDOM_SEED = -1  # as llama.cpp's -s -1: a seed drawn at random, reported with the run
MAX_SEED = (1 << 32) - 1  # llama.cpp's seeds are 32-bit


# Logits as a model gives them (float32) or as a sampler changed them (float64)
Floats = npt.NDArray[np.floating[Any]]
# A distribution over the vocabulary (float64, sums to 1)
Distribution = npt.NDArray[np.float64]
TokenIds = npt.NDArray[np.intp]


def softmax(logits: Floats, temperature: float = 1.0) -> Distribution:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    z -= z.max()
    p = np.exp(z)
    probabilities: npt.NDArray[np.float64] = p / p.sum()
    return probabilities


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    mixed: npt.NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return mixed


class PositionNoise:
    """A seed's noise: one standard exponential value E per (position, token id), computed on demand from a
    hash of the three, so that the same seed draws the same value for a token at a position in any process
    and whatever else was drawn, and values at other positions or of other tokens are independent of it.

    The draw from q at a position is the token of least E/q — the exponential race, the same as the
    Gumbel-max draw (log q − log E is log q plus standard Gumbel noise), with one logarithm a token."""

    def __init__(self, seed: int):
        with np.errstate(over="ignore"):
            self._key = _mix64(np.array([seed], dtype=np.uint64) * _GOLDEN + _GOLDEN)

    def exponential(self, position: int, ids: npt.ArrayLike) -> npt.NDArray[np.float64]:
        with np.errstate(over="ignore"):
            row = _mix64(self._key ^ (np.uint64(position) * _GOLDEN))
            h = _mix64(row + (np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
        u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1), never 0 or 1
        values: npt.NDArray[np.float64] = -np.log(u)
        return values

    def draw(self, q: Distribution, position: int) -> int:
        ids = np.flatnonzero(q > 0)
        return int(ids[np.argmin(self.exponential(position, ids) / q[ids])])

    def perturbed(self, q: Distribution, position: int) -> npt.NDArray[np.float64]:
        """log q plus this position's Gumbel noise over the tokens q keeps, -inf elsewhere: the draw is its
        argmax, and its top-2 gap how near a tie the draw was."""
        ids = np.flatnonzero(q > 0)
        out = np.full(len(q), -np.inf)
        out[ids] = np.log(q[ids]) - np.log(self.exponential(position, ids))
        return out


def random_seed() -> int:
    return secrets.randbelow(MAX_SEED + 1)


def check_seed(seed: int) -> None:
    if not RANDOM_SEED <= seed <= MAX_SEED:
        raise ConfigError(
            f"{OPTION} must be -1 (random) or a whole number from 0 to {MAX_SEED}, got {seed}", option="seed"
        )


@dataclass(frozen=True)
class Sampling:
    """The sampler settings of a generation. repeat_last_n: tokens the penalty looks back over (0: none;
    the caller turns llama.cpp's -1, the whole context, into the context size)."""

    temperature: float = 0.0
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax_of_logits(self) -> bool:
        """Greedy with nothing changing the logits: the token llama.cpp's own greedy sampler picks."""
        return self.greedy and (self.repeat_penalty == 1.0 or self.repeat_last_n == 0)

    def validate(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"{OPTION} must be a finite number ≥ 0", option="temperature")
        if self.top_k < 0:
            raise ConfigError(f"{OPTION} must be ≥ 0 (0: off)", option="top_k")
        if not 0 <= self.top_p <= 1:
            raise ConfigError(f"{OPTION} must be between 0 and 1 (1: off)", option="top_p")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"{OPTION} must be between 0 and 1 (0: off)", option="min_p")
        if not (self.repeat_penalty > 0 and math.isfinite(self.repeat_penalty)):
            raise ConfigError(f"{OPTION} must be a finite number > 0 (1: off)", option="repeat_penalty")
        if self.repeat_last_n < -1:
            raise ConfigError(
                f"{OPTION} must be -1 (the whole context), 0 (off) or a number of tokens", option="repeat_last_n"
            )

    def penalized(self, logits: Floats, history: Sequence[int]) -> Floats:
        """logits with the repetition penalty applied for the tokens before them (llama.cpp's rule: a
        positive logit is divided by the penalty, a negative one multiplied)."""
        if self.repeat_penalty == 1.0 or self.repeat_last_n <= 0 or not len(history):
            return logits
        seen = np.unique(np.asarray(history[-self.repeat_last_n :], dtype=np.int64))
        z = logits.astype(np.float64)
        v = z[seen]
        z[seen] = np.where(v <= 0, v * self.repeat_penalty, v / self.repeat_penalty)
        return z

    def distribution(self, logits: Floats, history: Sequence[int]) -> Distribution:
        """The distribution (float64, sums to 1) a sampled token is drawn from after `history`. Greedy: the
        penalised softmax at temperature 1, whose argmax is the token and whose values are the draft's
        confidence (the stop rules read them)."""
        z = self.penalized(logits, history).astype(np.float64)
        if self.greedy:
            return softmax(z)
        keep = _kept(z, self.top_k, self.top_p, self.min_p)
        kept = z[keep] / self.temperature
        p = np.zeros(len(z))
        e = np.exp(kept - kept.max())
        p[keep] = e / e.sum()
        return p

    def choose(self, logits: Floats, history: Sequence[int], noise: PositionNoise) -> tuple[int, Distribution]:
        """(the token at position len(history), the distribution it was drawn from)."""
        q = self.distribution(logits, history)
        if self.greedy:
            return int(np.argmax(q)), q
        return noise.draw(q, len(history)), q

    def token(self, logits: Floats, history: Sequence[int], noise: PositionNoise) -> int:
        """The token plain decoding commits at position len(history) after `history`."""
        if self.greedy:
            return self.greedy_token(logits, history)
        return noise.draw(self.distribution(logits, history), len(history))

    def scores(self, logits: Floats, history: Sequence[int], noise: PositionNoise) -> npt.NDArray[np.float64]:
        """What that token is the argmax of: the penalised logits (greedy), else the kept tokens'
        log-probabilities plus the position's noise. Its top-2 gap says how near a tie the choice was."""
        if self.greedy:
            return np.asarray(self.penalized(logits, history), dtype=np.float64)
        return noise.perturbed(self.distribution(logits, history), len(history))

    def greedy_token(self, logits: Floats, history: Sequence[int]) -> int:
        return int(np.argmax(self.penalized(logits, history)))


@dataclass(frozen=True)
class SeededSampler:
    """A generation's sampler: its chain and its seed's noise. Called as sample(logits, history), it gives
    (the token at position len(history), the distribution it was drawn from) — what drafters draw with."""

    sampling: Sampling
    noise: PositionNoise

    def __call__(self, logits: Floats, history: Sequence[int]) -> tuple[int, Distribution]:
        return self.sampling.choose(logits, history, self.noise)

    def ranked(self, logits: Floats, history: Sequence[int], count: int) -> tuple[TokenIds, Distribution]:
        """(the first `count` kept tokens, likeliest to be the one drawn first; the distribution). Greedy: by
        probability. Sampled: by log-probability plus the position's noise — the tokens a draw without
        replacement gives in turn, so the first is the token drawn, and a target close to the draft most
        likely draws one of the first few."""
        q = self.sampling.distribution(logits, history)
        ids = np.flatnonzero(q > 0)
        keys = -q[ids] if self.sampling.greedy else self.noise.exponential(len(history), ids) / q[ids]
        if count < len(ids):  # the drafter takes a few: no sort of the whole vocabulary per node
            part = np.argpartition(keys, count - 1)[:count]
            ids, keys = ids[part], keys[part]
        return ids[np.lexsort((ids, keys))], q


def _kept(z: npt.NDArray[np.float64], top_k: int, top_p: float, min_p: float) -> TokenIds:
    """Indices of the tokens top-k, then top-p, then min-p keep (each over what the one before kept; top-p
    and min-p on probabilities at temperature 1), as llama.cpp's samplers do. At least one is kept. Only
    top-p needs the kept tokens in order: without it nothing is sorted, which a large vocabulary notices."""
    n = len(z)
    idx = np.arange(n)
    if 0 < top_k < n:
        idx = np.argpartition(-z, top_k - 1)[:top_k]
    if top_p < 1.0:
        # highest first; ties by token id, so that the same logits always keep the same tokens
        order = idx[np.lexsort((idx, -z[idx]))]
        zz = z[order]
        p = np.exp(zz - zz[0])
        cum = np.cumsum(p / p.sum())
        # the first position where the mass reaches top_p is the last one kept
        idx = order[: min(int(np.searchsorted(cum, top_p, side="left")) + 1, len(order))]
    if min_p > 0.0:
        idx = idx[z[idx] >= z[idx].max() + math.log(min_p)]
    return idx
