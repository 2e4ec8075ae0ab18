"""The native routing hook: observe, draft restriction and reuse-aware gating, on every routing variant
(softmax with and without weight norm, sigmoid gating with and without a selection bias)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import variant_spec
from s2moe.engine.decoding.runtime import LlamaRuntime
from s2moe.engine.errors import ModelError
from s2moe.engine.model_info import read_model_info
from tinygguf import write_tiny

TOKENS = [262, 258, 108, 108, 111, 256, 258, 260, 256, 258, 32, 119, 111, 114, 108, 100]


def _fresh(rt):
    rt.kv_clear()


def selection_bias(path, n_layer: int, n_expert: int) -> np.ndarray:
    """[n_layer, n_expert] per-expert bias the router adds to its scores to select (zero if none)."""
    import gguf

    bias = np.zeros((n_layer, n_expert), np.float32)
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name.endswith(".exp_probs_b.bias"):
            bias[int(t.name.split(".")[1])] = np.asarray(t.data, np.float32)
    return bias


def test_observe_records_routing_without_changing_logits(tiny_models, decoders, arch):
    rt = decoders[arch].rt
    _fresh(rt)
    rt.hook.off()
    plain = rt.decode(TOKENS, 0, "all")
    _fresh(rt)
    rt.hook.observe()
    observed = rt.decode(TOKENS, 0, "all")
    routing = rt.hook.snapshot(len(TOKENS))
    _fresh(rt)
    np.testing.assert_array_equal(plain, observed)
    k = rt.info.n_expert_used
    assert (routing.rows == len(TOKENS)).all()
    assert ((routing.used >= 0) & (routing.used < rt.info.n_expert)).all()
    assert (routing.used == routing.orig).all()
    # each token's k experts are distinct, in decreasing selection score: the router probability, plus
    # the per-expert bias where the model selects with one (the weights stay the unbiased probabilities)
    assert all(len(set(row)) == k for row in routing.used.reshape(-1, k))
    bias = selection_bias(tiny_models[arch], rt.info.n_layer, rt.info.n_expert)
    score = routing.weight + np.take_along_axis(bias[:, None, :], routing.used, axis=-1)
    assert (np.diff(score, axis=-1) <= 1e-6).all()
    assert rt.info.biased_selection == bool(bias.any())


def test_draft_pass_reads_at_most_kd_experts_per_token(decoders, arch):
    rt = decoders[arch].rt
    k_d = 2
    _fresh(rt)
    rt.hook.draft(k_d)
    rt.decode(TOKENS, 0, "all")
    r = rt.hook.snapshot(len(TOKENS))
    _fresh(rt)
    for layer in range(rt.info.n_layer):
        for row in range(len(TOKENS)):
            used, orig, w = r.used[layer, row], r.orig[layer, row], r.weight[layer, row]
            assert len(set(used.tolist())) <= k_d
            assert set(used.tolist()) == set(orig[:k_d].tolist())  # the router's own top-k_d
            assert (w[k_d:] == 0).all() and (w[:k_d] > 0).all()
            assert len(set(orig.tolist())) == rt.info.n_expert_used  # the predicted target set


@pytest.mark.parametrize("k_d", [1, 2])
def test_draft_pass_equals_a_model_loaded_with_fewer_experts(tiny_models, decoders, arch, k_d):
    """Slot rewriting in the full model computes what a real top-k_d model computes (weight norm or not)."""
    rt = decoders[arch].rt
    _fresh(rt)
    rt.hook.draft(k_d)
    drafted = rt.decode(TOKENS, 0, "all")
    _fresh(rt)
    info = read_model_info(tiny_models[arch])
    small = LlamaRuntime(
        info, n_ctx=128, n_threads=1, install_hook=False, int_overrides={f"{info.arch}.expert_used_count": k_d}
    )
    try:
        reference = small.decode(TOKENS, 0, "all")
    finally:
        small.close()
    np.testing.assert_allclose(drafted, reference, atol=2e-4, rtol=1e-4)


def test_dropped_experts_are_never_read(tmp_path, arch):
    """NaN-poison, per layer, an expert that only the dropped slots select: draft logits stay finite."""
    spec = variant_spec(arch, n_layer=3, n_expert=16, k=6, seed=11)
    clean = write_tiny(tmp_path / "clean.gguf", spec)
    rt = LlamaRuntime(read_model_info(clean), n_ctx=128, n_threads=1)
    tokens = TOKENS[:4]
    k_d = 1
    rt.hook.draft(k_d)
    rt.decode(tokens, 0, "all")
    r = rt.hook.snapshot(len(tokens))
    rt.close()
    poison = []
    for layer in range(spec.n_layer):
        kept = set(r.orig[layer, :, :k_d].ravel().tolist())
        dropped = set(r.orig[layer, :, k_d:].ravel().tolist()) - kept
        assert dropped, "fixture should route some tokens to experts only dropped slots select"
        poison.append((layer, min(dropped)))
    spec.poison = poison
    poisoned = write_tiny(tmp_path / "poisoned.gguf", spec)
    rt = LlamaRuntime(read_model_info(poisoned), n_ctx=128, n_threads=1)
    try:
        rt.hook.draft(k_d)
        draft_logits = rt.decode(tokens, 0, "all")
        r2 = rt.hook.snapshot(len(tokens))
        rt.kv_clear()
        rt.hook.observe()
        with pytest.raises(ModelError, match="not numbers"):  # the poison is real: the full model reads it
            rt.decode(tokens, 0, "all")
    finally:
        rt.close()
    np.testing.assert_array_equal(r2.orig, r.orig)  # same routing as the clean model's draft
    assert np.isfinite(draft_logits).all()


def test_gating_moves_selection_only_toward_preferred_experts(decoders, arch):
    rt = decoders[arch].rt
    k, n_expert = rt.info.n_expert_used, rt.info.n_expert
    cap = k + k // 2  # below n_expert, or every expert would be preferred and nothing could move
    rng = np.random.default_rng(5)
    total_plain = total_gated = moved = 0
    for _ in range(6):
        batch = rng.integers(0, 256, size=9).tolist()
        _fresh(rt)
        rt.hook.observe()
        rt.decode(batch, 0, "all")
        plain = rt.hook.snapshot(len(batch))
        _fresh(rt)
        rt.hook.gate(1.0, cap, np.linspace(1.0, 0.3, len(batch)))
        gated_logits = rt.decode(batch, 0, "all")
        gated = rt.hook.snapshot(len(batch))
        _fresh(rt)
        assert np.isfinite(gated_logits).all()
        np.testing.assert_array_equal(gated.orig[0], plain.orig[0])  # layer 0 routes identical inputs
        for layer in range(rt.info.n_layer):
            preferred = set(gated.preferred[layer].tolist())
            assert len(preferred) == cap
            for row in range(len(batch)):
                before, after = set(gated.orig[layer, row].tolist()), set(gated.used[layer, row].tolist())
                assert len(after) == k
                assert after - before <= preferred  # new choices come only from E*
                assert before - after <= (before - preferred)  # only experts outside E* are given up
                moved += len(after - before)
        total_plain += plain.distinct_used(n_expert).sum()
        total_gated += gated.distinct_used(n_expert).sum()
    assert moved > 0
    assert total_gated < total_plain


def test_gating_off_is_bit_identical_to_observe(decoders, arch):
    rt = decoders[arch].rt
    batch = TOKENS[:9]
    _fresh(rt)
    rt.hook.observe()
    a = rt.decode(batch, 0, "all")
    _fresh(rt)
    rt.hook.gate(0.0, 8, np.ones(len(batch)))
    b = rt.decode(batch, 0, "all")
    _fresh(rt)
    np.testing.assert_array_equal(a, b)


def test_gated_weights_are_the_unbiased_probabilities(decoders, arch):
    """Moved slots mix with the router's own probability of the new expert (selection-only bias)."""
    rt = decoders[arch].rt
    k = rt.info.n_expert_used
    batch = np.random.default_rng(9).integers(0, 256, size=9).tolist()
    _fresh(rt)
    rt.hook.gate(1.0, k + 1, np.ones(len(batch)))
    rt.decode(batch, 0, "all")
    gated = rt.hook.snapshot(len(batch))
    assert (gated.used != gated.orig).any()
    _fresh(rt)
    # A model whose k covers every expert records every probability.
    info = rt.info
    full = LlamaRuntime(info, n_ctx=128, n_threads=1, int_overrides={f"{info.arch}.expert_used_count": info.n_expert})
    try:
        full.hook.observe()
        full.decode(batch, 0, "all")
        ref = full.hook.snapshot(len(batch))
    finally:
        full.close()
    checked = 0
    for layer in range(1):  # layer 0 sees identical inputs in both models
        for row in range(len(batch)):
            probs = dict(zip(ref.used[layer, row].tolist(), ref.weight[layer, row].tolist()))
            for e, w in zip(gated.used[layer, row].tolist(), gated.weight[layer, row].tolist()):
                assert w == pytest.approx(probs[e], rel=1e-5, abs=1e-7)
                checked += 1
    assert checked == len(batch) * k


