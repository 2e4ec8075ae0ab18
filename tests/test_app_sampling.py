"""llama.cpp's sampler options in the app: the chat's settings (read as generate's flags are, persisted, shown
in the settings bar, reaching the generation) and the Bench screen; and the chat's key hints at 60 columns."""

from __future__ import annotations

from dataclasses import replace

import pytest
from s2moe.app.parser import build_parser
from s2moe.app.tui.chat_settings import ChatSettings
from s2moe.app.tui.dialogs import SettingsDialog
from s2moe.app.tui.state import settings_from_state
from s2moe.engine.errors import ConfigError
from test_app import answered, fake_app, open_bench, open_settings, run, run_bench_screen, type_prompt, wait_for
from test_app_support import fake_run_bench

SAMPLED = {
    "temperature": "0.7",
    "seed": "42",
    "top_k": "20",
    "top_p": "0.9",
    "min_p": "0.1",
    "repeat_penalty": "1.1",
    "repeat_last_n": "32",
}


async def fill_settings(pilot, app, values: dict) -> SettingsDialog:
    dialog = await open_settings(pilot, app)
    for key, value in values.items():
        dialog.query_one(f"#sample-{key}").value = value
    await pilot.press("ctrl+s")
    await pilot.pause()
    return dialog


def test_sampling_settings_reach_the_generation_and_persist_across_restarts():
    async def first():
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            chat = app.screen
            await fill_settings(pilot, app, SAMPLED)
            assert app.screen is chat
            s = chat.settings
            assert (s.temperature, s.seed, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n) == (
                0.7,
                42,
                20,
                0.9,
                0.1,
                1.1,
                32,
            )
            bar = str(chat.query_one("#settings-bar").render())
            assert "T=0.7 seed 42 top-k=20 top-p=0.9 min-p=0.1 rep=1.1/32" in " ".join(bar.split())
            await type_prompt(pilot, "hello")
            await wait_for(pilot, lambda: not chat.generating and chat.transcript.turns, what="generation")
            cfg = app.fake_decoders[-1].configs[-1]
            assert (
                cfg.temperature,
                cfg.seed,
                cfg.top_k,
                cfg.top_p,
                cfg.min_p,
                cfg.repeat_penalty,
                cfg.repeat_last_n,
            ) == (0.7, 42, 20, 0.9, 0.1, 1.1, 32)
            return s

    async def second(seen):
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            seen.append(app.screen.settings)

    saved = run(first())
    seen = []
    run(second(seen))
    assert seen == [saved]


@pytest.mark.parametrize(
    "key, value, flag",
    [
        ("top_p", "2", "--top-p"),
        ("seed", "-2", "-s"),
        ("temperature", "hot", "--temp"),
        ("top_k", "-1", "--top-k"),
        ("repeat_penalty", "0", "--repeat-penalty"),
    ],
)
def test_the_dialog_refuses_a_sampling_value_as_its_flag_does(key, value, flag):
    with pytest.raises(ConfigError) as cli:
        build_parser().parse_args(["generate", "-p", "x", flag, value])
    reason = cli.value.message.split(": ", 2)[-1]  # "generate: argument --top-p: <reason>"

    async def go():
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            before = app.screen.settings
            dialog = await fill_settings(pilot, app, {key: value})
            assert app.screen is dialog  # still open, nothing applied
            assert [n.message for n in app._notifications][-1].endswith(": " + reason)
            await pilot.press("escape")
            assert app.screen.settings == before

    run(go())


def test_remembered_sampling_settings_keep_only_what_the_engine_accepts():
    s = settings_from_state({"temperature": 0.5, "seed": -1, "top_k": 0, "repeat_penalty": 1.2})
    assert (s.temperature, s.seed, s.top_k, s.repeat_penalty) == (0.5, -1, 0, 1.2)
    assert s.describe().endswith("T=0.5 seed random top-k=0 rep=1.2")
    assert settings_from_state({"top_p": 2.0}) == ChatSettings()
    assert settings_from_state({"seed": 1 << 40}) == ChatSettings()
    assert settings_from_state({"top_k": 2.5}).top_k == ChatSettings().top_k  # a float is no whole number
    # greedy with llama.cpp's defaults adds nothing to the bar
    assert ChatSettings().sampling_text() == ""


