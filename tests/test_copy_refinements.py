"""The copy rule's refinements switched off one at a time (GenerationConfig.copy_without), for an ablation: each
switch changes what the planner does, as the plain rule would, and an empty set is the whole rule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from s2moe.engine.decoding.decoder import run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.drafting.copies import COPY_REFINEMENTS, CopyPlanner, LookupOrSelfDrafter
from s2moe.engine.drafting.copylearner import copy_added
from s2moe.engine.drafting.ngrams import EarlierText
from s2moe.engine.drafting.stoprules import UtilityStop
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import CostConstants, Iteration
from test_engine_decoding import REPEATING, summarize

LOOPING = [5, 1, 2, 3, 1, 2, 3]  # a context in a loop of period 3


def cheap_rows(t_exp: float = 0.0) -> UtilityStop:
    """A rule under which a copied row costs a hundredth of a plain step: long copies pay."""
    return UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=t_exp, t_tok=0.01, intercept=0.0, source="test"))


def plan(rule, context=LOOPING, max_len=6, earlier=None, without=()):
    return CopyPlanner(rule, earlier, prompt=(context[0],), without=frozenset(without)).plan(context, max_len)


def test_without_the_loop_a_copy_stops_at_the_contexts_end():
    whole = plan(cheap_rows())
    assert whole.tokens == [1, 2, 3, 1, 2, 3] and "context, looped" in whole.kinds
    stopped = plan(cheap_rows(), without={"loop"})
    assert stopped.tokens == [1, 2, 3] and stopped.kinds == ["context"] * 3


def test_without_pricing_whole_a_copy_is_kept_token_by_token():
    """The copy of the pricing-whole test: eight rows pay together where the first alone costs more than it saves;
    weighed token by token the first row is declined, and with it the copy (a probe is not due yet)."""

    def learned_rule():
        rule = UtilityStop(
            CostConstants(t_ar=0.060, c_draft=0.02, t_exp=0.00233, t_tok=0.005, intercept=0.0, source="test")
        )
        learned = rule.copies(3)
        for _ in range(8):
            learned.learn(3, ["context"] * 3 + ["context, looped"] * 5, accepted=8)
        for _ in range(10):
            learned.verified(1, copy_added(0.45, 1, 48), 48, 0.0)
        return rule

    whole = plan(learned_rule(), max_len=8)
    assert whole.rows == 8 and not whole.probe and whole.weighed[0][2] < 1.0
    assert plan(learned_rule(), max_len=8, without={"whole"}) is None
    # where every row pays on its own, token by token keeps them all, as whole does
    assert plan(cheap_rows(), without={"whole"}).tokens == plan(cheap_rows()).tokens


def test_without_the_overlap_share_every_row_adds_what_a_first_draft_token_does():
    def learned_rule():
        rule = cheap_rows(t_exp=0.0001)
        rule.expected_first_experts = 20.0
        for _ in range(10):
            rule.copies(3).verified(1, copy_added(0.45, 1, 48), 48, 0.0)
        return rule

    pooled, plain = plan(learned_rule()), plan(learned_rule(), without={"overlap"})
    assert pooled.rows == plain.rows == 6
    assert pooled.experts == pytest.approx(copy_added(0.45, 6, 48)) and plain.experts == pytest.approx(6 * 20.0)
    # a verified copy of 6 rows that added 60 experts: the first row's share of the pool, or the rows' mean
    firsts = []
    for without in ((), ("overlap",)):
        rule = learned_rule()
        planner = CopyPlanner(rule, None, prompt=(5,), without=frozenset(without))
        planner.learn(planner.plan(LOOPING, 6), 6, 48 + 60.0, 48)
        firsts.append(rule.expected_first_experts)
    assert firsts[1] == pytest.approx(20.0 + rule.smoothing * (10.0 - 20.0)) and firsts[0] > firsts[1]


def timed_dear(rule: UtilityStop) -> None:
    """Copies timed at three times their constants' price, rows dearer than the plain step timed."""
    learned = rule.copies(3)
    learned.began()
    for _ in range(2):
        learned.timed(0.001, 0)
    for _ in range(learned.min_copies):
        learned.verified(1, 0.0, 0, rule.copy_cost(1, 0.0))
        learned.timed(0.003, 1)
        learned.timed(0.001, 0)


def test_without_timed_scaling_copies_are_priced_at_the_constants():
    rule, plain_rule = cheap_rows(), cheap_rows()
    timed_dear(rule)
    timed_dear(plain_rule)
    assert rule.copies(3).price() is not None
    assert plan(rule) is None  # not even a certain copy pays at the prices timed
    constants = plan(plain_rule, without={"timed-scaling"})
    assert constants is not None and not constants.probe and constants.saved == 1.0
    assert constants.cost == pytest.approx(plain_rule.copy_cost(constants.rows, 0.0))


