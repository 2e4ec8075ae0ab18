"""llama.cpp's sampler chain (engine.decoding.sampling): the same as llama.cpp's own samplers, and lossless in
speculative decoding — sampled verification reproduces the processed target distribution, greedy modes
stay token-identical to ar with the options on."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest
from s2moe.engine.decoding.acceptance import accept
from s2moe.engine.decoding.decoder import run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.decoding.sampling import MAX_SEED, PositionNoise, Sampling
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Finished, Iteration, Started
from test_engine_decoding import _chi2, _chi2_critical, assert_matches_ar

# Options that change the distribution everywhere: a penalty strong enough to change greedy tokens, and
# filters that cut the tail.
OPTIONS = dict(top_k=5, top_p=0.8, min_p=0.1, repeat_penalty=1.5, repeat_last_n=16)


def llama_cpp_chain(logits: np.ndarray, history, s: Sampling) -> np.ndarray:
    """The distribution llama.cpp's own samplers (penalties, top-k, top-p, min-p, temperature: its default
    order) leave over `logits` after `history`, softmaxed."""
    n = len(logits)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for sampler in (
        llama_cpp.llama_sampler_init_penalties(n, s.repeat_last_n, s.repeat_penalty, 0.0, 0.0),
        llama_cpp.llama_sampler_init_top_k(s.top_k),
        llama_cpp.llama_sampler_init_top_p(s.top_p, 0),
        llama_cpp.llama_sampler_init_min_p(s.min_p, 0),
        llama_cpp.llama_sampler_init_temp(s.temperature),
    ):
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    try:
        for t in history:
            llama_cpp.llama_sampler_accept(chain, int(t))
        data = (llama_cpp.llama_token_data * n)()
        for i, z in enumerate(logits):
            data[i].id, data[i].logit, data[i].p = i, float(z), 0.0
        arr = llama_cpp.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        ids = np.array([arr.data[i].id for i in range(arr.size)])
        kept = np.array([arr.data[i].logit for i in range(arr.size)], dtype=np.float64)
    finally:
        llama_cpp.llama_sampler_free(chain)
    p = np.zeros(n)
    e = np.exp(kept - kept.max())
    p[ids] = e / e.sum()
    return p


def test_the_chain_is_llama_cpps():
    """Random logits, histories and settings (each option on and off): the same kept tokens and the same
    probabilities as llama.cpp's samplers computed in llama.cpp."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        logits = rng.normal(0, 2, 50).astype(np.float32)
        history = list(rng.integers(0, 50, 24))
        s = Sampling(
            temperature=float(rng.choice([0.5, 0.8, 1.3])),
            top_k=int(rng.choice([0, 1, 5, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.0])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
            repeat_penalty=float(rng.choice([1.0, 1.1, 1.5, 0.8])),
            repeat_last_n=int(rng.choice([0, 8, 64])),
        )
        ours, theirs = s.distribution(logits, history), llama_cpp_chain(logits, history, s)
        assert np.array_equal(ours > 0, theirs > 0), s
        assert np.abs(ours - theirs).max() < 1e-5, s


def test_greedy_is_the_argmax_after_the_penalty_as_llama_cpps_temperature_0():
    rng = np.random.default_rng(1)
    changed = 0
    for _ in range(100):
        logits = rng.normal(0, 1, 30).astype(np.float32)
        history = list(rng.integers(0, 30, 10))
        s = Sampling(temperature=0.0, **OPTIONS)
        token = s.greedy_token(logits, history)
        assert llama_cpp_chain(logits, history, s)[token] == 1.0
        assert s.choose(logits, history, PositionNoise(7))[0] == token == s.token(logits, history, PositionNoise(7))
        changed += token != int(np.argmax(logits))
    assert changed > 0  # the penalty did change some argmaxes: the test compares something


def test_an_option_that_is_off_leaves_the_distribution_alone():
    logits = np.array([2.0, 1.0, 0.5, -1.0, -3.0])
    plain = np.exp(logits / 0.7 - (logits / 0.7).max())
    plain /= plain.sum()
    off = Sampling(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    assert np.allclose(off.distribution(logits, [0, 0, 1]), plain)
    assert np.allclose(
        Sampling(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=2.0, repeat_last_n=0).distribution(
            logits, [0, 1]
        ),
        plain,
    )


def _two_tokens(target_logits, draft_logits, verify: Sampling, draft: Sampling, history, noise):
    """The first two tokens of a speculative generation on a toy model whose logits at each position do
    not depend on the tokens before (the penalty does): a draft of two tokens, then plain steps until two
    tokens are committed. verify: the chain the verification accepts against."""
    d0 = draft.choose(draft_logits[0], history, noise)[0]
    d1 = draft.choose(draft_logits[1], history + [d0], noise)[0]
    n, token = accept([d0, d1], target_logits, verify, noise, history)
    out = [d0, d1][:n] + [token]
    while len(out) < 2:
        out += [accept([], target_logits[len(out) :], verify, noise, history + out)[1]]
    return tuple(out[:2])


def _pair_test(verify: Sampling, trials: int = 12000, seed: int = 0):
    """chi-square statistic and degrees of freedom of the first two tokens of speculative sampling (the
    verification using `verify`) against plain sampling with the processed chain OPTIONS at T 0.9."""
    chain = Sampling(temperature=0.9, **OPTIONS)
    target = np.array([[2.0, 1.6, 1.0, 0.4, 0.0, -0.5], [1.8, 0.2, 1.7, 1.2, 0.9, -1.0], [0.0] * 6])
    draft = np.array([[0.5, 2.0, 1.0, 1.5, 0.0, 0.8], [1.0, 1.0, 0.0, 2.0, 1.5, 0.0]])
    history = [0, 2, 2]  # the penalty lowers tokens 0 and 2, and then whatever the first token is
    expected = np.zeros((6, 6))
    p0 = chain.distribution(target[0], history)
    for a in range(6):
        expected[a] = p0[a] * chain.distribution(target[1], history + [a])
    counts: dict[int, int] = {}
    for trial in range(trials):
        a, b = _two_tokens(target, draft, verify, chain, history, PositionNoise(seed + trial))
        counts[6 * a + b] = counts.get(6 * a + b, 0) + 1
    return _chi2(counts, expected.ravel(), trials)


def test_sampled_verification_reproduces_the_processed_target_distribution():
    """Draft from the processed draft distribution, accept against the processed target distribution of
    the tokens before each row (drafted ones included): the first two committed tokens are distributed
    as plain sampling with the same options draws them."""
    stat, df = _pair_test(Sampling(temperature=0.9, **OPTIONS))
    assert df >= 6
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} df {df}"


def test_verification_against_the_unprocessed_target_is_caught():
    """The same draft, a verification that forgets the chain (plain temperature sampling): what it
    commits is no longer the processed distribution, and the test above would see it."""
    stat, df = _pair_test(Sampling(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0))
    assert stat > 4 * _chi2_critical(df), f"chi2 {stat:.1f} df {df}"


def test_verification_without_the_repeat_penalty_is_caught():
    """Only the penalty left out of the verification's chain (the filters kept): caught as well."""
    stat, df = _pair_test(Sampling(temperature=0.9, **{**OPTIONS, "repeat_penalty": 1.0}))
    assert stat > 4 * _chi2_critical(df), f"chi2 {stat:.1f} df {df}"


@pytest.mark.parametrize("mode", ["s2moe", "naive", "conf", "cascade", "lookup"])
def test_greedy_modes_stay_identical_to_ar_with_the_options_on(decoders, mode):
    d = decoders["olmoe"]
    prompt = "the the the cat sat on the the mat"
    base = dict(n_predict=40, stop_at_eos=False, **OPTIONS)
    ar = run(d, prompt, GenerationConfig(mode="ar", **base))[-1]
    plain = run(d, prompt, GenerationConfig(mode="ar", n_predict=40, stop_at_eos=False))[-1]
    assert ar.tokens != plain.tokens  # the penalty changed the greedy tokens: the comparison means something
    events = run(d, prompt, GenerationConfig(mode=mode, reuse_strength=0.0, utility=False, **base))
    spec = events[-1]
    assert isinstance(spec, Finished)
    assert sum(len(e.drafted) for e in events if isinstance(e, Iteration)) > 0
    assert_matches_ar(d, prompt, spec.tokens, GenerationConfig(**base), mode, ar=ar.tokens)


@pytest.mark.parametrize("mode", ["s2moe", "naive", "conf", "cascade", "lookup", "tree", "tree-prob", "ls"])
def test_sampled_modes_commit_ars_tokens_with_the_same_seed(decoders, mode):
    """Sampled with the options on, every drafting mode (gating off) commits the tokens plain sampling with
    the same seed commits: verification accepts a draft exactly when it is the token plain decoding draws
    there. Speculative sampling by rejection would give other (equally distributed) text."""
    d = decoders["olmoe"]
    prompt = "the the the cat sat on the the mat"
    options = dict(OPTIONS, temperature=0.9, top_k=12)
    drafted = accepted = 0
    for seed in (3, 4, 5):
        base = dict(n_predict=32, stop_at_eos=False, seed=seed, **options)
        ar = run(d, prompt, GenerationConfig(mode="ar", **base))[-1]
        events = run(d, prompt, GenerationConfig(mode=mode, reuse_strength=0.0, utility=False, **base))
        its = [e for e in events if isinstance(e, Iteration)]
        drafted += sum(len(e.drafted) for e in its)
        accepted += sum(len(e.accepted) for e in its)
        assert_matches_ar(d, prompt, events[-1].tokens, GenerationConfig(**base), f"{mode} (seed {seed})", ar=ar.tokens)
    assert drafted > 0 and 0 < accepted < drafted  # drafts were verified, and some were rejected


def test_speculative_sampling_with_the_options_matches_plain_sampling(decoders):
    """The real decoder, sampled with top-k, top-p, min-p and the repeat penalty: s2moe's first token is
    distributed as the processed target distribution (the chain computed here from llama.cpp's logits)."""
    d = decoders["olmoe"]
    prompt = d.tokenize("hello there the world")
    options = dict(temperature=2.0, top_k=12, top_p=0.97, min_p=0.01, repeat_penalty=1.5, repeat_last_n=64)
    rt = d.rt
    rt.kv_clear()
    rt.hook.off()
    p = Sampling(**options).distribution(rt.decode(prompt, 0, "last")[0], prompt)
    rt.kv_clear()
    trials = 1200
    first: dict[int, int] = {}
    for seed in range(trials):
        cfg = GenerationConfig(
            mode="s2moe",
            n_predict=3,
            seed=seed,
            draft_topk=1,
            utility=False,
            reuse_strength=0.0,
            draft_max=2,
            stop_at_eos=False,
            **options,
        )
        token = run(d, prompt, cfg)[-1].tokens[0]
        first[token] = first.get(token, 0) + 1
    assert set(first) <= set(np.flatnonzero(p))  # nothing outside what the filters keep
    stat, df = _chi2(first, p, trials)
    assert df >= 3
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} df {df}"


