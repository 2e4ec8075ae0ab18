"""llama.cpp's flag spellings, whole option names only, --version, the echoed prompt, and --events lines that
stay whole on a terminal the text also streams to."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
from importlib.metadata import version

import pytest
from s2moe.app.cli import main
from s2moe.app.parser import build_parser
from s2moe.engine.errors import ConfigError

# The options each command takes, with what it needs besides.
GPU_LAYERS = {"generate": ["-p", "x"]}
CTX = {"generate": ["-p", "x"], "app": []}
THREADS = {"generate": ["-p", "x"], "app": [], "bench": [], "calibrate": []}


def parse(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("flag", [["-ngl", "0"], ["-ngl=0"], ["--n-gpu-layers", "0"], ["--gpu-layers", "0"]])
def test_gpu_layers_in_llama_cpp_spellings(flag):
    for command, rest in GPU_LAYERS.items():
        args = parse(command, *rest, *flag, "-n", "5")
        assert (args.gpu_layers, args.n_predict) == (0, 5)
    assert parse("generate", "-p", "x", "-ngl", "-1").gpu_layers == -1


@pytest.mark.parametrize("command", [["models"], ["profiles", "list"]])
def test_ngl_where_there_is_no_such_option_is_named_not_read_as_dash_n(command):
    with pytest.raises(ConfigError, match=r"unknown option -ngl: no -ngl/--n-gpu-layers"):
        parse(*command, "-ngl", "0")


def test_ngl_with_its_value_glued_on_says_how_to_write_it():
    with pytest.raises(ConfigError, match=r"-ngl0: put a space or = between -ngl and its value"):
        parse("generate", "-p", "x", "-ngl0")


@pytest.mark.parametrize("flag", [["-c", "256"], ["--ctx-size", "256"], ["--ctx", "256"], ["-c256"]])
def test_context_size(flag):
    for command, rest in CTX.items():
        assert parse(command, *rest, *flag).ctx == 256


@pytest.mark.parametrize("flag", [["-t", "1"], ["--threads", "1"]])
def test_threads(flag):
    for command, rest in THREADS.items():
        assert parse(command, *rest, *flag).threads == 1


def test_seed():
    assert parse("generate", "-p", "x", "-s", "5").seed == 5 == parse("generate", "-p", "x", "--seed", "5").seed
    assert parse("generate", "-p", "x", "-s", "-1").seed == -1  # random, as in llama.cpp
    assert parse("generate", "-p", "x", "-s", "4294967295").seed == 4294967295
    for bad in ("-2", "4294967296"):
        with pytest.raises(
            ConfigError,
            match=re.escape(f"-s/--seed: must be -1 (random) or a whole number from 0 to 4294967295, got {bad}"),
        ):
            parse("generate", "-p", "x", "-s", bad)


def test_sampling_options_default_to_llama_cpps():
    args = parse("generate", "-p", "x")
    assert (args.top_k, args.top_p, args.min_p, args.repeat_penalty, args.repeat_last_n) == (40, 0.95, 0.05, 1.0, 64)
    args = parse(
        "generate",
        "-p",
        "x",
        "--top-k",
        "0",
        "--top-p",
        "1",
        "--min-p",
        "0",
        "--repeat-penalty",
        "1.1",
        "--repeat-last-n",
        "-1",
    )
    assert (args.top_k, args.top_p, args.min_p, args.repeat_penalty, args.repeat_last_n) == (0, 1.0, 0.0, 1.1, -1)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--top-k", "-1"], "--top-k: must be a whole number ≥ 0, got -1"),
        (["--top-k", "2.5"], "--top-k: expected a whole number, got '2.5'"),
        (["--top-p", "1.5"], "--top-p: must be between 0 and 1, got 1.5"),
        (["--min-p", "nan"], "--min-p: must be a finite number, got nan"),
        (["--repeat-penalty", "0"], "--repeat-penalty: must be a number > 0, got 0"),
        (["--repeat-penalty", "inf"], "--repeat-penalty: must be a finite number, got inf"),
        (["--repeat-last-n", "-2"], "--repeat-last-n: must be -1 (the whole context), 0 (off) or a number of tokens"),
    ],
)
def test_sampling_option_values_out_of_range_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse("generate", "-p", "x", *argv)


def test_a_prompt_from_a_file(tiny_models, tmp_path, capsys):
    """-f reads the prompt as llama.cpp does (one final newline dropped); -p and -f together are refused."""
    (tmp_path / "p.txt").write_text("hello there\n", encoding="utf-8")
    common = [
        "generate",
        "-m",
        str(tiny_models["olmoe"]),
        "-n",
        "4",
        "-t",
        "1",
        "-c",
        "64",
        "--mode",
        "ar",
        "--ignore-eos",
        "--json",
    ]
    assert main([*common, "-f", str(tmp_path / "p.txt")]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*common, "-p", "hello there"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == from_file["tokens"]
    with pytest.raises(ConfigError, match="-f/--file: not allowed with argument --prompt/-p"):
        parse("generate", "-p", "x", "-f", str(tmp_path / "p.txt"))
    with pytest.raises(ConfigError, match="one of the arguments --prompt/-p -f/--file is required"):
        parse("generate")


@pytest.mark.parametrize(
    "content,message",
    [
        (b"caf\xe9\n", "is not UTF-8 text (an invalid byte at offset 3)"),
        (None, "is a directory, not a file"),
    ],
)
def test_a_prompt_file_that_is_not_utf8_text_is_one_line(tiny_models, tmp_path, capsys, content, message):
    path = tmp_path / "p.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["generate", "-m", str(tiny_models["olmoe"]), "-f", str(path), "-t", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_random_seed_is_printed_and_recorded(tiny_models, capsys):
    common = [
        "generate",
        "-m",
        str(tiny_models["olmoe"]),
        "-p",
        "hello",
        "-n",
        "4",
        "-t",
        "1",
        "-c",
        "64",
        "--mode",
        "ar",
        "--temp",
        "0.8",
        "--ignore-eos",
        "-s",
        "-1",
    ]
    assert main([*common, "--json"]) == 0
    seed = json.loads(capsys.readouterr().out)["seed"]
    assert 0 <= seed <= 4294967295
    assert main(common) == 0
    printed = re.search(r"^seed (\d+) \(random; -s \1 repeats this run\)$", capsys.readouterr().err, re.M)
    assert printed and int(printed.group(1)) != seed  # drawn again: the chance of the same one is 2^-32


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "-p", "x", "--draft", "3"],  # --draft-topk or --draft-max?
        ["generate", "-p", "x", "--n-pred", "3"],
        ["bench", "--n-prompt", "3"],
        ["calibrate", "--repeat", "2"],
        ["app", "--prof", "x"],
    ],
)
def test_abbreviations_are_unknown_options(argv):
    with pytest.raises(ConfigError, match=re.escape(f"unrecognized arguments: {argv[-2]} {argv[-1]}")):
        parse(*argv)


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"s2moe {version('s2moe')}\n"


def test_prompt_is_echoed_before_the_text_unless_asked_not_to(tiny_models, capsys):
    common = [
        "generate",
        "-m",
        str(tiny_models["olmoe"]),
        "-p",
        "hello there",
        "-n",
        "6",
        "-t",
        "1",
        "-c",
        "64",
        "--mode",
        "ar",
        "--ignore-eos",
    ]
    assert main([*common, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert main(common) == 0
    assert capsys.readouterr().out.startswith("hello there" + text + "\n--\n")
    assert main([*common, "--no-display-prompt"]) == 0
    assert capsys.readouterr().out.startswith(text + "\n--\n")


def test_events_do_not_split_the_streamed_text_on_one_terminal(tiny_models, monkeypatch):
    """stdout and stderr on the same terminal (a pty): every event line starts on a line of its own."""
    master, slave = os.openpty()
    name = os.ttyname(slave)
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's last writer closed it
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    # Buffered as Python buffers a terminal's stdout and stderr.
    out = io.TextIOWrapper(
        io.FileIO(os.open(name, os.O_WRONLY | os.O_NOCTTY), "w"), encoding="utf-8", line_buffering=True
    )
    err = io.TextIOWrapper(
        io.FileIO(os.open(name, os.O_WRONLY | os.O_NOCTTY), "w"), encoding="utf-8", write_through=True
    )
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    try:
        rc = main(
            [
                "generate",
                "-m",
                str(tiny_models["olmoe"]),
                "-p",
                "hello",
                "-n",
                "12",
                "-t",
                "1",
                "-c",
                "64",
                "--ignore-eos",
                "--no-utility",
                "--events",
            ]
        )
        out.flush()
        err.flush()
    finally:
        monkeypatch.undo()
        out.close()
        err.close()
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    shown = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    assert rc == 0, shown
    events = re.findall(r"(^|.)\[\d+\] drafted ", shown, flags=re.M | re.S)
    assert len(events) >= 2, shown
    assert all(before in ("", "\n") for before in events), shown
    assert "hello" in shown and "tok/s" in shown