def test_missing_routing_tensors_are_reported_not_ignored(tiny_models, monkeypatch):
    """An architecture whose graph has no ffn_moe_weights-N nodes: MoE modes refuse with a clear error."""
    from s2moe.engine.decoding.decoder import Decoder, run
    from s2moe.engine.decoding.generation_config import GenerationConfig
    from s2moe.engine.errors import ModelError

    d = Decoder(str(tiny_models["olmoe"]), n_ctx=128, n_threads=1)
    try:
        monkeypatch.setattr(d.rt.hook, "hooked", lambda: 0)  # as if the callback never met a routing node
        with pytest.raises(ModelError, match="routing tensors"):
            run(d, "hello", GenerationConfig(mode="s2moe", n_predict=4))
        assert run(d, "hello", GenerationConfig(mode="ar", n_predict=4, stop_at_eos=False))[-1].n_tokens == 4
    finally:
        d.close()


@pytest.mark.parametrize("mode", ["observe", "draft", "masked", "gate"])
def test_backend_copies_match_host_copies(decoders, arch, mode):
    """Device buffers (a GPU offload) are read and written through ggml_backend_tensor_get/set. No GPU
    here, so the hook is told to take that path on host buffers: it must compute exactly what direct
    memory access computes. Gating reads full argsort rows, one past the end of the top-k view."""
    rt = decoders[arch].rt
    k = rt.info.n_expert_used
    batch = np.random.default_rng(11).integers(0, 256, size=9).tolist()

    def run(backend_copy: bool):
        rt.hook.force_backend_copy(backend_copy)
        try:
            _fresh(rt)
            if mode == "observe":
                rt.hook.observe()
            elif mode == "draft":
                rt.hook.draft(2)
            elif mode == "masked":  # a draft among allowed experts reads full argsort rows too
                rt.hook.draft(2, np.arange(rt.info.n_expert)[None, :] % 3 != 0)
            else:
                rt.hook.gate(1.0, k + 1, np.linspace(1.0, 0.3, len(batch)))
            logits = rt.decode(batch, 0, "all")
            return logits, rt.hook.snapshot(len(batch))
        finally:
            rt.hook.force_backend_copy(False)
            _fresh(rt)

    # a layer is narrowed only once a graph has shown the hook its down matmul's node
    _fresh(rt)
    rt.hook.observe()
    rt.decode(batch, 0, "none")
    before = rt.hook.narrowed()
    host_logits, host = run(False)
    narrowed = rt.hook.narrowed() - before
    dev_logits, dev = run(True)
    if mode != "observe":
        assert (host.used != host.orig).any()  # the rewrite path really ran
    # On host buffers a draft's expert matmuls run on its k_d slots only (the device path repeats ids, which a
    # GPU does not read twice): the logits must not change by a bit.
    assert (narrowed == rt.info.n_layer) == (mode in ("draft", "masked"))
    assert rt.hook.narrowed() - before == narrowed
    assert rt.hook.unwidened() == 0  # every narrowed view got its slots back at its own down matmul
    np.testing.assert_array_equal(host_logits, dev_logits)
    for field in ("orig", "used", "weight", "rows"):
        np.testing.assert_array_equal(getattr(host, field), getattr(dev, field))
    for a, b in zip(host.preferred, dev.preferred):
        np.testing.assert_array_equal(a, b)


