"""Draft trees: several candidates per position, drafted and verified in the one shared KV cache.

Drafting. A node's children are the draft's first b tokens there (SeededSampler.ranked: the most likely,
or, sampled, the draft's draws without replacement under the seed's noise, so that a target close to the
draft draws one of them); all of them are decoded in one pass, each on a sequence id of its own that first
receives its parent's cells (llama_memory_seq_cp: the cells are shared, not copied), so that siblings never
see each other. Each child's routing, recorded by the
hook as in the chain, gives the target experts it would add to the verification. Best-first expansion then
takes the frontier node of largest utility U = p_path·T_AR / (T_exp·ΔE(node | experts of the nodes already
taken) + T_tok + C_draft) until none reaches the threshold or the node cap is hit, and expands each node it
takes. With T_exp = 0 this is a probability-only tree (`tree-prob`); with the measured constants the rule
prefers, between branches of similar probability, the one whose experts the batch already reads. All draft
cells are removed afterwards.

Verification. One target pass over the pending token and every node taken. Each leaf gets a sequence id that
first receives the committed prefix; a row belongs to the sequences of every leaf below it and attends
through the first of them, which holds exactly its ancestors. Greedy: the longest path the target agrees
with, plus its next token; sampled, the same with the target's draw at each node (the seed's noise at its
position, engine.decoding.sampling): a child is accepted when it is the token plain sampling would commit there, so
the tree commits plain sampling's tokens, and a node's children together are accepted with the target's
probability of their tokens. The accepted branch's cells then move to sequence 0 and every
other cell is freed: the cache holds exactly the committed path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..drafting.drafters import Drafter, Proposal
from ..drafting.stoprules import UtilityStop
from ..events import DraftCandidate
from .sampling import Floats, PositionNoise, Sampling, SeededSampler

if TYPE_CHECKING:
    from .decoder import Decoder, Gating, _Verified


@dataclass
class DraftTree:
    """The nodes a verification takes, in batch order (parents before children)."""

    parents: list[int] = field(default_factory=list)  # index of each node's parent; -1: the pending token
    depths: list[int] = field(default_factory=list)  # 1 for the pending token's children

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self.parents)) if i not in has_child]


@dataclass
class _Node:
    token: int
    parent: int  # index into the drafter's decoded nodes; -1: the pending token
    depth: int
    prob: float  # draft probability of its token at the parent
    path: float  # product of draft probabilities from the pending token down to it
    seq: int  # draft sequence id
    logits: Floats | None  # draft logits at the node (its children's distribution)
    # [n_layer, n_expert + 1]: the router's top-k, the target experts it predicts
    predicted: npt.NDArray[np.bool_] | None
    history: list[int]  # committed tokens and the path down to and including it
    taken: int = -1  # its index in the tree once taken
    routed: npt.NDArray[np.int32] | None = None  # [n_layer, k] the router's ids in its draft pass (-1: no MoE)


class TreeDrafter(Drafter):
    """Self-drafting (top-k_d experts) of a tree: best-first under the utility rule, or, without a rule, the
    fixed shape of the paper's baselines: `width` nodes per depth (the most likely of their parents' top-b
    children), as deep as the draft cap allows, one drafting pass per depth."""

    name = "tree"
    drafts_in_context = True

    def __init__(
        self,
        k_draft: int,
        rule: UtilityStop | None,
        width: int,
        max_nodes: int,
        allowed: Callable[[], npt.NDArray[np.bool_]] | None = None,
    ):
        self.k_draft = k_draft
        self.rule = rule
        self.width = width
        self.max_nodes = max_nodes
        self.allowed = allowed  # as SelfDrafter's: None, the router's top-k_d; else the best among these in memory

    def propose(self, dec: Decoder, committed: list[int], max_len: int, sample: SeededSampler) -> Proposal:
        pending, pos = committed[-1], len(committed) - 1
        out = Proposal()
        if max_len <= 0:
            out.stop = "limit"
            return out
        rule = self.rule
        if rule is not None:
            drafting = rule.worth_drafting()
            out.decision = rule.decision
            if not drafting:
                out.stop = "no-draft"
                return out
        rt, hook = dec.rt, dec.rt.hook
        assert hook is not None  # self-drafting routes through the target's own hook
        n_layer, n_expert = rt.info.n_layer, rt.info.n_expert
        layers = np.arange(n_layer)[:, None]
        t0 = time.perf_counter()
        hook.draft(self.k_draft, None if self.allowed is None else self.allowed())
        root_logits = rt.decode([pending], pos, "last")[0]  # sequence 0, removed by the decoder afterwards
        routing = hook.snapshot(1)
        in_batch = np.zeros((n_layer, n_expert + 1), bool)
        read = np.zeros((n_layer, n_expert + 1), bool)
        in_batch[layers, routing.orig[:, 0, :]] = True
        read[layers, routing.used[:, 0, :]] = True
        observer = dec.observer
        if observer is not None:
            observer.predicted(in_batch[:, :n_expert])

        nodes: list[_Node] = []
        frontier: list[int] = []
        free_seqs = list(range(rt.n_seq_max - 1, 0, -1))
        used_seqs: list[int] = []
        root = _Node(pending, -1, 0, 1.0, 1.0, 0, root_logits, None, list(committed))

        def expand(parents: list[tuple[int, _Node]]) -> list[int]:
            """Decode the first b children of the given nodes in one pass (those that could still pay, under a
            rule); they join the frontier. Returns their indices."""
            kids = []
            for index, parent in parents:
                assert parent.logits is not None  # a node is expanded once decoded
                order, q = sample.ranked(parent.logits, parent.history, self.width)
                for t in order:
                    p = parent.path * float(q[t])
                    if not free_seqs:
                        break
                    if rule is not None and rule.utility(p, 0.0) < rule.threshold:
                        continue  # sampled, siblings come in the noise's order: a later one may still pay
                    s = free_seqs.pop()
                    rt.seq_cp(parent.seq, s)
                    used_seqs.append(s)
                    kids.append(
                        _Node(int(t), index, parent.depth + 1, float(q[t]), p, s, None, None, parent.history + [int(t)])
                    )
            if not kids:
                return []
            kid_logits = rt.decode_tree([k.token for k in kids], [pos + k.depth for k in kids], [[k.seq] for k in kids])
            r = hook.snapshot(len(kids))
            added = []
            for j, kid in enumerate(kids):
                kid.logits = kid_logits[j]
                kid.predicted = np.zeros((n_layer, n_expert + 1), bool)
                kid.predicted[layers, r.orig[:, j, :]] = True
                kid.routed = r.orig[:, j, :].copy()
                read[layers, r.used[:, j, :]] = True
                added.append(len(nodes))
                nodes.append(kid)
            frontier.extend(added)
            return added

        tree = DraftTree()

        def take(i: int, utility: float | None) -> None:
            node = nodes[i]
            frontier.remove(i)
            added = node.predicted & ~in_batch
            in_batch[:] |= node.predicted
            if observer is not None:
                observer.predicted(added[:, :n_expert])
            node.taken = len(tree.parents)
            tree.parents.append(-1 if node.parent < 0 else nodes[node.parent].taken)
            tree.depths.append(node.depth)
            out.tokens.append(node.token)
            out.chain.append(node.path)
            out.candidates.append(
                DraftCandidate(
                    node.token,
                    dec.piece_text(node.token),
                    node.prob,
                    node.path,
                    utility,
                    added[:, :n_expert].sum(axis=1),
                    True,
                    node.routed,
                )
            )

        expand([(-1, root)])
        if rule is None:
            # the fixed shape: per depth, the `width` most likely of the children just drafted
            out.stop = "cap"
            level = list(frontier)
            while level and len(tree.parents) < self.max_nodes:
                level.sort(key=lambda i: -nodes[i].path)
                chosen = level[: min(self.width, self.max_nodes - len(tree.parents))]
                for i in chosen:
                    take(i, None)
                if nodes[chosen[0]].depth >= max_len:
                    break
                level = expand([(i, nodes[i]) for i in chosen])
        else:
            if nodes:
                first = nodes[0]  # the pending token's most likely child: what the rule learns a first token from
                rule.observe_first(first.prob)
                rule.observe_first_experts(int((first.predicted & ~in_batch)[:, :n_expert].sum()))
            else:
                top = float(sample(root_logits, list(committed))[1].max())
                rule.pre_reject(top, top)  # no child could pay: tells a probe that it did not
            out.stop = "utility"
            while frontier:
                if len(tree.parents) >= self.max_nodes:
                    out.stop = "cap"
                    break
                new = [int((nodes[i].predicted & ~in_batch)[:, :n_expert].sum()) for i in frontier]
                utilities = [rule.utility(nodes[i].path, e) for i, e in zip(frontier, new)]
                j = int(np.argmax(utilities))
                i = frontier[j]
                keep, u = rule.keep(nodes[i].path, nodes[i].prob, new[j])
                if not keep:
                    break
                take(i, u)
                if nodes[i].depth < max_len:
                    expand([(i, nodes[i])])
        for i in frontier:  # drafted, never taken
            n = nodes[i]
            added = (n.predicted & ~in_batch)[:, :n_expert].sum(axis=1)
            utility = None if rule is None else rule.utility(n.path, float(added.sum()))
            out.candidates.append(
                DraftCandidate(n.token, dec.piece_text(n.token), n.prob, n.path, utility, added, False, n.routed)
            )
        for s in used_seqs:
            rt.seq_rm(s)
        out.tree = tree
        out.seconds = time.perf_counter() - t0
        out.experts_read = read[:, :n_expert].sum(axis=1)
        out.predicted = in_batch[:, :n_expert]
        return out


def tree_layout(tree: DraftTree, pos: int) -> tuple[list[int], list[list[int]], dict[int, int]]:
    """Positions and sequence ids of the verification rows (the pending token at pos, then the nodes), and
    the sequence id of each leaf."""
    leaves = tree.leaves()
    leaf_seq = {leaf: s for s, leaf in enumerate(leaves, start=1)}
    below: list[list[int]] = [[] for _ in tree.parents]
    for leaf, s in leaf_seq.items():
        i = leaf
        while i >= 0:
            below[i].append(s)
            i = tree.parents[i]
    positions = [pos] + [pos + d for d in tree.depths]
    return positions, [[0] + list(leaf_seq.values())] + below, leaf_seq


def verify_tree(
    dec: Decoder,
    proposal: Proposal,
    pending: int,
    pos: int,
    gate: Gating | None,
    sampler: Sampling,
    history: Sequence[int],
    noise: PositionNoise,
) -> tuple[_Verified, list[int], int]:
    """One target pass over the pending token (at pos) and the tree; the accepted path (node indices) and the
    target's token after it. Leaves sequence 0 holding the committed path, and no other sequence."""
    rt, tree = dec.rt, proposal.tree
    assert isinstance(tree, DraftTree)  # the proposal of a TreeDrafter
    positions, seqs, leaf_seq = tree_layout(tree, pos)
    for s in leaf_seq.values():
        rt.seq_cp(0, s, 0, pos)
    try:
        v = dec._verify([pending] + proposal.tokens, pos, proposal, gate, layout=(positions, seqs))
        path, token = accept_tree(proposal.tokens, tree.parents, v.logits, sampler, noise, history)
        if path:
            rt.seq_cp(seqs[path[-1] + 1][0], 0, pos + 1, pos + 1 + len(path))
    finally:
        for s in leaf_seq.values():
            rt.seq_rm(s)
    return v, path, token


def accept_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    logits: Floats,
    sampler: Sampling,
    noise: PositionNoise,
    history: Sequence[int],
) -> tuple[list[int], int]:
    """(indices of the accepted nodes from the pending token down, the target's token after them): at each
    node the target's own token (engine.decoding.acceptance) moves to the child that drafted it, if one did.

    logits: [1 + len(tokens), n_vocab], row 0 the pending token's, row i + 1 node i's."""
    children: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        children.setdefault(i, [])
        children[p].append(i)
    path: list[int] = []
    context = list(history)
    node = -1
    while True:
        token = sampler.token(logits[node + 1], context, noise)
        nxt = next((c for c in children[node] if tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        context.append(tokens[nxt])
        node = nxt