def test_the_bench_screen_passes_its_sampling_options_to_the_bench(monkeypatch):
    calls = []

    def recording_run_bench(model, **kw):
        calls.append(kw)
        return fake_run_bench(model, **kw)

    monkeypatch.setattr("s2moe.engine.measure.bench.run_bench", recording_run_bench)

    async def go():
        app = fake_app()
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await open_bench(pilot, app)
            for key, value in SAMPLED.items():
                screen.query_one(f"#bench-{key}").value = value
            screen.query_one("#bench-top_p").value = "1.5"
            await pilot.press("ctrl+r")
            await pilot.pause()
            assert not screen.running and not calls
            assert "Top-p: must be between 0 and 1, got 1.5" in [n.message for n in app._notifications][-1]
            screen.query_one("#bench-top_p").value = "0.9"
            await run_bench_screen(pilot, screen)
            base = calls[-1]["base"]
            assert (
                base.temperature,
                base.seed,
                base.top_k,
                base.top_p,
                base.min_p,
                base.repeat_penalty,
                base.repeat_last_n,
            ) == (0.7, 42, 20, 0.9, 0.1, 1.1, 32)

    run(go())


@pytest.mark.parametrize("width", [60, 50, 40])
def test_the_chat_footer_keeps_f1_at_small_widths(width):
    from s2moe.app.tui.widgets import FittedFooter
    from textual.widgets._footer import FooterKey

    def shown(app):
        footer = app.screen.query_one(FittedFooter)
        keys = list(footer.query(FooterKey))
        return [k.action for k in keys], max(k.region.right for k in keys)

    async def go():
        app = fake_app()
        async with app.run_test(size=(120, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            wide, _ = shown(app)
            assert "help" in wide and "full_live" in wide and "command_palette" in wide
            await pilot.resize_terminal(width, 20)
            await wait_for(pilot, lambda: "command_palette" not in shown(app)[0], what="re-layout")
            actions, right = shown(app)
            assert "help" in actions and right <= width  # F1 on the line, nothing past the edge
            # the screen's own keys keep their order; those given first outlast the rest
            assert actions == [a for a in wide if a in actions]
            if "cycle_topk" in actions:
                assert "full_live" in actions

    run(go())


FLAGS = [
    "--temp",
    "0.6",
    "-s",
    "9",
    "--top-k",
    "12",
    "--top-p",
    "0.8",
    "--min-p",
    "0.01",
    "--repeat-penalty",
    "1.05",
    "--repeat-last-n",
    "-1",
]


def test_bench_takes_generates_sampling_flags_and_defaults():
    from s2moe.app.options import sampling_settings
    from s2moe.engine.decoding.generation_config import GenerationConfig

    parser = build_parser()
    generate = sampling_settings(parser.parse_args(["generate", "-p", "x", *FLAGS]))
    bench = sampling_settings(parser.parse_args(["bench", *FLAGS]))
    assert (
        generate
        == bench
        == dict(temperature=0.6, seed=9, top_k=12, top_p=0.8, min_p=0.01, repeat_penalty=1.05, repeat_last_n=-1)
    )
    # not given: llama.cpp's defaults, the same as the engine's and the app's
    defaults = sampling_settings(parser.parse_args(["bench"]))
    engine = GenerationConfig()
    assert defaults == {key: getattr(engine, key) for key in defaults}
    assert defaults == ChatSettings().sampling_fields()


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--top-p", "1.5"),
        ("--min-p", "-0.1"),
        ("-s", "-2"),
        ("--temp", "nan"),
        ("--repeat-last-n", "-2"),
        ("--top-k", "x"),
    ],
)
def test_bench_refuses_a_bad_sampling_value_as_generate_does(flag, value):
    reasons = []
    for command in (["generate", "-p", "x"], ["bench"]):
        with pytest.raises(ConfigError) as caught:
            build_parser().parse_args([*command, flag, value])
        reasons.append(caught.value.message.split(": ", 2)[-1])
    assert reasons[0] == reasons[1]