def test_skip_mode_silences_the_routed_experts_of_the_layers_named(decoders, arch):
    """A skipped layer reads only the expert given, with weight 0: which expert that is cannot matter, and
    the other layers route as the router chose."""
    rt = decoders[arch].rt
    tokens = list(range(20, 30))
    outputs = {}
    for mode, expert in (("observe", None), ("skip", 0), ("skip", 5)):
        rt.kv_clear()
        if mode == "observe":
            rt.hook.observe()
        else:
            rt.hook.skip([1], expert)
        outputs[(mode, expert)] = (rt.decode(tokens, 0, "all"), rt.hook.snapshot(len(tokens)))
    rt.kv_clear()
    (plain, seen), (skip0, r0), (skip5, r5) = outputs.values()
    assert np.array_equal(skip0, skip5)
    assert np.abs(plain - skip0).max() > 1e-2
    assert (r0.used[1] == 0).all() and (r5.used[1] == 5).all() and (r5.weight[1] == 0).all()
    assert np.array_equal(r0.used[0], seen.used[0])


def _rows_distinct(ids: np.ndarray) -> bool:
    """No row of any layer names one expert twice."""
    s = np.sort(ids, axis=-1)
    return not (s[..., 1:] == s[..., :-1]).any()


@pytest.mark.parametrize("mode", ["draft", "skip"])
def test_distinct_ids_leave_the_output_unchanged_and_name_no_expert_twice(decoders, arch, mode):
    """Where MUL_MAT_ID may run on a GPU (CUDA aborts on an id repeated within a row), the slots a draft
    or a skipped layer would fill by repeating an id take other experts with the dropped weight. The
    logits must be bit-identical to the repeating fill; below the row threshold the repeats stay (on the
    CPU they cost nothing, distinct fillers would be read)."""
    rt = decoders[arch].rt
    k = rt.info.n_expert_used
    assert k > 2  # a draft keeping 2 leaves slots to fill
    batch = np.random.default_rng(5).integers(0, 256, size=6).tolist()

    def run(min_rows: int):
        rt.hook.distinct_from(min_rows)
        try:
            _fresh(rt)
            rt.hook.draft(2) if mode == "draft" else rt.hook.skip([1], 3)
            return rt.decode(batch, 0, "all"), rt.hook.snapshot(len(batch))
        finally:
            rt.hook.distinct_from(0)
            _fresh(rt)

    rep_logits, rep = run(0)
    dis_logits, dis = run(1)
    below_logits, below = run(len(batch) + 1)
    assert not _rows_distinct(rep.used[:, : len(batch)])  # the repeating fill really repeats
    assert _rows_distinct(dis.used[:, : len(batch)])
    np.testing.assert_array_equal(rep_logits, dis_logits)
    np.testing.assert_array_equal(below.used, rep.used)
    np.testing.assert_array_equal(below_logits, rep_logits)
    if mode == "draft":
        # kept slots are the router's top-2; fillers come from what the batch already reads where it can
        np.testing.assert_array_equal(dis.used[:, :, :2], rep.used[:, :, :2])
        for layer in range(rt.info.n_layer):
            rows = dis.used[layer, : len(batch)]
            pool = set(rows[:, :2].ravel().tolist())
            for row in rows:
                fillers = row[2:].tolist()
                spare = pool - set(row[:2].tolist())
                assert set(fillers[: min(len(spare), k - 2)]) <= spare
        assert (dis.weight[:, : len(batch), 2:] == rep.weight[:, : len(batch), 2:]).all()
    else:
        assert (dis.used[1, : len(batch), 0] == 3).all() and (dis.weight[1] == 0).all()
        np.testing.assert_array_equal(dis.used[0], rep.used[0])


