"""Device profiles: schema validation, fingerprint keying, atomic writes, the shipped profiles, the CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from s2moe.engine.errors import ConfigError
from s2moe.engine.profiles import (
    cost_for_model,
    hot_experts_for_model,
    list_profiles,
    load_profile,
    save_profile,
    shipped_profile_dir,
)

FP = "0123456789abcdef"
GOOD = {
    "schema": 1,
    "name": "dev",
    "kind": "measured",
    "device": {
        "name": "test cpu",
        "kind": "cpu",
        "memory_bytes": 1 << 30,
        "budget_bytes": None,
        "memory_bandwidth_gb_s": 20.0,
        "storage_bandwidth_gb_s": 0.8,
    },
    "models": {
        "0123456789abcdef": {
            "model": "m.gguf",
            "n_layer": 2,
            "n_expert": 8,
            "n_expert_used": 2,
            "expert_bytes": 4096,
            "t_ar_ms": 10.0,
            "c_draft_ms": 7.0,
            "t_exp_ms": 0.1,
            "t_exp_cold_ms": 2.0,
            "t_tok_ms": 1.0,
            "intercept_ms": 0.5,
            "fit": {"intercept_ms": 0.5, "t_exp_ms": 0.1, "t_tok_ms": 1.0, "r2": 0.97, "mape": 0.03, "n": 30},
            "hot_experts": [[0, 1], [1, 7]],
            "measured": {"at": "2026-01-01T00:00:00+00:00", "by": "test"},
        }
    },
}


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "s2moe" / "profiles"


def _write(tmp_path, data, name="p.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_a_good_profile_loads_and_gives_its_constants(tmp_path):
    prof = load_profile(str(_write(tmp_path, GOOD)))
    c = cost_for_model(prof, "0123456789abcdef", "m.gguf")
    assert c.t_ar == pytest.approx(0.010) and c.t_exp == pytest.approx(1e-4) and c.t_tok == pytest.approx(1e-3)
    assert c.r2 == pytest.approx(0.97) and c.source == "profile:dev"
    cold = cost_for_model(prof, "0123456789abcdef", offloaded=True)
    assert cold.t_exp == pytest.approx(2e-3) and "cold" in cold.source and cold.t_ar == pytest.approx(0.010)
    block = dict(GOOD["models"][FP], t_ar_cold_ms=300.0, c_draft_cold_ms=120.0)
    cold = cost_for_model(dict(GOOD, models={FP: block}), FP, offloaded=True)
    assert cold.t_ar == pytest.approx(0.3) and cold.c_draft == pytest.approx(0.12)
    assert hot_experts_for_model(prof, "0123456789abcdef") == [(0, 1), (1, 7)]


def test_a_profile_for_another_model_is_refused(tmp_path):
    prof = load_profile(str(_write(tmp_path, GOOD)))
    with pytest.raises(ConfigError, match="not calibrated for this model .*fedcba9876543210"):
        cost_for_model(prof, "fedcba9876543210", "other.gguf")


def _bad(path, value):
    import copy

    data = copy.deepcopy(GOOD)
    *head, last = path
    node = data
    for k in head:
        node = node[k]
    node[last] = value
    return data


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("kind",), "guess", "field kind"),
        (("schema",), 7, "field schema"),
        (("device", "kind"), "toaster", "device: field kind"),
        (("device", "memory_bandwidth_gb_s"), -3, "memory_bandwidth_gb_s"),
        (("device", "memory_bytes"), "lots", "memory_bytes"),
        (("models", FP, "t_ar_ms"), 0, "t_ar_ms must be a positive"),
        (("models", FP, "t_exp_ms"), "fast", "t_exp_ms"),
        (("models", FP, "t_exp_cold_ms"), float("nan"), "t_exp_cold_ms"),
        (("models", FP, "fit"), {"r2": 3}, "fit: field r2"),
        (("models", FP, "fit_cold"), {"r2": 0.9, "r2_ceiling": 2}, "fit_cold: field r2_ceiling"),
        (
            ("models", FP, "fit_cold_misses"),
            {
                "intercept_ms": 0.1,
                "t_exp_warm_ms": 0.01,
                "t_exp_cold_ms": 0.3,
                "t_tok_ms": 0.2,
                "mape": 0.2,
                "n": 9,
                "r2_given_faults": "high",
            },
            "fit_cold_misses: field r2_given_faults",
        ),
        (
            ("models", FP, "fit_cold_misses"),
            {
                "intercept_ms": 0.1,
                "t_exp_warm_ms": 0.01,
                "t_exp_cold_ms": 0.3,
                "t_tok_ms": 0.2,
                "mape": 0.2,
                "n": 9,
                "r2_ceiling": 1.5,
            },
            "fit_cold_misses: field r2_ceiling must be a number ≤ 1",
        ),
        (("models", FP, "measured"), {"budget_bytes": "lots"}, "measured: field budget_bytes"),
        (("models", FP, "hot_experts"), [[0, 1], [9, 0]], r"hot_experts\[1\]"),
        (("models", FP, "hot_experts"), [[0, 1], [0, 1]], "listed twice"),
        (("models", FP, "hot_experts"), [[0, "x"]], r"hot_experts\[0\]"),
        (("models", FP, "expert_bytes"), 1.5, "expert_bytes"),
        (("models",), [1, 2], "field models"),
    ],
)
def test_a_bad_field_is_named(tmp_path, path, value, needle):
    p = _write(tmp_path, _bad(path, value))
    with pytest.raises(ConfigError, match=needle) as e:
        load_profile(str(p))
    assert "p.yaml" in str(e.value)


def test_save_is_atomic_and_round_trips(xdg, monkeypatch):
    path = save_profile(GOOD, "mine")
    assert path == xdg / "mine.yaml"
    assert load_profile("mine")["models"][FP]["hot_experts"] == [[0, 1], [1, 7]]
    before = path.read_text()
    # an interruption while writing leaves the old file and no temporary behind
    real_replace = os.replace

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    changed = dict(GOOD, description="changed")
    with pytest.raises(KeyboardInterrupt):
        save_profile(changed, "mine")
    monkeypatch.setattr(os, "replace", real_replace)
    assert path.read_text() == before
    assert sorted(p.name for p in xdg.iterdir()) == ["mine.yaml"]
    # an invalid profile is refused before anything is written
    with pytest.raises(ConfigError):
        save_profile(_bad(("models", FP, "t_ar_ms"), -1), "broken")
    assert sorted(p.name for p in xdg.iterdir()) == ["mine.yaml"]
    with pytest.raises(ConfigError, match="invalid profile name"):
        save_profile(GOOD, "../escape")


def test_save_refuses_an_invalid_profile_before_touching_the_disk(xdg):
    with pytest.raises(ConfigError, match="field kind"):
        save_profile(_bad(("kind",), "guess"), "fresh")
    assert not xdg.exists()  # not even the profile folder
    with pytest.raises(ConfigError, match="needs a field models"):
        save_profile({"schema": 1, "kind": "measured"}, "fresh")
    assert not xdg.exists()


def test_shipped_profiles_are_valid_and_marked(xdg):
    names = {e.name: e for e in list_profiles()}
    for n in ("jetson-orin-16gb", "jetson-orin-32gb", "jetson-orin-64gb", "rtx-4090"):
        assert names[n].error is None and names[n].kind == "reference" and names[n].where == "shipped"
    assert any(e.kind == "measured" and e.where == "shipped" for e in names.values())
    orin = load_profile("jetson-orin-16gb")
    c = cost_for_model(orin, "any-model-fingerprint")
    assert c.t_ar == pytest.approx(0.100) and c.c_draft == pytest.approx(0.0075)
    assert c.t_exp == pytest.approx(0.571875 / 3.66 / 1e3) and "reference" in c.source
    assert orin["device"]["budget_bytes"] == 16 << 30
    here = (str(Path(__file__).resolve().parents[1]), str(Path.home()))
    for p in shipped_profile_dir().glob("*.yaml"):
        assert not any(place in p.read_text() for place in here)  # no path of the machine that measured


def test_user_profile_shadows_and_cli_lists_and_shows(xdg, capsys):
    from s2moe.app.cli import main

    save_profile(GOOD, "jetson-orin-16gb")
    listed = {e.name: e for e in list_profiles()}
    assert listed["jetson-orin-16gb"].where == "user"
    assert main(["profiles", "list"]) == 0
    out = capsys.readouterr().out
    assert "jetson-orin-16gb" in out and "rtx-4090" in out
    assert main(["profiles", "show", "rtx-4090"]) == 0
    assert "kind: reference" in capsys.readouterr().out
    assert main(["profiles", "show", "nope"]) == 2
    assert "no profile named 'nope'" in capsys.readouterr().err


@pytest.fixture
def only_user_profiles(xdg, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr("s2moe.engine.profiles.shipped_profile_dir", lambda: shipped)
    xdg.mkdir(parents=True)
    return xdg, shipped


def test_the_list_kind_is_what_loading_gives(only_user_profiles):
    user, shipped = only_user_profiles
    # no `kind` and only reference constants: loading makes it a measured profile, and so does the list
    (user / "no-kind.yaml").write_text("schema: 1\nreference: {t_ar_ms: 100, c_draft_ms: 7.5, t_exp_ms: 0.15}\n")
    (user / "bad-kind.yaml").write_text(yaml.safe_dump(dict(_bad(("kind",), "guess"), description="typo")))
    (user / "a-list.yaml").write_text("- 1\n- 2\n")
    (user / "broken.yml").write_text("schema: [1\n")
    _write(user, GOOD, "good.yaml")
    _write(shipped, dict(GOOD, kind="reference"), "good.yaml")  # shadowed by the user's
    _write(shipped, dict(GOOD, kind="reference"), "ref.yaml")
    entries = list_profiles()
    assert [(e.name, e.where) for e in entries] == [
        ("a-list", "user"),
        ("bad-kind", "user"),
        ("broken", "user"),
        ("good", "user"),
        ("no-kind", "user"),
        ("ref", "shipped"),
    ]
    by = {e.name: e for e in entries}
    assert load_profile("no-kind")["kind"] == "measured" and by["no-kind"].kind == "measured"
    assert by["no-kind"].error is None and by["no-kind"].covers(FP) == "reference"
    assert by["good"].kind == "measured" and by["ref"].kind == "reference"
    assert by["good"].covers(FP) == "measured" and by["good"].covers("fedcba9876543210") == ""
    assert by["good"].device == "test cpu" and by["good"].n_models == 1
    # an invalid profile says what `--profile NAME` would say, and keeps what it holds for the inspector
    for name in ("bad-kind", "a-list", "broken"):
        with pytest.raises(ConfigError) as e:
            load_profile(name)
        assert by[name].error == str(e.value) and by[name].kind == "invalid" and by[name].covers(FP) == ""
    assert "field kind" in by["bad-kind"].error and by["bad-kind"].data["description"] == "typo"
    assert "expected a mapping" in by["a-list"].error and by["a-list"].data is None
    assert "invalid YAML line" in by["broken"].error and by["broken"].data is None


def test_a_profile_file_is_read_with_a_bound(only_user_profiles, monkeypatch):
    from s2moe.engine import profiles

    user, _ = only_user_profiles
    _write(user, dict(GOOD, description="x" * 4000), "big.yaml")
    assert load_profile("big")["kind"] == "measured"
    monkeypatch.setattr(profiles, "MAX_PROFILE_BYTES", 1024)
    with pytest.raises(ConfigError, match="big.yaml: larger than"):
        load_profile("big")
    assert "larger than" in list_profiles()[0].error
    (user / "latin1.yaml").write_bytes("schema: 1\ndescription: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_profile("latin1")


# -- the device a profile describes ----------------------------------------------------------------------
def test_cpu_name_reads_cpuinfo_and_falls_back(monkeypatch):
    import io
    import platform

    from s2moe.engine.measure import device

    assert device.cpu_name().strip()
    cpuinfo = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n"
    monkeypatch.setattr(device, "open", lambda *a, **k: io.StringIO(cpuinfo), raising=False)
    assert device.cpu_name() == "Test CPU 9000"
    # an ARM board's cpuinfo has no model name
    monkeypatch.setattr(
        device, "open", lambda *a, **k: io.StringIO("processor\t: 0\nCPU part\t: 0xd42\n"), raising=False
    )
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert device.cpu_name() == "aarch64"


def test_default_threads_follow_the_affinity_and_leave_spares(monkeypatch):
    from s2moe.engine.measure import device

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert device.default_threads() == 3
    assert device.default_threads(spare=1) == 2
    assert device.default_threads(spare=5) == 1


def test_profiles_list_shows_file_names_and_devices_as_written(tmp_path, monkeypatch, capsys):
    """A profile's name and device come from a file: rich markup in them is shown, not interpreted."""
    import yaml
    from s2moe.app.cli import main

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    folder = tmp_path / "s2moe" / "profiles"
    folder.mkdir(parents=True)
    profile = {
        "schema": 1,
        "name": "[bold]x",
        "kind": "reference",
        "device": {"name": "[red]box[/red]", "kind": "cpu"},
        "reference": {"t_ar_ms": 1.0, "c_draft_ms": 0.5, "t_exp_ms": 0.1},
    }
    (folder / "[bold]x.yaml").write_text(yaml.safe_dump(profile))
    assert main(["profiles", "list"]) == 0
    out = capsys.readouterr().out
    assert "[bold]x" in out and "[red]box[/red]" in out
