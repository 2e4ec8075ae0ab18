"""Decoding traces: recorded by a forced-to-the-cap generation, written and read back, bad files refused."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from s2moe.app.cli import main
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.drafting.stoprules import UtilityStop
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Iteration
from s2moe.engine.measure.trace import TraceRecorder, dumps, read_trace, write_trace
from s2moe.engine.measure.trace_replay import _Source, propose

COST = dict(t_ar=1e-3, c_draft=2e-4, t_exp=1e-5, t_tok=1e-4, intercept=0.0, source="test")


def _cost():
    from s2moe.engine.events import CostConstants

    return CostConstants(**COST)


def record(dec, prompt="the cat sat on the mat and", n=24, mode="s2moe", **kw):
    rec = TraceRecorder(dec.info)
    cfg = GenerationConfig(mode=mode, n_predict=n, stop_at_eos=False, trace=True, cost=_cost(), **kw)
    for ev in dec.generate(prompt, cfg):
        rec.add(ev)
    return rec.trace


def test_a_traced_generation_drafts_to_the_cap_and_records_every_row(decoders):
    dec = decoders["olmoe"]
    tr = record(dec)
    h = tr.header
    assert (h.n_layer, h.n_expert, h.k, h.k_d, h.draft_max) == (dec.info.n_layer, dec.info.n_expert, 4, 1, 8)
    assert h.expert_bytes > 0 and h.non_expert_bytes > 0 and h.cost["t_ar"] == COST["t_ar"]
    assert sum(len(s.committed) for s in tr.steps) == tr.n_tokens == 24
    for s in tr.steps:
        room = h.n_predict - sum(len(x.committed) for x in tr.steps[: tr.steps.index(s)]) - 1
        assert len(s.drafted) == min(h.draft_max, room)  # the cap, whatever the rule said
        assert s.rows.shape == (len(s.drafted) + 1, h.n_layer, h.k)
        assert (s.rows >= 0).all() and (s.rows < h.n_expert).all()
        assert s.accepted <= len(s.drafted)
    drafting = [s for s in tr.steps if s.drafted]
    assert drafting and all(s.pending is not None and s.would is not None for s in drafting)
    # reuse gating moved some verification rows away from the router's choice
    assert any(not np.array_equal(s.rows, s.gated) for s in tr.steps)


def test_what_the_trace_says_the_rule_would_keep_is_what_the_rule_keeps(decoders):
    """First iteration of a plain s2moe run and of a traced one: same position, a fresh rule on each side,
    the same draft passes; the traced draft runs on, but records the real rule's decision."""
    dec = decoders["qwen3moe"]
    cost = replace(_cost(), source="test-would")  # rules are kept by constants: a fresh one
    cfg = GenerationConfig(mode="s2moe", n_predict=12, stop_at_eos=False, cost=cost, reuse_strength=0.0)
    plain = next(e for e in dec.generate("one two three four", cfg) if isinstance(e, Iteration))
    traced = next(e for e in dec.generate("one two three four", replace(cfg, trace=True)) if isinstance(e, Iteration))
    assert traced.forced.would_draft == (plain.draft_stop != "no-draft")
    assert traced.forced.would_keep == len(plain.drafted)
    assert len(traced.drafted) == 8


def test_replaying_the_recorded_rule_reproduces_its_decision(decoders):
    dec = decoders["dots1"]
    tr = record(dec, reuse_strength=0.0)
    step = tr.steps[0]
    rule = UtilityStop(_cost(), 1.0)
    rule.start()
    out = propose(rule, _Source(step, 0), tr.header.draft_max, tr.header.k_d, tr.header.n_expert)
    assert (len(out.tokens), out.stop != "no-draft") == (step.would.would_keep, step.would.would_draft)


def test_round_trip(decoders, tmp_path):
    tr = record(decoders["olmoe"], mode="conf")
    path = tmp_path / "t.jsonl"
    write_trace(path, tr)
    back = read_trace(path)
    assert back.header == tr.header
    assert back.header.prompt == tuple(decoders["olmoe"].tokenize("the cat sat on the mat and"))
    assert (back.n_tokens, back.stop, back.prefill) == (tr.n_tokens, tr.stop, tr.prefill) and tr.prefill > 0
    assert len(back.steps) == len(tr.steps)
    for a, b in zip(tr.steps, back.steps):
        assert a.committed == b.committed and a.accepted == b.accepted and a.would == b.would
        assert np.array_equal(a.rows, b.rows) and np.array_equal(a.gated, b.gated)
        assert (a.pending is None) == (b.pending is None)
        assert [(d.token, d.prob, d.chain) for d in a.drafted] == [(d.token, d.prob, d.chain) for d in b.drafted]
        assert all(np.array_equal(x.predicted, y.predicted) for x, y in zip(a.drafted, b.drafted))
    assert dumps(back) == dumps(tr)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_budgeted_trace_takes_the_disk_read_around_its_run_and_keeps_the_rest(decoders, tmp_path):
    from s2moe.engine.measure.trace import record_storage

    tr = record(decoders["olmoe"], mode="conf", n=8)
    ran = {"auto": True, "budget_bytes": 1 << 30, "hot_bytes": 0, "cache_bytes": 0, "pinned": [[0, 1]]}
    budgeted, resident = tmp_path / "budget-auto-000.jsonl", tmp_path / "resident-000.jsonl"
    write_trace(budgeted, tr.with_budget(ran))
    write_trace(resident, tr)
    reading = {"qd1_gb_s": 0.7, "qd8_gb_s": 1.2, "readings": 6}
    record_storage([budgeted, resident], reading)
    back = read_trace(budgeted)
    assert back.header.budget == {**ran, "storage": reading}
    assert dumps(back) == dumps(tr.with_budget({**ran, "storage": reading}))
    assert read_trace(resident).header.budget is None  # resident: no disk to price


