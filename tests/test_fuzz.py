"""Property-based fuzzing (Hypothesis) of what a user hands s2moe: GGUF metadata, device profiles, flag
values and the JSON s2moe reads (copy caches, the app's chat settings, traces). Whatever the input, a
command ends in success or in one line on stderr with exit code 2: never a traceback, an abort (which would
end this very process: the runs are in-process) or a hang.

In the suite the inputs are drawn derandomized, a fixed number per property (EXAMPLES), so that every run
tries the same ones and stays within its time. S2MOE_FUZZ=explore draws fresh random inputs, twenty times
as many: run it after a change to what is validated, and turn what it finds into a regression test.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import signal
from datetime import timedelta

import gguf
import pytest
import yaml
from conftest import variant_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s2moe.app.cli import main
from tinygguf import TinySpec, write_tiny

EXPLORE = os.environ.get("S2MOE_FUZZ") == "explore"
# Examples per property in one run of the suite (docs/reliability.md).
EXAMPLES = {
    "gguf": 400,
    "profile_engine": 1000,
    "profile_cli": 100,
    "flags": 300,
    "n_predict": 30,
    "budget": 300,
    "json_engine": 300,
    "json_cli": 30,
    "json_trace": 100,
}
HANG_SECONDS = 60  # one example; a tiny model's slowest finishes in about a second


def fuzz(kind: str):
    return settings(
        max_examples=EXAMPLES[kind] * (20 if EXPLORE else 1),
        derandomize=not EXPLORE,
        database=None,
        deadline=timedelta(seconds=HANG_SECONDS),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Hang(Exception):
    pass


@contextlib.contextmanager
def hang_guard():
    """A run that does not finish raises Hang (a deadline alone only reports a run once it has ended)."""

    def hang(signum, frame):
        raise Hang(f"no result after {HANG_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with hang_guard(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def assert_clean(rc: int, out: str, err: str, json_out: bool = False) -> None:
    """Success (its JSON, when asked, parses), or one line on stderr, 'error: …', exit code 2, nothing on stdout."""
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if rc == 0:
        if json_out:
            json.loads(out)
        return
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == "", out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A fresh file name per example (examples run in a loop inside one test call)."""
    folder = tmp_path_factory.mktemp("fuzz")
    counter = itertools.count()
    return lambda suffix: folder / f"{next(counter)}{suffix}"


# -- GGUF metadata ----------------------------------------------------------------------------------------------
T = gguf.GGUFValueType
NAN, INF = float("nan"), float("inf")
U32_EDGES = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    9,
    15,
    16,
    17,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    255,
    256,
    511,
    512,
    513,
    1023,
    1024,
    1025,
    1 << 16,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
]
F32_EDGES = [NAN, INF, -INF, 0.0, -0.0, -1.0, 1e-45, 1e-38, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e4, 1e38, 3.4e38]
# The hyperparameters llama.cpp reads for the tiny models' architectures (and a few it reads for others).
HPARAMS = [
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon",
    "rope.freq_base",
    "rope.freq_scale",
    "rope.dimension_count",
    "rope.scaling.factor",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "expert_shared_feed_forward_length",
    "attention.key_length",
    "attention.value_length",
    "expert_shared_count",
    "expert_weights_norm",
    "expert_weights_scale",
    "expert_gating_func",
    "leading_dense_block_count",
    "vocab_size",
]
GENERAL = [
    "general.architecture",
    "general.name",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
]
KEYS = st.one_of(st.sampled_from(HPARAMS).map(lambda k: "{arch}." + k), st.sampled_from(GENERAL))
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
u32 = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, (1 << 32) - 1))
f32 = st.one_of(st.sampled_from(F32_EDGES), st.floats(width=32))
VALUES = st.one_of(
    u32.map(lambda v: (v, T.UINT32)),
    u32.map(lambda v: (v, T.UINT32)),  # the type llama.cpp reads most keys as: drawn twice as often
    f32.map(lambda v: (v, T.FLOAT32)),
    st.integers(-(1 << 31), (1 << 31) - 1).map(lambda v: (v, T.INT32)),
    st.integers(0, (1 << 64) - 1).map(lambda v: (v, T.UINT64)),
    st.booleans().map(lambda v: (v, T.BOOL)),
    st.one_of(TEXT, st.sampled_from(["olmoe", "qwen3moe", "dots1", "llama", "gpt2", "llama4", "deepseek2"])).map(
        lambda v: (v, T.STRING)
    ),
    # per-layer values (gguf-py writes no empty array)
    st.lists(u32, min_size=1, max_size=4).map(lambda v: (v, T.ARRAY, T.UINT32)),
    st.none(),  # the key left out
)
BASES = {
    "olmoe": variant_spec("olmoe", n_layer=2),
    "qwen3moe": variant_spec("qwen3moe", n_layer=2),
    "dots1": variant_spec("dots1", n_layer=2),
    "dense": TinySpec(arch="llama", n_layer=2),
}