# -- drafts from resident experts (a residency mask) ------------------------------------------------------
def _full_ranking(info, batch):
    """The router's whole ranking and every probability at layer 0 (identical inputs in any model): the
    same model loaded with k = n_expert."""
    full = LlamaRuntime(info, n_ctx=128, n_threads=1, int_overrides={f"{info.arch}.expert_used_count": info.n_expert})
    try:
        full.hook.observe()
        full.decode(batch, 0, "all")
        return full.hook.snapshot(len(batch))
    finally:
        full.close()


def _masked_draft(rt, batch, k_d, allowed):
    _fresh(rt)
    rt.hook.draft(k_d, allowed)
    try:
        return rt.decode(batch, 0, "all"), rt.hook.snapshot(len(batch))
    finally:
        _fresh(rt)


def test_masked_draft_keeps_the_best_ranked_allowed_experts(decoders, arch):
    """Each token keeps, in rank order, the router's best k_d among the allowed experts, each weighing the
    router's probability of it; the spare slots repeat kept ids with weight 0; orig stays the router's top-k."""
    rt = decoders[arch].rt
    k, n_expert, k_d = rt.info.n_expert_used, rt.info.n_expert, 2
    batch = np.random.default_rng(3).integers(0, 256, size=9).tolist()
    allowed = np.zeros((rt.info.n_layer, n_expert), bool)
    allowed[:, 1::2] = True  # half of the experts, at least k_d per layer
    _fresh(rt)
    rt.hook.draft(k_d)
    rt.decode(batch, 0, "all")
    router = rt.hook.snapshot(len(batch))
    logits, masked = _masked_draft(rt, batch, k_d, allowed)
    before = rt.hook.mask_fallbacks()
    ref = _full_ranking(rt.info, batch)
    assert rt.hook.mask_fallbacks() == before
    moe = masked.rows > 0
    assert moe.any()
    kept = masked.used[moe][..., :k_d]
    assert allowed[np.nonzero(moe)[0][:, None, None], kept].all()  # only allowed experts in kept slots
    assert (masked.weight[moe][..., k_d:] == 0).all()
    np.testing.assert_array_equal(masked.used[moe][..., k_d:], np.tile(kept, (1, 1, k))[..., : k - k_d])
    np.testing.assert_array_equal(masked.orig[0], router.orig[0])  # layer 0: the same router input
    for row in range(len(batch)):
        ranking = ref.used[0, row].tolist()
        best = [e for e in ranking if allowed[0, e]][:k_d]
        assert masked.used[0, row, :k_d].tolist() == best
        probs = dict(zip(ranking, ref.weight[0, row].tolist()))
        for e, w in zip(best, masked.weight[0, row, :k_d].tolist()):
            assert w == pytest.approx(probs[e], rel=1e-5, abs=1e-7)
    assert (masked.used[moe][..., :k_d] != router.used[moe][..., :k_d]).any()  # the mask really moved choices
    assert np.isfinite(logits).all()


