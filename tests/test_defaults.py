"""Settings no flag gives follow the model's routing: k_d, the draft cap and |E*| for top-1/2/4/8 models, every
mode with default settings on a top-2 model (CLI, bench, app session), and the one-line error for an explicit
value that cannot work."""

from __future__ import annotations

import json

import pytest
from conftest import variant_spec
from s2moe.engine.decoding.decoder import Decoder, run
from s2moe.engine.decoding.generation_config import GenerationConfig, RoutingDefaults, defaults_for, routing_defaults
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Finished, Iteration, Started
from s2moe.engine.model_info import read_model_info
from s2moe.engine.modes import MODES, MOE_MODES
from test_cli import assert_clean_error, s2moe
from test_engine_decoding import assert_ar_is_llama_cpp
from tinygguf import write_tiny

# (experts, experts per token) → (k_d, draft cap, |E*|)
EXPECTED = {(16, 8): (2, 8, 15), (8, 4): (1, 8, 7), (8, 2): (1, 8, 4), (8, 1): (1, 8, 2), (64, 8): (2, 8, 16)}


@pytest.fixture(scope="module")
def routed_models(tmp_path_factory):
    """Tiny models with top-1, top-2, top-4 and top-8 routing."""
    root = tmp_path_factory.mktemp("routing")
    return {
        (n, k): write_tiny(root / f"top{k}.gguf", variant_spec("olmoe", n_layer=2, n_expert=n, k=k, seed=11))
        for n, k in EXPECTED
        if n <= 16
    }


@pytest.fixture(scope="module")
def top2(routed_models):
    d = Decoder(str(routed_models[(8, 2)]), n_ctx=256, n_threads=1)
    yield d
    d.close()


def test_the_rule_for_each_routing():
    for (n, k), want in EXPECTED.items():
        assert routing_defaults(n, k) == RoutingDefaults(*want), (n, k)


def test_models_get_the_defaults_of_their_routing(routed_models):
    for (n, k), path in routed_models.items():
        info = read_model_info(path)
        assert (info.n_expert, info.n_expert_used) == (n, k)
        assert defaults_for(info) == RoutingDefaults(*EXPECTED[(n, k)])
        cfg = GenerationConfig().resolved(info)
        assert (cfg.draft_topk, cfg.draft_max, cfg.reuse_cap) == EXPECTED[(n, k)]


def test_the_shipped_model_keeps_its_settings():
    from s2moe.engine.zoo import default_model_path

    info = read_model_info(default_model_path())
    assert (info.n_expert, info.n_expert_used) == (64, 8)
    cfg = GenerationConfig().resolved(info)
    assert (cfg.draft_topk, cfg.draft_max, cfg.reuse_cap) == (2, 8, 16)


def test_given_values_win_over_the_defaults(routed_models):
    info = read_model_info(routed_models[(16, 8)])
    cfg = GenerationConfig(draft_topk=3, draft_max=5, reuse_cap=9).resolved(info)
    assert (cfg.draft_topk, cfg.draft_max, cfg.reuse_cap) == (3, 5, 9)


def test_ar_gives_llama_cpp_s_own_greedy_tokens_for_every_top_k(routed_models):
    for path in routed_models.values():
        d = Decoder(str(path), n_ctx=256, n_threads=1)
        try:
            assert_ar_is_llama_cpp(d, ["hello there"], 12)
        finally:
            d.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_on_a_top2_model_with_default_settings(top2, mode):
    events = run(top2, "hello there", GenerationConfig(mode=mode, n_predict=6, stop_at_eos=False))
    started = events[0]
    assert isinstance(started, Started)
    assert started.config["draft_topk"] == 1 and started.config["reuse_cap"] == 4  # what it ran with
    assert isinstance(events[-1], Finished) and events[-1].n_tokens == 6
    if mode in ("naive", "cascade"):
        assert any(e.drafted for e in events if isinstance(e, Iteration))


def test_an_explicit_k_d_that_cannot_work_still_errors(top2):
    with pytest.raises(ConfigError) as caught:
        run(top2, "hello", GenerationConfig(mode="s2moe", n_predict=2, draft_topk=2))
    assert caught.value.option == "draft_topk"
    assert (
        caught.value.worded({"draft_topk": "--draft-topk"})
        == "--draft-topk 2 must be below the model's experts per token (2)"
    )


