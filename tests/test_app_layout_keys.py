"""What a first-time user at 80×24 or 60×20 meets: text that fits, keys that mean one thing on every screen,
focus that shows, words a user reads right, and a Device screen with history and this process's memory."""

from __future__ import annotations

import asyncio
import io

import pytest
from s2moe.app.tui.app import S2MoEApp
from s2moe.app.tui.bench import BenchScreen
from s2moe.app.tui.calibrate import CalibrateScreen
from s2moe.app.tui.chat import ChatScreen
from s2moe.app.tui.chat_settings import ChatSettings
from s2moe.app.tui.device import DeviceScreen, DeviceView, graph
from s2moe.app.tui.profiles_screen import ProfilesScreen
from s2moe.app.tui.widgets import SHORT_LABELS
from test_app_support import FakeDecoder, fake_run_calibration, only_test_profiles

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((60, 20), id="60x20")]
MAIN_SCREENS = (ChatScreen, CalibrateScreen, ProfilesScreen, BenchScreen, DeviceScreen)


@pytest.fixture(autouse=True)
def own_profiles(tmp_path, monkeypatch):
    only_test_profiles(tmp_path, monkeypatch)
    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", fake_run_calibration())


def make_app() -> S2MoEApp:
    return S2MoEApp("fake-moe.gguf", decoder_factory=lambda path: FakeDecoder(path))


async def ready(pilot) -> None:
    for _ in range(500):
        if pilot.app.session.model is not None:
            break
        await pilot.pause(0.01)
    await pilot.pause()


def screen_text(app) -> str:
    """The screen as a user reads it: its characters, line by line."""
    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def run(test):
    asyncio.run(test())


# -- text that fits ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_the_header_keeps_the_model_and_profile_whole(size, monkeypatch):
    label = "olmoe-64x8 · 16L 64E top-8 · profile my-box"
    monkeypatch.setattr(S2MoEApp, "model_short_label", property(lambda self: label))

    async def go():
        app = make_app()
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            for key, name in (
                ("f2", "Chat"),
                ("f3", "Calibrate"),
                ("f4", "Profiles"),
                ("f5", "Bench"),
                ("f10", "Device"),
            ):
                await pilot.press(key)
                await pilot.pause()
                header = screen_text(app).splitlines()[0]
                assert label in header, header
                assert name in header or SHORT_LABELS[name] in header  # the screen the user is on

    run(go)


@pytest.mark.parametrize("size", SIZES)
def test_placeholders_buttons_and_profile_constants_are_not_cut(size):
    async def go():
        app = make_app()
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            prompt = app.screen.query_one("#prompt")
            assert prompt.content_size.width >= len(prompt.placeholder)
            await pilot.press("f3")
            await pilot.pause()
            screen = app.screen
            for field in ("#cal-name", "#cal-budget", "#cal-tune-minutes"):
                box = screen.query_one(field)
                assert box.content_size.width >= len(box.placeholder), field
            for button in screen.query("Button"):
                assert button.content_size.width >= len(str(button.label)), button.id
            await pilot.press("f4")
            await pilot.pause()
            names = [e.name for e in app.screen.entries]
            app.screen.query_one("#prof-table").move_cursor(row=names.index("test-cpu"))
            await pilot.pause()
            text = screen_text(app)
            assert "…" not in text
            if size == (80, 24):  # at 60×20 the detail is under the table, further down (scrolled to below)
                for constant in ("c_draft", "intercept", "measured", "reference"):
                    assert constant in text

    run(go)


def test_the_80_column_bench_table_shows_no_fewer_columns_than_the_60_column_one():
    async def columns(size):
        app = make_app()
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            await pilot.press("f5")
            await pilot.pause()
            table = app.screen.query_one("#bench-table")
            table.set_rows([("ar", {"mode": "ar"})])
            await pilot.pause()
            await pilot.pause()
            return len(table.shown)

    assert asyncio.run(columns((80, 24))) >= asyncio.run(columns((60, 20)))


def flagged_profile(folder) -> None:
    """A profile whose calibration doubted its fit, as the wizard saves it (measured.flagged)."""
    (folder / "s2moe" / "profiles" / "doubtful.yaml").write_text("""\
schema: 1
name: doubtful
kind: measured
description: calibrated on a busy machine, with a poor fit of the verification cost to its terms
device: {name: test cpu, kind: cpu}
models:
  0123456789abcdef: {model: fake-moe.gguf, t_ar_ms: 10.0, c_draft_ms: 4.0, t_exp_ms: 0.1, t_tok_ms: 1.0,
                     intercept_ms: 2.0, fit: {r2: 0.57, mape: 0.2},
                     measured: {flagged: ["cost model: fit R² 0.57 is below 0.8"]}}
""")


