"""Draft trees: layout, acceptance, losslessness and the KV cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from s2moe.engine.decoding.decoder import run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.decoding.sampling import PositionNoise, Sampling, softmax
from s2moe.engine.decoding.tree import DraftTree, accept_tree, tree_layout
from s2moe.engine.events import CostConstants, Finished, Iteration
from test_cli import assert_clean_error, s2moe
from test_engine_decoding import (
    PROMPTS,
    PendingExperts,
    _chi2,
    _chi2_critical,
    assert_matches_ar,
    routed_experts,
    summarize,
)

# Drafting always pays, and a wide tree: exercises branching, not only chains.
CHEAP_DRAFT = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.001, t_tok=0.01, intercept=0.0, source="test")
GREEDY = Sampling()


def _logits_preferring(tokens, n_vocab=8):
    out = np.zeros((len(tokens), n_vocab))
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


def test_layout_gives_each_row_the_sequences_of_the_leaves_below_it():
    # pending ─ a(0) ─ c(2) ─ d(3)
    #         └ b(1)
    t = DraftTree(parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    positions, seqs, leaf_seq = tree_layout(t, 10)
    assert positions == [10, 11, 11, 12, 13]
    assert leaf_seq == {1: 1, 3: 2}
    assert seqs == [[0, 1, 2], [2], [1], [2], [2]]


@pytest.mark.parametrize(
    "target, expected",
    [
        ([5, 0, 0, 0, 0], ([], 5)),  # no child of the pending token agrees
        ([2, 0, 0, 0, 0], ([1], 0)),  # the second sibling agrees; its row has no child agreeing
        ([1, 3, 0, 4, 7], ([0, 2, 3], 7)),  # the whole deep branch, then the bonus token
        ([1, 6, 0, 4, 7], ([0], 6)),  # a mismatch under the first node ends the path
    ],
)
def test_greedy_tree_keeps_the_longest_agreeing_path(target, expected):
    tokens, parents = [1, 2, 3, 4], [-1, -1, 0, 2]
    logits = _logits_preferring(target)
    assert accept_tree(tokens, parents, logits, GREEDY, PositionNoise(0), [9]) == expected


def test_a_sampled_tree_commits_plain_samplings_token_and_its_children_cover_their_mass():
    """At each node the target's own draw decides: the first committed token is the one plain sampling with
    the same seed commits, whichever siblings were drafted and in whatever order, so the tree is accepted
    exactly when a child drafted that token — with the target's probability of the children's tokens."""
    sampler = Sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    row0 = np.log(np.array([0.30, 0.25, 0.2, 0.1, 0.1, 0.05]))
    logits = np.vstack([row0, np.zeros((3, 6))])
    tokens, parents = [1, 0, 3], [-1, -1, -1]  # three siblings, in the draft's (not the target's) order
    n = 20000
    accepted = 0
    first = np.zeros(6)
    for seed in range(n):
        noise = PositionNoise(seed)
        path, token = accept_tree(tokens, parents, logits, sampler, noise, [4, 4])
        committed = tokens[path[0]] if path else token
        assert committed == sampler.token(row0, [4, 4], noise)
        accepted += bool(path)
        first[committed] += 1
    assert accepted / n == pytest.approx(0.25 + 0.30 + 0.1, abs=0.015)
    stat, df = _chi2({i: int(c) for i, c in enumerate(first)}, softmax(row0), n)
    assert stat < _chi2_critical(df), f"tree sampling differs from the target: chi2 {stat:.1f}"


def _tree_cfg(mode: str, **kw) -> GenerationConfig:
    return GenerationConfig(
        mode=mode, n_predict=kw.pop("n_predict", 48), cost=CHEAP_DRAFT, reuse_strength=0.0, stop_at_eos=False, **kw
    )


@pytest.mark.parametrize("mode,width", [("tree-prob", 2), ("tree", 3)])
def test_greedy_trees_match_ar(decoders, arch, mode, width):
    d = decoders[arch]
    branched = accepted = rolled_back = off_first = 0
    for prompt in PROMPTS:
        ar = summarize(run(d, prompt, GenerationConfig(mode="ar", n_predict=48, stop_at_eos=False)))
        events = run(d, prompt, _tree_cfg(mode, tree_width=width))
        spec = summarize(events)
        assert spec.n_tokens == ar.n_tokens == 48
        for e in events:
            if isinstance(e, Iteration) and e.tree_parents:
                branched += len(e.tree_parents) > len(set(e.tree_parents))
                accepted += len(e.accepted)
                rolled_back += e.rollback
                # an accepted node that is not its parent's first child: the tree found what a chain missed
                firsts = {p: i for i, p in reversed(list(enumerate(e.tree_parents)))}
                off_first += any(firsts[e.tree_parents[i]] != i for i in e.accepted_path)
        assert_matches_ar(d, prompt, spec.tokens, GenerationConfig(), mode, ar=ar.tokens)
    assert branched and accepted and rolled_back and off_first, (branched, accepted, rolled_back, off_first)


@pytest.mark.parametrize("mode,temp,gating", [("tree-prob", 0.0, 0.0), ("tree", 0.0, 0.5), ("tree", 1.0, 0.5)])
def test_draft_kv_never_leaks_into_the_cache(decoders, arch, mode, temp, gating):
    """After every iteration sequence 0 ends where the committed tokens end (the newest excepted) and no
    draft or branch sequence holds a cell."""
    d = decoders[arch]
    rt = d.rt
    cfg = _tree_cfg(mode, n_predict=40, temperature=temp, seed=5, tree_width=3)
    cfg.reuse_strength = gating
    iters = 0
    for e in d.generate(PROMPTS[0], cfg):
        if isinstance(e, Iteration):
            iters += bool(e.drafted)
            assert e.kv_end == e.n_committed - 1
            assert rt.kv_end() == e.n_committed - 1
            assert all(rt.seq_end(s) == 0 for s in range(1, rt.n_seq_max))
            assert e.rollback == len(e.drafted) - len(e.accepted) == len(e.rejected)
            assert list(e.committed) == list(e.accepted) + [e.target_token]
    assert iters


def test_tree_kv_entries_are_target_computed(decoders, arch):
    """The cache a tree generation leaves continues as a fresh plain prefill of the same tokens does. Not
    bit for bit: the committed cells sit among the freed cells of rejected branches, and the attention sums
    run over another layout (≈1e-2 on these models, where a cache computed by the k_d-expert draft is off
    by 0.4 and more: checked below, so that the bound can tell the two apart)."""
    d = decoders[arch]
    rt = d.rt
    bound = 3e-2

    def deviation(seq):
        rt.hook.off()
        kept = rt.decode([seq[-1]], len(seq) - 1, "last")[0]
        rt.kv_clear()
        fresh = rt.decode(seq, 0, "last")[0]
        rt.kv_clear()
        return float(np.abs(kept - fresh).max())

    fin = run(d, PROMPTS[1], _tree_cfg("tree-prob", n_predict=24, tree_width=3))[-1]
    assert isinstance(fin, Finished)
    seq = d.tokenize(PROMPTS[1]) + list(fin.tokens)
    assert deviation(seq) < bound
    rt.kv_clear()
    rt.hook.draft(2)
    for pos, tok in enumerate(seq[:-1]):
        rt.decode([tok], pos, "none")
    assert deviation(seq) > 10 * bound


def test_cost_aware_tree_prefers_nodes_adding_fewer_experts(decoders):
    """Under an expensive T_exp the tree's utilities follow the experts each node adds; with T_exp = 0
    (tree-prob) only the path probability counts."""
    d = decoders["olmoe"]
    c = CostConstants(t_ar=1.0, c_draft=0.01, t_exp=0.05, t_tok=0.01, intercept=0.0, source="test")
    seen = 0
    told = PendingExperts(d)
    for mode in ("tree", "tree-prob"):
        t_exp = c.t_exp if mode == "tree" else 0.0
        told.rounds.clear()
        d.attach(told)
        try:
            events = run(
                d,
                PROMPTS[2],
                GenerationConfig(mode=mode, n_predict=30, cost=c, stop_at_eos=False, reuse_strength=0.0, tree_width=3),
            )
        finally:
            d.detach(told)
        iters = [e for e in events if isinstance(e, Iteration)]
        assert len(told.rounds) == len(iters)
        for e, in_batch in zip(iters, told.rounds):
            kept = [cand for cand in e.candidates if cand.kept]
            assert [cand.token for cand in kept] == list(e.drafted)
            # taken nodes come first, in the order taken, each adding its routing to the batch's experts; the
            # nodes never taken are weighed against the whole batch
            for cand in e.candidates:
                routed = routed_experts(cand.predicted, in_batch.shape)
                new = int((routed & ~in_batch).sum())
                expected = cand.chain_prob * c.t_ar / (t_exp * new + c.t_tok + c.c_draft)
                assert cand.utility == pytest.approx(expected, rel=1e-9)
                assert cand.kept or cand.utility < 1.0 or len(e.drafted) == 8
                if cand.kept:
                    in_batch |= routed
                seen += 1
    assert seen


def test_sampled_tree_commits_ars_tokens_and_its_later_siblings_are_accepted(decoders):
    """End to end on a model: a sampled tree generation commits plain sampling's tokens with the same seed,
    and children after the first — the draft's later draws under the seed's noise — are accepted often
    enough to matter."""
    d = decoders["olmoe"]
    temp = 1.5
    # no truncation: the draft's distribution keeps several tokens, so that siblings exist
    options = dict(temperature=temp, top_k=0, top_p=1.0, min_p=0.0, stop_at_eos=False)
    prompt = d.tokenize(PROMPTS[0])
    later_sibling = 0
    for seed in range(60):
        ar = run(d, prompt, GenerationConfig(mode="ar", n_predict=6, seed=seed, **options))[-1].tokens
        cfg = GenerationConfig(
            mode="tree-prob",
            n_predict=6,
            seed=seed,
            draft_topk=1,
            cost=CHEAP_DRAFT,
            tree_width=3,
            draft_max=3,
            **options,
        )
        events = run(d, prompt, cfg)
        assert events[-1].tokens == ar, f"seed {seed}"
        later_sibling += sum(
            e.accepted_path[0] != tree_first_child(e) for e in events if isinstance(e, Iteration) and e.accepted_path
        )
    assert later_sibling > 10


def tree_first_child(it: Iteration) -> int:
    """The index of the pending token's first child in an iteration's tree."""
    return it.tree_parents.index(-1)


def test_fixed_shape_tree_takes_width_nodes_per_depth(decoders, arch):
    """Without the utility rule a tree has the paper's fixed shape: `width` nodes at every depth down to the
    draft cap (or the node cap), the most likely of their parents' children; still lossless."""
    d = decoders[arch]
    ar = run(d, PROMPTS[0], GenerationConfig(mode="ar", n_predict=40, stop_at_eos=False))[-1].tokens
    cfg = GenerationConfig(
        mode="tree-prob", utility=False, tree_width=2, tree_max_nodes=16, draft_max=8, n_predict=40, stop_at_eos=False
    )
    events = run(d, PROMPTS[0], cfg)
    full = 0
    for e in events:
        if isinstance(e, Iteration) and e.drafted:
            depths = [0] * len(e.tree_parents)
            for i, p in enumerate(e.tree_parents):
                depths[i] = 1 if p < 0 else depths[p] + 1
            per_depth = np.bincount(depths)[1:]
            assert (per_depth <= 2).all() and len(per_depth) <= 8
            full += list(per_depth) == [2] * 8
            paths = [c.chain_prob for c in e.candidates if c.kept]
            assert len(paths) == len(e.drafted) and all(c.utility is None for c in e.candidates)
    assert full
    assert events[-1].tokens == ar


def test_cli_tree_flag_turns_s2moe_into_its_tree(tiny_models):
    model = str(tiny_models["olmoe"])
    done = s2moe(
        "generate",
        "--model",
        model,
        "-p",
        "hello",
        "-n",
        "6",
        "--tree",
        "--tree-width",
        "3",
        "--json",
        "--threads",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["mode"] == "tree"
    assert_clean_error(s2moe("generate", "--model", model, "-p", "hello", "--mode", "conf", "--tree"), "--tree")
    assert_clean_error(
        s2moe("generate", "--model", model, "-p", "hello", "--mode", "tree", "--tree-max-nodes", "99"),
        "--tree-max-nodes",
    )
