"""Decoding correctness: losslessness, KV bookkeeping, speculative sampling."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from s2moe.engine.decoding.decoder import run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.decoding.observer import VerifyObserver
from s2moe.engine.drafting.copies import CopyPlanner
from s2moe.engine.drafting.copylearner import COPY_KINDS
from s2moe.engine.drafting.ngrams import NgramIndex
from s2moe.engine.drafting.stoprules import UtilityStop
from s2moe.engine.events import CostConstants, Finished, Iteration, Summary
from s2moe.engine.measure.quality_checks import near_tie
from s2moe.engine.offload import Residency

PROMPTS = ["hello there the world", "in the beginning", "once upon a time re"]

# Constants under which drafting always pays: exercises utility expansion without timing noise.
CHEAP_DRAFT = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.001, t_tok=0.01, intercept=0.0, source="test")


def summarize(events) -> Summary:
    s = Summary()
    for e in events:
        s.add(e)
    return s


def assert_matches_ar(decoder, prompt, tokens, cfg: GenerationConfig, what: str, ar=None, most_excused: int = 2):
    """`tokens`, what a mode committed after `prompt` with cfg's sampler settings and seed, are ar's. Where they
    leave ar's, ar's two best scores there must lie within what the arithmetic moves them by on this model
    (quality_checks.near_tie: the context decoded in one batch against token by token); ar then continues from the
    mode's own tokens and the comparison goes on to the end. `ar`: ar's tokens from `prompt`, where the caller has them.
    Returns the number of divergences excused (at most most_excused)."""
    context = decoder.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    sampler = {
        key: getattr(cfg, key)
        for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
    }
    plain = GenerationConfig(mode="ar", n_predict=len(tokens), stop_at_eos=False, **sampler)
    tokens = tuple(tokens)
    start = excused = 0
    while True:
        here = context + list(tokens[:start])
        if ar is None or start > 0:
            ar = run(decoder, here, replace(plain, n_predict=len(tokens) - start))[-1].tokens
        rest = tokens[start:]
        assert len(ar) == len(rest), f"{what} committed {len(tokens)} tokens, ar {start + len(ar)}"
        j = next((i for i, (a, b) in enumerate(zip(ar, rest)) if a != b), None)
        if j is None:
            return excused
        assert near_tie(decoder, here, ar, rest, plain), (
            f"{what} left ar's tokens at token {start + j} where ar's choice is no near-tie"
        )
        excused += 1
        assert excused <= most_excused, f"{what} left ar's tokens at {excused} near-ties: more than chance gives"
        start += j + 1


def test_the_comparison_with_ar_excuses_only_near_ties_and_compares_on_after_them(decoders, monkeypatch):
    """assert_matches_ar, which every lossless test here uses: tokens that leave ar's where ar's choice is clear
    fail; with every choice counted a tie, each divergence is excused and what follows it is compared with ar's
    continuation from the mode's own tokens, one excuse a divergence, no more than allowed."""
    from s2moe.engine.measure import quality_checks

    d = decoders["olmoe"]
    n, cfg = 16, GenerationConfig()
    context = d.tokenize(PROMPTS[0])

    def plain(head):
        return run(d, context + list(head), GenerationConfig(mode="ar", n_predict=n - len(head), stop_at_eos=False))[
            -1
        ].tokens

    def left_at(tokens, i):  # another token at i, then ar's own continuation from there
        head = tuple(tokens[:i]) + ((tokens[i] + 1) % d.rt.n_vocab,)
        return head + plain(head)

    ar = plain(())
    once = left_at(ar, 5)
    twice = left_at(once, 11)
    assert len(ar) == len(once) == len(twice) == n and ar[:5] == once[:5] and once[:11] == twice[:11]
    assert assert_matches_ar(d, PROMPTS[0], ar, cfg, "ar") == 0
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_matches_ar(d, PROMPTS[0], once, cfg, "left once", ar=ar)
    monkeypatch.setattr(quality_checks, "NEAR_TIE", float("inf"))
    assert assert_matches_ar(d, PROMPTS[0], once, cfg, "left once", ar=ar) == 1
    assert assert_matches_ar(d, PROMPTS[0], twice, cfg, "left twice", ar=ar) == 2
    with pytest.raises(AssertionError, match="more than chance gives"):
        assert_matches_ar(d, PROMPTS[0], twice, cfg, "left twice", ar=ar, most_excused=1)


@pytest.mark.parametrize("utility", [False, True], ids=["fixed-length", "utility"])
def test_greedy_s2moe_without_gating_matches_ar(decoders, arch, utility):
    d = decoders[arch]
    n = 72
    total_rollbacks = total_accepted = 0
    for prompt in PROMPTS:
        ar = summarize(run(d, prompt, GenerationConfig(mode="ar", n_predict=n, stop_at_eos=False)))
        cfg = GenerationConfig(
            mode="s2moe",
            n_predict=n,
            reuse_strength=0.0,
            utility=utility,
            cost=CHEAP_DRAFT if utility else None,
            stop_at_eos=False,
        )
        spec = summarize(run(d, prompt, cfg))
        assert ar.n_tokens == spec.n_tokens == n
        total_rollbacks += spec.rollbacks
        total_accepted += sum(spec.committed_per_iter) - spec.iterations
        assert_matches_ar(d, prompt, spec.tokens, cfg, "s2moe", ar=ar.tokens)
    # the test must exercise both accepted drafts and rollbacks of rejected ones
    assert total_accepted > 0 and total_rollbacks > 0


def assert_ar_is_llama_cpp(decoder, prompts, n: int) -> None:
    """Our ar gives llama-cpp-python's own greedy tokens of the decoder's model (loaded apart, nothing of ours
    in it): with the routing hook as ar leaves it for plain steps, and with it reading every layer's routing
    (observe_plain)."""
    import itertools

    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(decoder.info.path), n_ctx=decoder.n_ctx, n_threads=1, n_threads_batch=1, verbose=False
    )
    try:
        for prompt in prompts:
            theirs = tuple(itertools.islice(llm.generate(decoder.tokenize(prompt), temp=0.0, top_k=1, reset=True), n))
            for observe in (False, True):
                hooked = decoder.rt.hook.hooked()
                decoder.observe_plain = observe
                try:
                    ours = run(decoder, prompt, GenerationConfig(mode="ar", n_predict=n, stop_at_eos=False))[-1].tokens
                finally:
                    decoder.observe_plain = False
                if observe:  # the hook read the routing of every plain step
                    assert decoder.rt.hook.hooked() - hooked >= n
                assert len(ours) == n and ours == theirs, f"ar left llama.cpp's greedy tokens (observe_plain {observe})"
    finally:
        llm.close()


def test_ar_with_the_hook_installed_gives_llama_cpp_s_own_greedy_tokens(decoders, arch):
    """Every lossless test compares a mode with our ar; this holds our ar to llama.cpp itself, on each routing
    variant."""
    assert_ar_is_llama_cpp(decoders[arch], PROMPTS, 24)


@pytest.mark.parametrize("mode,temp", [("ar", 0.0), ("s2moe", 0.0), ("s2moe", 0.8), ("conf", 0.0)])
def test_kv_cache_holds_exactly_the_committed_tokens(decoders, arch, mode, temp):
    """After every iteration the cache ends where the committed sequence ends (the newest token,
    whose KV the next target pass computes, excepted): kv_end == n_committed - 1."""
    d = decoders[arch]
    cfg = GenerationConfig(mode=mode, n_predict=40, temperature=temp, seed=3, utility=False, stop_at_eos=False)
    events = run(d, PROMPTS[0], cfg)
    iters = [e for e in events if isinstance(e, Iteration)]
    assert iters
    for e in iters:
        assert e.kv_end == e.n_committed - 1
        assert e.rollback == len(e.rejected)
        assert list(e.committed) == list(e.accepted) + [e.target_token]


