"""`s2moe generate` end to end, and every kind of bad input: one line, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def s2moe(*args, timeout=120):
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "s2moe.app.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_clean_error(done, *needles):
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_generate_json_has_the_documented_fields(tiny_models):
    done = s2moe(
        "generate",
        "--model",
        str(tiny_models["olmoe"]),
        "-p",
        "hello there",
        "-n",
        "24",
        "--json",
        "--threads",
        "1",
        "--no-utility",
        "--ignore-eos",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for key in (
        "mode",
        "tokens",
        "text",
        "n_tokens",
        "tok_per_s",
        "accept_len",
        "reuse_ratio",
        "rollbacks",
        "iterations",
    ):
        assert key in out
    assert 0 < out["prefill_seconds"] < out["seconds"]
    # both speeds, each named: over the whole generation, and decoding alone as bench and tune count it
    assert out["decode_tok_per_s"] == pytest.approx(out["n_tokens"] / (out["seconds"] - out["prefill_seconds"]))
    assert out["tok_per_s"] == pytest.approx(out["n_tokens"] / out["seconds"])
    assert out["tok_per_s"] < out["decode_tok_per_s"]
    assert out["mode"] == "s2moe" and out["n_tokens"] == 24 == len(out["tokens"])
    assert out["accept_len"] >= 1.0 and out["tok_per_s"] > 0 and 0 < out["reuse_ratio"] <= 1


def test_generate_prints_text_then_summary(tiny_models):
    done = s2moe(
        "generate", "--model", str(tiny_models["qwen3moe"]), "-p", "hello", "-n", "8", "--threads", "1", "--ignore-eos"
    )
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stdout and "accept length" in done.stdout and "rollbacks" in done.stdout
    assert re.search(r"\(\d+\.\d tok/s decoding, \d+\.\d with the \d+\.\d\d s prefill\)", done.stdout)
    assert "cost constants (measured at start-up)" in done.stderr


def test_missing_model(tmp_path):
    assert_clean_error(s2moe("generate", "--model", str(tmp_path / "nope.gguf"), "-p", "x"), "not found")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("definitely not a model\n")
    assert_clean_error(s2moe("generate", "--model", str(bad), "-p", "x"), "not a GGUF")


@pytest.mark.parametrize("keep", [0.001, 0.6])
def test_truncated_gguf(tiny_models, tmp_path, keep):
    data = tiny_models["olmoe"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    assert_clean_error(s2moe("generate", "--model", str(cut), "-p", "x"), "truncated")


def test_dense_model_runs_ar_with_a_notice_and_refuses_moe_modes(tiny_models):
    ok = s2moe(
        "generate", "--model", str(tiny_models["llama"]), "-p", "hello", "-n", "4", "--mode", "ar", "--threads", "1"
    )
    assert ok.returncode == 0, ok.stderr
    assert "dense model" in ok.stderr and len(ok.stderr.strip().splitlines()) == 1
    assert_clean_error(s2moe("generate", "--model", str(tiny_models["llama"]), "-p", "hello"), "dense")


def test_draft_topk_must_be_below_k(tiny_models):
    assert_clean_error(
        s2moe("generate", "--model", str(tiny_models["olmoe"]), "-p", "x", "--draft-topk", "4"), "--draft-topk"
    )


def test_prompt_longer_than_context(tiny_models):
    assert_clean_error(
        s2moe("generate", "--model", str(tiny_models["olmoe"]), "-p", "word " * 300, "--ctx", "32"), "context"
    )


def test_a_prompt_longer_than_the_batch_is_prefilled_in_chunks_to_the_same_tokens(tiny_models):
    outs = [
        s2moe(
            "generate",
            "--model",
            str(tiny_models["olmoe"]),
            "-p",
            "word " * 100,
            "-n",
            "6",
            "--json",
            "--threads",
            "1",
            "--mode",
            "ar",
            *flags,
        )
        for flags in ([], ["-b", "32"])
    ]
    assert all(o.returncode == 0 for o in outs), outs[1].stderr
    assert json.loads(outs[0].stdout)["tokens"] == json.loads(outs[1].stdout)["tokens"]


def test_context_filling_up_mid_generation_stops_cleanly(tiny_models):
    done = s2moe(
        "generate",
        "--model",
        str(tiny_models["olmoe"]),
        "-p",
        "hello",
        "--ctx",
        "32",
        "-n",
        "400",
        "--json",
        "--threads",
        "1",
        "--ignore-eos",
        "--no-utility",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["stop_reason"] == "context"
    assert 0 < out["n_tokens"] < 400


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["-n", "0"], "-n"),
        (["-n", "many"], "-n"),
        (["--temp", "-1"], "--temp"),
        (["--temp", "nan"], "--temp"),
        (["--draft-max", "0"], "--draft-max"),
        (["-b", "0"], "--batch-size"),
        (["--reuse-strength", "x"], "--reuse-strength"),
        (["--mode", "fast"], "--mode"),
        (["--bogus"], "--bogus"),
        (["--greedy", "--temp", "0.7"], "--greedy"),
        (["--profile", "no-such-profile"], "no-such-profile"),
    ],
)
def test_invalid_flags(tiny_models, flags, needle):
    assert_clean_error(s2moe("generate", "--model", str(tiny_models["olmoe"]), "-p", "x", *flags), needle)


def test_bad_profile_yaml(tiny_models, tmp_path):
    prof = tmp_path / "broken.yaml"
    prof.write_text("models: [unclosed\n")
    assert_clean_error(
        s2moe("generate", "--model", str(tiny_models["olmoe"]), "-p", "x", "--profile", str(prof)), "invalid YAML"
    )


def test_a_mode_list_that_starts_with_a_dash_is_told_how_to_pass_it(capsys):
    from s2moe.app.cli import main

    assert main(["bench", "--modes", "-gating,ar"]) == 2
    err = capsys.readouterr().err
    assert "--modes=-gating,ar" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "-m", ""],
        ["bench", "--profile", " "],
        ["app", "-m", ""],
        ["app", "--profile", ""],
        ["app", "--budget", "9" * 400],
        ["bench", "--budget", "9" * 400],
    ],
)
def test_empty_paths_and_absurd_budgets_are_one_line_errors(argv, capsys):
    from s2moe.app.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "-p", "x", "--pregate", "2"], "give --budget too"),
        (["bench", "--pregate", "1"], "give --budget too"),
        (["generate", "-p", "x", "--budget", "1G", "--pregate", "5"], "0 to 4"),
        (["bench", "--pregate", "two"], "0 to 4"),
        (["bench", "--pregate", "1:-1"], "0 to 4"),
    ],
)
def test_pregate_is_a_depth_under_a_budget(argv, needle, capsys):
    from s2moe.app.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_models_lists_whole_paths_and_json(capsys):
    from s2moe.app.cli import main
    from s2moe.engine.zoo import list_models

    shipped = list_models()
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(f"{m['name']}" in out and str(m["path"]) in out for m in shipped)  # whole, copyable
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == [m["name"] for m in shipped]
    assert all(m["path"] == str(s["path"]) for m, s in zip(listed, shipped))


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["-ngl", "-1"],
        ["-ngl", "12", "--cpu-moe"],
        ["--n-cpu-moe", "3"],
        ["-ngl", "99", "--cpu-moe", "--op-offload-min-batch", "4"],
    ],
)
def test_a_budget_child_is_given_the_placement_it_was_asked_for(flags):
    """bench reruns itself under each budget: the child must place the weights as the parent was told (a
    Jetson's --cpu-moe under a budget), so the flags it gets parse back to the same Placement."""
    from s2moe.app.options import placement_flags, placement_from_args
    from s2moe.app.parser import build_parser

    parser = build_parser()
    asked = placement_from_args(parser.parse_args(["bench", *flags]))
    assert placement_from_args(parser.parse_args(["bench", *placement_flags(asked)])) == asked


def test_a_copy_cache_carries_generations_from_one_run_to_the_next(tiny_models, tmp_path):
    """--copy-cache: each run adds its prompt and text to the file (created by the first), the runs before kept;
    a file of another model, or not a copy cache, is one clean error and stays as it was."""
    cache = tmp_path / "copies.json"
    runs = []
    for prompt in ("hello there", "good morning"):
        done = s2moe(
            "generate",
            "--model",
            str(tiny_models["olmoe"]),
            "-p",
            prompt,
            "-n",
            "12",
            "--json",
            "--threads",
            "1",
            "--ignore-eos",
            "--copy-cache",
            str(cache),
        )
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    kept = json.loads(cache.read_text())
    assert kept["format"] == "s2moe-copy-cache" and len(kept["generations"]) == 2
    for g, out in zip(kept["generations"], runs):
        assert g["text"][: len(g["prompt"])] == g["prompt"]
        assert g["text"][len(g["prompt"]) :] == out["tokens"]
    other = s2moe(
        "generate",
        "--model",
        str(tiny_models["qwen3moe"]),
        "-p",
        "hi",
        "-n",
        "4",
        "--threads",
        "1",
        "--copy-cache",
        str(cache),
    )
    assert_clean_error(other, "another model's tokens")
    assert json.loads(cache.read_text()) == kept
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "s2moe-copy-cache", "version": 1, "model": "x", "generations": [')
    assert_clean_error(
        s2moe("generate", "--model", str(tiny_models["olmoe"]), "-p", "hi", "-n", "4", "--copy-cache", str(broken)),
        "not valid JSON",
    )
    assert broken.read_text().endswith("[")
    nowhere = s2moe(
        "generate",
        "--model",
        str(tiny_models["olmoe"]),
        "-p",
        "hi",
        "-n",
        "4",
        "--copy-cache",
        str(tmp_path / "missing" / "copies.json"),
    )
    assert_clean_error(nowhere, "there is no folder")
