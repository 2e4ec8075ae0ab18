"""The copy rule's refinements switched off one at a time (GenerationConfig.copy_without), for an ablation: each
switch changes what the planner does, as the plain rule would, and an empty set is the whole rule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from s2moe.engine.decoding.decoder import run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.drafting.copies import COPY_REFINEMENTS, CopyPlanner, LookupOrSelfDrafter
from s2moe.engine.drafting.ngrams import EarlierText
from s2moe.engine.drafting.stoprules import UtilityStop
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import CostConstants, Iteration
from test_engine_decoding import REPEATING, summarize

LOOPING = [5, 1, 2, 3, 1, 2, 3]  # a context in a loop of period 3


def cheap_rows() -> UtilityStop:
    """A rule under which a copied row costs a hundredth of a plain step: long copies pay."""
    return UtilityStop(CostConstants(t_ar=1.0, c_draft=0.9, t_exp=0.0, t_tok=0.01, intercept=0.0, source="test"))


def plan(rule, context=LOOPING, max_len=6, earlier=None, without=()):
    return CopyPlanner(rule, earlier, prompt=(context[0],), without=frozenset(without)).plan(context, max_len)


def test_without_the_loop_a_copy_stops_at_the_contexts_end():
    whole = plan(cheap_rows())
    assert whole.tokens == [1, 2, 3, 1, 2, 3] and "context, looped" in whole.kinds
    stopped = plan(cheap_rows(), without={"loop"})
    assert stopped.tokens == [1, 2, 3] and stopped.kinds == ["context"] * 3


def test_without_hope_an_estimate_is_its_share_where_plain_steps_fetch():
    def fetching():
        rule = cheap_rows()
        rule.copies(3).fetched(40, 48)
        return rule

    hoped = 0.6 + math.sqrt(0.6 * 0.4 / 2)  # the prior's share, raised by its standard error
    assert plan(fetching()).p == pytest.approx(hoped)
    assert plan(fetching(), without={"hope"}).p == pytest.approx(0.6)
    assert fetching().copies(3).likeliest(hope=False) == pytest.approx(0.6)


def session() -> EarlierText:
    """Three earlier generations holding the trigram 7 8 9: the two older go on with 20, the latest with 30."""
    earlier = EarlierText()
    earlier.add((1,), [1, 7, 8, 9, 20, 21])
    earlier.add((2,), [2, 7, 8, 9, 20, 21])
    earlier.add((3,), [3, 7, 8, 9, 30, 31])
    return earlier


def test_without_session_copies_only_the_context_is_copied():
    copied = plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session())
    assert copied.source == "session" and copied.tokens == [30, 31]  # the latest generation's
    assert plan(cheap_rows(), [5, 7, 8, 9], 2, earlier=session(), without={"session"}) is None


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
    session_off = replace(cfg, copy_without=frozenset({"session"}))
    drafter = d._drafter(session_off, c, [1, 2, 3])
    assert isinstance(drafter, LookupOrSelfDrafter) and drafter.copies.without == {"session"}
    assert d._drafter(cfg, c, [1, 2, 3]).copies.rule is not drafter.copies.rule
    ar = summarize(run(d, REPEATING, GenerationConfig(mode="ar", n_predict=32, stop_at_eos=False)))
    all_off = run(d, REPEATING, replace(cfg, copy_without=frozenset(COPY_REFINEMENTS)))
    assert any(e.drafted for e in all_off if isinstance(e, Iteration))
    assert summarize(all_off).tokens == ar.tokens