def test_kv_entries_are_target_computed(decoders, arch):
    """Continuing from the cache left by speculation gives the logits of a fresh plain prefill, as closely
    as continuing from plain decoding's own cache does: llama.cpp's results depend slightly on the batch
    size (up to ~4e-3 on the sigmoid-gated variant, for plain decoding too), so the bound is plain
    decoding's own deviation. A cache holding draft-computed entries misses it by far (checked below)."""
    d = decoders[arch]
    rt = d.rt

    def deviation(seq, draft_prefix=False):
        rt.hook.off()
        if draft_prefix:  # the bug this test exists for: KV computed by the k_d-expert draft
            rt.kv_clear()
            rt.hook.draft(2)
            for pos, tok in enumerate(seq[:-1]):  # one row at a time, as drafts are decoded
                rt.decode([tok], pos, "none")
            rt.hook.off()
        kept = rt.decode([seq[-1]], len(seq) - 1, "last")[0]
        rt.kv_clear()
        fresh = rt.decode(seq, 0, "last")[0]
        rt.kv_clear()
        return float(np.abs(kept - fresh).max())

    devs = {}
    for mode in ("ar", "s2moe"):
        cfg = GenerationConfig(mode=mode, n_predict=20, utility=False, reuse_strength=0.0, stop_at_eos=False)
        fin = run(d, PROMPTS[1], cfg)[-1]
        assert isinstance(fin, Finished)
        seq = d.tokenize(PROMPTS[1]) + list(fin.tokens)
        devs[mode] = deviation(seq)
    bound = max(1e-3, 2 * devs["ar"])
    assert devs["ar"] < 1e-2 and devs["s2moe"] <= bound, devs
    assert deviation(seq, draft_prefix=True) > 5 * bound


def test_utility_rule_stops_drafting_when_it_cannot_pay(decoders, arch):
    """Neither a draft pass nor a copy from the context can pay when a verified row costs more than the plain
    step a token saves: nothing is drafted, copies not even probed."""
    d = decoders[arch]
    expensive = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=1.2, intercept=0.0, source="test")
    events = run(d, PROMPTS[0], GenerationConfig(mode="s2moe", n_predict=16, cost=expensive, stop_at_eos=False))
    iters = [e for e in events if isinstance(e, Iteration)]
    assert all(not e.drafted and e.draft_stop in ("no-draft", "limit") for e in iters)
    assert sum(e.draft_stop == "no-draft" for e in iters) == len(iters) - 1
    cheap = run(d, PROMPTS[0], GenerationConfig(mode="s2moe", n_predict=16, cost=CHEAP_DRAFT, stop_at_eos=False))
    assert any(e.drafted for e in cheap if isinstance(e, Iteration))


def test_the_rule_learns_how_often_its_drafts_are_accepted():
    """With nothing verified a token's chance is its draft probability; verified chains move its bin toward what
    the target did, and the tokens after the first rejection, never judged, teach nothing."""
    from s2moe.engine.drafting.stoprules import AcceptanceMap

    m = AcceptanceMap(prior=4.0)
    assert m.estimate(0.2) == pytest.approx(0.2) and m.estimate(0.95) == pytest.approx(0.95)
    m.learn([0.2, 0.22, 0.25], 3)  # all three accepted
    assert m.estimate(0.2) == pytest.approx((4 * 0.2 + 3) / 7)
    m.learn([0.6, 0.25, 0.95], 1)  # the second rejected, the third never judged
    assert m.estimate(0.6) == pytest.approx((4 * 0.6 + 1) / 5)
    assert m.estimate(0.25) == pytest.approx((4 * 0.25 + 3) / 8)
    assert m.estimate(0.95) == pytest.approx(0.95)


def test_a_rule_that_saw_its_unlikely_drafts_accepted_keeps_them():
    """A 0.2-probability token is not worth a draft pass at face value; after verifications accepted such tokens
    it is. The recording rule passes on only what its rule would have kept."""
    from s2moe.engine.drafting.stoprules import RecordingStop
    from s2moe.engine.events import ForcedDraft

    rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.3, t_exp=0.0, t_tok=0.1, intercept=0.0, source="test"))
    assert not rule.keep(rule.acceptance(0.2), 0.2, 0)[0]  # 0.2 / 0.4 = 0.5 < 1
    for _ in range(10):
        rule.observe_outcome([0.2, 0.2], 2)
    assert rule.keep(rule.acceptance(0.2), 0.2, 0)[0]
    inner = UtilityStop(CHEAP_DRAFT)
    recording = RecordingStop(inner)
    recording.forced = ForcedDraft(True, 1)  # its rule would have kept the first token only
    recording.observe_outcome([0.05, 0.05, 0.05], 3)
    assert inner.acceptance(0.05) == pytest.approx((4 * 0.05 + 1) / 5)


def test_the_decoder_teaches_its_rule_from_each_verification(decoders, arch):
    d = decoders[arch]
    cost = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.001, t_tok=0.01, intercept=0.0, source="test-learns")
    events = run(d, PROMPTS[0], GenerationConfig(mode="s2moe", n_predict=24, cost=cost, stop_at_eos=False))
    judged = {False: 0, True: 0}  # tokens the target judged, of drafts from a pass and of copies
    for e in events:
        if isinstance(e, Iteration) and e.drafted:
            judged[e.draft_decision.copied is not None] += min(len(e.accepted) + 1, len(e.drafted))
    rule = next(r for key, r in d._rules.items() if cost in key)
    assert judged[False] > 0 and rule.learned.seen.sum() == judged[False]
    assert rule.copies(3).seen.sum() == judged[True]


def test_a_warm_up_teaches_nothing_to_the_rule_of_the_generations_after_it(decoders, arch):
    """A warm-up runs before offloading is in place, so what it times is not what a step will cost: given
    constants, it drafts by a rule of its own, and the rule a later generation gets has seen only that one."""
    d = decoders[arch]
    cost = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.001, t_tok=0.01, intercept=0.0, source="test-warm")
    cfg = GenerationConfig(mode="s2moe", n_predict=12, cost=cost, stop_at_eos=False)
    with d.untimed_costs():
        warm = [e for e in run(d, PROMPTS[0], cfg) if isinstance(e, Iteration)]
    assert any(e.drafted for e in warm)
    events = [e for e in run(d, PROMPTS[1], cfg) if isinstance(e, Iteration)]
    judged = sum(
        min(len(e.accepted) + 1, len(e.drafted)) for e in events if e.drafted and e.draft_decision.copied is None
    )
    (rule,) = [r for key, r in d._rules.items() if cost in key and not key[-1]]
    assert rule.learned.seen.sum() == judged


def test_generations_that_gate_or_copy_differently_keep_rules_of_their_own(decoders, arch):
    """A rule learns from the steps it sees: generations with the same settings share one across prompts, while
    s2moe without its memory bias, without copies, or with copies that stop at the context's end (bench's
    ablation rows in s2moe's process) learn apart from s2moe."""
    d = decoders[arch]
    cost = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.001, t_tok=0.01, intercept=0.0, source="test-apart")
    base = GenerationConfig(mode="s2moe", n_predict=4, cost=cost, stop_at_eos=False)

    def rules():
        return [r for key, r in d._rules.items() if cost in key]

    run(d, PROMPTS[0], base)
    run(d, PROMPTS[1], base)
    assert len(rules()) == 1
    for i, other in enumerate(
        [replace(base, memory_strength=0.0), replace(base, lookup=False), replace(base, lookup_periodic=False)]
    ):
        run(d, PROMPTS[0], other)
        assert len(rules()) == 2 + i


