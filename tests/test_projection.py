"""The projection's replay on a hand-made trace whose answers are known, and `s2moe project` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from s2moe.app.cli import main
from s2moe.engine.events import ForcedDraft
from s2moe.engine.projection import ExpertCache, project
from s2moe.engine.trace import Drafted, Trace, TraceHeader, TraceStep, write_trace

FP = "0123456789abcdef"
# two layers of four experts, top-2; one expert per layer in a draft pass
R0 = np.array([[0, 1], [0, 1]])
R1 = np.array([[0, 1], [2, 3]])
R2 = np.array([[2, 3], [2, 3]])


def header(**kw) -> TraceHeader:
    base = dict(model="hand", fingerprint=FP, n_layer=2, n_expert=4, k=2, k_d=1, expert_bytes=1000.0,
                non_expert_bytes=0, draft_max=2, n_predict=6, mode="s2moe", threshold=1.0, reuse_strength=0.0,
                conf_p_min=0.5, temperature=0.0, prompt_tokens=3)
    return TraceHeader(**{**base, **kw})


def step(rows, tokens, prob=0.9) -> TraceStep:
    """Both drafted tokens accepted; each drafted token's predicted experts are its own verification row."""
    rows = np.stack(rows)
    drafted = tuple(Drafted(t, prob, prob ** (i + 1), rows[i + 1]) for i, t in enumerate(tokens[:2]))
    return TraceStep(tuple(tokens), 2, drafted, rows[0], rows, rows, 0.0, 0.0, ForcedDraft(True, 2))


def hand_trace(**kw) -> Trace:
    steps = [step([R0, R1, R2], (5, 6, 7)), step([R0, R0, R0], (8, 9, 10))]
    return Trace(header(**kw), steps, n_tokens=6, seconds=1.0, stop="length", name="hand")


def profile(t_ar_ms=10.0, c_draft_ms=2.0, t_tok_ms=3.0, t_exp_ms=1.0, hot=None) -> dict:
    block = {"t_ar_ms": t_ar_ms, "c_draft_ms": c_draft_ms, "t_exp_ms": t_exp_ms, "t_tok_ms": t_tok_ms,
             "intercept_ms": 0.0, "fit": {"intercept_ms": 0.0, "t_exp_ms": t_exp_ms, "t_tok_ms": t_tok_ms},
             "fit_cold_misses": {"t_exp_warm_ms": 1.0, "t_exp_cold_ms": 5.0}, "expert_bytes": 1000}
    if hot:
        block["hot_experts"] = hot
    return {"name": "hand", "kind": "measured", "device": {"storage_bandwidth_gb_s": 1.0}, "models": {FP: block}}


def test_plain_decoding_costs_one_plain_step_per_token():
    p = project([hand_trace()], profile(), modes=["ar"])
    ar = p.modes["ar"]
    assert (ar.tokens, ar.iterations, ar.draft_passes, ar.fetched) == (6, 6, 0, 0)
    assert ar.seconds == pytest.approx(6 * 10e-3)
    assert ar.tok_per_s == pytest.approx(100.0)


def test_a_rule_that_keeps_everything_verifies_the_whole_chain():
    # conf at p_min 0.5 keeps every token of probability 0.9: two draft passes (the last token is not
    # routed), a verification of three tokens, three tokens committed, per iteration
    p = project([hand_trace()], profile(), modes=["conf"])
    c = p.modes["conf"]
    assert (c.tokens, c.iterations, c.drafted, c.accepted, c.draft_passes) == (6, 2, 4, 4, 4)
    # first verification: 8 distinct experts, 4 more than one token's; the second: none more
    assert c.t_verify == pytest.approx((10 + 2 * 3 + 4 * 1) * 1e-3 + (10 + 2 * 3) * 1e-3)
    assert c.t_draft == pytest.approx(4 * 2e-3)
    assert c.speedup == pytest.approx((6 / c.seconds) / 100.0)


def test_the_utility_rule_at_threshold_zero_keeps_everything_and_routes_every_token():
    p = project([hand_trace()], profile(), modes=["s2moe"], threshold=0.0)
    s = p.modes["s2moe"]
    assert (s.tokens, s.iterations, s.drafted, s.draft_passes) == (6, 2, 4, 6)


def test_constants_that_forbid_drafting_make_s2moe_plain_decoding():
    # a certain token saves T_AR 1 ms but costs C_draft 2 + T_tok 3 ms: the rule never drafts
    p = project([hand_trace()], profile(t_ar_ms=1.0), modes=["ar", "s2moe"])
    ar, s = p.modes["ar"], p.modes["s2moe"]
    assert (s.tokens, s.iterations, s.draft_passes, s.drafted) == (6, 6, 0, 0)
    assert s.seconds == pytest.approx(ar.seconds) and s.speedup == pytest.approx(1.0)


def test_a_cache_of_nothing_fetches_every_expert_every_time():
    # 1 MiB: below the plan's slack, so no room for an expert cache; nothing pinned
    p = project([hand_trace()], profile(), budget="1M", modes=["ar"])
    ar = p.modes["ar"]
    assert ar.fetched == 6 * 4  # four experts per token (two layers, top-2)
    assert ar.t_fetch == pytest.approx(24 * 4e-3)  # cold − warm: 5 − 1 ms


def test_a_cache_of_everything_fetches_each_expert_once():
    p = project([hand_trace()], profile(), budget="1G", modes=["ar", "conf"])
    assert p.modes["ar"].fetched == 8  # every expert of both layers, once
    assert p.modes["conf"].fetched == 8


def test_pinned_hot_experts_are_never_fetched():
    hot = [[0, 0], [0, 1], [1, 0], [1, 1]]
    p = project([hand_trace()], profile(hot=hot), budget="1G", modes=["ar"])
    assert p.modes["ar"].fetched == 4  # experts 2 and 3 of each layer
    assert "4 hot experts pinned" in p.budget


def test_the_lru_evicts_the_least_recently_used():
    cache = ExpertCache(4, capacity=2)
    one = lambda layer, e: np.array([[e, -1]] if layer == 0 else [[-1, -1], [e, -1]])  # noqa: E731
    assert cache.access(one(0, 0)) == 1
    assert cache.access(one(0, 1)) == 1
    assert cache.access(one(0, 0)) == 0      # 0 is now the most recent
    assert cache.access(one(0, 2)) == 1      # evicts 1
    assert cache.access(one(0, 0)) == 0
    assert cache.access(one(0, 1)) == 1
    assert cache.access(one(1, 0)) == 1      # another layer, another expert


def test_project_cli_prints_a_labelled_table_and_json(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config"
    (cfg / "s2moe" / "profiles").mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg))
    import yaml

    (cfg / "s2moe" / "profiles" / "hand.yaml").write_text(yaml.safe_dump(profile()))
    write_trace(tmp_path / "a.jsonl", hand_trace())
    assert main(["project", str(tmp_path), "--profile", "hand"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (not a measurement)") and "s2moe" in out and "cascade" in out
    assert all(len(line) <= 80 for line in out.splitlines()[2:])
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "hand", "--modes", "ar", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["modes"]["ar"]["tok_per_s"] == pytest.approx(100.0)
    assert main(["project", str(tmp_path / "a.jsonl"), "--profile", "hand", "--modes", "naive"]) == 2
