"""The one aggregation of iteration events (engine.events.Totals/Summary) that the CLI summary, the
benchmark and the app's live panel read: hand-built events with totals worked out by hand."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from s2moe.engine.events import CostConstants, Finished, Iteration, Prefilled, Started, Summary, Totals

COST = CostConstants(t_ar=0.01, c_draft=0.004, t_exp=0.0001, t_tok=0.001, intercept=0.002, source="profile:test")


def step(
    index,
    drafted,
    n_accepted,
    target,
    *,
    experts,
    reuse,
    useful=None,
    misses=None,
    faults=None,
    gated_moves=0,
    t_draft=0.0,
    t_verify=0.0,
) -> Iteration:
    accepted = drafted[:n_accepted]
    committed = accepted + (target,)
    return Iteration(
        index=index,
        candidates=(),
        drafted=drafted,
        accepted=accepted,
        rejected=drafted[n_accepted:],
        target_token=target,
        committed=committed,
        committed_text="",
        draft_stop="utility" if drafted else "no-draft",
        rollback=len(drafted) - n_accepted,
        kv_end=0,
        n_committed=0,
        verify_tokens=len(drafted) + 1,
        verify_experts=np.array(experts, float),
        reuse_ratio=np.array(reuse, float),
        gated_moves=gated_moves,
        t_draft=t_draft,
        t_verify=t_verify,
        useful_experts=None if useful is None else np.array(useful, float),
        verify_misses=None if misses is None else np.array(misses),
        verify_major_faults=faults,
    )


# a verification that kept two of three drafts (offloaded: one expert fetched, three storage faults),
# a plain step (offloaded, no fault count), and a verification that rejected both drafts (resident, and
# without the experts its committed rows needed)
FIRST = [
    step(
        1,
        (5, 6, 7),
        2,
        9,
        experts=[3, 5],
        reuse=[0.5, 0.25],
        useful=[2, 4],
        misses=[1, 0],
        faults=3,
        gated_moves=2,
        t_draft=0.25,
        t_verify=0.5,
    ),
    step(2, (), 0, 8, experts=[2, 2], reuse=[0, 0], useful=[2, 2], misses=[2, 1], t_verify=0.125),
    step(3, (1, 2), 0, 4, experts=[4, 4], reuse=[0.75, 0.5], gated_moves=1, t_draft=0.125, t_verify=0.25),
]
SECOND = [
    step(
        1,
        (3,),
        1,
        2,
        experts=[6, 2],
        reuse=[1.0, 0.5],
        useful=[6, 2],
        misses=[0, 2],
        faults=1,
        gated_moves=4,
        t_draft=0.5,
        t_verify=1.0,
    ),
    step(2, (), 0, 7, experts=[1, 1], reuse=[0, 0], useful=[1, 1], t_verify=0.25),
]


def generation(its, seconds=2.0, prefill=0.125):
    tokens = tuple(t for it in its for t in it.committed)
    return (
        [Started("s2moe", "m", (1, 2), 2, 8, 2, {}, COST), Prefilled(2, prefill)]
        + its
        + [Finished(tokens, "", len(tokens), seconds, "length", len(its))]
    )


def summarize(events) -> Summary:
    s = Summary()
    for e in events:
        s.add(e)
    return s


def test_a_generation_is_totalled_as_worked_out_by_hand():
    s = summarize(generation(FIRST))
    assert (s.iterations, s.verifications, s.committed, s.committed_per_iter) == (3, 2, 5, [3, 1, 1])
    assert (s.drafted, s.accepted, s.rollbacks, s.gated_moves) == (5, 2, 3, 3)
    assert (s.t_draft, s.t_verify) == (0.375, 0.875)
    # reuse and experts: the two multi-token verifications only
    assert s.reuse_n == 2
    assert s.reuse_per_layer.tolist() == [0.625, 0.375] and s.reuse_ratio == 0.5
    assert s.verify_experts_sum == 16 and s.mean_verify_experts == 8
    # useful share: only the verification that said which experts its committed rows needed (6 of 8)
    assert s.useful_share == 0.75
    # offloading: the two steps that counted their misses, whether or not they drafted
    assert (s.offloaded_steps, s.experts_read, s.experts_fetched, s.storage_faults) == (2, 12, 4, 3)
    assert s.accept_len == pytest.approx(5 / 3) and s.accept_len == np.mean(s.committed_per_iter)
    assert s.acceptance_rate == 0.4 and s.mean_draft_len == pytest.approx(5 / 3)
    assert (s.mode, s.cost, s.n_tokens, s.stop_reason) == ("s2moe", COST, 5, "length")
    assert (s.tok_per_s, s.decode_seconds) == (2.5, 1.875)
    # decoding speed, as bench and tune count it: the prefill left out, the first token's step kept
    assert s.decode_tok_per_s == pytest.approx(5 / 1.875) and s.as_dict()["decode_tok_per_s"] == s.decode_tok_per_s
    assert s.as_dict()["reuse_ratio_per_layer"] == [0.625, 0.375]


def test_nothing_to_total():
    s = summarize(generation([]))
    assert (s.accept_len, s.acceptance_rate, s.mean_draft_len) == (0.0, 0.0, 0.0)
    assert s.reuse_per_layer is None and s.reuse_ratio is None
    assert s.mean_verify_experts is None and s.useful_share is None


def test_merged_generations_equal_one_run_over_all_their_iterations():
    """The benchmark sums a mode's generations with merge: every field must come out as if one Totals had
    seen every iteration (a field that merge forgot fails here)."""
    merged = Totals()
    for its in (FIRST, SECOND):
        merged.merge(summarize(generation(its)))
    whole = Totals()
    for it in FIRST + SECOND:
        whole.add_iteration(it)
    for f in fields(Totals):
        a, b = getattr(merged, f.name), getattr(whole, f.name)
        if isinstance(b, np.ndarray):
            assert np.array_equal(a, b), f.name
        else:
            assert a == b, f.name
    assert whole.iterations == 5 and whole.committed == 8 and whole.storage_faults == 4
    assert whole.reuse_per_layer.tolist() == [2.25 / 3, 1.25 / 3]
    # merging copies: adding to the merged totals leaves the generation it started from as it was
    first = summarize(generation(FIRST))
    sink = Totals()
    sink.merge(first)
    sink.merge(first)
    assert first.reuse_sum.tolist() == [1.25, 0.75] and len(first.committed_per_iter) == 3