def test_utility_uses_each_candidates_own_predicted_experts(decoders, arch):
    """Utility = p_i·T_AR / (T_exp·new_i + T_tok + C_draft), with new_i from the candidate's own routing and p_i
    the rule's learned acceptance through the candidate: the product of draft probabilities until a verification
    has been seen."""
    d = decoders[arch]
    c = CostConstants(t_ar=1.0, c_draft=0.05, t_exp=0.02, t_tok=0.05, intercept=0.0, source="test")
    told = PendingExperts(d)
    d.attach(told)
    try:
        events = run(d, PROMPTS[2], GenerationConfig(mode="s2moe", n_predict=30, cost=c, stop_at_eos=False))
    finally:
        d.detach(told)
    seen = {False: 0, True: 0}
    iters = [e for e in events if isinstance(e, Iteration)]
    assert len(told.rounds) == len(iters)
    first = next(e for e in iters if e.draft_decision is not None and not e.draft_decision.copied)
    assert first.candidates and all(cand.accept_chance == pytest.approx(cand.chain_prob) for cand in first.candidates)
    for e, in_batch in zip(iters, told.rounds):
        decision = e.draft_decision
        copied = decision is not None and decision.copied is not None
        kept = [cand for cand in e.candidates if cand.kept]
        assert [cand.token for cand in kept] == list(e.drafted)
        if copied:
            # weighed whole (CopyPlanner): each token's utility is the copy's through it, and the one verified is
            # the decision's, its expected accepted tokens the survivals summed
            assert len(kept) == decision.rows or decision.probing
            if not decision.probing:
                assert kept[-1].utility == pytest.approx(decision.utility, rel=1e-9) and decision.utility >= 1.0
                assert decision.p_first == pytest.approx(sum(cand.accept_chance for cand in kept), rel=1e-9)
            seen[True] += 1
            continue
        for cand in e.candidates:
            if cand.utility is None:
                continue
            routed = routed_experts(cand.predicted, in_batch.shape)  # its draft pass's routing
            new = int((routed & ~in_batch).sum())  # against the batch's experts so far
            expected = cand.accept_chance * c.t_ar / (c.t_exp * new + c.t_tok + c.c_draft)
            assert cand.utility == pytest.approx(expected, rel=1e-9)
            assert cand.kept == (cand.utility >= 1.0)
            if cand.kept:
                in_batch |= routed
            seen[False] += 1
    assert seen[False] > 0 and seen[True] > 0


def _chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Upper critical value of chi-square (Wilson–Hilferty), alpha_z = normal quantile (3.09 ≈ 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + alpha_z * math.sqrt(a)) ** 3


def _chi2(observed: dict, probs: np.ndarray, n: int) -> tuple[float, int]:
    order = np.argsort(probs)[::-1]
    bins, other_p, other_o = [], 0.0, n
    for t in order:
        if probs[t] * n >= 8:
            bins.append((observed.get(int(t), 0), probs[t] * n))
            other_o -= observed.get(int(t), 0)
        else:
            other_p += probs[t]
    if other_p * n >= 1:
        bins.append((other_o, other_p * n))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1


def test_speculative_sampling_matches_plain_sampling(decoders):
    d = decoders["olmoe"]
    temp = 1.5
    prompt = d.tokenize(PROMPTS[0])
    rt = d.rt
    rt.kv_clear()
    rt.hook.off()
    # the distribution plain sampling draws from: llama.cpp's chain with its defaults (top-k 40, top-p, min-p)
    chain = GenerationConfig(temperature=temp).sampling()
    p1 = chain.distribution(rt.decode(prompt, 0, "last")[0], prompt)
    rt.kv_clear()
    rt.hook.draft(1)
    q1 = chain.distribution(rt.decode(prompt, 0, "last")[0], prompt)
    rt.kv_clear()
    # the draft must differ from the target, or the test could not tell a broken verifier apart
    assert 0.5 * np.abs(p1 - q1).sum() > 0.05

    trials = 1500
    first: dict[int, int] = {}
    pairs: list[tuple[int, int]] = []
    for seed in range(trials):
        cfg = GenerationConfig(
            mode="s2moe",
            n_predict=4,
            temperature=temp,
            seed=seed,
            draft_topk=1,
            utility=False,
            reuse_strength=0.0,
            draft_max=3,
            stop_at_eos=False,
        )
        fin = run(d, prompt, cfg)[-1]
        first[fin.tokens[0]] = first.get(fin.tokens[0], 0) + 1
        pairs.append(fin.tokens[:2])
    stat, df = _chi2(first, p1, trials)
    assert df >= 3
    assert stat < _chi2_critical(df), f"first-token distribution differs from plain sampling: chi2 {stat:.1f} df {df}"

    # second token, given the most frequent first token (drawn from later draft positions too)
    t1 = max(first, key=first.get)
    second: dict[int, int] = {}
    for a, b in pairs:
        if a == t1:
            second[b] = second.get(b, 0) + 1
    n2 = sum(second.values())
    rt.kv_clear()
    rt.hook.off()
    p2 = chain.distribution(rt.decode(prompt + [t1], 0, "last")[0], prompt + [t1])
    rt.kv_clear()
    stat2, df2 = _chi2(second, p2, n2)
    if df2 >= 1:
        assert stat2 < _chi2_critical(df2), f"second-token distribution differs: chi2 {stat2:.1f} df {df2}"


@pytest.mark.parametrize("mode", ["naive", "conf", "cascade", "lookup", "ls"])
def test_every_baseline_is_lossless_in_greedy_mode(decoders, arch, mode):
    d = decoders[arch]
    drafted = 0
    for prompt in PROMPTS[:2]:
        ar = summarize(run(d, prompt, GenerationConfig(mode="ar", n_predict=48, stop_at_eos=False)))
        events = run(d, prompt, GenerationConfig(mode=mode, n_predict=48, stop_at_eos=False))
        spec = summarize(events)
        drafted += spec.drafted
        for e in events:
            if isinstance(e, Iteration):
                assert e.kv_end == e.n_committed - 1
        assert_matches_ar(d, prompt, spec.tokens, GenerationConfig(), mode, ar=ar.tokens)
    assert drafted > 0