@fuzz("gguf")
@given(
    base=st.sampled_from(sorted(BASES)),
    metadata=st.dictionaries(KEYS, VALUES, min_size=1, max_size=3),
    mode=st.sampled_from(["ar", "s2moe", "conf"]),
    temp=st.sampled_from(["0", "0.8"]),
)
def test_gguf_metadata_mutations(scratch, base, metadata, mode, temp):
    spec = BASES[base]
    path = write_tiny(scratch(".gguf"), TinySpec(**{**spec.__dict__, "metadata": metadata}))
    argv = [
        "generate",
        "-m",
        path,
        "-p",
        "hello world",
        "-n",
        "3",
        "--threads",
        "1",
        "--ctx",
        "64",
        "--mode",
        mode,
        "--temp",
        temp,
        "--json",
    ]
    assert_clean(*run_cli(*argv), json_out=True)


# -- device profiles --------------------------------------------------------------------------------------------
def _good_profile(fingerprint: str) -> dict:
    return {
        "schema": 1,
        "name": "fuzz",
        "kind": "measured",
        "description": "fuzz",
        "device": {
            "name": "cpu",
            "kind": "cpu",
            "memory_bytes": 1 << 30,
            "budget_bytes": None,
            "memory_bandwidth_gb_s": 10.0,
            "storage_bandwidth_gb_s": 1.0,
        },
        "models": {
            fingerprint: {
                "model": "olmoe.gguf",
                "arch": "olmoe",
                "n_layer": 3,
                "n_expert": 8,
                "n_expert_used": 4,
                "expert_bytes": 4096,
                "t_ar_ms": 1.0,
                "c_draft_ms": 0.8,
                "t_exp_ms": 0.01,
                "t_exp_cold_ms": 0.5,
                "t_tok_ms": 0.05,
                "intercept_ms": 0.1,
                "t_ar_cold_ms": 3.0,
                "c_draft_cold_ms": 2.0,
                "fit": {"intercept_ms": 0.1, "t_exp_ms": 0.01, "t_tok_ms": 0.05, "r2": 0.9, "mape": 0.1, "n": 30},
                "fit_cold": {"intercept_ms": 0.2, "t_exp_ms": 0.3, "t_tok_ms": 0.05, "r2": 0.8, "mape": 0.2, "n": 30},
                "fit_cold_misses": {
                    "intercept_ms": 0.2,
                    "t_exp_warm_ms": 0.01,
                    "t_exp_cold_ms": 0.4,
                    "t_tok_ms": 0.05,
                    "r2": 0.8,
                    "mape": 0.2,
                    "n": 30,
                    "r2_given_faults": 0.9,
                },
                "hot_experts": [[0, 1], [2, 7], [1, 3]],
                "measured": {"at": "2026-01-01T00:00:00+00:00", "by": "fuzz"},
            }
        },
        "reference": {"t_ar_ms": 2.0, "c_draft_ms": 1.0, "t_exp_ms": 0.02, "expert_bytes": 4096},
    }


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10),
    st.integers(-(10**400), 10**400),
    st.floats(),
    st.sampled_from([NAN, INF, -INF, 0.0, -0.0, 1e-300]),
    TEXT,
    st.sampled_from(["1e-3", "1E5", "-2e2", ".5e1", "0x10", "1_000", "inf", ".nan", "~", "yes"]),
)
YAML_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_profiles(draw, fingerprint: str):
    """A valid profile with one to three of its nodes replaced, removed or given a new key; or its YAML
    text cut, or with a character or a raw byte put in."""
    data = _good_profile(fingerprint)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(data))))
        if not path:
            data = draw(YAML_VALUES)
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
        if op == "replace":
            parent[path[-1]] = draw(YAML_VALUES)
        elif op == "remove":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(TEXT)] = draw(YAML_VALUES)
        else:
            parent.append(draw(YAML_VALUES))
    text = yaml.safe_dump(data, allow_unicode=True).encode()
    cut = draw(st.sampled_from(["none", "none", "truncate", "insert"]))
    if cut == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif cut == "insert":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.binary(min_size=1, max_size=3) | TEXT.map(str.encode)) + text[at:]
    return text