def test_without_the_timed_plain_step_a_copied_token_saves_the_constants_t_ar():
    def slow_plain_steps_fetching_most():
        rule = UtilityStop(
            CostConstants(t_ar=0.010, c_draft=0.009, t_exp=0.0, t_tok=0.002, intercept=0.0, source="test")
        )
        learned = rule.copies(3)
        learned.began()
        for _ in range(3):
            learned.timed(0.030, 0)
            learned.fetched(33, 48)
        return rule

    assert plan(slow_plain_steps_fetching_most(), max_len=4).saved == pytest.approx(0.030)
    assert plan(slow_plain_steps_fetching_most(), max_len=4, without={"timed-plain"}).saved == pytest.approx(0.010)


def test_without_hope_an_estimate_is_its_share_where_plain_steps_fetch():
    def fetching():
        rule = cheap_rows()
        rule.copies(3).fetched(40, 48)
        return rule

    hoped = 0.6 + math.sqrt(0.6 * 0.4 / 2)  # the prior's share, raised by its standard error
    assert plan(fetching()).p == pytest.approx(hoped)
    assert plan(fetching(), without={"hope"}).p == pytest.approx(0.6)
    assert fetching().copies(3).likeliest(hope=False) == pytest.approx(0.6)


def test_without_probes_a_declined_copy_is_never_verified():
    def declining():  # rows at a third of a plain step, an n whose copies were rejected: it declines them
        rule = UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.34, intercept=0.0, source="test"))
        learned = rule.copies(3)
        for _ in range(4):
            learned.learn(3, ["context"], accepted=0)
        learned.probe_interval[:] = 1  # a probe on every decline
        return rule

    probe = plan(declining())
    assert probe.probe and probe.tokens == [1]
    assert plan(declining(), without={"probes"}) is None


def test_without_probes_no_copy_is_made_where_none_could_pay():
    """The rare probe, at prices where not even a certain copy pays, after the longest wait, is not made."""
    for without, due in (((), True), (("probes",), False)):
        rule = cheap_rows()
        timed_dear(rule)
        learned = rule.copies(3)
        planner = CopyPlanner(rule, None, prompt=(5,), without=frozenset(without))
        plans = [planner.plan(LOOPING, 4) for _ in range(16 * learned.probe_every)]
        assert plans[:-1] == [None] * (len(plans) - 1)
        assert (plans[-1] is not None and plans[-1].probe) == due


def session() -> EarlierText:
    """Three earlier generations holding the trigram 7 8 9: the two older go on with 20, the latest with 30."""
    earlier = EarlierText()
    earlier.add((1,), [1, 7, 8, 9, 20, 21])
    earlier.add((2,), [2, 7, 8, 9, 20, 21])
    earlier.add((3,), [3, 7, 8, 9, 30, 31])
    return earlier


def test_without_session_copies_only_the_context_is_copied():
    copied = plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session())
    assert copied.source == "session"
    assert plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session(), without={"session"}) is None


def test_without_voting_a_session_copy_takes_the_latest_generations_tokens():
    voted = plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session())
    assert voted.tokens == [20, 21]
    latest = plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session(), without={"voting"})
    assert latest.source == "session" and latest.tokens == [30, 31] and latest.kinds == ["session"] * 2
    # two voters that agree: the copy stands as agreed with voting, not without
    earlier = EarlierText()
    earlier.add((1,), [1, 7, 8, 9, 20])
    earlier.add((2,), [2, 7, 8, 9, 20])
    assert plan(cheap_rows(), [5, 7, 8, 9], 1, earlier=earlier).kinds == ["session, agreed"]
    assert plan(cheap_rows(), [5, 7, 8, 9], 1, earlier=earlier, without={"voting"}).kinds == ["session"]


def test_an_unknown_refinement_is_a_one_line_error():
    with pytest.raises(ConfigError, match="unknown copy refinement 'vote'"):
        GenerationConfig(copy_without=frozenset({"vote"})).validate()
    with pytest.raises(ConfigError, match="not the string"):
        GenerationConfig(copy_without="hope").validate()
    GenerationConfig(copy_without=frozenset(COPY_REFINEMENTS)).validate()


def test_the_decoder_hands_the_switches_to_its_copies_and_each_set_learns_apart(decoders, arch):
    """A generation's switches reach its planner, each set of them keeps a rule of its own (what one learns is not
    the other's), and copies stay lossless with every refinement off."""
    d = decoders[arch]
    c = CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.2, intercept=0.0, source="test-refinements")
    cfg = GenerationConfig(mode="s2moe", n_predict=32, cost=c, reuse_strength=0.0, stop_at_eos=False).resolved(d.info)
    voting_off = replace(cfg, copy_without=frozenset({"voting"}))
    drafter = d._drafter(voting_off, c, [1, 2, 3])
    assert isinstance(drafter, LookupOrSelfDrafter) and drafter.copies.without == {"voting"}
    assert d._drafter(cfg, c, [1, 2, 3]).copies.rule is not drafter.copies.rule
    ar = summarize(run(d, REPEATING, GenerationConfig(mode="ar", n_predict=32, stop_at_eos=False)))
    all_off = run(d, REPEATING, replace(cfg, copy_without=frozenset(COPY_REFINEMENTS)))
    assert any(e.drafted for e in all_off if isinstance(e, Iteration))
    assert summarize(all_off).tokens == ar.tokens