def _scan_lookup(
    seq: list[int], max_ngram: int, min_ngram: int, max_len: int, periodic: bool
) -> tuple[int, list[int], int]:
    """Prompt lookup by its definition: the longest n-gram ending seq, searched backwards through the rest; periodic,
    what followed it taken again from its start each time it reaches the end of seq."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == seq[-n:]:
                followed = seq[start + n :]
                if not periodic:
                    return n, followed[:max_len], len(followed)
                return n, (followed * max_len)[:max_len], len(followed)
    return 0, [], 0


@pytest.mark.parametrize("periodic", [False, True])
def test_the_ngram_index_finds_what_scanning_the_context_finds(periodic):
    """The lookup drafter's index, kept as the context grows, against a scan of the whole context at every
    step, on small vocabularies where n-grams recur often."""
    rng = np.random.default_rng(7)
    matched = 0
    for trial in range(200):
        vocab = int(rng.choice([2, 3, 5, 20]))
        max_ngram = int(rng.integers(1, 5))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        index = NgramIndex(max_ngram, min_ngram, periodic)
        seq = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 6)))]
        for _ in range(40):
            max_len = int(rng.integers(1, 9))
            found = index.lookup(seq, max_len)
            assert found == _scan_lookup(seq, max_ngram, min_ngram, max_len, periodic), (trial, seq)
            matched += found[0] > 0
            seq = seq + [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
    assert matched > 1000


def test_a_periodic_lookup_goes_on_round_the_loop_the_context_is_in():
    """A context in a loop of period 3 ("1 2 3"): its latest trigram's continuation meets the end of the context
    after 3 tokens, and goes on round the loop to the length asked for. s2moe's copies do, and learn the tokens
    taken round the loop apart from the others."""
    assert NgramIndex(3, 2).lookup([5, 1, 2, 3, 1, 2, 3], 7) == (3, [1, 2, 3], 3)
    assert NgramIndex(3, 2, periodic=True).lookup([5, 1, 2, 3, 1, 2, 3], 7) == (3, [1, 2, 3, 1, 2, 3, 1], 3)
    assert NgramIndex(3, 2, periodic=True).lookup([5, 1, 2, 3, 4, 1, 2, 3], 2) == (3, [4, 1], 4)

    rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.01, intercept=0.0, source="test"))
    planner = CopyPlanner(rule, None, prompt=(5,))
    plan = planner.plan([5, 1, 2, 3, 1, 2, 3], 6)
    assert plan.tokens == [1, 2, 3, 1, 2, 3] and plan.kinds == ["context"] * 3 + ["context, looped"] * 3
    learned = rule.copies(3)
    planner.learn(plan, 4, 0.0, 0)  # the fifth token, the loop's second, rejected
    context, looped = COPY_KINDS.index("context"), COPY_KINDS.index("context, looped")
    assert (learned.seen[context, 3], learned.accepted[context, 3]) == (3, 3)
    assert (learned.seen[looped, 3], learned.accepted[looped, 3]) == (2, 1)
    assert learned.estimate(3, "context, looped") < learned.estimate(3, "context")


def test_earlier_text_finds_the_longest_ngram_in_other_prompts_generations():
    from s2moe.engine.drafting.ngrams import EarlierText

    e = EarlierText(max_ngram=3, min_ngram=2, keep=3)
    e.add((1,), [1, 5, 6, 7, 8])
    e.add((2,), [2, 6, 7, 9, 5, 6, 10])
    assert e.lookup((9,), [4, 5, 6], 3)[:2] == (2, [10])  # the latest entry holding the bigram
    assert e.lookup((9,), [5, 6, 7], 3)[:2] == (3, [8])  # a trigram beats the latest entry's bigram "6 7"
    assert e.lookup((2,), [4, 5, 6], 3) == (2, [7, 8], [False, False])  # never the entry of its own prompt
    assert e.lookup((9,), [8, 3], 3) == (0, [], [])
    assert e.lookup((9,), [3, 7, 8], 3) == (0, [], [])  # a last token nothing followed
    e.add((1,), [1, 5, 6, 11])  # a prompt run again replaces its entry
    assert e.lookup((9,), [5, 6, 7], 3)[:2] == (2, [9, 5, 6])  # its trigram "5 6 7" gone with it
    e.add((3,), [3])
    e.add((4,), [4])
    assert list(e.entries) == [(1,), (3,), (4,)]  # the oldest dropped past `keep`
    e = EarlierText(keep=8, max_tokens=10)
    for prompt, text in (((1,), [1, 2, 3, 4]), ((2,), [5, 6, 7]), ((3,), [8, 9, 10, 11])):
        e.add(prompt, text)
    assert list(e.entries) == [(2,), (3,)] and e.tokens == 7  # ... and past `max_tokens`
    e.add((4,), list(range(20)))
    assert list(e.entries) == [(4,)]  # the latest entry stays, however long


def test_earlier_text_votes_among_the_entries_holding_the_ngram():
    """Where several other prompts' entries hold the longest n-gram, what followed it votes token by token: the
    commonest next token among the continuations that agree so far, ties to the latest entry; at most `vote` of
    the latest entries take part. Each token says whether two or more voters were left and all agreed on it."""
    from s2moe.engine.drafting.ngrams import EarlierText

    e = EarlierText(max_ngram=3, min_ngram=2)
    e.add((1,), [1, 5, 6, 7, 8, 9])
    e.add((2,), [2, 5, 6, 7, 8, 4])
    e.add((3,), [3, 5, 6, 10, 11])  # the latest entry, outvoted at the first token
    # 7 by two to one, 8 by both left, then a tie: the later entry's 4
    assert e.lookup((9,), [0, 5, 6], 4) == (2, [7, 8, 4], [False, True, False])
    # its own entry does not vote: a tie, the latest wins, and one voter is left
    assert e.lookup((1,), [0, 5, 6], 4) == (2, [10, 11], [False, False])
    e.add((4,), [4, 5, 6, 10, 12, 13])
    assert e.lookup((9,), [0, 5, 6], 4)[:2] == (2, [10, 12, 13])  # two to two, then one to one: the latest's
    e.add((5,), [5, 5, 6, 10, 12, 13])
    # 10 by three of five, 12 by two of three, 13 by both left
    assert e.lookup((9,), [0, 5, 6], 4) == (2, [10, 12, 13], [False, False, True])
    few = EarlierText(max_ngram=3, min_ngram=2, vote=2)
    for prompt, text in (((1,), [1, 5, 6, 7]), ((2,), [2, 5, 6, 7]), ((3,), [3, 5, 6, 10]), ((4,), [4, 5, 6, 11])):
        few.add(prompt, text)
    assert few.lookup((9,), [0, 5, 6], 4)[:2] == (2, [11])  # only the two latest vote


def test_copies_come_from_the_longer_match_the_context_first_on_a_tie():
    """The context's bigram against an earlier generation's trigram: the trigram's copy; on equal lengths the
    context's; the acceptance each source learned is its own."""
    from s2moe.engine.drafting.ngrams import EarlierText

    rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.01, intercept=0.0, source="test"))
    earlier = EarlierText()
    earlier.add((9,), [9, 1, 2, 3, 7, 7])
    planner = CopyPlanner(rule, earlier, prompt=(5,))
    # the context repeats "2 3" (followed by 4), the earlier text holds "1 2 3" (followed by 7)
    plan = planner.plan([5, 2, 3, 4, 1, 2, 3], 2)
    assert (plan.source, plan.n, plan.tokens) == ("session", 3, [7, 7])
    planner.learn(plan, 0, 0.0, 0)
    assert rule.copies(3).estimate(3, "session") < rule.copies(3).estimate(3, "context")
    plan = CopyPlanner(rule, earlier, prompt=(5,)).plan([5, 1, 2, 3, 4, 1, 2, 3], 2)
    assert (plan.source, plan.n, plan.tokens) == ("context", 3, [4, 1])
    assert CopyPlanner(rule, None, prompt=(5,)).plan([5, 2, 3, 4, 1, 2, 3], 2).source == "context"


def test_copied_tokens_the_session_agreed_on_are_learned_and_weighed_apart():
    """A session copy's tokens that every voter agreed on are priced at what such tokens were accepted at, the
    others at the session's other tokens' rate, each token of the chain at its own kind's; verifying a copy
    teaches each kind by its own tokens."""
    from s2moe.engine.drafting.copies import CopyPlanner
    from s2moe.engine.drafting.ngrams import EarlierText
    from s2moe.engine.drafting.stoprules import UtilityStop

    rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.5, intercept=0.0, source="test"))
    learned = rule.copies(3)
    for _ in range(4):
        learned.learn(3, ["session, agreed"] * 2, accepted=2)
        learned.learn(3, ["session"], accepted=0)
    agreed, other = learned.estimate(3, "session, agreed"), learned.estimate(3, "session")
    assert agreed > 0.8 > 0.3 > other
    earlier = EarlierText()
    earlier.add((1,), [1, 7, 8, 9, 20, 21])
    earlier.add((2,), [2, 7, 8, 9, 20, 22])
    planner = CopyPlanner(rule, earlier, prompt=(5,))
    plan = planner.plan([5, 7, 8, 9], 2)
    assert plan.source == "session" and plan.p == pytest.approx(agreed)
    assert [w[0] for w in plan.weighed] == [20, 22]  # both agree on 20; 22, the latest's, where they part
    assert [w[1] for w in plan.weighed] == pytest.approx([agreed, agreed * other])
    assert plan.tokens == [20] and plan.kinds == ["session, agreed"]  # 22 does not pay at its kind's rate
    planner.learn(plan, 0, 0.0, 0)
    assert learned.estimate(3, "session, agreed") < agreed and learned.estimate(3, "session") == other


def test_where_copies_cannot_pay_at_the_timed_prices_the_planner_waits_steps_and_probes_one_token():
    """Timed rows dearer than a plain step: not even a certain copy pays. The planner then plans nothing for the
    longest wait (no lookup), counting steps, and then probes one token where the context repeats."""
    from s2moe.engine.drafting.copies import CopyPlanner
    from s2moe.engine.drafting.stoprules import UtilityStop

    rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.01, intercept=0.0, source="test"))
    learned = rule.copies(3)
    learned.probe_every = 2
    learned.began()
    for _ in range(2):
        learned.timed(0.001, 0)
    for _ in range(learned.min_copies):
        learned.verified(1, 0.0, 0, rule.copy_cost(1, 0.0))
        learned.timed(0.003, 1)
        learned.timed(0.001, 0)
    saved, scale = learned.price()
    assert saved * 4 < scale * rule.copy_cost(4, 0.0)  # a row dearer than a plain step
    wait = 16 * learned.probe_every
    planner = CopyPlanner(rule, None, prompt=(5,))
    context = [5, 1, 2, 3, 4, 1, 2, 3]
    assert [planner.plan(context, 4) for _ in range(wait - 1)] == [None] * (wait - 1)
    # the wait is over on a step whose context repeats nothing: the probe waits for a copy to make
    assert CopyPlanner(rule, None, prompt=(6,)).plan([6, 1, 2, 3], 4) is None
    plan = planner.plan(context, 4)
    assert plan is not None and plan.probe and plan.tokens == [4]
    assert [planner.plan(context, 4) for _ in range(wait - 1)] == [None] * (wait - 1)
    assert planner.plan(context, 4).probe