@pytest.fixture(scope="module")
def olmoe_fingerprint(tiny_models):
    from s2moe.engine.model_info import read_model_info

    return read_model_info(tiny_models["olmoe"]).fingerprint


@fuzz("profile_engine")
@given(data=st.data())
def test_profile_mutations_load_or_say_why(scratch, olmoe_fingerprint, data):
    from s2moe.engine.errors import ConfigError
    from s2moe.engine.profiles import cost_for_model, hot_experts_for_model, load_profile

    path = scratch(".yaml")
    path.write_bytes(data.draw(mutated_profiles(olmoe_fingerprint)))
    try:
        profile = load_profile(str(path))
        for offloaded in (False, True):
            cost = cost_for_model(profile, olmoe_fingerprint, "olmoe.gguf", offloaded=offloaded)
            assert all(isinstance(getattr(cost, f), float) for f in ("t_ar", "c_draft", "t_exp", "t_tok", "intercept"))
        hot = hot_experts_for_model(profile, olmoe_fingerprint)
        assert all(isinstance(p, tuple) and len(p) == 2 for p in hot)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)


@fuzz("profile_cli")
@given(data=st.data())
def test_profile_mutations_through_generate_and_the_list(
    scratch, tiny_models, olmoe_fingerprint, data, tmp_path_factory
):
    path = scratch(".yaml")
    path.write_bytes(data.draw(mutated_profiles(olmoe_fingerprint)))
    argv = [
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hello",
        "-n",
        "3",
        "--threads",
        "1",
        "--ctx",
        "64",
        "--profile",
        path,
        "--json",
        "--ignore-eos",
    ]
    assert_clean(*run_cli(*argv), json_out=True)
    home = tmp_path_factory.mktemp("xdg")
    (home / "s2moe" / "profiles").mkdir(parents=True)
    path.rename(home / "s2moe" / "profiles" / "mutated.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(home))
        rc, out, err = run_cli("profiles", "list")
    assert rc == 0 and "mutated" in out, err


# -- flag values ------------------------------------------------------------------------------------------------
NUMBERISH = st.one_of(
    st.integers(-5, 70).map(str),
    st.integers(-(10**30), 10**30).map(str),
    st.just("9" * 400),
    st.floats().map(repr),
    st.sampled_from(
        ["nan", "inf", "-inf", "1e400", "0x10", "1_000", "٣", " 4", "4 ", "", " ", "+3", "-0", "0.5", "1e3", "0.0"]
    ),
    TEXT,
)


def _whole(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


FLAGS = {
    "--mode": st.one_of(st.sampled_from(["ar", "s2moe", "naive", "conf", "cascade", "lookup"]), TEXT),
    "--temp": NUMBERISH,
    "--seed": NUMBERISH,
    "--draft-topk": NUMBERISH,
    "--draft-max": NUMBERISH,
    "--threshold": NUMBERISH,
    "--reuse-strength": NUMBERISH,
    "--reuse-cap": NUMBERISH,
    "--threads": NUMBERISH,
    "--gpu-layers": NUMBERISH,
    "--top-k": NUMBERISH,
    "--top-p": NUMBERISH,
    "--min-p": NUMBERISH,
    "--repeat-penalty": NUMBERISH,
    "--repeat-last-n": NUMBERISH,
    # a valid context above ~70k tokens is a large allocation (16M tokens take 8.6 GB for the tiny model),
    # not bad input: kept out
    "--ctx": st.one_of(
        st.integers(-5, 70000).map(str),
        st.integers((1 << 24) + 1, 1 << 70).map(str),
        NUMBERISH.filter(lambda v: not _whole(v) or not 70000 < int(v) <= 1 << 24),
    ),
    "--profile": st.one_of(TEXT, st.sampled_from(["cpu-generic", "rtx-4090", "nope"])),
    "--model": st.one_of(TEXT, st.just("/dev/zero"), st.just("/")),
    "--prompt": st.one_of(TEXT, st.binary(max_size=12).map(os.fsdecode), st.just("word " * 80)),
    "--file": st.one_of(TEXT, st.sampled_from(["/dev/zero", "/", "/proc/self/status", "/etc/hostname"])),
}
SWITCHES = ["--greedy", "--no-utility", "--ignore-eos", "--events"]


@fuzz("flags")
@given(
    flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None), min_size=1, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: FLAGS[k] for k in d})
    ),
    switches=st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True),
)
def test_generate_flag_values(tiny_models, flags, switches):
    prompt = {} if "--file" in flags else {"--prompt": "hello"}  # one or the other
    argv = {"--model": str(tiny_models["olmoe"]), **prompt, "--threads": "1", "--ctx": "128", **flags}
    args = ["generate", "-n", "3", "--json", *switches]
    for flag, value in argv.items():
        args += [f"{flag}={value}"]  # =: a value that starts with '-' is still this flag's
    assert_clean(*run_cli(*args), json_out=True)


