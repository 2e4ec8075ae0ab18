"""What the README promises for bad input, signals and the filesystem: one line on stderr and exit code 2
for bad input, exit code 130 for Ctrl-C, no hang, no half-written or left-behind file."""

from __future__ import annotations

import os
import threading

import pytest

from s2moe.app.cli import main
from s2moe.engine.errors import ConfigError, ModelError


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line(rc: int, err: str, *needles: str, code: int = 2) -> None:
    assert rc == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def make_fifo():
    """Named pipes with no writer. Should anything open one for reading, a watchdog opens its writing end
    after a while, so that a regression fails the test instead of hanging the suite."""
    done = threading.Event()
    watchdogs = []

    def make(path):
        os.mkfifo(path)

        def unblock():
            if not done.wait(30):
                with open(path, "wb"):
                    pass

        watchdogs.append(threading.Thread(target=unblock, daemon=True))
        watchdogs[-1].start()
        return path

    yield make
    done.set()
    for w in watchdogs:
        w.join()


@pytest.fixture
def fifo(make_fifo, tmp_path):
    return make_fifo(tmp_path / "pipe.gguf")


# -- only regular files are opened ----------------------------------------------------------------------------
def test_a_fifo_as_the_model_is_refused_without_opening_it(fifo, capsys):
    from s2moe.engine.calibrate import run_calibration

    rc, _, err = run_cli(capsys, "generate", "-m", fifo, "-p", "hi")
    assert_one_line(rc, err, "not a regular file")
    with pytest.raises(ModelError, match="not a regular file"):
        next(run_calibration(fifo, save=False))


def test_a_device_or_fifo_as_prompts_is_refused(fifo):
    from s2moe.engine.bench import load_prompts
    from s2moe.engine.calibrate import read_prompts

    for path in ("/dev/zero", fifo):
        with pytest.raises(ConfigError, match="not a regular file"):
            read_prompts(path)
    with pytest.raises(ConfigError, match="not 'humaneval', 'natural' or an existing JSONL file"):
        load_prompts(str(fifo))


def test_prompt_files_are_read_with_a_bound(tmp_path):
    from s2moe.engine.bench import load_prompts
    from s2moe.engine.calibrate import read_prompts
    from s2moe.engine.files import MAX_PROMPT_FILE_BYTES

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_PROMPT_FILE_BYTES + 1)  # sparse: no 16 MiB written
    with pytest.raises(ConfigError, match="big.txt: larger than 16 MiB"):
        read_prompts(big)
    with pytest.raises(ConfigError, match="big.txt: larger than 16 MiB"):
        load_prompts(str(big))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_prompts(str(latin))


def test_a_fifo_in_the_profile_folder_is_listed_as_invalid(make_fifo, tmp_path, monkeypatch):
    from s2moe.engine.profiles import list_profiles

    folder = tmp_path / "cfg" / "s2moe" / "profiles"
    folder.mkdir(parents=True)
    make_fifo(folder / "pipe.yaml")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (entry,) = [e for e in list_profiles() if e.name == "pipe"]
    assert entry.kind == "invalid" and "not a regular file" in entry.error