class QuietObserver(VerifyObserver):
    """An observer of a decoder's verifications that counts nothing and sees nothing in memory: tests override
    what they watch."""

    def __init__(self, decoder):
        self.shape = (decoder.info.n_layer, decoder.info.n_expert)

    def predicted(self, experts):
        pass

    def verifying(self, predicted, first_row_ids):
        pass

    def start_counting(self):
        pass

    def misses(self):
        return np.zeros(self.shape[0])

    def residency(self):
        n_layer = self.shape[0]
        return Residency(np.zeros(self.shape), np.zeros(self.shape, bool), np.full(n_layer, np.nan), 0, 0, 0)


class PendingExperts(QuietObserver):
    """Records, for each verification, the experts the pending token's draft pass routed to: the first set a
    drafter tells its observer (a copy of it, None where nothing was drafted)."""

    def __init__(self, decoder):
        super().__init__(decoder)
        self.rounds: list[np.ndarray | None] = []
        self._first = None

    def predicted(self, experts):
        if self._first is None:
            self._first = experts.copy()

    def verifying(self, predicted, first_row_ids):
        self.rounds.append(self._first)
        self._first = None


def routed_experts(routed, shape) -> np.ndarray:
    """[n_layer, n_expert] bool of a row's routed ids ([n_layer, k], -1 where a layer has none; None: the row
    was not routed, nothing)."""
    out = np.zeros(shape, bool)
    if routed is not None:
        for layer, row in enumerate(routed):
            out[layer, row[row >= 0]] = True
    return out


def test_until_copies_are_timed_a_copied_token_saves_the_plain_step_as_timed_where_the_cache_serves_little():
    """What a copied token saves is a plain step. Where plain steps fetch at least half the experts they read
    (the cache serves them little, so copies have little to disturb), the plain step timed in this run replaces
    the constants' T_AR before any copy was timed (a profile's T_AR was read on another day of the disk, or at
    another split of the budget); a row keeps the constants' price until copies were rejected whole and timed.
    Where the cache serves most, or nothing was counted (no budget), the constants price it."""
    from s2moe.engine.drafting.copies import CopyPlanner
    from s2moe.engine.drafting.stoprules import UtilityStop

    context = [5, 1, 2, 3, 4, 1, 2, 3]

    def planned(plain_s, fetched=None):
        rule = UtilityStop(
            CostConstants(t_ar=0.010, c_draft=0.009, t_exp=0.0, t_tok=0.002, intercept=0.0, source="test")
        )
        learned = rule.copies(3)
        learned.began()
        for _ in range(3 if plain_s else 0):
            learned.timed(plain_s, 0)
            if fetched is not None:
                learned.fetched(fetched, 48)
        return CopyPlanner(rule, None, prompt=(5,)).plan(context, 4)

    untimed, slow = planned(None), planned(0.030, fetched=33)
    assert (untimed.saved, untimed.cost / untimed.rows) == pytest.approx((0.010, 0.002))
    assert (slow.saved, slow.cost / slow.rows) == pytest.approx((0.030, 0.002))
    assert len(slow.tokens) >= len(untimed.tokens) > 0
    assert planned(0.001, fetched=33) is None  # plain steps cheaper than a row: not even a certain copy pays
    for served in (planned(0.030, fetched=23), planned(0.030)):  # 23 of 48 fetched; nothing counted
        assert (served.saved, served.cost / served.rows) == pytest.approx((0.010, 0.002))


def test_s2moe_counts_what_its_plain_steps_read_and_fetched_where_an_observer_counts_misses(decoders, arch):
    """The experts each plain step read and fetched reach the copies' learner (copies and drafts of the model's
    own are not plain steps); without an observer nothing is counted."""
    d = decoders[arch]
    n_layer = d.info.n_layer
    cfg = GenerationConfig(mode="s2moe", n_predict=24, reuse_strength=0.0, stop_at_eos=False)

    class Misses(QuietObserver):
        def __init__(self, per_layer):
            super().__init__(d)
            self.per_layer = per_layer

        def misses(self):
            return np.full(n_layer, self.per_layer)

    def learned_after(observer, name):
        c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.01, intercept=0.0, source=name)
        if observer is not None:
            d.attach(observer)
            d.observe_plain = True
        try:
            events = [e for e in run(d, REPEATING, replace(cfg, cost=c)) if isinstance(e, Iteration)]
        finally:
            if observer is not None:
                d.detach(observer)
                d.observe_plain = False
        assert any(not e.drafted for e in events)
        return next(r for key, r in d._rules.items() if c in key).copies(3)

    k = d.info.n_expert_used  # a plain step reads k experts in each MoE layer
    n_moe = int(d.moe_layers().sum())
    assert learned_after(Misses(k), "fetch all").cache_serves_little()
    fetched, read = learned_after(Misses(1), "fetch one")._plain_fetched
    assert fetched / read == pytest.approx(n_layer / (k * n_moe))
    assert not learned_after(None, "no budget").cache_serves_little()


def test_s2moe_copies_from_an_earlier_generation_of_another_prompt(decoders, arch):
    """Where its own context repeats nothing, s2moe copies what followed the context's last n-gram in an earlier
    generation of another prompt: here a prompt that differs from an earlier one in its first token only, whose
    last trigram that earlier generation continued. The copies keep ar's tokens; with lookup_session off
    (bench's +lookup rung) none comes from an earlier generation."""
    d = decoders[arch]
    c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test-session")
    earlier = d.tokenize(PROMPTS[1])
    prompt = [earlier[0] + 1] + earlier[1:]
    run(d, earlier, GenerationConfig(mode="ar", n_predict=16, stop_at_eos=False))
    plain = summarize(run(d, prompt, GenerationConfig(mode="ar", n_predict=16, stop_at_eos=False)))
    events = run(d, prompt, GenerationConfig(mode="s2moe", n_predict=16, cost=c, reuse_strength=0.0, stop_at_eos=False))
    from_session = [e for e in events if isinstance(e, Iteration) and e.draft_stop.startswith("lookup: session")]
    assert from_session and all(e.draft_decision.copied == "session" for e in from_session)
    first = from_session[0]
    assert first.draft_decision.text.startswith(f"copying {len(first.drafted)} tokens from an earlier generation:")
    assert summarize(events).tokens == plain.tokens
    off = run(
        d,
        prompt,
        GenerationConfig(
            mode="s2moe", n_predict=16, cost=c, reuse_strength=0.0, lookup_session=False, stop_at_eos=False
        ),
    )
    assert not any(e.draft_stop.startswith("lookup: session") for e in off if isinstance(e, Iteration))


REPEATING = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def test_copies_from_the_context_pay_where_a_draft_pass_cannot(decoders, arch):
    """With a draft pass too dear (C_draft + T_tok > T_AR) but a verified row cheap, greedy s2moe drafts only the
    tokens that followed the context's repeated n-grams, priced without a pass; without gating that stays
    lossless, and so does sampling: copies sampled commit plain sampling's tokens with the same seed. Without
    copies (--no-lookup) nothing at all is drafted."""
    d = decoders[arch]
    c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test-copies")
    ar = summarize(run(d, REPEATING, GenerationConfig(mode="ar", n_predict=32, stop_at_eos=False)))
    events = run(
        d, REPEATING, GenerationConfig(mode="s2moe", n_predict=32, cost=c, reuse_strength=0.0, stop_at_eos=False)
    )
    drafted = [e for e in events if isinstance(e, Iteration) and e.drafted]
    assert drafted and all(e.draft_decision.copied and e.draft_stop.startswith("lookup") for e in drafted)
    assert all(cand.prob == 1.0 and cand.predicted is None for e in drafted for cand in e.candidates)
    assert summarize(events).tokens == ar.tokens
    off = run(d, REPEATING, GenerationConfig(mode="s2moe", n_predict=32, cost=c, lookup=False, stop_at_eos=False))
    assert not any(e.drafted for e in off if isinstance(e, Iteration))
    sampling = dict(n_predict=32, temperature=0.8, seed=3, stop_at_eos=False)
    plain = summarize(run(d, REPEATING, GenerationConfig(mode="ar", **sampling)))
    sampled = run(d, REPEATING, GenerationConfig(mode="s2moe", cost=c, reuse_strength=0.0, **sampling))
    copied = [e for e in sampled if isinstance(e, Iteration) and e.drafted]
    assert copied and all(e.draft_decision.copied for e in copied)
    assert summarize(sampled).tokens == plain.tokens