@fuzz("n_predict")
@given(n=NUMBERISH)
def test_n_predict_values(tiny_models, n):
    assert_clean(
        *run_cli(
            "generate",
            "-m",
            tiny_models["olmoe"],
            "-p",
            "hi",
            f"-n={n}",
            "--ctx",
            "64",
            "--threads",
            "1",
            "--mode",
            "ar",
            "--json",
        ),
        json_out=True,
    )


@fuzz("budget")
@given(
    text=st.one_of(
        NUMBERISH,
        NUMBERISH.map(lambda v: v + "M"),
        st.sampled_from(["auto", "AUTO", " auto ", "800M", "1.5G", "300MiB", "2GB"]),
    )
)
def test_budget_values_parse_or_say_why(text):
    import argparse

    from s2moe.app.options import budget_text
    from s2moe.engine.errors import S2MoEError
    from s2moe.engine.offload import Budget
    from s2moe.engine.offload.procfs import meminfo

    try:
        budget = Budget.parse(text)
    except S2MoEError:
        budget = None
    if budget is None or (budget.size is not None and budget.size > meminfo()["MemTotal"]):
        # what the budget cannot read, or a size beyond this machine, the command line refuses in one line
        with pytest.raises(argparse.ArgumentTypeError) as e:
            budget_text(text)
        assert str(e.value) and "\n" not in str(e.value)
    else:
        assert budget_text(text) == text  # and hands on as it came, for Budget.parse to read again


# -- JSON: copy caches, the app's chat settings, traces -----------------------------------------------------------
def _nested(depth: int, kind: str) -> bytes:
    return b"[" * depth + b"]" * depth if kind == "array" else b'{"a":' * depth + b"0" + b"}" * depth


# What json.loads cannot take (nesting past the recursion limit, integers past 4,300 digits, bytes that are not
# UTF-8) or takes but a reader must not trust (non-finite numbers, lone surrogates, the wrong type).
HOSTILE = st.one_of(
    st.builds(
        _nested,
        st.one_of(st.integers(1, 3000), st.sampled_from([100_000, 120_000])),
        st.sampled_from(["array", "object"]),
    ),
    st.integers(4000, 6000).map(lambda n: b"9" * n),
    st.integers(4000, 6000).map(lambda n: b"-" + b"1" * n),
    st.sampled_from(
        [
            b"1e400",
            b"-1e400",
            b"NaN",
            b"Infinity",
            b"-0",
            b"1.5",
            b"true",
            b"null",
            b'"\\ud800"',
            b'"x"',
            b"[]",
            b"{}",
            b"\xff",
            b"\xc3",
            b"\xed\xa0\x80",
        ]
    ),
    st.integers(-(10**30), 10**30).map(lambda v: str(v).encode()),
    st.binary(min_size=1, max_size=8),
)