def test_a_trace_needs_a_drafting_mode():
    with pytest.raises(ConfigError, match="cannot record"):
        GenerationConfig(mode="ar", trace=True).validate()


def _lines(decoders):
    return dumps(record(decoders["olmoe"], n=10)).splitlines()


def _bad_cases(lines):
    header = json.loads(lines[0])
    step = json.loads(lines[1])
    yield "not valid JSON", [lines[0], "{"] + lines[2:]
    yield "no end record", lines[:-1]
    yield "not an s2moe trace", [json.dumps({"x": 1})] + lines[1:]
    yield "missing field k_d", [json.dumps({k: v for k, v in header.items() if k != "k_d"})] + lines[1:]
    yield "holds", [lines[0], json.dumps({**step, "rows": ["AAAA"] + step["rows"][1:]})] + lines[2:]
    yield "not base64", [lines[0], json.dumps({**step, "pending": "!!"})] + lines[2:]
    yield "exceeds", [lines[0], json.dumps({**step, "accepted": 99})] + lines[2:]
    # JSON's integers of thousands of digits (below Python's 4,300) are no float, nor shown whole
    yield (
        "field t_draft must be a number in [0, inf], got a number of 4001 digits",
        [lines[0], json.dumps({**step, "t_draft": 10**4000})] + lines[2:],
    )
    yield "after the end record", lines + [lines[1]]
    yield "end record says", lines[:-1] + [json.dumps({"end": {"n_tokens": 999, "seconds": 1.0, "stop": "x"}})]
    yield "field draft_experts must be one of", [json.dumps({**header, "draft_experts": "pinned"})] + lines[1:]
    ran = {"auto": True, "budget_bytes": 1 << 30, "hot_bytes": 0, "cache_bytes": 0, "pinned": []}
    yield (
        "storage field qd8_gb_s must be above 0",
        [json.dumps({**header, "budget": {**ran, "storage": {"qd1_gb_s": 0.5, "qd8_gb_s": 0, "readings": 6}}})]
        + lines[1:],
    )
    yield "field storage must be a mapping", [json.dumps({**header, "budget": {**ran, "storage": 1.2}})] + lines[1:]
    yield "prompt must list the prompt's", [json.dumps({**header, "prompt": header["prompt"][1:]})] + lines[1:]
    yield "a prompt token id must be", [json.dumps({**header, "prompt": [-1] + header["prompt"][1:]})] + lines[1:]
    yield "empty", []


def test_bad_trace_files_are_one_line_and_exit_2(decoders, tmp_path, capsys):
    lines = _lines(decoders)
    for i, (expect, bad) in enumerate(_bad_cases(lines)):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text("\n".join(bad) + ("\n" if bad else ""))
        assert main(["project", str(path), "--profile", "cpu-generic"]) == 2, expect
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err and "Traceback" not in err, (expect, err)
    (tmp_path / "empty-folder").mkdir()
    for path in (tmp_path / "missing.jsonl", tmp_path / "empty-folder", "/dev/zero"):
        assert main(["project", str(path), "--profile", "cpu-generic"]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_generate_writes_a_trace_and_refuses_a_missing_folder(tiny_models, tmp_path, capsys):
    model = str(tiny_models["olmoe"])
    path = tmp_path / "g.jsonl"
    assert main(["generate", "-m", model, "-p", "hello there", "-n", "8", "--ignore-eos", "--trace", str(path)]) == 0
    tr = read_trace(path)
    assert tr.n_tokens == 8 and tr.header.mode == "s2moe"
    capsys.readouterr()
    assert main(["generate", "-m", model, "-p", "x", "-n", "4", "--trace", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "-m", model, "-p", "x", "-n", "4", "--mode", "ar", "--trace", str(path)]) == 2


def test_bench_records_a_trace_per_prompt_beside_its_timed_runs(tiny_models, tmp_path):
    folder = tmp_path / "traces"
    out = tmp_path / "b.json"
    assert (
        main(
            [
                "bench",
                "-m",
                str(tiny_models["olmoe"]),
                "--prompts",
                "natural",
                "--n-prompts",
                "2",
                "-n",
                "8",
                "--modes",
                "ar,s2moe",
                "--no-quality",
                "--no-reference",
                "--repeats",
                "1",
                "--draft-max",
                "8",
                "--reuse-strength",
                "0.5",
                "-t",
                "1",
                "--trace",
                str(folder),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["resident-000.jsonl", "resident-001.jsonl"]
    traces = [read_trace(folder / f) for f in files]
    assert all(t.n_tokens == 8 and t.header.budget is None and t.header.mode == "s2moe" for t in traces)
    # the timed rows are the modes asked for; the trace generation is not one of them
    assert [r["mode"] for r in json.loads(out.read_text())["results"]] == ["ar", "s2moe"]


def test_a_trace_says_what_its_drafts_read_and_older_traces_read_as_the_router_s(decoders, tmp_path):
    """The header records what the draft passes read (without a budget: the router's choice); a header written
    before it did reads as the router's."""
    tr = record(decoders["olmoe"], n=8)
    assert tr.header.draft_experts == "router"
    lines = dumps(tr).splitlines()
    older = {k: v for k, v in json.loads(lines[0]).items() if k != "draft_experts"}
    path = tmp_path / "older.jsonl"
    path.write_text("\n".join([json.dumps(older)] + lines[1:]) + "\n")
    assert read_trace(path).header == tr.header
    resident = replace(tr, header=replace(tr.header, draft_experts="resident"))
    write_trace(path, resident)
    assert read_trace(path).header.draft_experts == "resident"