def test_copies_are_learned_per_ngram_length_and_probed_again_after_declines():
    from s2moe.engine.drafting.copylearner import CopyLearner

    m = CopyLearner(3, rate=0.6, prior=2.0, probe_every=4)
    assert m.estimate(1) == m.estimate(3) == pytest.approx(0.6)
    m.learn(3, ["context"] * 4, accepted=4)  # all four accepted
    m.learn(1, ["context"] * 4, accepted=1)  # the second rejected: two judged, the rest never were
    assert m.estimate(3) == pytest.approx((1.2 + 4) / 6) and m.estimate(1) == pytest.approx((1.2 + 1) / 4)
    assert m.estimate(2) == pytest.approx(0.6)

    def declines_until_probe(n):
        k = 1
        while not m.probe(n):
            k += 1
        return k

    assert declines_until_probe(1) == 4
    m.learn(1, ["context"], accepted=0, probe=True)  # rejected: the wait doubles
    assert declines_until_probe(1) == 8
    m.learn(1, ["context"], accepted=0, probe=True)
    assert declines_until_probe(1) == 16 and declines_until_probe(2) == 4  # each n waits on its own
    m.learn(1, ["context"], accepted=1, probe=True)  # accepted: back to the first wait
    assert declines_until_probe(1) == 4
    steps = 1
    while not m.rare_probe_due():  # prices at which not even a certain copy pays: the longest wait, in steps
        steps += 1
    assert steps == 64
    assert m.rare_probe_due()  # due until a probe is made (a step without an n-gram to copy makes none)
    m.rare_probe_made()
    assert not m.rare_probe_due()


def test_a_copy_seen_little_is_hoped_above_its_share_where_plain_steps_fetch_most_of_their_experts():
    """Few verified tokens say little of an n's acceptance: where plain steps fetch most of what they read, its
    estimate is raised by the share's standard error, so that a rule which saw few long copies still makes them,
    and the raise shrinks as copies are seen. Where the cache serves plain steps, or nothing was counted, the share
    alone: the copies hope would buy there evict what plain steps find."""
    from s2moe.engine.drafting.copylearner import CopyLearner

    def hoped(accepted, seen):  # with the prior's 2 tokens at 0.6, raised by one standard error
        share = (1.2 + accepted) / (2 + seen)
        return min(1.0, share + math.sqrt(share * (1 - share) / (2 + seen)))

    m = CopyLearner(3, rate=0.6, prior=2.0)
    m.learn(1, ["context"] * 4, accepted=3)
    for _ in range(10):
        m.learn(2, ["context"] * 4, accepted=3)
    assert m.estimate(1) == pytest.approx((1.2 + 3) / 6) and m.likeliest() == pytest.approx((1.2 + 30) / 42)
    m.fetched(40, 48)  # a plain step under a tight budget
    assert m.estimate(1) == pytest.approx(hoped(3, 4)) and m.estimate(2) == pytest.approx(hoped(30, 40))
    assert m.estimate(1) > m.estimate(2) > (1.2 + 30) / 42 > (1.2 + 3) / 6  # the lower share, seen less, hopes more
    assert m.estimate(3, "session") == m.estimate(3) == m.likeliest() == pytest.approx(hoped(0, 0))  # never seen
    for _ in range(1000):
        m.learn(2, ["context"] * 4, accepted=3)
    assert 0.75 < m.estimate(2) < 0.76
    for _ in range(40):
        m.fetched(4, 48)  # the cache now serves plain steps
    assert m.estimate(1) == pytest.approx((1.2 + 3) / 6) and m.estimate(3) == pytest.approx(0.6)


def test_copies_are_priced_as_timed_once_enough_were():
    """A plain step's wall time, and a copy's over the constants' price of it, as running means: plain steps
    timed only after plain steps, copies on those rejected whole, each charged what the plain step after it paid
    beyond one (llama.cpp builds its graph anew after a batch of another shape); the constants' price until three
    were timed, and never a row priced as nearly free."""
    from s2moe.engine.drafting.copies import CopyPlanner
    from s2moe.engine.drafting.stoprules import UtilityStop

    rule = UtilityStop(CostConstants(t_ar=0.010, c_draft=0.009, t_exp=0.0, t_tok=0.001, intercept=0.0, source="test"))
    m = rule.copies(3)
    m.smoothing = 0.5
    m.began()

    def copy(rows, seconds, accepted=0):
        m.verified(rows, 4.0 * rows, 48, rule.copy_cost(rows, 4.0 * rows))  # priced at 1 ms a row
        m.timed(seconds, rows, accepted)

    m.timed(0.010, 0)  # the step after the prefill rebuilds the graph: not a plain step's time
    copy(2, 0.010)  # a copy before any plain step was timed says nothing of a copy's price
    m.timed(0.004, 0)  # nor the step after it
    assert m.plain_s is None
    for _ in range(3):
        m.timed(0.002, 0)
    assert m.plain_s == pytest.approx(0.002)
    copy(1, 0.0021, accepted=1)  # an accepted copy's rows read what the next step needed: not their cost
    m.timed(0.009, 0)  # ... and the step after it is not a plain step's time either
    copy(2, 0.0030, accepted=1)
    copy(2, 0.006)
    m.timed(0.003, 0)  # 5 ms over two plain steps, for a copy priced at 2 ms: 2.5 times its price
    copy(1, 0.004)
    copy(2, 0.008)  # a copy after a copy: the first is not timed without its following step
    m.timed(0.002, 0)  # 6 ms over 2 ms: 3
    assert m.price() is None
    m.timed(0.002, 0)
    copy(1, 0.004)
    m.timed(0.002, 0)  # 2 ms over 1 ms: 2
    plain, scale = m.price()
    assert plain == pytest.approx(0.002) and scale == pytest.approx(2.375)  # 2.5, 3, 2: half-way means
    m.began()
    copy(1, 0.004)
    m.began()  # a copy whose next step is another generation's first is not timed
    m.timed(0.002, 0)
    m.timed(0.004, 1)  # nor one the learner was not told of: it has no price to compare with
    m.timed(0.002, 0)
    assert m.price() == (pytest.approx(0.002), pytest.approx(2.375))
    m.timed(0.001, 0)  # plain steps slower than the copies: a copy would cost nothing
    for _ in range(3):
        copy(1, 0.0011)
        m.timed(0.001, 0)
    assert m.price()[1] < 0.1
    plan = CopyPlanner(rule, None, prompt=(5,)).plan([5, 1, 2, 3, 4, 1, 2, 3], 4)
    assert plan.cost == pytest.approx(plan.rows * m.plain_s / 20)


def test_a_copys_experts_grow_ever_more_slowly_with_its_rows_and_any_length_teaches_every_length():
    """Rows drawn from a pool, each repeating a share q of the one before's experts: what r rows add is
    concave in r, and copy_overlap inverts it. A learner that verified only one-row copies (probes) prices every
    length as one that verified only eight-row copies does: the length of the copies made does not teach the
    rule to keep making copies of that length."""
    from s2moe.engine.drafting.copylearner import CopyLearner, copy_added, copy_overlap

    k = 48.0
    for q in (0.0, 0.2, 0.45, 0.9):
        for rows in (1, 3, 8):
            assert copy_overlap(rows, copy_added(q, rows, k), k) == pytest.approx(q, abs=1e-6)
    added = np.array([copy_added(0.45, rows, k) for rows in range(9)])
    assert added[0] == pytest.approx(0.0) and added[1] == pytest.approx(k * 0.55)
    assert (np.diff(added) > 0).all() and (np.diff(added, 2) < 0).all()
    assert CopyLearner(3).added(5, 7.0) == 35.0  # before any copy was verified: the per-row estimate, each row
    short, long = CopyLearner(3), CopyLearner(3)
    for _ in range(20):
        short.verified(1, copy_added(0.45, 1, k), k, 0.0)
        long.verified(8, copy_added(0.45, 8, k), k, 0.0)
    for rows in range(1, 9):
        assert short.added(rows, 0.0) == pytest.approx(long.added(rows, 0.0), rel=1e-6)
    assert long.added(8, 0.0) < 3 * long.added(1, 0.0)