def test_masked_draft_with_every_expert_allowed_is_the_router_draft(decoders, arch):
    rt = decoders[arch].rt
    batch = TOKENS[:9]
    for k_d in (1, 2):
        _fresh(rt)
        rt.hook.draft(k_d)
        plain = rt.decode(batch, 0, "all")
        r = rt.hook.snapshot(len(batch))
        before = rt.hook.mask_fallbacks()
        logits, m = _masked_draft(rt, batch, k_d, np.ones((rt.info.n_layer, rt.info.n_expert), bool))
        assert rt.hook.mask_fallbacks() == before
        np.testing.assert_array_equal(plain, logits)
        for field in ("orig", "used", "weight", "rows"):
            np.testing.assert_array_equal(getattr(r, field), getattr(m, field))


def test_masked_draft_takes_the_router_choice_where_too_few_are_allowed(decoders, arch):
    """One allowed expert per layer with k_d = 2: it takes slot 0 and the router's best other expert slot 1,
    counted as a fallback per token and layer. None allowed: the router's own draft, bit for bit."""
    rt = decoders[arch].rt
    k_d, n_layer, n_expert = 2, rt.info.n_layer, rt.info.n_expert
    batch = TOKENS[:7]
    _fresh(rt)
    rt.hook.draft(k_d)
    plain = rt.decode(batch, 0, "all")
    router = rt.hook.snapshot(len(batch))
    one = np.zeros((n_layer, n_expert), bool)
    one[:, 5] = True
    before = rt.hook.mask_fallbacks()
    _, m = _masked_draft(rt, batch, k_d, one)
    moe = m.rows > 0
    assert rt.hook.mask_fallbacks() - before == int(m.rows[moe].sum())
    assert (m.used[moe][..., 0] == 5).all()
    ref = _full_ranking(rt.info, batch)
    for row in range(len(batch)):
        assert m.used[0, row, 1] == next(e for e in ref.used[0, row] if e != 5)
    before = rt.hook.mask_fallbacks()
    logits, none = _masked_draft(rt, batch, k_d, np.zeros((n_layer, n_expert), bool))
    assert rt.hook.mask_fallbacks() - before == k_d * int(none.rows[moe].sum())
    np.testing.assert_array_equal(plain, logits)
    np.testing.assert_array_equal(router.used, none.used)
    np.testing.assert_array_equal(router.weight, none.weight)