def test_seed_minus_one_draws_a_seed_and_the_run_records_it(decoders):
    d = decoders["olmoe"]
    cfg = GenerationConfig(mode="ar", n_predict=2, temperature=0.8, seed=-1)
    seeds = [run(d, "hello", cfg)[0].config["seed"] for _ in range(2)]
    assert all(isinstance(s, int) and 0 <= s <= MAX_SEED for s in seeds)
    assert seeds[0] != seeds[1]
    events = run(d, "hello", GenerationConfig(mode="ar", n_predict=6, temperature=0.8, seed=seeds[0]))
    again = run(d, "hello", GenerationConfig(mode="ar", n_predict=6, temperature=0.8, seed=seeds[0]))
    assert isinstance(events[0], Started) and events[-1].tokens == again[-1].tokens


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_k", -1, "top_k must be ≥ 0"),
        ("top_p", 1.5, "top_p must be between 0 and 1"),
        ("min_p", -0.1, "min_p must be between 0 and 1"),
        ("repeat_penalty", 0.0, "repeat_penalty must be a finite number > 0"),
        ("repeat_penalty", float("nan"), "repeat_penalty must be a finite number > 0"),
        ("repeat_last_n", -2, "repeat_last_n must be -1"),
        ("temperature", float("inf"), "temperature must be a finite number"),
        ("seed", MAX_SEED + 1, "seed must be -1 .random. or a whole number from 0"),
    ],
)
def test_the_engine_refuses_bad_sampling_settings_naming_them(field, value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        GenerationConfig(**{field: value}).validate()
    assert caught.value.option == field