def test_a_copy_that_pays_whole_is_made_where_its_first_token_alone_would_not_pay():
    """A first row adds the most experts; priced whole, a copy of eight rows pays where its first token alone
    costs more than it saves, even after the rule saw only one-row copies."""
    from s2moe.engine.drafting.copies import CopyPlanner
    from s2moe.engine.drafting.copylearner import copy_added
    from s2moe.engine.drafting.stoprules import UtilityStop

    rule = UtilityStop(
        CostConstants(t_ar=0.060, c_draft=0.02, t_exp=0.00233, t_tok=0.005, intercept=0.0, source="test")
    )
    learned = rule.copies(3)
    for _ in range(8):  # copies round a loop, accepted whole
        learned.learn(3, ["context"] * 3 + ["context, looped"] * 5, accepted=8)
    for _ in range(10):
        learned.verified(1, copy_added(0.45, 1, 48), 48, 0.0)
    plan = CopyPlanner(rule, None, prompt=(5,)).plan([5, 1, 2, 3, 1, 2, 3], 8)
    assert plan.weighed[0][2] < 1.0 < plan.weighed[-1][2]
    assert plan.tokens == [1, 2, 3, 1, 2, 3, 1, 2] and plan.rows == 8 and not plan.probe


def test_cascade_tests_every_draft_length_then_settles(decoders):
    d = decoders["olmoe"]
    events = run(d, PROMPTS[0], GenerationConfig(mode="cascade", n_predict=60, stop_at_eos=False))
    stops = [e.draft_stop for e in events if isinstance(e, Iteration)]
    assert {s for s in stops if s.startswith("test:")} >= {"test:K=0", "test:K=1", "test:K=4", "test:K=8"}
    assert any(s.startswith("set:") for s in stops)


