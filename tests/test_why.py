"""The utility rule says why it drafts or not, with its numbers: the decision's text from real UtilityStop
decisions, `generate --events`, and the chat's live panel."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from s2moe.engine.drafting.stoprules import UtilityStop
from s2moe.engine.events import CostConstants, DraftDecision, Iteration
from test_app_support import FakeDecoder, scripted_events
from test_cli import s2moe

MS = 1e-3
# a certain token saves a plain step (0.51 ms) but its draft pass and verify row cost 0.46 + 0.24 ms
CANNOT_PAY = CostConstants(
    t_ar=0.51 * MS, c_draft=0.46 * MS, t_exp=0.01 * MS, t_tok=0.24 * MS, intercept=0.0, source="test"
)
CAN_PAY = CostConstants(t_ar=1.0 * MS, c_draft=0.2 * MS, t_exp=0.05 * MS, t_tok=0.1 * MS, intercept=0.0, source="test")


def decide(rule: UtilityStop) -> tuple[bool, DraftDecision]:
    drafting = rule.worth_drafting()
    return drafting, rule.decision


def test_a_certain_token_that_cannot_pay():
    drafting, d = decide(UtilityStop(CANNOT_PAY, 1.0))
    assert not drafting and not d.drafting and not d.can_pay
    assert d.text == "not drafting: a certain token saves T_AR 0.51 ms but costs C_draft 0.46 + T_tok 0.24 ms"
    assert d.wordings[1:] == ("no draft: T_AR 0.51 < C_draft 0.46 + T_tok 0.24 ms", "no draft: 0.51<0.46+0.24 ms")


def test_a_threshold_other_than_one_is_part_of_the_reason():
    # 1.0 / (0.2 + 0.1) = 3.33 pays at threshold 1 but not at 4
    drafting, d = decide(UtilityStop(CAN_PAY, 4.0))
    assert not drafting and not d.can_pay
    assert d.text == (
        "not drafting: a certain token saves T_AR 1.00 ms but costs C_draft 0.20 + T_tok 0.10 ms "
        "(utility 3.33 < threshold 4)"
    )
    assert d.wordings[1:] == ("no draft: even a certain token's utility 3.33 < 4", "no draft: utility 3.33 < 4")


def test_drafting_states_the_expected_utility():
    rule = UtilityStop(CAN_PAY, 1.0)
    rule.observe_first(0.9)
    rule.observe_first_experts(4)
    drafting, d = decide(rule)
    p, e = rule.expected_first, rule.expected_first_experts
    assert drafting and d.drafting and d.can_pay and not d.probing
    assert d.utility == pytest.approx(rule.utility(p, e))
    assert d.cost == pytest.approx(CAN_PAY.c_draft + CAN_PAY.t_tok + CAN_PAY.t_exp * e)
    assert d.text == (
        f"drafting: the first token's expected utility {d.utility:.2f} ≥ threshold 1 "
        f"(p {p:.2f} × T_AR 1.00 ms / cost {d.cost / MS:.2f} ms with {e:.1f} new experts)"
    )


def test_a_copy_from_the_context_is_priced_whole_without_a_draft_pass():
    rule = UtilityStop(CAN_PAY, 1.0)
    cost = rule.copy_cost(3, 6.0)
    assert cost == pytest.approx(3 * CAN_PAY.t_tok + CAN_PAY.t_exp * 6.0)
    d = rule.copy_decision(2.4, 6.0, CAN_PAY.t_ar, cost, 3)
    assert d.copied and d.drafting and d.c_draft == 0.0 and d.utility == pytest.approx(2.4 * CAN_PAY.t_ar / cost)
    assert d.text == (
        "copying 3 tokens from the context: the copy's expected utility 4.00 ≥ threshold 1 "
        "(2.40 expected accepted × T_AR 1.00 ms / cost 0.60 ms for 3 rows with 6.0 new experts), "
        "no draft pass"
    )
    assert d.wordings[1:] == (
        "copying: utility 4.00 ≥ 1 (2.40 of 3 accepted, cost 0.60 ms)",
        "copying: utility 4.00 ≥ 1",
    )
    probe = rule.copy_decision(0.2, 4.0, CAN_PAY.t_ar, rule.copy_cost(1, 4.0), 1, probing=True)
    assert probe.text.startswith("probing: the best copy's expected utility 0.67 < threshold 1")


def test_not_drafting_while_the_first_token_is_unlikely_then_probing():
    rule = UtilityStop(CAN_PAY, 1.0, probe_every=4)
    for _ in range(12):
        rule.observe_first(0.05)  # the first draft token is rarely the target's
    drafting, d = decide(rule)
    assert not drafting and d.can_pay and not d.drafting and d.next_probe == 3
    assert d.utility < 1.0
    assert d.text.startswith(
        f"not drafting: the first token's expected utility {d.utility:.2f} < threshold 1 "
        f"(p {rule.expected_first:.2f} × T_AR 1.00 ms / cost "
    )
    assert d.text.endswith("; next probe in 3 iterations")
    assert [decide(rule)[1].next_probe for _ in range(2)] == [2, 1]
    drafting, d = decide(rule)
    assert drafting and d.probing and d.text.startswith("probing: the first token's expected utility")
    head = f"probing: utility {d.utility:.2f} < 1"
    assert d.wordings[1:] == (f"{head} (p {rule.expected_first:.2f}, cost {d.cost / MS:.2f} ms)", head)


def test_the_decoder_puts_the_decision_on_each_iteration(decoders):
    from s2moe.engine.decoding.decoder import run
    from s2moe.engine.decoding.generation_config import GenerationConfig

    events = run(
        decoders["olmoe"],
        "hello there",
        GenerationConfig(mode="s2moe", n_predict=6, cost=CANNOT_PAY, stop_at_eos=False),
    )
    iters = [e for e in events if isinstance(e, Iteration)]
    no_draft = [e for e in iters if e.draft_stop == "no-draft"]
    assert no_draft and all(not e.draft_decision.can_pay for e in no_draft)
    plain = run(
        decoders["olmoe"], "hello there", GenerationConfig(mode="s2moe", n_predict=4, utility=False, stop_at_eos=False)
    )
    assert all(e.draft_decision is None for e in plain if isinstance(e, Iteration))


def test_generate_events_print_the_reason(tiny_models, tmp_path):
    profile = tmp_path / "slow-draft.yaml"
    profile.write_text(
        "schema: 1\nname: slow-draft\nkind: reference\ndevice: {name: test, kind: cpu}\n"
        "reference: {t_ar_ms: 0.51, c_draft_ms: 0.46, t_exp_ms: 0.01, t_tok_ms: 0.24}\n"
    )
    done = s2moe(
        "generate",
        "--model",
        str(tiny_models["olmoe"]),
        "-p",
        "hello",
        "-n",
        "4",
        "--threads",
        "1",
        "--ignore-eos",
        "--events",
        "--profile",
        str(profile),
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert lines and "(no-draft)" not in done.stderr
    assert (
        "[1] drafted 0 accepted 0 (not drafting: a certain token saves T_AR 0.51 ms but costs C_draft 0.46 + "
        "T_tok 0.24 ms; --no-utility drafts anyway) rollback 0 verify 1 tok"
    ) in lines[0]
    # the same reason goes on: said once, then "as above" rather than the sentence again on every line
    # (the last step stops at -n, the token limit, not for the rule)
    assert len(lines) >= 3 and all("(as above) rollback 0 verify 1 tok" in line for line in lines[1:-1])
    assert "(limit)" in lines[-1]
    assert done.stderr.count("not drafting") == 1


def test_event_lines_say_a_reason_in_full_where_it_changes_and_its_numbers_where_they_move():
    from s2moe.app.cmd_generate import event_line

    def iteration(index, decision, stop="no-draft"):
        return replace(scripted_events("ar")[2], index=index, draft_decision=decision, draft_stop=stop)

    rule = UtilityStop(CAN_PAY, 1.0)
    for _ in range(12):
        rule.observe_first(0.05)
    rule.worth_drafting()
    waiting = rule.decision  # not drafting: it can pay, but not at this p
    rule.observe_first(0.04)
    rule.worth_drafting()
    lower = rule.decision
    assert waiting.wordings[-1] != lower.wordings[-1]
    cannot = decide(UtilityStop(CANNOT_PAY, 1.0))[1]
    first = iteration(1, waiting)
    assert f"({waiting.text})" in event_line(first)  # the first line: in full
    assert f"({waiting.text})" in event_line(first, None)
    assert "(as above)" in event_line(iteration(2, waiting), first)  # the same, word for word
    moved = event_line(iteration(2, lower), first)
    assert f"({lower.wordings[-1]})" in moved and "not drafting:" not in moved  # its numbers moved
    # another reason: in full again, and so after an iteration that drafted
    assert f"({cannot.text}; --no-utility drafts anyway)" in event_line(iteration(3, cannot), first)
    drafted = iteration(3, None, stop="utility")
    assert "(utility)" in event_line(drafted, first)
    assert f"({waiting.text})" in event_line(iteration(4, waiting), drafted)


def test_event_line_of_a_rule_that_waits_for_a_probe():
    from s2moe.app.cmd_generate import event_line

    rule = UtilityStop(CAN_PAY, 1.0)
    for _ in range(12):
        rule.observe_first(0.05)
    rule.worth_drafting()
    it = replace(scripted_events("ar")[2], draft_decision=rule.decision)
    assert f"({rule.decision.text})" in event_line(it)
    assert "--no-utility" not in event_line(it)  # drafting can pay: the rule probes again by itself


@pytest.mark.parametrize(
    "size,wording",
    [
        ((80, 24), "no draft: 0.51<0.46+0.24 ms (F7)"),
        ((120, 40), "no draft: 0.51<0.46+0.24 ms · F7 forces it"),
        ((200, 50), "no draft: T_AR 0.51 < C_draft 0.46 + T_tok 0.24 ms · F7 forces it"),
    ],
)
def test_the_live_panel_states_the_decision_in_one_line(size, wording):
    from s2moe.app.tui.app import S2MoEApp
    from s2moe.app.tui.messages import EngineEvent, JobEnded
    from s2moe.app.tui.segments import view_of

    rule = UtilityStop(CANNOT_PAY, 1.0)
    rule.worth_drafting()

    async def go():
        app = S2MoEApp("fake-moe.gguf", decoder_factory=lambda path: FakeDecoder(path))
        async with app.run_test(size=size) as pilot:
            for _ in range(500):
                if app.session.model is not None:
                    break
                await pilot.pause(0.01)
            chat = app.screen
            decoder = FakeDecoder()
            chat.begin_turn("hello")
            for i, event in enumerate(scripted_events("ar")):
                if isinstance(event, Iteration):
                    event = replace(event, draft_decision=rule.decision)
                chat.on_engine_event(EngineEvent(chat._turn_index, event, view_of(event, decoder), 1.0 + 0.05 * i))
            chat.on_job_ended(JobEnded("generate"))
            chat.flush()
            await pilot.pause()
            stats = chat.query_one("#live-stats")
            rows = [strip.text.rstrip() for strip in stats.render_lines(stats.region.reset_offset)]
            assert any(row.strip() == wording for row in rows), rows
            assert chat.live.state.decision == rule.decision

    asyncio.run(go())