def test_masked_draft_never_reads_an_expert_the_mask_leaves_out(tmp_path, arch):
    """NaN-poison, per layer, the expert the router ranks first for the first token: the router's draft
    reads it (not numbers), a draft whose mask leaves it out stays finite."""
    spec = variant_spec(arch, n_layer=3, n_expert=16, k=6, seed=11)
    clean = write_tiny(tmp_path / "clean.gguf", spec)
    tokens = TOKENS[:4]
    rt = LlamaRuntime(read_model_info(clean), n_ctx=128, n_threads=1)
    try:
        rt.hook.draft(1)
        rt.decode(tokens, 0, "all")
        r = rt.hook.snapshot(len(tokens))
    finally:
        rt.close()
    moe = [layer for layer in range(spec.n_layer) if r.rows[layer] > 0]
    spec.poison = [(layer, int(r.orig[layer, 0, 0])) for layer in moe]
    poisoned = write_tiny(tmp_path / "poisoned.gguf", spec)
    allowed = np.ones((spec.n_layer, spec.n_expert), bool)
    for layer, expert in spec.poison:
        allowed[layer, expert] = False
    rt = LlamaRuntime(read_model_info(poisoned), n_ctx=128, n_threads=1)
    try:
        rt.hook.draft(1, allowed)
        logits = rt.decode(tokens, 0, "all")
        m = rt.hook.snapshot(len(tokens))
        rt.kv_clear()
        rt.hook.draft(1)
        with pytest.raises(ModelError, match="not numbers"):
            rt.decode(tokens, 0, "all")
    finally:
        rt.close()
    assert np.isfinite(logits).all()
    for layer, expert in spec.poison:
        assert (m.used[layer, : len(tokens)] != expert).all()


def test_masked_draft_with_distinct_ids_names_no_expert_twice(decoders, arch):
    """The masked draft's spare slots take other experts where ids must be distinct (CUDA), among the allowed
    ones (fillers are read too): the same output."""
    rt = decoders[arch].rt
    batch = np.random.default_rng(8).integers(0, 256, size=6).tolist()
    allowed = np.zeros((rt.info.n_layer, rt.info.n_expert), bool)
    allowed[:, :5] = True
    rep_logits, rep = _masked_draft(rt, batch, 2, allowed)
    rt.hook.distinct_from(1)
    try:
        dis_logits, dis = _masked_draft(rt, batch, 2, allowed)
    finally:
        rt.hook.distinct_from(0)
    assert _rows_distinct(dis.used[:, : len(batch)])
    np.testing.assert_array_equal(rep_logits, dis_logits)
    np.testing.assert_array_equal(dis.used[:, :, :2], rep.used[:, :, :2])
    moe = dis.rows > 0
    assert allowed[np.nonzero(moe)[0][:, None, None], dis.used[moe]].all()  # fillers from the allowed too