@pytest.mark.parametrize("size", SIZES)
def test_a_saved_warning_is_in_the_profile_detail_and_the_pane_scrolls_to_it(size, tmp_path):
    flagged_profile(tmp_path / "config")

    async def go():
        app = make_app()
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            await pilot.press("f4")
            await pilot.pause()
            screen = app.screen
            names = [e.name for e in screen.entries]
            screen.query_one("#prof-table").move_cursor(row=names.index("doubtful"))
            await pilot.pause()
            box = screen.query_one("#prof-detail-box")
            await pilot.press("tab")
            assert app.focused is box
            await pilot.press("end")
            await pilot.pause()
            assert box.scroll_y == box.max_scroll_y
            if size == (60, 20):
                assert box.max_scroll_y > 0  # more than the pane holds: the keys must reach the rest
            await pilot.press("home")
            await pilot.pause()
            text = screen_text(app)  # near the top, where the eye is (the pane wraps it at 80 columns)
            assert "⚠ doubt" in text and "0.57 is below" in text

    run(go)


# -- keys and focus ------------------------------------------------------------------------------------------
# keys that name the same thing in other words on different screens
SAME_MEANING = [{"stop", "cancel"}, {"save", "export"}]


def test_no_key_means_two_things_across_the_screens():
    from textual.binding import Binding

    meanings: dict[str, set[str]] = {}
    for owner in (S2MoEApp,) + MAIN_SCREENS:
        for b in owner.__dict__.get("BINDINGS", ()):  # Textual's own (Screen's Ctrl+C copy) are not ours
            b = b if isinstance(b, Binding) else Binding(*b)
            for key in b.key.split(","):
                meanings.setdefault(key.strip(), set()).add(b.action.split("(")[0])
    clashes = {
        key: actions
        for key, actions in meanings.items()
        if len(actions) > 1 and not any(actions <= same for same in SAME_MEANING)
    }
    assert not clashes


def test_ctrl_u_clears_the_whole_prompt():
    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await pilot.press(*"hello", "left", "left", "ctrl+u")
            assert app.screen.query_one("#prompt").value == ""

    run(go)


def test_shift_f6_and_shift_f9_go_back():
    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            chat = app.screen
            mode, k_d = chat.settings.mode, chat.shown_settings().draft_topk
            await pilot.press("f6")
            assert chat.settings.mode != mode
            await pilot.press("shift+f6")
            assert chat.settings.mode == mode
            await pilot.press("shift+f6")
            modes = chat.available_modes()
            assert chat.settings.mode == modes[(modes.index(mode) - 1) % len(modes)]
            await pilot.press("f9")
            assert chat.shown_settings().draft_topk != k_d
            await pilot.press("shift+f9")
            assert chat.shown_settings().draft_topk == k_d

    run(go)


@pytest.mark.parametrize("key", ["f2", "f3", "f4", "f5", "f10"])
def test_tab_stops_only_where_the_focus_shows(key):
    """Every stop of Tab draws itself differently with the focus: no invisible container takes a Tab."""

    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await pilot.press(key)
            await pilot.pause()
            chain = app.screen.focus_chain
            assert chain
            for widget in chain:
                widget.focus()
                await pilot.pause()
                focused = app.export_screenshot()
                app.set_focus(None)
                await pilot.pause()
                assert app.export_screenshot() != focused, f"{widget!r} looks the same with the focus"

    run(go)


def test_the_focused_prompt_has_a_heavy_frame():
    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            prompt = app.screen.query_one("#prompt")
            assert app.focused is prompt
            assert prompt.styles.border_left[0] == "thick"

    run(go)


@pytest.mark.parametrize(
    "query, command",
    [("export", "Save transcript…"), ("export", "Save bench results…"), ("Save transcript", "Save transcript…")],
)
def test_the_palette_finds_a_command_by_a_word_for_it(query, command):
    from s2moe.app.tui.commands import S2MoECommands

    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            provider = S2MoECommands(app.screen)
            hits = [hit async for hit in provider.search(query)]
            assert command in [
                str(hit.match_display) if not hasattr(hit.match_display, "plain") else hit.match_display.plain
                for hit in hits
            ]

    run(go)