def test_utility_rule_learns_to_skip_drafts_that_rarely_pay():
    from s2moe.engine.drafting.stoprules import UtilityStop

    c = CostConstants(t_ar=1.0, c_draft=0.3, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test")
    rule = UtilityStop(c, probe_every=8)
    assert rule.worth_drafting()  # optimistic until it has seen a draft
    for _ in range(6):
        rule.observe_first(0.1)  # first drafts are unlikely: 0.1·1.0/0.5 < 1
    decisions = [rule.worth_drafting() for _ in range(32)]
    assert sum(decisions) == 4  # one probe every 8 iterations while nothing says whether probes pay
    for _ in range(10):
        rule.observe_first(0.95)
    assert rule.worth_drafting()


def test_probes_that_do_not_pay_back_off_and_one_that_pays_resets_them():
    from s2moe.engine.drafting.stoprules import UtilityStop

    c = CostConstants(t_ar=1.0, c_draft=0.3, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test")
    rule = UtilityStop(c, probe_every=4)
    for _ in range(10):
        rule.observe_first(0.1)

    def gaps(n_probes, first_prob):
        out, since = [], 0
        while len(out) < n_probes:
            since += 1
            if rule.worth_drafting():
                out.append(since)
                since = 0
                rejected, _ = rule.pre_reject(first_prob, first_prob)
                if not rejected:
                    rule.keep(first_prob, first_prob, 0)
        return out

    assert gaps(6, 0.1) == [4, 8, 16, 32, 64, 64]  # doubling up to 16x probe_every
    assert gaps(1, 0.99) == [64]  # this probe's first token pays ...
    assert gaps(1, 0.1) == [4]  # ... so the next one comes after probe_every again


def test_utility_rule_also_learns_what_the_first_token_costs_in_experts():
    """Offloaded, each new expert is a fetch: a likely first token that adds many experts does not pay,
    and drafting it only to discard it costs a draft pass every iteration."""
    from s2moe.engine.drafting.stoprules import UtilityStop

    c = CostConstants(t_ar=1.0, c_draft=0.2, t_exp=0.05, t_tok=0.1, intercept=0.0, source="test")
    rule = UtilityStop(c, probe_every=8)
    for _ in range(10):
        rule.observe_first(0.9)  # 0.9 / 0.3 ≥ 1 by probability alone
    assert rule.worth_drafting()
    for _ in range(10):
        rule.observe_first_experts(20)  # 0.9 / (0.3 + 20·0.05) < 1
    assert sum(rule.worth_drafting() for _ in range(32)) == 4
    for _ in range(10):
        rule.observe_first_experts(1)
    assert rule.worth_drafting()


def test_what_the_utility_rule_learned_carries_over_to_the_next_generation(decoders):
    """A fresh rule is optimistic and drafts until its estimates say drafting does not pay. That is a
    property of the model and device, so the next prompt starts from what the last one learned, while
    other constants (or another threshold) get a rule of their own."""
    d = decoders["olmoe"]
    # every new expert is dear: a first token rarely pays for what it adds to the verification
    dear = CostConstants(t_ar=1.0, c_draft=0.2, t_exp=0.5, t_tok=0.1, intercept=0.0, source="test")

    def drafted_iterations(cost, threshold=1.0):
        """Iterations that ran a draft pass (its candidate kept or not)."""
        events = run(
            d,
            PROMPTS[1],
            GenerationConfig(mode="s2moe", n_predict=24, cost=cost, threshold=threshold, stop_at_eos=False),
        )
        return sum(1 for e in events if isinstance(e, Iteration) and e.draft_stop not in ("no-draft", "limit"))

    first = drafted_iterations(dear)
    second = drafted_iterations(dear)
    assert first >= 1 and second < first  # the first prompt paid to learn; the second does not
    other = CostConstants(t_ar=1.0, c_draft=0.2, t_exp=0.5, t_tok=0.1, intercept=0.0, source="test-2")
    assert drafted_iterations(other) == first  # other constants: learned afresh
    assert drafted_iterations(dear, threshold=1.01) == first


def test_a_sampled_generation_repeats_with_its_seed_whatever_came_before(decoders):
    """Sampled generations share a kept rule, which drafts otherwise after what earlier generations taught it;
    what is drafted never moves what a seed commits, so the same seed draws the same text."""
    d = decoders["olmoe"]
    pays = CostConstants(t_ar=1.0, c_draft=0.3, t_exp=0.0, t_tok=0.3, intercept=0.0, source="test-seed")

    def sampled(seed):
        events = run(
            d,
            "hello",
            GenerationConfig(
                mode="s2moe", n_predict=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, cost=pays
            ),
        )
        return summarize(events).tokens, sum(len(e.drafted) for e in events if isinstance(e, Iteration))

    first, drafted = sampled(11)
    sampled(22)
    assert drafted > 0 and sampled(11)[0] == first


def test_plain_steps_report_k_experts_per_layer_with_or_without_recording(decoders, arch):
    d = decoders[arch]
    k, n_layer = d.info.n_expert_used, d.info.n_layer
    for observe in (False, True):
        d.observe_plain = observe
        try:
            events = run(d, PROMPTS[0], GenerationConfig(mode="ar", n_predict=6, stop_at_eos=False))
        finally:
            d.observe_plain = False
        for e in events:
            if isinstance(e, Iteration):
                assert list(e.verify_experts) == [k] * n_layer
                assert list(e.reuse_ratio) == [1.0] * n_layer


def test_verifications_report_the_misses_their_counter_counted(decoders, arch):
    """Offloading counts misses natively as each layer routes; the decoder brackets the draft passes and
    then the verification with the counter and reports each count apart."""
    d = decoders[arch]
    n_layer = d.info.n_layer
    cfg = GenerationConfig(
        mode="s2moe", n_predict=10, utility=False, draft_max=3, reuse_strength=0.0, stop_at_eos=False
    )
    assert all(
        e.verify_misses is None and e.verify_major_faults is None
        for e in run(d, PROMPTS[0], cfg)
        if isinstance(e, Iteration)
    )

    class Counter(VerifyObserver):
        def __init__(self):
            self.log, self.n, self.told, self.first_rows = [], 0, [], []

        def predicted(self, experts):
            assert experts.shape == (n_layer, d.info.n_expert) and experts.dtype == bool
            self.log.append("predicted")

        def verifying(self, predicted, first_row_ids):
            self.told.append(predicted)
            self.first_rows.append(first_row_ids)

        def verified(self):
            self.log.append("verified")

        def start_counting(self):
            self.log.append("begin")

        def misses(self):
            self.n += 1
            self.log.append("counted")
            return np.full(n_layer, self.n)

        def residency(self):
            shape = (n_layer, d.info.n_expert)
            return Residency(np.zeros(shape), np.zeros(shape, bool), np.full(n_layer, np.nan), 0, 0, 0)

    counter = Counter()
    d.attach(counter)
    d.observe_plain = True  # the offloader's routing callback keeps the hook on for plain steps too
    try:
        events = [e for e in run(d, PROMPTS[0], cfg) if isinstance(e, Iteration)]
    finally:
        d.detach(counter)
        d.observe_plain = False
    # drafts are counted apart from the verification that follows them, and tell what they predict as
    # they go (at least the pending token's experts, from the first pass)
    counting = [x for x in counter.log if x != "predicted"]
    assert events and counting == ["begin", "counted", "begin", "verified", "counted"] * len(events)
    segments = " ".join(counter.log).split("begin ")[1:]  # per iteration: the draft's, then the verification's
    drafts, verifications = segments[0::2], segments[1::2]
    assert all(v.strip() == "verified counted" for v in verifications)
    assert [("predicted" in seg) for seg in drafts] == [bool(e.drafted) for e in events]
    # before each verification: what its draft predicted, nothing for a plain step; and which of its routed
    # ids are its first row's (all of a plain step's)
    assert [p is not None for p in counter.told] == [bool(e.drafted) for e in events]
    k = d.info.n_expert_used
    assert counter.first_rows == [k if e.drafted else 0 for e in events]
    assert [int(e.draft_misses[0]) for e in events] == list(range(1, 2 * len(events), 2))
    assert [int(e.verify_misses[0]) for e in events] == list(range(2, 2 * len(events) + 1, 2))
    assert all(isinstance(e.verify_major_faults, int) and e.verify_major_faults >= 0 for e in events)


def test_a_draft_on_weights_of_its_own_is_told_to_the_observer(decoders, arch):
    """The independent drafter (naive: bench's base rung) maps the model file a second time, outside the routing
    hook: after each of its drafts the observer is told, so that offloading lets go of what it read; self-drafts
    never are."""
    d = decoders[arch]

    class Watcher(QuietObserver):
        def __init__(self):
            super().__init__(d)
            self.elsewhere = 0

        def drafted_elsewhere(self, mappings):
            assert mappings and all(length > 0 for _, length, _ in mappings)
            self.elsewhere += 1

    watcher = Watcher()
    d.attach(watcher)
    try:
        for mode, told in (("s2moe", False), ("naive", True)):
            watcher.elsewhere = 0
            cfg = GenerationConfig(mode=mode, n_predict=6, utility=False, draft_max=2, stop_at_eos=False)
            iterations = [e for e in run(d, PROMPTS[0], cfg) if isinstance(e, Iteration)]
            assert watcher.elsewhere == (len(iterations) if told else 0), mode
    finally:
        d.detach(watcher)


def test_engine_errors_name_the_setting_and_let_each_front_end_word_it():
    """The engine names a setting as it knows it; the CLI says its flag, the app its own field name."""
    from s2moe.app.options import FLAGS
    from s2moe.engine.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        GenerationConfig(draft_max=0).validate()
    e = caught.value
    assert e.option == "draft_max" and str(e) == "draft_max must be between 1 and 64"
    assert e.worded(FLAGS) == "--draft-max must be between 1 and 64"
    assert e.worded({"draft_max": "draft cap"}) == "draft cap must be between 1 and 64"


def test_a_seed_below_minus_one_is_refused_by_the_engine_too():
    """-1 is a random seed, as in llama.cpp; the CLI refuses less while parsing, and the app and scripts
    reach the engine directly."""
    from s2moe.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="seed must be -1 .random. or a whole number from 0"):
        GenerationConfig(seed=-2).validate()


def test_runs_sharing_a_copy_cache_keep_each_others_generations(decoders, tmp_path):
    """Two runs load the same file, each generates for a prompt of its own, and both write it back: the file
    then holds both generations (the second writer merges what the first wrote since it loaded), and the text
    of the run that wrote last where both generated for one prompt."""
    from s2moe.engine.drafting.copycache import load_copy_cache, save_copy_cache
    from s2moe.engine.drafting.ngrams import EarlierText

    d = decoders["olmoe"]
    path = tmp_path / "copies.json"
    shared, mine, theirs = (d.tokenize(p) for p in PROMPTS[:3])
    kept = d.earlier
    try:
        d.earlier = EarlierText()
        d.earlier.add(shared, shared + [1, 2, 3])
        save_copy_cache(path, d.info, d.earlier)
        a, b = EarlierText(), EarlierText()
        load_copy_cache(path, d.info, a)
        load_copy_cache(path, d.info, b)
        a.add(mine, mine + [4, 5])
        a.add(shared, shared + [6])
        b.add(theirs, theirs + [7, 8])
        save_copy_cache(path, d.info, b)
        save_copy_cache(path, d.info, a)
        again = EarlierText()
        assert load_copy_cache(path, d.info, again) == 3
        assert dict(again.generations()) == {
            tuple(shared): shared + [6],
            tuple(mine): mine + [4, 5],
            tuple(theirs): theirs + [7, 8],
        }
        # a full cache (three entries): each run adds one, dropping the oldest; the other's survives the merge
        full = [(tuple(t), t + [9]) for t in ([5, 6, 7], [8, 9, 10], [11, 12, 13])]
        start = EarlierText(keep=3)
        for prompt, text in full:
            start.add(prompt, text)
        save_copy_cache(path, d.info, start)
        a, b = EarlierText(keep=3), EarlierText(keep=3)
        load_copy_cache(path, d.info, a)
        load_copy_cache(path, d.info, b)
        b.add(theirs, theirs + [1])
        a.add(mine, mine + [2])
        save_copy_cache(path, d.info, b)
        save_copy_cache(path, d.info, a)
        again = EarlierText(keep=3)
        load_copy_cache(path, d.info, again)
        assert [p for p, _ in again.generations()] == [full[2][0], tuple(theirs), tuple(mine)]
    finally:
        d.earlier = kept


def test_a_copy_cache_file_gives_a_new_session_the_generations_of_an_earlier_one(decoders, tmp_path):
    """What one process kept (save_copy_cache) a fresh session loads (load_copy_cache) and copies from, as from
    its own earlier generations, keeping ar's tokens; a file of another model is refused."""
    from s2moe.engine.drafting.copycache import load_copy_cache, save_copy_cache
    from s2moe.engine.drafting.ngrams import EarlierText
    from s2moe.engine.errors import ConfigError

    d = decoders["olmoe"]
    c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test-copy-cache")
    earlier = d.tokenize(PROMPTS[1])
    prompt = [earlier[0] + 1] + earlier[1:]
    kept = d.earlier
    try:
        d.earlier = EarlierText()
        first = summarize(run(d, earlier, GenerationConfig(mode="ar", n_predict=16, stop_at_eos=False)))
        path = tmp_path / "copies.json"
        save_copy_cache(path, d.info, d.earlier)
        d.earlier = EarlierText()  # a new process: nothing generated yet
        assert load_copy_cache(path, d.info, d.earlier) == 1
        assert d.earlier.generations() == [(tuple(earlier), earlier + list(first.tokens))]
        plain = summarize(run(d, prompt, GenerationConfig(mode="ar", n_predict=16, stop_at_eos=False)))
        d.earlier = EarlierText()
        load_copy_cache(path, d.info, d.earlier)
        events = run(
            d, prompt, GenerationConfig(mode="s2moe", n_predict=16, cost=c, reuse_strength=0.0, stop_at_eos=False)
        )
        assert any(e.draft_stop.startswith("lookup: session") for e in events if isinstance(e, Iteration))
        assert summarize(events).tokens == plain.tokens
        with pytest.raises(ConfigError, match="another model's tokens"):
            load_copy_cache(path, decoders["qwen3moe"].info, EarlierText())
    finally:
        d.earlier = kept
