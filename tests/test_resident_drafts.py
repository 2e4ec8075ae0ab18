"""Drafts from resident experts under a memory budget: how the utility rule prices them, and what the decoder
records. (The hook's masked draft: test_engine_hook.py; the mask filled under a real budget: test_offload.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from s2moe.engine.decoding.decoder import Decoder, run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.drafting.stoprules import UtilityStop, rule_cost
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Started
from s2moe.engine.measure.costmodel import measure_cost_constants
from s2moe.engine.profile_schema import validate_profile
from s2moe.engine.profiles import cost_for_model

FINGERPRINT = "d09f3c78bdbddbd4"


def _profile(c_draft_cold_ms: float) -> dict:
    """A measured profile as calibrate writes it under a budget: steps and fits measured resident and cold."""
    block = {
        "model": "widened.gguf",
        "arch": "olmoe",
        "n_layer": 6,
        "n_expert": 64,
        "n_expert_used": 8,
        "expert_bytes": 1_750_000,
        "draft_topk": 2,
        "t_ar_ms": 6.1,
        "c_draft_ms": 3.2,
        "t_exp_ms": 0.09,
        "t_exp_cold_ms": 1.2,
        "t_tok_ms": 1.9,
        "intercept_ms": 0.0,
        "fit": {"intercept_ms": 0.0, "t_exp_ms": 0.09, "t_tok_ms": 1.9, "r2": 0.99, "mape": 0.04, "n": 27},
        "fit_cold": {"intercept_ms": 0.0, "t_exp_ms": 1.0, "t_tok_ms": 0.9, "r2": 0.5, "mape": 0.3, "n": 81},
        "t_ar_cold_ms": 55.0,
        "c_draft_cold_ms": c_draft_cold_ms,
    }
    return validate_profile(
        {
            "schema": 1,
            "name": "test",
            "kind": "measured",
            "device": {"name": "test", "kind": "cpu"},
            "models": {FINGERPRINT: block},
        }
    )


def test_under_a_budget_a_resident_draft_is_priced_at_the_draft_step_measured_in_memory():
    """A draft that fetches its experts costs (here) more than the plain step it could save: the rule cannot
    pay. A draft from resident experts costs the draft step measured with the model in memory: it can."""
    cost = cost_for_model(_profile(c_draft_cold_ms=60.0), FINGERPRINT, offloaded=True)
    assert cost.c_draft == pytest.approx(0.060) and cost.c_draft_resident == pytest.approx(0.0032)
    router = UtilityStop(rule_cost(cost, "router"))
    resident = UtilityStop(rule_cost(cost, "resident"))
    assert not router.worth_drafting() and not router.decision.can_pay
    assert resident.worth_drafting() and resident.decision.can_pay
    assert resident.decision.c_draft == pytest.approx(0.0032)
    assert resident.decision.t_ar == router.decision.t_ar == pytest.approx(0.055)  # a plain step under the budget
    # the verification side is priced the same either way
    assert rule_cost(cost, "resident").verify_cost(40, 3) == cost.verify_cost(40, 3)


def test_a_resident_draft_cost_that_is_not_known_prices_drafts_as_measured():
    cost = cost_for_model(_profile(c_draft_cold_ms=60.0), FINGERPRINT, offloaded=True)
    unknown = cost.__class__(**{**cost.__dict__, "c_draft_resident": None})
    assert rule_cost(unknown, "resident") == unknown


def test_resident_runs_draft_with_the_routers_choice_and_say_so(tiny_models):
    """Without a budget (no observer of what is in memory) every draft reads the router's top-k_d, whatever
    the setting, and the Started event records what ran."""
    d = Decoder(str(tiny_models["olmoe"]), n_ctx=256, n_threads=1)
    try:
        base = GenerationConfig(mode="s2moe", n_predict=12, utility=False, stop_at_eos=False)
        events = {
            which: run(d, "hello there", GenerationConfig(**{**base.__dict__, "draft_experts": which}))
            for which in (None, "resident", "router")
        }
        for evs in events.values():
            assert next(e for e in evs if isinstance(e, Started)).config["draft_experts"] == "router"
        tokens = {w: evs[-1].tokens for w, evs in events.items()}
        assert tokens[None] == tokens["resident"] == tokens["router"]
    finally:
        d.close()


def test_draft_experts_must_be_resident_or_router():
    with pytest.raises(ConfigError, match="resident, router") as e:
        GenerationConfig(draft_experts="pinned").validate()
    assert e.value.option == "draft_experts"


def test_start_up_measurement_times_drafts_among_the_allowed_experts(decoders):
    """Asked for it (under a budget), the start-up measurement times draft steps that read only what the
    function allows, asking it before each step."""
    rt = decoders["olmoe"].rt
    asked = []

    def allowed():
        asked.append(1)
        mask = np.zeros((rt.info.n_layer, rt.info.n_expert), bool)
        mask[:, :3] = True
        return mask

    before = rt.hook.mask_fallbacks()
    cost, _ = measure_cost_constants(rt, 2, 4, repeats=1, draft_allowed=allowed)
    assert len(asked) == 4 + 2  # the timed steps and the two warm-up steps
    assert cost.c_draft_resident > 0 and rt.hook.mask_fallbacks() == before
    plain, _ = measure_cost_constants(rt, 2, 4, repeats=1)
    assert plain.c_draft_resident == plain.c_draft


def test_bench_names_what_each_chain_drafted_from(decoders):
    """bench runs s2moe and its resident-drafting variant interleaved; each self-drafting row says what its
    drafts read (here, with no budget, every draft reads the router's choice), ar says nothing."""
    from s2moe.engine.measure.bench import run_bench
    from s2moe.engine.measure.bench_results import BenchDone

    d = decoders["olmoe"]
    events = list(
        run_bench(
            str(d.info.path),
            prompts=["def add(a, b):"],
            modes=["ar", "s2moe", "s2moe:resident"],
            n_tokens=8,
            decoder=d,
            warmup=False,
        )
    )
    done = next(e for e in events if isinstance(e, BenchDone))
    rows = {r.mode: r for r in done.rows}
    assert rows["ar"].draft_experts is None
    assert rows["s2moe"].draft_experts == rows["s2moe:resident"].draft_experts == "router"
    assert done.config["draft_experts"] == "router"


def test_bench_modes_take_what_their_drafts_read():
    """Any mode or ladder rung that drafts from the model's own experts takes :resident or :router; the rung's
    own settings stay; a mode that does not draft from them, or another suffix, is refused by name."""
    from s2moe.engine.measure.bench import expected_lossless, mode_config

    base = GenerationConfig()
    chain = mode_config("+shared-kv:resident", base)
    assert (chain.mode, chain.utility, chain.reuse_strength, chain.draft_experts) == ("s2moe", False, 0.0, "resident")
    assert mode_config("tree:router", base).draft_experts == "router"
    assert mode_config("conf:resident", base).mode == "conf" and mode_config("conf", base).draft_experts is None
    assert expected_lossless("conf:resident", mode_config("conf:resident", base))
    assert not expected_lossless("s2moe:resident", mode_config("s2moe:resident", base))  # gated verification
    exact = mode_config("-gating", base)  # s2moe with gating off: its copies and drafts keep ar's tokens
    assert (exact.mode, exact.reuse_strength, exact.lookup, exact.lookup_session) == ("s2moe", 0.0, True, True)
    assert expected_lossless("-gating", exact) and not expected_lossless("s2moe", mode_config("s2moe", base))
    for bad in ("ar:router", "lookup:resident", "base:router", "s2moe:pinned", "s2moe:", "fast"):
        with pytest.raises(ConfigError, match="unknown mode"):
            mode_config(bad, base)