def test_a_random_seed_is_named_in_the_answer_and_repeats_it(tiny_models):
    from s2moe.app.tui.app import S2MoEApp

    async def go():
        app = S2MoEApp(str(tiny_models["olmoe"]), n_threads=1, n_ctx=256)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, timeout=60, what="model")
            chat = app.screen
            await fill_settings(
                pilot, app, {"temperature": "1.0", "seed": "-1", "top_k": "0", "top_p": "1", "min_p": "0"}
            )
            # gating off: a seed fixes the text wherever decoding is lossless; with gating on a verification's
            # routing depends on what was drafted with it, and whether to draft follows this process's timings
            chat.apply_settings(replace(chat.settings, n_predict=12, mode="s2moe", gating=False))
            answers = []
            for _ in range(2):
                await type_prompt(pilot, "hello")
                await wait_for(
                    pilot,
                    lambda: not chat.generating and len(chat.transcript.turns) > len(answers),
                    timeout=120,
                    what="generation",
                )
                answers.append(chat.transcript.turns[-1])
            seeds = [turn.settings_text.split("seed ")[1].split()[0] for turn in answers]
            assert all(s.isdigit() for s in seeds) and "random" not in answers[0].settings_text
            # the named seed typed back repeats the first answer
            chat.action_new_chat()
            await fill_settings(pilot, app, {"seed": seeds[0]})
            await type_prompt(pilot, "hello")
            await wait_for(pilot, lambda: not chat.generating and chat.transcript.turns, timeout=120, what="generation")
            again = chat.transcript.turns[-1]
            assert f"seed {seeds[0]}" in again.settings_text
            assert again.answer_text == answers[0].answer_text

    run(go())


def test_the_dialogs_switches_say_their_state_in_a_glyph():
    async def go():
        app = fake_app()
        async with app.run_test(size=(60, 20)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            await open_settings(pilot, app)
            gating = app.screen.query_one("#set-gating")
            assert "✓" in str(gating.render())
            gating.focus()
            await pilot.press("space")
            assert "✓" not in str(gating.render()) and not gating.value
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.screen.settings.gating is False

    run(go())


def test_the_copies_switch_reaches_the_generation_the_settings_bar_and_the_next_run():
    async def first():
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            chat = app.screen
            await answered(pilot, chat, "hello")
            assert app.fake_decoders[-1].configs[-1].lookup is True
            await open_settings(pilot, app)
            copies = app.screen.query_one("#set-lookup")
            assert copies.value
            copies.focus()
            await pilot.press("space")
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert "copies off" in " ".join(str(chat.query_one("#settings-bar").render()).split())
            await answered(pilot, chat, "again")
            assert app.fake_decoders[-1].configs[-1].lookup is False
            app.chat_action("toggle_lookup")  # the command palette's entry
            assert chat.settings.lookup is True
            app.chat_action("toggle_lookup")

    async def second(seen):
        app = fake_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            seen.append(app.screen.settings.lookup)

    run(first())
    seen = []
    run(second(seen))
    assert seen == [False]


def test_the_apps_sampler_flags_override_the_remembered_settings_for_the_session():
    from s2moe.app.cmd_app import build_app

    args = build_parser().parse_args(["app", "-m", "missing.gguf", "--temp", "0.6", "--top-k", "7", "-s", "3"])
    assert build_app(args).sampling_flags == {"temperature": 0.6, "top_k": 7, "seed": 3}
    assert build_app(build_parser().parse_args(["app", "-m", "missing.gguf"])).sampling_flags == {}

    async def go():
        app = fake_app(sampling={"temperature": 0.6, "top_k": 7, "seed": 3})
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.session.model is not None, what="model")
            s = app.screen.settings
            assert (s.temperature, s.top_k, s.seed, s.top_p) == (0.6, 7, 3, ChatSettings().top_p)
            await type_prompt(pilot, "hello")
            await wait_for(pilot, lambda: not app.screen.generating and app.screen.transcript.turns, what="generation")
            cfg = app.fake_decoders[-1].configs[-1]
            assert (cfg.temperature, cfg.top_k, cfg.seed) == (0.6, 7, 3)

    run(go())
    with pytest.raises(ConfigError):
        build_parser().parse_args(["app", "--top-p", "2"])