# -- gating toward the experts in memory -------------------------------------------------------------------
def _one_row_decodes(rt, tokens, gate):
    """Each token decoded alone at position 0 (so every row sees the same inputs in both arms)."""
    routes, logits = [], []
    for t in tokens:
        _fresh(rt)
        gate()
        logits.append(rt.decode([t], 0, "all"))
        routes.append(rt.hook.snapshot(1))
    _fresh(rt)
    return routes, logits


def test_memory_gating_moves_a_single_row_only_onto_experts_in_memory(decoders, arch):
    """A plain step's one row has no batch to share experts with: its borderline choices move onto the
    experts the mask says are in memory, only those outside it are given up, and fewer are read from outside."""
    rt = decoders[arch].rt
    info = rt.info
    rng = np.random.default_rng(3)
    in_memory = rng.random((info.n_layer, info.n_expert)) < 0.5
    tokens = rng.integers(0, 256, size=12).tolist()
    plain, _ = _one_row_decodes(rt, tokens, rt.hook.observe)
    gated, logits = _one_row_decodes(
        rt, tokens, lambda: rt.hook.gate(0.0, info.n_expert_used, [1.0], memory=1.0, in_memory=in_memory)
    )
    moved = outside_plain = outside_gated = 0
    for p, g in zip(plain, gated):
        np.testing.assert_array_equal(g.orig[0], p.orig[0])  # layer 0 routes identical inputs
        for layer in range(info.n_layer):
            before, after = set(g.orig[layer, 0].tolist()), set(g.used[layer, 0].tolist())
            mem = set(np.flatnonzero(in_memory[layer]).tolist())
            assert len(after) == info.n_expert_used
            assert after - before <= mem  # new choices are in memory
            assert before - after <= before - mem  # only experts out of memory are given up
            moved += len(after - before)
            outside_gated += len(after - mem)
        outside_plain += sum(
            len(set(p.used[layer, 0].tolist()) - set(np.flatnonzero(in_memory[layer]).tolist()))
            for layer in range(info.n_layer)
        )
    assert all(np.isfinite(x).all() for x in logits)
    assert moved > 0
    assert outside_gated < outside_plain


@pytest.mark.parametrize("mask", ["all", "none", "unknown"])
def test_memory_gating_with_every_expert_or_none_in_memory_is_bit_identical_to_observe(decoders, arch, mask):
    """All in memory (nothing to prefer), none, or no way to tell (no mask, no prefetcher routed): unchanged."""
    rt = decoders[arch].rt
    info = rt.info
    in_memory = {
        "all": np.ones((info.n_layer, info.n_expert), bool),
        "none": np.zeros((info.n_layer, info.n_expert), bool),
        "unknown": None,
    }[mask]
    _, plain = _one_row_decodes(rt, TOKENS[:6], rt.hook.observe)
    _, gated = _one_row_decodes(
        rt, TOKENS[:6], lambda: rt.hook.gate(0.0, info.n_expert_used, [1.0], memory=2.0, in_memory=in_memory)
    )
    for a, b in zip(plain, gated):
        np.testing.assert_array_equal(a, b)


def test_a_gate_without_memory_forgets_the_previous_memory_preference(decoders, arch):
    rt = decoders[arch].rt
    info = rt.info
    in_memory = np.random.default_rng(4).random((info.n_layer, info.n_expert)) < 0.5
    _, plain = _one_row_decodes(rt, TOKENS[:6], rt.hook.observe)
    _one_row_decodes(
        rt, TOKENS[:6], lambda: rt.hook.gate(0.0, info.n_expert_used, [1.0], memory=1.0, in_memory=in_memory)
    )
    _, again = _one_row_decodes(rt, TOKENS[:6], lambda: rt.hook.gate(0.0, info.n_expert_used, [1.0]))
    for a, b in zip(plain, again):
        np.testing.assert_array_equal(a, b)