# -- words a user reads right --------------------------------------------------------------------------------
def test_the_settings_line_says_gating_one_way_and_whether_it_is_lossy():
    assert "gating 0.5 (lossy)" in ChatSettings().describe()
    off = ChatSettings(gating=False).describe()
    zero = ChatSettings(reuse_strength=0.0).describe()
    assert "gating off (lossless)" in off and "gating off (lossless)" in zero
    assert "gating 0 " not in zero + " "


def test_the_calibration_says_where_the_profile_went_once_saved(monkeypatch):
    from s2moe.engine.measure.calibration_events import CalibrationDone, StepResult, StepStarted

    base = fake_run_calibration()

    def with_profile_step(model_path, **kw):
        done = None
        for event in base(model_path, **kw):
            if isinstance(event, CalibrationDone):
                done = event
                continue
            yield event
        yield StepStarted(4, 4, "profile", "the profile")
        yield StepResult(4, "profile", "not written to a file yet · model 0123456789abcdef", {"path": None})
        yield done

    monkeypatch.setattr("s2moe.engine.measure.calibrate.run_calibration", with_profile_step)

    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await pilot.press("f3")
            screen = app.screen
            screen.query_one("#cal-name").value = "my-box"
            await pilot.press("ctrl+r")
            for _ in range(500):
                if screen.result is not None and not screen.running:
                    break
                await pilot.pause(0.01)
            assert "not written to a file yet" in screen.steps_text().plain
            await pilot.press("ctrl+s")
            await pilot.pause()
            said = screen.steps_text().plain
            assert "saved as my-box: " in said and str(screen.saved_path) in said
            assert "not written" not in said and "save=False" not in said

    run(go)


# -- the device screen ---------------------------------------------------------------------------------------
def test_graph_draws_columns_to_scale_with_the_newest_on_the_right():
    rows = graph([0.0, 0.5, 1.0], width=4, height=2, top=1.0)
    assert rows == ["   █", "  ██"]
    assert graph([0.25], width=2, height=1, top=1.0) == [" ▂"]


def readings(jetson: bool):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_app_snapshots import device_samples, plain_pc_samples

    return device_samples() if jetson else plain_pc_samples()


@pytest.mark.parametrize(
    "jetson, thermal", [(True, False), (False, False), (False, True)], ids=["jetson", "pc", "pc-with-thermal-zones"]
)
def test_device_view_has_history_this_process_and_says_what_it_lacks(jetson, thermal):
    from collections import deque
    from dataclasses import replace

    from s2moe.app.tui.device import HISTORY, record

    history = {k: deque(maxlen=HISTORY) for k in ("disk", "cpu", "memory", "gpu", "temp", "power")}
    samples = readings(jetson)
    if thermal:
        samples = [replace(s, temps={"x86_pkg_temp": 40.0 + i, "acpitz": 27.8}) for i, s in enumerate(samples)]
    for sample in samples:
        record(history, sample)
    lines = [line.plain for line in DeviceView(samples[-1], history, height=22).lines(78)]
    text = "\n".join(lines)
    assert "This app" in text and "1.2 GiB resident" in text
    assert "History" in text
    labels = {line.split()[0] for line in lines if line.strip()}
    assert {"CPU", "Memory"} <= labels
    if jetson:
        assert {"GPU", "Temp", "Power"} <= labels
    elif thermal:
        assert "x86_pkg_temp 47.0°C" in text and "47°C max" in text  # the zones now, the hottest in history
        assert "no GPU or power source" in text and "Power" not in labels
    else:
        assert "no GPU, temperature or power source" in text
        assert "Temp" not in labels and "Power" not in labels
    assert len(lines) >= 20  # the graphs take the height the 80×24 screen has


def test_device_screen_fills_80x24(monkeypatch):
    samples = readings(False)
    monkeypatch.setattr("s2moe.app.tui.device.DeviceScreen.INTERVAL", 3600.0)
    monkeypatch.setattr("s2moe.engine.measure.device.DeviceMonitor.sample", lambda self: samples[0])

    async def go():
        app = make_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await pilot.press("f10")
            for _ in range(200):
                if app.screen.samples:
                    break
                await pilot.pause(0.01)
            for sample in samples[1:]:
                app.screen.show(sample)
            await pilot.pause()
            body = screen_text(app).splitlines()[1:-1]
            # the focus bar on the left edge is drawn on every line: only what is right of it counts
            assert sum(1 for line in body if line.strip(" ▌▎▊")) >= len(body) - 2

    run(go)