@st.composite
def hostile_json(draw, document: bytes):
    """`document` (valid JSON) with a number or the whole of it replaced by HOSTILE, a byte put in, or cut."""
    how = draw(st.sampled_from(["value", "value", "value", "whole", "cut", "byte"]))
    numbers = [m.span() for m in re.finditer(rb"-?[0-9]+(\.[0-9]+)?", document)]
    if how == "whole" or not numbers:
        return draw(HOSTILE)
    if how == "cut":
        return document[: draw(st.integers(0, len(document)))]
    if how == "byte":
        at = draw(st.integers(0, len(document)))
        return document[:at] + draw(st.binary(min_size=1, max_size=3)) + document[at:]
    start, end = draw(st.sampled_from(numbers))
    return document[:start] + draw(HOSTILE) + document[end:]


def _copy_cache(fingerprint: str) -> bytes:
    return json.dumps(
        {
            "format": "s2moe-copy-cache",
            "version": 1,
            "model": fingerprint,
            "generations": [{"prompt": [1, 2, 3], "text": [1, 2, 3, 4, 5]}],
        }
    ).encode()


SETTINGS = json.dumps(
    {
        "mode": "s2moe",
        "n_predict": 64,
        "draft_topk": 2,
        "temperature": 0.0,
        "seed": 1,
        "reuse_strength": 0.5,
        "reuse_cap": 6,
    }
).encode()


@pytest.fixture(scope="module")
def olmoe_info(tiny_models):
    from s2moe.engine.model_info import read_model_info

    return read_model_info(tiny_models["olmoe"])


@fuzz("json_engine")
@given(data=st.data())
def test_copy_caches_and_app_settings_read_or_say_why(scratch, olmoe_info, data):
    """The engine's copy-cache reader and the app's settings reader: the generations or the settings, or a
    ConfigError of one line (which the CLI prints and the app shows), never another exception."""
    from s2moe.app.tui.state import remembered_settings, settings_from_state, state_dir
    from s2moe.engine.drafting.copycache import load_copy_cache
    from s2moe.engine.drafting.ngrams import EarlierText
    from s2moe.engine.errors import ConfigError

    path = scratch(".json")
    path.write_bytes(data.draw(hostile_json(_copy_cache(olmoe_info.fingerprint))))
    try:
        assert load_copy_cache(path, olmoe_info, EarlierText(), write_back=False) >= 0
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / "chat-settings.json").write_bytes(data.draw(hostile_json(SETTINGS)))
    try:
        settings_from_state(remembered_settings())
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)


@fuzz("json_cli")
@given(data=st.data())
def test_copy_caches_through_generate(scratch, tiny_models, olmoe_info, data):
    path = scratch(".json")
    written = data.draw(hostile_json(_copy_cache(olmoe_info.fingerprint)))
    path.write_bytes(written)
    rc, out, err = run_cli(
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hello",
        "-n",
        "3",
        "--threads",
        "1",
        "--ctx",
        "64",
        "--copy-cache",
        path,
        "--json",
    )
    assert_clean(rc, out, err, json_out=True)
    if rc != 0:
        assert path.read_bytes() == written  # a file refused is left as it was


@pytest.fixture(scope="module")
def recorded_trace(tiny_models, tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    assert (
        main(
            [
                "generate",
                "-m",
                str(tiny_models["olmoe"]),
                "-p",
                "hello there",
                "-n",
                "6",
                "--threads",
                "1",
                "--ignore-eos",
                "--trace",
                str(path),
            ]
        )
        == 0
    )
    return path.read_bytes()


@fuzz("json_trace")
@given(data=st.data())
def test_traces_through_project(scratch, recorded_trace, data):
    lines = recorded_trace.splitlines()
    at = data.draw(st.integers(0, len(lines) - 1))
    lines[at] = data.draw(hostile_json(lines[at]))
    path = scratch(".jsonl")
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert_clean(*run_cli("project", path, "--profile", "cpu-generic", "--json"), json_out=True)