def test_uniform_routing_reads_expert_zero_alone_whatever_the_mode(tmp_path, arch):
    """A warm-up's uniform routing: with every expert but 0 NaN-poisoned in every layer, decodes in every mode
    stay finite inside it (no other expert is read) and the poison shows the moment it ends."""
    spec = variant_spec(arch, n_layer=2, n_expert=8, k=4, seed=3)
    spec.poison = [(layer, e) for layer in range(spec.n_layer) for e in range(1, spec.n_expert)]
    rt = LlamaRuntime(read_model_info(write_tiny(tmp_path / "poisoned.gguf", spec)), n_ctx=128, n_threads=1)
    try:
        with rt.hook.uniform():
            for mode in ("off", "observe", "draft", "gate"):
                rt.kv_clear()
                if mode == "draft":
                    rt.hook.draft(2)
                elif mode == "gate":
                    rt.hook.gate(1.0, 4, np.ones(16, np.float32))
                else:
                    getattr(rt.hook, mode)()
                assert np.isfinite(rt.decode(TOKENS[:6], 0, "all")).all(), mode
            assert (rt.hook.snapshot(6).used == 0).all()
        rt.kv_clear()
        rt.hook.observe()
        with pytest.raises(ModelError, match="not numbers"):
            rt.decode(TOKENS[:6], 0, "all")
    finally:
        rt.close()


def test_the_weights_are_mapped_from_the_file(tiny_models):
    """Offloading manages the file's pages: the load maps the file."""
    rt = LlamaRuntime(read_model_info(tiny_models["olmoe"]), n_ctx=64, n_threads=1, install_hook=False)
    try:
        assert rt.file_mappings and sum(length for _, length, _ in rt.file_mappings) > 0
    finally:
        rt.close()


@pytest.mark.parametrize("backend_copy", [False, True])
def test_pregating_predicts_with_each_router_and_its_recall_is_the_recorded_routings(decoders, arch, backend_copy):
    """Pre-gating applies later layers' routers to a layer's input hidden state. Applied to the layer's own
    router (distance 0) it must name exactly what the layer then reads: the hidden state, the norm before the
    router, the router and any selection bias are the ones llama.cpp uses. Its running recall at every distance
    is the one computed here from each step's recorded routing and predictions, and it changes no logit. Also
    where the hidden state is read as from a device buffer."""
    rt = decoders[arch].rt
    rt.hook.force_backend_copy(backend_copy)
    k, n_layer = rt.info.n_expert_used, rt.info.n_layer
    steps = TOKENS[4:12]

    def run(pregate: bool):
        _fresh(rt)
        rt.hook.pregate(2 if pregate else 0, check_self=pregate)
        rt.hook.observe()
        rt.decode(TOKENS[:4], 0, "all")
        logits, recorded = [], []
        for i, token in enumerate(steps):
            logits.append(rt.decode([token], 4 + i, "all"))
            recorded.append((rt.hook.snapshot(1).used[:, 0, :], rt.hook.predicted.copy()))
        return np.concatenate(logits), recorded

    try:
        plain, _ = run(False)
        before = rt.hook.pregate_stats()
        pregated, recorded = run(True)
        after = rt.hook.pregate_stats()
    finally:
        rt.hook.pregate(0)
        rt.hook.force_backend_copy(False)
        _fresh(rt)
    np.testing.assert_array_equal(plain, pregated)
    hits, total = np.zeros(3, int), np.zeros(3, int)
    for used, predicted in recorded:
        for d in range(3):
            for layer in range(n_layer):
                if predicted[d, layer, 0] >= 0:
                    hits[d] += len(set(predicted[d, layer]) & set(used[layer]))
                    total[d] += k
    assert after.decodes - before.decodes == len(steps)
    # every layer predicts itself; the first layer cannot be predicted ahead, nor the first two two ahead
    assert list(total) == [len(steps) * n_layer * k, len(steps) * (n_layer - 1) * k, len(steps) * (n_layer - 2) * k]
    np.testing.assert_array_equal(after.hits[:3] - before.hits[:3], hits)
    np.testing.assert_array_equal(after.total[:3] - before.total[:3], total)
    assert hits[0] == total[0]


def test_an_empty_batch_decodes_nothing_and_has_no_logits(decoders):
    rt = decoders["olmoe"].rt
    rt.kv_clear()
    assert rt.decode([], 0, "none") is None
    for outputs in ("last", "all"):
        with pytest.raises(ValueError, match="empty batch"):
            rt.decode([], 0, outputs)
    assert rt.kv_end() == 0