def test_a_top1_model_says_self_speculation_is_impossible(routed_models):
    d = Decoder(str(routed_models[(8, 1)]), n_ctx=256, n_threads=1)
    try:
        for mode in ("ar", "lookup"):
            assert run(d, "hello", GenerationConfig(mode=mode, n_predict=4, stop_at_eos=False))[-1].n_tokens == 4
        for mode in MOE_MODES:
            with pytest.raises(ConfigError, match="single expert: self-speculation is impossible") as caught:
                run(d, "hello", GenerationConfig(mode=mode, n_predict=2))
            assert "modes ar and lookup apply" in str(caught.value)
    finally:
        d.close()


def test_cli_generate_runs_on_a_top2_model_with_default_flags(routed_models):
    model = str(routed_models[(8, 2)])
    done = s2moe(
        "generate",
        "--model",
        model,
        "-p",
        "def merge(a, b):",
        "-n",
        "8",
        "--mode",
        "s2moe",
        "--json",
        "--threads",
        "1",
        "--ignore-eos",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n_tokens"] == 8
    assert_clean_error(
        s2moe("generate", "--model", model, "-p", "x", "--draft-topk", "2"),
        "--draft-topk 2 must be below the model's experts per token (2)",
    )
    assert_clean_error(
        s2moe("generate", "--model", str(routed_models[(8, 1)]), "-p", "x"), "self-speculation is impossible"
    )


def test_cli_bench_runs_on_a_top2_model_with_default_flags(routed_models, tmp_path):
    out = tmp_path / "bench.json"
    done = s2moe(
        "bench",
        "--model",
        str(routed_models[(8, 2)]),
        "--prompts",
        "natural",
        "--n-prompts",
        "1",
        "-n",
        "6",
        "--threads",
        "1",
        "--no-quality",
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["config"]["draft_topk"] == 1 and data["config"]["draft_max"] == 8
    assert {r["mode"] for r in data["results"]} >= {"ar", "naive", "conf", "cascade", "lookup", "s2moe"}


def test_app_settings_follow_the_model(routed_models):
    from s2moe.app.tui.chat_settings import ChatSettings
    from s2moe.app.tui.session import EngineSession

    session = EngineSession(str(routed_models[(8, 2)]), n_threads=1, n_ctx=256)
    try:
        model = session.load()
        assert ChatSettings().describe(model).startswith("s2moe · k_d=1 ·")
        # what the settings bar shows is what runs: a profile's tuned values where the chat sets none
        tuned = {"draft_topk": 3, "reuse_strength": 0.25}
        assert ChatSettings().describe(model, tuned).startswith("s2moe · k_d=3 · utility on · gating 0.25")
        assert ChatSettings(draft_topk=1).describe(model, tuned).startswith("s2moe · k_d=1 ·")
        for mode in MODES:
            events = []
            session.generate("hello", ChatSettings(mode=mode, n_predict=4), lambda e, v, seen=events: seen.append(e))
            assert isinstance(events[-1], Finished) and events[-1].n_tokens >= 1, mode
        with pytest.raises(ConfigError):
            session.config(ChatSettings(draft_topk=2))
    finally:
        session.close()


def test_a_model_read_again_is_not_parsed_again_unless_it_changed(tmp_path, monkeypatch):
    from s2moe.engine import model_info
    from s2moe.engine.model_info import read_model_info
    from tinygguf import TinySpec, write_tiny

    path = write_tiny(tmp_path / "m.gguf", TinySpec(arch="olmoe", n_expert=8, k=4, seed=1))
    first = read_model_info(path)
    parsed = []
    with monkeypatch.context() as m:
        m.setattr(model_info, "_parse", lambda *a: parsed.append(a) or first)
        assert read_model_info(str(path)) == first and not parsed  # read again: the same, from memory
    # rewritten in place with other metadata of the same size: parsed afresh
    write_tiny(path, TinySpec(arch="olmoe", n_expert=8, k=2, seed=1))
    assert read_model_info(path).n_expert_used == 2
