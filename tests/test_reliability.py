"""What the README promises for bad input, signals and the filesystem: one line on stderr and exit code 2
for bad input, exit code 130 for Ctrl-C, no hang, no half-written or left-behind file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import gguf
import pytest
from conftest import variant_spec
from tinygguf import TinySpec, write_tiny

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


# -- what llama.cpp asserts on is refused before it sees the file -------------------------------------------
U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
NAN, INF = float("nan"), float("inf")

# Each of these stopped llama.cpp in an assertion (exit 134, a debugger backtrace on stdout) or a
# traceback here, on a file that otherwise looks fine.
ASSERTED = [
    ("olmoe", {"{arch}.expert_count": (0, U32)}, "expert_count 0"),
    ("olmoe", {"{arch}.expert_count": (1, U32)}, "between 1 and expert_count (1)"),
    ("olmoe", {"{arch}.expert_count": (100000, U32)}, "limit of 1024"),
    ("olmoe", {"{arch}.expert_count": None}, "expert_count 0"),
    ("olmoe", {"{arch}.expert_count": ("8", STR)}, "expert_count must be a GGUF UINT32, got STRING"),
    ("olmoe", {"{arch}.expert_used_count": (0, U32)}, "between 1 and expert_count (8)"),
    ("olmoe", {"{arch}.expert_used_count": (9, U32)}, "between 1 and expert_count (8)"),
    ("llama", {"{arch}.expert_used_count": (2, U32)}, "no experts"),
    ("olmoe", {"{arch}.block_count": (0, U32)}, "block_count 0 is outside"),
    ("olmoe", {"{arch}.block_count": (0xFFFFFFFF, U32)}, "block_count 4294967295 is outside"),
    ("llama", {"{arch}.block_count": (513, U32)}, "1–512 layers"),
    ("qwen3moe", {"{arch}.attention.layer_norm_rms_epsilon": (NAN, F32)}, "layer_norm_rms_epsilon must be"),
    ("olmoe", {"{arch}.attention.layer_norm_rms_epsilon": (-1.0, F32)}, "finite number above 0, got -1.0"),
    ("olmoe", {"{arch}.attention.layer_norm_rms_epsilon": (INF, F32)}, "layer_norm_rms_epsilon"),
    ("llama", {"{arch}.attention.layer_norm_rms_epsilon": (0.0, F32)}, "layer_norm_rms_epsilon"),
    ("olmoe", {"{arch}.attention.layer_norm_epsilon": (NAN, F32)}, "layer_norm_epsilon must be"),
    ("dots1", {"{arch}.rope.freq_base": (0.0, F32)}, "rope.freq_base"),
    ("olmoe", {"{arch}.attention.key_length": (8, U32)}, "head sizes must be equal"),
    ("qwen3moe", {"{arch}.rope.dimension_count": (8, U32)}, "head sizes must be equal"),
    ("dots1", {"{arch}.attention.value_length": (8, U32)}, "head sizes must be equal"),
    ("olmoe", {"{arch}.context_length": ("x", STR)}, "context_length must be a GGUF UINT32"),
]


@pytest.mark.parametrize("arch,metadata,needle", ASSERTED,
                         ids=[f"{a}-{'-'.join(m)}-{n[:12]}" for a, m, n in ASSERTED])
def test_metadata_llama_cpp_asserts_on_is_refused_first(tmp_path, capsys, arch, metadata, needle):
    from s2moe.engine.model_info import read_model_info

    model = write_tiny(tmp_path / "m.gguf", variant_spec(arch) if arch != "llama" else TinySpec(arch="llama"),
                       metadata=metadata)
    with pytest.raises(ModelError, match=re.escape(needle)):
        read_model_info(model)
    # the CLI, in this very process: were the check missing, llama.cpp would stop the test run here
    rc, out, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "-n", "2", "--threads", "1", "--json")
    assert_one_line(rc, err, needle)
    assert out == ""


def test_llama_cpp_load_failures_say_why(tmp_path, capsys):
    # 7 experts declared, tensors of 8: llama.cpp refuses the file (no assertion) and says which tensor
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"{arch}.expert_count": (7, U32)})
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "-n", "2", "--threads", "1")
    assert_one_line(rc, err, "llama.cpp could not load m.gguf: check_tensor_dims: tensor 'blk.0.ffn_gate_inp.weight' "
                             "has wrong shape")
    model = write_tiny(tmp_path / "arch.gguf", variant_spec("olmoe"), metadata={"general.architecture": ("nosuch", STR)})
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "-n", "2", "--threads", "1")
    assert_one_line(rc, err, "unknown model architecture: 'nosuch'")


LLAMA_ABORT = """
import sys
import llama_cpp
from s2moe.app.cli import _abort_line
from s2moe.engine.runtime import on_llama_abort
on_llama_abort(_abort_line)
llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
print("not reached")
"""


def test_a_failed_check_inside_llama_cpp_is_one_line_not_a_backtrace(tmp_path):
    """The last line of defence, for a check the model reader does not know yet: a file that stops llama.cpp
    in an assertion, loaded past the reader."""
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"{arch}.block_count": (0, U32)})
    done = subprocess.run([sys.executable, "-c", LLAMA_ABORT, str(model)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-2000:])
    assert done.stderr.splitlines()[-1] == (
        "error: llama.cpp stopped on a failed check (llama-model.cpp:1328: GGML_ASSERT(hparams.n_layer_all > 0 && "
        "hparams.n_layer_all <= LLAMA_MAX_LAYERS) failed): the model file or a setting is not one it supports")


# -- threads and context ----------------------------------------------------------------------------------
def test_threads_are_capped_with_one_line(tiny_models, capsys, monkeypatch):
    from s2moe.engine import runtime

    monkeypatch.setattr(runtime, "default_threads", lambda: 2)
    for threads in ("999", "99999999999999999999"):
        rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--threads", threads)
        assert_one_line(rc, err, f"--threads {threads} is more than 8 (4 × the 2 CPUs")
    rc, _, err = run_cli(capsys, "calibrate", "-m", tiny_models["olmoe"], "--threads", "999", "--no-save")
    assert_one_line(rc, err, "--threads 999 is more than 8")
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "2", "--threads", "8",
                         "--mode", "ar")
    assert rc == 0, err


@pytest.mark.parametrize("ctx,needle", [("1", "--ctx 1 is too small: the context must hold at least 32 tokens"),
                                        ("16", "--ctx 16 is too small"), ("17", "at least 32 tokens"),
                                        ("31", "--ctx 31 is too small"),
                                        ("4294967296", "--ctx 4294967296 is above the largest context s2moe accepts "
                                                       "(16777216 tokens)")])
def test_context_sizes_out_of_range_say_the_limit(tiny_models, capsys, ctx, needle):
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--ctx", ctx, "--threads", "1")
    assert_one_line(rc, err, needle)


def test_the_smallest_context_runs_every_mode(tiny_models, capsys):
    for mode in ("s2moe", "ar"):
        rc, out, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "4", "--ctx", "32",
                               "--threads", "1", "--mode", mode, "--json", "--ignore-eos")
        assert rc == 0, err
        assert json.loads(out)["n_tokens"] == 4


# -- Ctrl-C at any moment -------------------------------------------------------------------------------------
class _InterruptOnFirstLine:
    """Stands in for the llama.cpp log: the first line it is given, the process gets a Ctrl-C (SIGINT), so
    the Python handler runs inside llama.cpp's log callback, in the middle of a model load."""

    def __init__(self):
        self.sent = False

    def debug(self, msg, *args):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_inside_llama_cpp_log_callback_interrupts_the_load(tiny_models, monkeypatch, capfd):
    from s2moe.engine import runtime
    from s2moe.engine.model_info import read_model_info

    info = read_model_info(tiny_models["olmoe"])
    monkeypatch.setattr(runtime, "_log", _InterruptOnFirstLine())
    with pytest.raises(KeyboardInterrupt):
        runtime.LlamaRuntime(info, n_ctx=64, n_threads=1)
    assert runtime._log.sent
    assert "Exception ignored" not in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    runtime.LlamaRuntime(info, n_ctx=64, n_threads=1).close()  # the handler is back: a load without Ctrl-C works


def test_ctrl_c_during_calibrate_model_load_writes_no_profile(tiny_models, monkeypatch, tmp_path):
    from s2moe.engine import runtime
    from s2moe.engine.calibrate import run_calibration

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setattr(runtime, "_log", _InterruptOnFirstLine())
    with pytest.raises(KeyboardInterrupt):
        for _ in run_calibration(str(tiny_models["olmoe"]), prompts=["hello"], n_threads=1, repeats=1):
            pass
    assert not list(tmp_path.rglob("*.yaml"))


@pytest.fixture(scope="module")
def widened_model(tmp_path_factory):
    """The shipped default model with experts 8 times as wide: a load long enough to land a signal in."""
    out = tmp_path_factory.mktemp("widened") / "w8.gguf"
    done = subprocess.run([sys.executable, "-m", "s2moe.app.cli", "make-synthetic", "--from", "olmoe-64x8",
                           "--widen", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def _inside_llama_load(pid: int, model: str, seen: dict) -> bool:
    """Whether llama.cpp now has the model open, judged from outside: our own reader maps the file and lets
    go of it first; the next time the process holds it open is llama.cpp's load."""
    try:
        fds = sum(1 for fd in os.listdir(f"/proc/{pid}/fd") if _link(f"/proc/{pid}/fd/{fd}") == model)
        with open(f"/proc/{pid}/maps") as f:
            mapped = model in f.read()
    except OSError:
        return False
    if mapped and not seen.get("llama"):
        seen["reader"] = True
    if seen.get("reader") and not mapped and fds == 0:
        seen["llama"] = True  # the reader has let go; llama.cpp opens it next
        return False
    return bool(seen.get("llama") and fds)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.mark.parametrize("delay_ms", [0, 15, 30, 45])
def test_ctrl_c_during_a_real_model_load_exits_130(widened_model, delay_ms):
    """A real Ctrl-C from outside, sent while llama.cpp loads a 160 MB model: before, it was swallowed in the
    log callback and generation went on to exit 0."""
    model = os.path.realpath(widened_model)
    proc = subprocess.Popen([sys.executable, "-m", "s2moe.app.cli", "generate", "-m", model, "-p", "hello",
                             "-n", "100000", "--ignore-eos", "--mode", "ar", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen, deadline = {}, time.monotonic() + 60
        while not _inside_llama_load(proc.pid, model, seen):
            assert proc.poll() is None and time.monotonic() < deadline, "never saw llama.cpp load the model"
        time.sleep(delay_ms / 1000)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err)
