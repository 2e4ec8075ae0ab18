"""What docs/reliability.md promises for bad input, signals and the filesystem: one line on stderr and exit code 2
for bad input, exit code 130 for Ctrl-C and 143 for SIGTERM, no hang, no half-written or left-behind file."""

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
from s2moe.app.cli import main
from s2moe.engine.errors import ConfigError, ModelError
from tinygguf import TinySpec, write_tiny


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
    from s2moe.engine.measure.calibrate import run_calibration

    rc, _, err = run_cli(capsys, "generate", "-m", fifo, "-p", "hi")
    assert_one_line(rc, err, "not a regular file")
    with pytest.raises(ModelError, match="not a regular file"):
        next(run_calibration(fifo, save=False))


def test_a_device_or_fifo_as_prompts_is_refused(fifo):
    from s2moe.engine.measure.calibration_measures import read_prompts
    from s2moe.engine.measure.prompts import load_prompts

    for path in ("/dev/zero", fifo):
        with pytest.raises(ConfigError, match="not a regular file"):
            read_prompts(path)
    with pytest.raises(ConfigError, match="not 'humaneval', 'natural' or an existing JSONL file"):
        load_prompts(str(fifo))


def test_prompt_files_are_read_with_a_bound(tmp_path):
    from s2moe.engine.files import MAX_PROMPT_FILE_BYTES
    from s2moe.engine.measure.calibration_measures import read_prompts
    from s2moe.engine.measure.prompts import load_prompts

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
    # found by tests/test_fuzz.py
    ("dots1", {"{arch}.attention.head_count_kv": (8, U32)}, "blk.0.attn_k.weight has 64 rows, but the head count"),
    ("dots1", {"{arch}.expert_gating_func": None}, "dots1 needs expert_gating_func"),
    ("dots1", {"{arch}.expert_gating_func": (0, U32)}, "expert_gating_func 0 is not one of llama.cpp's (1–4)"),
    ("olmoe", {"{arch}.expert_gating_func": (16, U32)}, "expert_gating_func 16 is not one"),
    ("qwen3moe", {"{arch}.rope.dimension_count": (0, U32)}, "rope.dimension_count 0"),
    ("olmoe", {"tokenizer.ggml.model": ("llama", STR)}, "SentencePiece vocabulary without the byte token <0x00>"),
]


@pytest.mark.parametrize("arch,metadata,needle", ASSERTED, ids=[f"{a}-{'-'.join(m)}-{n[:12]}" for a, m, n in ASSERTED])
def test_metadata_llama_cpp_asserts_on_is_refused_first(tmp_path, capsys, arch, metadata, needle):
    from s2moe.engine.model_info import read_model_info

    model = write_tiny(
        tmp_path / "m.gguf", variant_spec(arch) if arch != "llama" else TinySpec(arch="llama"), metadata=metadata
    )
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
    assert_one_line(
        rc,
        err,
        "llama.cpp could not load m.gguf: check_tensor_dims: tensor 'blk.0.ffn_gate_inp.weight' has wrong shape",
    )
    model = write_tiny(
        tmp_path / "arch.gguf", variant_spec("olmoe"), metadata={"general.architecture": ("nosuch", STR)}
    )
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "-n", "2", "--threads", "1")
    assert_one_line(rc, err, "unknown model architecture: 'nosuch'")


def test_a_tokenizer_that_gives_no_token_is_one_line(tmp_path, capsys):
    # the RWKV tokenizer on a byte-level BPE vocabulary has no token for a space: it gives -1, which
    # llama_decode refused with a RuntimeError traceback
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"tokenizer.ggml.model": ("rwkv", STR)})
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hello world", "-n", "2", "--threads", "1")
    assert_one_line(rc, err, "m.gguf: its tokenizer gave token ids outside its vocabulary of 264")


def test_an_error_naming_a_file_stays_one_line(capsys):
    rc, _, err = run_cli(capsys, "generate", "-m", "/nonexistent/a\rb\nc\x1b[2J.gguf", "-p", "hi")
    assert_one_line(rc, err, r"/nonexistent/a\rb\nc\x1b[2J.gguf: not found")


LLAMA_ABORT = """
import sys
import llama_cpp
from s2moe.app.cli import _abort_line
from s2moe.engine.decoding.llama_process import on_llama_abort
on_llama_abort(_abort_line)
llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
print("not reached")
"""


def test_a_failed_check_inside_llama_cpp_is_one_line_not_a_backtrace(tmp_path):
    """The last line of defence, for a check the model reader does not know yet: a file that stops llama.cpp
    in an assertion, loaded past the reader."""
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"{arch}.block_count": (0, U32)})
    done = subprocess.run([sys.executable, "-c", LLAMA_ABORT, str(model)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-2000:])
    assert done.stderr.splitlines()[-1] == (
        "error: llama.cpp stopped on a failed check (llama-model.cpp:1328: GGML_ASSERT(hparams.n_layer_all > 0 && "
        "hparams.n_layer_all <= LLAMA_MAX_LAYERS) failed): the model file or a setting is not one it supports"
    )


LLAMA_THROWS = """
import sys
import llama_cpp
from s2moe.app.cli import _abort_line
from s2moe.engine.model_info import read_model_info
from s2moe.engine.decoding.llama_process import on_llama_abort
from s2moe.engine.decoding.runtime import LlamaRuntime
on_llama_abort(_abort_line)
rt = LlamaRuntime(read_model_info(sys.argv[1]), n_ctx=64, n_threads=1)
llama_cpp.llama_vocab_get_text(rt.vocab, 1000000)  # id_to_token.at(): std::out_of_range through the C API
print("not reached")
"""


def test_a_cpp_exception_through_llama_cpps_c_api_is_one_line(tiny_models):
    """A throw nothing in llama.cpp catches crosses its C API and ends in std::terminate: one line and exit 2
    with the exception's type and message, not the C++ runtime's lines, ggml's backtrace and exit 134."""
    done = subprocess.run(
        [sys.executable, "-c", LLAMA_THROWS, str(tiny_models["olmoe"])], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        "error: llama.cpp stopped on a failed check (an uncaught C++ exception, std::out_of_range"
    ), last
    assert "terminate called" not in done.stderr


# -- threads and context ----------------------------------------------------------------------------------
def test_threads_are_capped_with_one_line(tiny_models, capsys, monkeypatch):
    from s2moe.engine.decoding import runtime_settings

    monkeypatch.setattr(runtime_settings, "default_threads", lambda: 2)
    for threads in ("999", "99999999999999999999"):
        rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--threads", threads)
        assert_one_line(rc, err, f"--threads {threads} is more than 8 (4 × the 2 CPUs")
    rc, _, err = run_cli(capsys, "calibrate", "-m", tiny_models["olmoe"], "--threads", "999", "--no-save")
    assert_one_line(rc, err, "--threads 999 is more than 8")
    rc, _, err = run_cli(
        capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "2", "--threads", "8", "--mode", "ar"
    )
    assert rc == 0, err


@pytest.mark.parametrize(
    "ctx,needle",
    [
        ("1", "--ctx 1 is too small: the context must hold at least 32 tokens"),
        ("16", "--ctx 16 is too small"),
        ("17", "at least 32 tokens"),
        ("31", "--ctx 31 is too small"),
        ("4294967296", "--ctx 4294967296 is above the largest context s2moe accepts (16777216 tokens)"),
    ],
)
def test_context_sizes_out_of_range_say_the_limit(tiny_models, capsys, ctx, needle):
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--ctx", ctx, "--threads", "1")
    assert_one_line(rc, err, needle)


def test_a_context_whose_cache_would_not_fit_in_memory_says_so(tiny_models, capsys, monkeypatch):
    """llama.cpp allocates the whole KV cache up front: a context whose cache would take more than half the
    memory available is refused in one line that names the model's training context (a 16 Mi context held
    8.6 GB on a tiny model)."""
    from s2moe.engine.decoding import runtime_settings
    from s2moe.engine.model_info import read_model_info

    monkeypatch.setattr(runtime_settings, "available_memory", lambda: 1 << 30)
    per_token = read_model_info(tiny_models["olmoe"]).kv_rows * runtime_settings.KV_VALUE_BYTES
    too_many = (1 << 29) // per_token + 1
    rc, _, err = run_cli(
        capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--ctx", too_many, "--threads", "1"
    )
    assert_one_line(
        rc,
        err,
        f"--ctx {too_many} needs 512.0 MiB of KV cache, more than half the 1.0 GiB of memory "
        "available; olmoe.gguf was trained on a context of 512 tokens",
    )
    rc, out, err = run_cli(
        capsys,
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hi",
        "--ctx",
        too_many - 1,
        "-n",
        "2",
        "--threads",
        "1",
        "--mode",
        "ar",
        "--json",
    )
    assert rc == 0, err


def test_the_smallest_context_runs_every_mode(tiny_models, capsys):
    for mode in ("s2moe", "ar"):
        rc, out, err = run_cli(
            capsys,
            "generate",
            "-m",
            tiny_models["olmoe"],
            "-p",
            "hi",
            "-n",
            "4",
            "--ctx",
            "32",
            "--threads",
            "1",
            "--mode",
            mode,
            "--json",
            "--ignore-eos",
        )
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
    from s2moe.engine.decoding import llama_process, runtime
    from s2moe.engine.model_info import read_model_info

    info = read_model_info(tiny_models["olmoe"])
    monkeypatch.setattr(llama_process, "_log", _InterruptOnFirstLine())
    with pytest.raises(KeyboardInterrupt):
        runtime.LlamaRuntime(info, n_ctx=64, n_threads=1)
    assert llama_process._log.sent
    assert "Exception ignored" not in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    runtime.LlamaRuntime(info, n_ctx=64, n_threads=1).close()  # the handler is back: a load without Ctrl-C works


def test_ctrl_c_during_calibrate_model_load_writes_no_profile(tiny_models, monkeypatch, tmp_path):
    from s2moe.engine.decoding import llama_process
    from s2moe.engine.measure.calibrate import run_calibration

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setattr(llama_process, "_log", _InterruptOnFirstLine())
    with pytest.raises(KeyboardInterrupt):
        for _ in run_calibration(str(tiny_models["olmoe"]), prompts=["hello"], n_threads=1, repeats=1):
            pass
    assert not list(tmp_path.rglob("*.yaml"))


@pytest.fixture(scope="module")
def widened_model(tmp_path_factory):
    """The shipped default model with experts 8 times as wide: a load long enough to land a signal in."""
    out = tmp_path_factory.mktemp("widened") / "w8.gguf"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "make-synthetic",
            "--from",
            "olmoe-64x8",
            "--widen",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # Decoded once, as a user's model has been: the first run's check of llama.cpp's buffer types (in a
    # child, said when slow) is behind it, and the signals below land in the load itself.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "generate",
            "-m",
            str(out),
            "-p",
            "hello",
            "-n",
            "1",
            "--mode",
            "ar",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
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


@pytest.mark.parametrize(
    "sig,delay_ms",
    [
        (signal.SIGINT, 0),
        (signal.SIGINT, 15),
        (signal.SIGINT, 30),
        (signal.SIGINT, 45),
        (signal.SIGTERM, 0),
        (signal.SIGTERM, 30),
    ],
)
def test_a_signal_during_a_real_model_load_ends_the_run(widened_model, sig, delay_ms):
    """A real Ctrl-C (or SIGTERM) from outside, sent while llama.cpp loads a 160 MB model: before, a Ctrl-C
    was swallowed in the log callback and generation went on to exit 0. Exit 130 for Ctrl-C, 143 for
    SIGTERM, each saying so in one line."""
    code, word = (130, "interrupted") if sig == signal.SIGINT else (143, "terminated")
    model = os.path.realpath(widened_model)
    # The load lasts a fraction of a second and is seen by polling /proc from outside: on a loaded machine
    # the poll can miss it, and then no signal was sent at all. Such an attempt proves nothing either way
    # and is made again; an attempt whose signal was sent must end in exit 130.
    for _attempt in range(5):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "s2moe.app.cli",
                "generate",
                "-m",
                model,
                "-p",
                "hello",
                "-n",
                "100000",
                "--ignore-eos",
                "--mode",
                "ar",
                "--threads",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            seen, deadline, caught = {}, time.monotonic() + 60, False
            while proc.poll() is None and time.monotonic() < deadline:
                if _inside_llama_load(proc.pid, model, seen):
                    caught = True
                    break
            if not caught:
                continue
            time.sleep(delay_ms / 1000)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == code and err == f"{word}\n", (proc.returncode, err)
        return
    pytest.fail("never saw llama.cpp load the model in five attempts")


def _has_mapped(pid: int, name: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


# The CLI as its console script runs it, closing the file descriptor given first just before main starts: the
# moment from which Ctrl-C must end in exit 130.
_MAIN_STARTS = "import os, sys; from s2moe.app.cli import entry; os.close(int(sys.argv.pop(1))); entry()"


def test_ctrl_c_at_any_moment_after_main_starts_exits_130(widened_model):
    """Ctrl-C swept over a run every 25 ms from the moment main starts: through the imports main makes (the
    command modules, llama.cpp, numpy, the engine, the model reader's), the model's reading, the backend's
    start, the load and the first decodes. Before, a Ctrl-C landing in an import could be dropped by
    CPython's import machinery (a weakref callback called from C), about 1 in 300 signals; one landing as
    the backend started was dropped in llama.cpp's log callback and generation ran on to exit 0. Every
    offset must end in exit 130 and that one line."""
    model = os.path.realpath(widened_model)
    for delay_ms in range(0, 600, 25):
        started, starting = os.pipe()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _MAIN_STARTS,
                str(starting),
                "generate",
                "-m",
                model,
                "-p",
                "hello",
                "-n",
                "100000",
                "--ignore-eos",
                "--mode",
                "ar",
                "--threads",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(starting,),
        )
        os.close(starting)
        try:
            assert os.read(started, 1) == b"" and proc.poll() is None, "the run ended before main started"
            time.sleep(delay_ms / 1000)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            os.close(started)
            proc.kill()
            proc.wait()
        assert (proc.returncode, err) == (130, "interrupted\n"), (delay_ms, proc.returncode, err)


# Runs the CLI with an audit hook that names every module the main thread loads after main starts while
# Ctrl-C is not held; prints them as JSON on stderr's last line.
_UNHELD_IMPORTS = """
import json, sys, threading
from s2moe.app.cli import main
from s2moe.engine import errors
unheld = []
def hook(event, args):
    if event == "import" and errors._hold is None and threading.current_thread() is threading.main_thread():
        unheld.append(args[0])
sys.addaudithook(hook)
main(sys.argv[1:])
print(json.dumps(unheld), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [["generate", "-p", "hello", "-n", "8", "--mode", "s2moe", "--json"], ["profiles", "list"]],
    ids=["generate", "profiles"],
)
def test_every_import_after_main_starts_holds_ctrl_c(tiny_models, tmp_path, argv):
    """A Ctrl-C inside an import can be dropped by CPython (a weakref callback called from C frees the
    module's lock) or lost in a C extension's initialisation; too rare to show in a sweep of real signals,
    so this checks the cause: every module loaded after main starts — main's own lazy imports, the
    command's, numpy's during the first speculative generation, rich's for a table — is loaded with
    Ctrl-C held. Before, 240 modules were loaded unheld before the model was read."""
    model = ["-m", str(tiny_models["olmoe"])] if argv[0] == "generate" else []
    done = subprocess.run(
        [sys.executable, "-c", _UNHELD_IMPORTS, *argv, *model],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.splitlines()[-1]) == []


class _SignalDuring:
    """Stands in for one llama.cpp function: a Ctrl-C to this process, then the real call. Held, the call
    runs to its end and the KeyboardInterrupt comes after; not held, it is raised before the call (in C, a
    log line from the call would drop it)."""

    def __init__(self, real):
        self.real, self.returned = real, False

    def __call__(self, *args):
        os.kill(os.getpid(), signal.SIGINT)
        result = self.real(*args)
        self.returned = True
        return result


@pytest.mark.parametrize("call", ["llama_tokenize", "llama_token_to_piece", "llama_decode"])
def test_llama_cpp_calls_finish_before_a_ctrl_c_is_raised(decoders, monkeypatch, call):
    import llama_cpp
    from s2moe.engine.decoding.generation_config import GenerationConfig

    decoder = decoders["olmoe"]
    spy = _SignalDuring(getattr(llama_cpp, call))
    monkeypatch.setattr(llama_cpp, call, spy)
    with pytest.raises(KeyboardInterrupt) as raised:
        for _ in decoder.generate("hello", GenerationConfig(mode="s2moe", n_predict=4)):
            pass
    assert spy.returned
    # raised as soon as the held call returned, inside the runtime, not later in the generation step
    assert raised.traceback[-1].name in ("__exit__", "release") or "runtime" in str(raised.traceback[-1].path)
    assert any(entry.name in ("tokenize", "_run", "piece", "detokenize") for entry in raised.traceback)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_generation_swaps_the_signal_handlers_once_per_step(decoders, monkeypatch):
    """Swapping the handlers costs a measurable share of a small model's decode (docs/reliability.md): a generation
    swaps them once per step, not around each llama.cpp call (a speculative step drafts and verifies)."""
    from s2moe.engine import errors
    from s2moe.engine.decoding.generation_config import GenerationConfig

    swaps = []
    real = signal.signal
    monkeypatch.setattr(errors.signal, "signal", lambda *a: swaps.append(a[0]) or real(*a))
    events = list(decoders["olmoe"].generate("hello", GenerationConfig(mode="s2moe", n_predict=16, stop_at_eos=False)))
    assert len(events) >= 4
    # one hold per event and one for the end, each swapping SIGINT's handler in and out
    assert len(swaps) <= 2 * (len(events) + 1), (len(swaps), len(events))


def test_a_signal_held_inside_an_import_waits_for_the_outermost_import(tmp_path, monkeypatch):
    """Nested holds swap the handlers once; a Ctrl-C noted inside comes at the end of the inner block, except
    inside imports, where it waits for the outermost import to end (raised in between, it would land in the
    middle of an import again)."""
    from s2moe.engine.errors import held_signals, imports_held

    with held_signals():
        with pytest.raises(KeyboardInterrupt):
            with held_signals():
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(1000))  # the handler has run by now, and only noted it
            pytest.fail("not raised at the end of the inner block")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    (tmp_path / "s2moe_outer.py").write_text("import s2moe_inner\nimport os\nos.environ['S2MOE_OUTER'] = 'done'\n")
    (tmp_path / "s2moe_inner.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("S2MOE_OUTER", raising=False)
    for name in ("s2moe_outer", "s2moe_inner"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with imports_held(), pytest.raises(KeyboardInterrupt):
        import s2moe_outer  # noqa: F401
    assert os.environ.get("S2MOE_OUTER") == "done"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _app_in_a_pty(model: str, tmp_path, act, after_s: float) -> tuple[int | None, str, bool]:
    """`s2moe app` on a pseudo-terminal of 80×24: a prompt typed and Enter pressed once it is up (its prompt
    box drawn), then act(proc, terminal) after_s later. Its exit code (None: it had not exited 15 s later), what it
    wrote, and whether the terminal's modes came back as they were."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    terminal, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    modes = termios.tcgetattr(side)
    env = {
        **os.environ,
        "TERM": "xterm-256color",
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "s2moe.app.cli", "app", "-m", model, "-t", "1"],
        stdin=side,
        stdout=side,
        stderr=side,
        env=env,
        start_new_session=True,
    )
    out = bytearray()

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([terminal], [], [], 0.05)[0]:
                try:
                    out.extend(os.read(terminal, 1 << 16))
                except OSError:  # the app has exited and closed its side
                    return

    def read_until(text: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            read_for(0.05)
            if text in re.sub(r"\x1b\[[0-9;?<>]*[A-Za-z]", "", out.decode("utf-8", "replace")):
                return True
        return False

    try:
        assert read_until("Enter runs, Esc stops", 30), out.decode("utf-8", "replace")[-2000:]
        os.write(terminal, b"tell me a long story\r")
        read_for(after_s)
        act(proc, terminal)
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            read_for(0.2)
        read_for(0.2)
        code = proc.poll()
        return code, out.decode("utf-8", "replace"), termios.tcgetattr(side) == modes
    finally:
        proc.kill()
        proc.wait()
        os.close(terminal)
        os.close(side)


@pytest.mark.parametrize(
    "how,after_s,code", [("SIGINT", 0.0, 130), ("SIGINT", 0.6, 130), ("SIGTERM", 0.3, 143), ("Ctrl+C", 0.3, 0)]
)
def test_the_app_quits_cleanly_on_a_signal_while_it_decodes(widened_model, tmp_path, how, after_s, code):
    """The app while it loads, measures and generates: a SIGINT (kill -INT) or SIGTERM to its process
    quits it as Ctrl+Q does, with exit code 130 or 143 and that word once the terminal is back; Ctrl+C
    typed is its quit key (exit 0). Before, a SIGINT quit with exit code 0. Never a traceback, and the
    terminal's modes, alternate screen, cursor and mouse reporting come back as they were."""

    def act(proc, terminal):
        if how == "Ctrl+C":
            os.write(terminal, b"\x03")
        else:
            proc.send_signal(getattr(signal, how))

    rc, out, modes_back = _app_in_a_pty(str(widened_model), tmp_path, act, after_s)
    assert rc == code, out[-2000:]
    assert "Traceback" not in out and "Exception" not in out
    assert modes_back
    tail = out[out.rindex("\x1b[?1049l") :]  # from leaving the alternate screen on
    assert "\x1b[?25h" in tail and "\x1b[?1000l" in tail  # cursor shown, mouse reporting off
    words = {130: "interrupted", 143: "terminated"}
    assert [line.strip() for line in re.sub(r"\x1b\[[0-9;?<>]*[A-Za-z]", "", tail).splitlines() if line.strip()] == (
        [words[code]] if code in words else []
    )


# -- no traceback ----------------------------------------------------------------------------------------------
def test_a_prompt_of_undecodable_bytes_is_one_line(tiny_models, capsys):
    # what Python makes of the command-line bytes b"caf\xe9" (Latin-1), undecodable as UTF-8
    prompt = os.fsdecode(b"caf\xe9")
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", prompt, "--threads", "1")
    assert_one_line(rc, err, "the prompt is not UTF-8 text")


def test_an_empty_prompt_is_the_documented_error(tiny_models, capsys):
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "", "--threads", "1")
    assert_one_line(rc, err, "the prompt is empty")


def test_a_model_path_of_undecodable_bytes_works(tiny_models, tmp_path, capsys):
    model = tmp_path / os.fsdecode(b"mod\xe8le.gguf")
    model.write_bytes(tiny_models["olmoe"].read_bytes())
    rc, out, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "-n", "2", "--threads", "1", "--json")
    assert rc == 0, err
    assert json.loads(out)["model"] == str(model)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--seed", "-2"], "--seed: must be -1 (random) or a whole number from 0 to 4294967295, got -2"),
        (["--seed", "9" * 400], "--seed: must be -1 (random) or a whole number from 0 to 4294967295, got 999"),
        (["--budget", "9" * 400], "--budget: size 999999999999999999999999… is too large"),
        (["--budget", ""], "--budget: must not be empty"),
        (["--profile", ""], "--profile: must not be empty"),
        (["--model", ""], "--model/-m: must not be empty"),
        (["--gpu-layers", "-2"], "--gpu-layers: must be -1 (all layers), 0 or a number of layers, got -2"),
    ],
)
def test_flag_values_that_raised_or_meant_the_default(tiny_models, capsys, argv, needle):
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--threads", "1", *argv)
    assert_one_line(rc, err, needle)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--name", ""], "--name: must not be empty"),
        (["--model", ""], "--model/-m: must not be empty"),
        (["--budget", "9" * 400], "is too large"),
    ],
)
def test_calibrate_flag_values_that_raised_or_meant_the_default(tiny_models, capsys, argv, needle):
    rc, _, err = run_cli(capsys, "calibrate", "-m", tiny_models["olmoe"], "--no-save", *argv)
    assert_one_line(rc, err, needle)


def test_gpu_layers_reach_llama_cpp(tiny_models, capsys, monkeypatch):
    from s2moe.engine.decoding.runtime import LlamaRuntime

    asked = []
    real = LlamaRuntime.__init__

    def init(self, info, **kw):
        asked.append(kw["placement"].n_gpu_layers)
        real(self, info, **kw)

    monkeypatch.setattr(LlamaRuntime, "__init__", init)
    rc, _, err = run_cli(
        capsys,
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hi",
        "-n",
        "2",
        "--threads",
        "1",
        "--mode",
        "ar",
        "--gpu-layers",
        "3",
    )
    assert rc == 0, err
    assert asked == [3]


def test_non_finite_logits_are_one_line_with_sampling(tmp_path, capsys):
    # every expert of the first layer poisoned: every token's logits are NaN
    model = write_tiny(tmp_path / "nan.gguf", variant_spec("olmoe", poison=[(0, e) for e in range(8)]))
    for mode in ("ar", "s2moe"):
        rc, _, err = run_cli(
            capsys, "generate", "-m", model, "-p", "hi", "--temp", "0.8", "--threads", "1", "--mode", mode
        )
        assert_one_line(rc, err, "nan.gguf: llama.cpp computed logits that are not numbers")


def _profile_for(model, **constants) -> dict:
    from s2moe.engine.model_info import read_model_info

    block = {"t_ar_ms": 1.0, "c_draft_ms": 0.8, "t_exp_ms": 0.01, **constants}
    return {"schema": 1, "kind": "measured", "models": {read_model_info(model).fingerprint: block}}


def test_profile_numbers_too_long_and_in_exponent_form(tiny_models, tmp_path, capsys):
    import yaml
    from s2moe.engine.profiles import cost_for_model, load_profile

    model = tiny_models["olmoe"]
    fp = next(iter(_profile_for(model)["models"]))
    huge = tmp_path / "huge.yaml"
    huge.write_text(yaml.safe_dump(_profile_for(model, t_ar_ms=10**400)))
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "--profile", huge, "--threads", "1")
    assert_one_line(rc, err, "field t_ar_ms is too large (401 digits)")
    longer = tmp_path / "longer.yaml"
    longer.write_text(yaml.safe_dump(_profile_for(model)).replace("t_ar_ms: 1.0", "t_ar_ms: " + "9" * 5000))
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hi", "--profile", longer, "--threads", "1")
    assert_one_line(rc, err, "longer.yaml: a number too long to read")
    # YAML 1.1 reads 1e-3 (no dot) as text; a profile edited by hand means the number
    sci = tmp_path / "sci.yaml"
    sci.write_text(yaml.safe_dump(_profile_for(model)).replace("t_ar_ms: 1.0", "t_ar_ms: 1e-3"))
    assert cost_for_model(load_profile(str(sci)), fp).t_ar == pytest.approx(1e-6)


def test_a_utf16_profile_is_one_line_and_lists_as_invalid(tiny_models, tmp_path, capsys, monkeypatch):
    import yaml
    from s2moe.engine.profiles import list_profiles

    folder = tmp_path / "cfg" / "s2moe" / "profiles"
    folder.mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (folder / "wide.yaml").write_text(yaml.safe_dump(_profile_for(tiny_models["olmoe"])), encoding="utf-16")
    (folder / "fine.yaml").write_text(yaml.safe_dump(_profile_for(tiny_models["olmoe"])))
    by = {e.name: e for e in list_profiles()}
    assert by["wide"].error == "profile wide.yaml: not UTF-8 text" and by["fine"].error is None
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "--profile", "wide")
    assert_one_line(rc, err, "wide.yaml: not UTF-8 text")
    rc, out, err = run_cli(capsys, "profiles", "list")
    assert rc == 0 and "wide" in out and "invalid" in out and "fine" in out  # one bad file does not break the list


# -- calibrate says what is wrong before it measures, in one line ---------------------------------------------
def _first_event(model, **kw):
    from s2moe.engine.measure.calibrate import run_calibration

    return next(run_calibration(str(model), prompts=["hello"], n_threads=1, repeats=1, **kw))


def test_calibrate_checks_the_profile_folder_before_measuring(tiny_models, tmp_path, capsys, monkeypatch):
    from s2moe.engine import profiles

    # a folder no process can create files in, whoever runs the tests (root ignores permission bits)
    monkeypatch.setenv("XDG_CONFIG_HOME", "/proc/s2moe-test")
    with pytest.raises(ConfigError, match="cannot write profile /proc/s2moe-test/s2moe/profiles/local.yaml"):
        _first_event(tiny_models["olmoe"])
    rc, _, err = run_cli(capsys, "calibrate", "-m", tiny_models["olmoe"], "--threads", "1")
    assert_one_line(rc, err, "cannot write profile")
    assert _first_event(tiny_models["olmoe"], save=False).index == 1  # --no-save writes nothing: nothing to check

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setattr(profiles.shutil, "disk_usage", lambda path: shutil_usage(free=300 << 10))
    with pytest.raises(ConfigError, match="300 KiB free, a profile needs up to 1 MiB"):
        _first_event(tiny_models["olmoe"])
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (tmp_path / "cfg" / "s2moe" / "profiles" / "local.yaml").mkdir(parents=True)
    with pytest.raises(ConfigError, match="local.yaml: it is a folder"):
        _first_event(tiny_models["olmoe"])


def shutil_usage(free: int):
    import shutil

    return shutil._ntuple_diskusage(total=1 << 30, used=(1 << 30) - free, free=free)


def test_a_profile_write_that_fails_is_one_error(tmp_path):
    from s2moe.engine.profiles import save_profile

    profile = {"schema": 1, "kind": "measured", "models": {}}
    with pytest.raises(ConfigError, match="cannot write profile /proc/s2moe-test/p.yaml"):
        save_profile(profile, "p", folder="/proc/s2moe-test")


def test_calibrate_errors_come_without_a_banner(tmp_path, capsys):
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"{arch}.expert_used_count": (9, U32)})
    rc, out, err = run_cli(capsys, "calibrate", "-m", model, "--no-save")
    assert_one_line(rc, err, "expert_used_count 9 must be between 1 and expert_count (8)")
    assert "dense" not in err and out == ""
    rc, _, err = run_cli(capsys, "calibrate", "-m", model.parent / "missing.gguf", "--no-save")
    assert_one_line(rc, err, "missing.gguf: not found")


def test_calibrate_on_a_file_llama_cpp_refuses_fails_before_any_step(tmp_path, capsys):
    """The reader's checks pass, llama.cpp's load does not (7 experts declared, tensors of 8): one line and
    nothing on stdout, where before step 1 measured and printed first."""
    model = write_tiny(tmp_path / "m.gguf", variant_spec("olmoe"), metadata={"{arch}.expert_count": (7, U32)})
    rc, out, err = run_cli(capsys, "calibrate", "-m", model, "--no-save", "--threads", "1")
    assert_one_line(rc, err, "llama.cpp could not load m.gguf: check_tensor_dims")
    assert out == ""


@pytest.mark.parametrize("out", ["/proc/s2moe-test.gguf", "folder"])
def test_make_synthetic_out_that_cannot_be_written(tmp_path, capsys, out):
    (tmp_path / "folder").mkdir()
    out = out if out.startswith("/") else str(tmp_path / out)
    for argv in (["--preset", "tiny"], ["--from", "olmoe-64x8", "--widen", "2"]):
        rc, _, err = run_cli(capsys, "make-synthetic", *argv, "--out", out)
        assert_one_line(rc, err, "--out: ")


# -- signals under a memory budget: one "interrupted", no cgroup or worker left behind ------------------------
def _cgroups_of(pid: int) -> list:
    from s2moe.engine.offload import MemoryCgroup

    _, parent = MemoryCgroup.locate()
    return sorted(parent.glob(f"s2moe-*-{pid}-*"))


def _members(cgroup) -> list[int]:
    for name in ("cgroup.procs", "tasks"):
        try:
            return [int(x) for x in (cgroup / name).read_text().split()]
        except OSError:
            continue
    return []


def _budget_run_started(proc, model: str, deadline: float) -> tuple:
    """The budget cgroup of proc and the process inside it, once that process has mapped the model."""
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the budgeted run did not start"
        for cg in _cgroups_of(proc.pid):
            for pid in _members(cg):
                try:
                    with open(f"/proc/{pid}/maps") as f:
                        if model in f.read():
                            return cg, pid
                except OSError:
                    pass
        time.sleep(0.02)


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _unavailable() -> str | None:
    from s2moe.engine.offload import MemoryCgroup

    return MemoryCgroup.unavailable_reason()


@pytest.mark.skipif(_unavailable() is not None, reason="no memory cgroup here")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_generate_under_a_budget_interrupted_says_so_once_and_cleans_up(tiny_models, how):
    model = os.path.realpath(tiny_models["olmoe"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "generate",
            "-m",
            model,
            "-p",
            "hello",
            "-n",
            "100000",
            "--ignore-eos",
            "--mode",
            "ar",
            "--threads",
            "1",
            "--ctx",
            "16384",
            "--budget",
            "400M",
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        cg, child = _budget_run_started(proc, model, time.monotonic() + 60)
        time.sleep(0.3)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole process group
        else:
            proc.send_signal(signal.SIGTERM)  # the parent alone
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    code, word = (130, "interrupted") if how == "ctrl-c" else (143, "terminated")
    assert proc.returncode == code and err == f"{word}\n", (proc.returncode, err)
    assert not cg.exists() and _gone(child)


@pytest.mark.skipif(_unavailable() is not None, reason="no memory cgroup here")
def test_sigterm_during_calibrate_budget_auto_removes_its_cgroup_and_worker(tiny_models, tmp_path):
    model = os.path.realpath(tiny_models["olmoe"])
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "calibrate",
            "-m",
            model,
            "--budget",
            "auto",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--no-plot",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        cg, worker = _budget_run_started(proc, model, time.monotonic() + 120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.splitlines()[-1] == "terminated", (proc.returncode, err)
    assert not cg.exists() and _gone(worker)
    assert not list(tmp_path.rglob("*.yaml")) and not list(tmp_path.rglob(".*.tmp"))


@pytest.mark.skipif(_unavailable() is not None, reason="no memory cgroup here")
def test_sigkill_of_a_budgeted_run_takes_its_worker_and_the_next_run_removes_its_cgroup(tiny_models):
    """SIGKILL leaves the parent no clean-up: the worker must die with it all the same (else it decodes on,
    re-parented to init, holding the budget cgroup), and the next run removes the cgroup left behind."""
    from s2moe.engine.offload import MemoryCgroup

    model = os.path.realpath(tiny_models["olmoe"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "s2moe.app.cli",
            "generate",
            "-m",
            model,
            "-p",
            "hello",
            "-n",
            "100000",
            "--ignore-eos",
            "--threads",
            "1",
            "--ctx",
            "16384",
            "--budget",
            "auto",
            "--json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = None
    try:
        cg, worker = _budget_run_started(proc, model, time.monotonic() + 60)
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        assert _gone(worker), "the worker outlived its parent's SIGKILL"
    finally:
        proc.kill()
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)  # a zombie still counts in its cgroup until init reaps it
    MemoryCgroup.create(64 << 20, "test-next").remove()
    assert not cg.exists()


def test_a_budget_worker_whose_parent_is_gone_before_it_starts_exits_at_once():
    """The parent can die between the fork and the child's asking to die with it; the child sees that its
    parent is no longer the one recorded before the fork, and ends there."""
    from s2moe.engine.offload.libc import dies_with_parent

    gone = subprocess.Popen(["true"])
    gone.wait()
    started = time.monotonic()
    rc = subprocess.run(["sleep", "30"], preexec_fn=dies_with_parent(gone.pid), timeout=20).returncode
    assert rc == -signal.SIGKILL and time.monotonic() - started < 10


# -- `--budget auto` beside other runs: never refuses the budget it chose ------------------------------------
HOLD_IN_MEMORY = """
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
print("held", flush=True)
time.sleep(120)
"""


def _wide_model(tmp_path) -> str:
    """Experts large beside the slack: pages of them another process read are charged to that one."""
    spec = variant_spec("olmoe", n_layer=3, n_expert=8, k=4, n_embd=128, n_ff=512, seed=7)
    return os.path.realpath(write_tiny(tmp_path / "wide.gguf", spec))


def _auto_argv(model: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "s2moe.app.cli",
        "generate",
        "-m",
        model,
        "--threads",
        "1",
        "--budget",
        "auto",
        "--ignore-eos",
        "--json",
        *args,
    ]


@pytest.mark.skipif(_unavailable() is not None, reason="no memory cgroup here")
def test_two_auto_budgets_at_once_both_run(tmp_path):
    """Of two `--budget auto` runs started together one or both sized themselves from a cgroup that was not
    charged for the pages the other had read first (model, libraries): short of what its own plan counts, it
    refused the budget it had chosen itself (4 pairs in 5). Three pairs, each run a real process."""
    model = _wide_model(tmp_path)
    for _ in range(3):
        pair = [
            subprocess.Popen(
                _auto_argv(model, "-p", prompt, "-n", "32"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for prompt in ("a", "b")
        ]
        try:
            done = [(run.communicate(timeout=120), run.returncode) for run in pair]
        finally:
            for run in pair:
                run.kill()
        for (out, err), rc in done:
            assert rc == 0, err
            assert json.loads(out.splitlines()[-1])["tokens"]


@pytest.mark.skipif(_unavailable() is not None, reason="no memory cgroup here")
def test_an_auto_budget_runs_while_another_process_holds_the_model_in_memory(tmp_path):
    """Whatever else runs: a process holding the model's pages (a resident run, a copy, a backup) leaves them
    charged to its own cgroup, and an auto budget counted them out of its own."""
    model = _wide_model(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_IN_MEMORY, model], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        run = subprocess.run(_auto_argv(model, "-p", "b", "-n", "16"), capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1])["tokens"]


# -- temporary files a killed profile write left are removed by the next one ----------------------------------
PROFILE = {"schema": 1, "kind": "measured", "models": {}}

KILLED_SAVE = """
import os, sys, time
from s2moe.engine import profiles

def stuck(fd):
    print("writing", flush=True)
    time.sleep(60)

profiles.os.fsync = stuck
profile = {"schema": 1, "kind": "measured", "models": {}, "description": "new"}
profiles.save_profile(profile, "local", folder=sys.argv[1])
"""


def test_a_save_removes_the_temporary_file_a_killed_save_left(tmp_path):
    from s2moe.engine.files import STALE_TMP_SECONDS
    from s2moe.engine.profiles import load_profile, save_profile

    target = save_profile(dict(PROFILE, description="old"), "local", folder=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.kill()
        proc.wait()
    (left,) = tmp_path.glob(".local.*.tmp")
    assert load_profile(str(target))["description"] == "old"  # the profile itself is untouched
    long_ago = time.time() - STALE_TMP_SECONDS - 60
    os.utime(left, (long_ago, long_ago))
    in_flight = tmp_path / ".local.another-save.tmp"  # a save running now, in another process
    in_flight.write_text("kind: measured\n")
    other = tmp_path / ".other.left.tmp"  # another profile's: its own next save removes it
    other.write_text("kind: measured\n")
    os.utime(other, (long_ago, long_ago))
    save_profile(dict(PROFILE, description="new"), "local", folder=tmp_path)
    assert not left.exists() and in_flight.exists() and other.exists()
    assert load_profile(str(target))["description"] == "new"


TERMINATED_SAVE = """
import os, sys, time
from s2moe.app.cli import main

real_fsync = os.fsync

def stuck(fd):  # the profile's temporary file only
    if not os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".local."):
        return real_fsync(fd)
    print("writing", flush=True)
    time.sleep(60)

os.fsync = stuck
sys.exit(main(["calibrate", "-m", sys.argv[1], "--threads", "1", "--repeats", "1", "--no-plot"]))
"""


def test_sigterm_during_calibrates_profile_write_leaves_no_file(tiny_models, tmp_path):
    """Killed by SIGTERM mid-write (the default action would end the process there and then): the
    temporary file is removed, no profile appears, the exit code is 143."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    proc = subprocess.Popen(
        [sys.executable, "-c", TERMINATED_SAVE, str(tiny_models["olmoe"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in proc.stdout:
            if line == "writing\n":
                break
        assert list(tmp_path.rglob(".*.tmp")), "no temporary profile while writing"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143 and err.splitlines()[-1] == "terminated", (proc.returncode, err)
    assert not list(tmp_path.rglob(".*.tmp")) and not list(tmp_path.rglob("*.yaml"))


def test_profiles_list_shows_messages_with_brackets_as_written(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "cfg" / "s2moe" / "profiles"
    folder.mkdir(parents=True)
    (folder / "hot.yaml").write_text(
        "models:\n  0123456789abcdef: {t_ar_ms: 1, c_draft_ms: 1, t_exp_ms: 0.1, hot_experts: [[0, 1, 2]]}\n"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("COLUMNS", "400")
    rc, out, err = run_cli(capsys, "profiles", "list")
    assert rc == 0, err
    assert "field hot_experts[0] must be a [layer, expert] pair of whole numbers, got [0, 1, 2]" in out


def test_a_stage_is_said_once_it_turns_out_slow_and_not_before():
    import threading

    from s2moe.engine.slow import said_if_slow

    said = []
    with said_if_slow(said.append, "quick…", after=0.5):
        pass
    with said_if_slow(said.append, "slow…", after=0.05):
        done = threading.Event()
        assert done.wait(0.5) is False  # the body outlasts `after`: the line comes while it runs
    assert said == ["slow…"]
    with said_if_slow(None, "nobody listens", after=0.0):
        pass


# -- JSON a user can hand s2moe, copy caches, the app's settings --------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000
LONG_NUMBER = b'{"format": "s2moe-copy-cache", "version": ' + b"9" * 5000 + b"}"
NOT_UTF8 = b'{"format": "s2moe-copy-cache\xff"}'
BAD_JSON = [
    (DEEP, "nested too deeply"),
    (LONG_NUMBER, "a number too long to read"),
    (NOT_UTF8, "not UTF-8 text (an invalid byte at offset 28)"),
]


@pytest.mark.parametrize("data,needle", BAD_JSON, ids=["deep", "long-number", "not-utf8"])
def test_a_copy_cache_of_json_that_json_loads_cannot_take_is_one_line(tiny_models, tmp_path, capsys, data, needle):
    cache = tmp_path / "copies.json"
    cache.write_bytes(data)
    rc, out, err = run_cli(
        capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "4", "-t", "1", "--copy-cache", cache
    )
    assert_one_line(rc, err, f"copy cache {cache}: ", needle)
    assert out == "" and cache.read_bytes() == data


@pytest.mark.parametrize(
    "data,needle", BAD_JSON + [(b"[1, 2]", "not a JSON object")], ids=["deep", "long-number", "not-utf8", "a-list"]
)
def test_app_settings_that_cannot_be_read_are_a_config_error(data, needle):
    from s2moe.app.tui.state import remembered_settings, state_dir

    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / "chat-settings.json").write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        remembered_settings()


def test_a_fifo_as_the_apps_state_is_refused_without_opening_it(make_fifo):
    """The app reads its settings and active profile at start-up: a FIFO there would block it for good."""
    from s2moe.app.tui.state import remembered_profile, remembered_settings, state_dir

    state_dir().mkdir(parents=True, exist_ok=True)
    make_fifo(state_dir() / "chat-settings.json")
    make_fifo(state_dir() / "active-profile")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="chat settings .* is not a regular file"):
        remembered_settings()
    assert remembered_profile() is None
    assert time.monotonic() - t0 < 5


def test_a_trace_in_a_folder_is_named_with_the_folder_as_given(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "deep.jsonl").write_bytes(DEEP + b"\n")
    rc, _, err = run_cli(capsys, "project", "runs", "--profile", "cpu-generic")
    assert_one_line(rc, err, "trace runs/deep.jsonl line 1: nested too deeply")


def test_a_copy_cache_named_as_a_missing_folder_is_refused_not_made_a_file(tiny_models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(
        capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "4", "-t", "1", "--copy-cache", "nodir/"
    )
    assert_one_line(rc, err, "copy cache nodir/: there is no directory nodir")
    assert list(tmp_path.iterdir()) == []


def test_a_symlinked_copy_cache_or_profile_is_written_through(tiny_models, tmp_path, capsys):
    from s2moe.engine.profiles import load_profile, save_profile

    kept = tmp_path / "kept"
    kept.mkdir()
    link, dangling, loop = tmp_path / "copies.json", tmp_path / "new.json", tmp_path / "loop.json"
    link.symlink_to(kept / "copies.json")
    dangling.symlink_to(kept / "new.json")  # its file is made by the first run
    loop.symlink_to(loop)
    for prompt in ("hello", "good morning"):
        for cache in (link, dangling):
            rc, _, err = run_cli(
                capsys,
                "generate",
                "-m",
                tiny_models["olmoe"],
                "-p",
                prompt,
                "-n",
                "4",
                "-t",
                "1",
                "--copy-cache",
                cache,
            )
            assert rc == 0, err
    for cache in (link, dangling):
        assert cache.is_symlink()
        assert len(json.loads(cache.resolve().read_text())["generations"]) == 2
    assert sorted(p.name for p in kept.iterdir()) == ["copies.json", "new.json"]
    rc, _, err = run_cli(
        capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "4", "-t", "1", "--copy-cache", loop
    )
    assert_one_line(rc, err, f"cannot write copy cache {loop}: its symbolic link leads round in a loop")
    # profiles go through the same writer
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "local.yaml").symlink_to(kept / "local.yaml")
    save_profile(dict(PROFILE, description="through"), "local", folder=tmp_path / "profiles")
    assert (tmp_path / "profiles" / "local.yaml").is_symlink()
    assert load_profile(str(kept / "local.yaml"))["description"] == "through"


KILLED_COPY_CACHE_SAVE = """
import os, sys, time
from s2moe.engine.drafting.copycache import save_copy_cache
from s2moe.engine.model_info import read_model_info
from s2moe.engine.drafting.ngrams import EarlierText

def stuck(src, dst):  # the temporary file written, not yet renamed
    print("writing", flush=True)
    time.sleep(60)

os.replace = stuck
earlier = EarlierText()
earlier.add([1, 2, 3], [1, 2, 3, 4, 5, 6])
save_copy_cache(sys.argv[2], read_model_info(sys.argv[1]), earlier)
"""


def test_a_copy_cache_save_removes_the_temporary_file_a_killed_save_left(tiny_models, tmp_path):
    from s2moe.engine.drafting.copycache import load_copy_cache, save_copy_cache
    from s2moe.engine.drafting.ngrams import EarlierText
    from s2moe.engine.files import STALE_TMP_SECONDS
    from s2moe.engine.model_info import read_model_info

    model, cache = str(tiny_models["olmoe"]), tmp_path / "copies.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_COPY_CACHE_SAVE, model, str(cache)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (left,) = tmp_path.glob(".copies.json*tmp*")
    long_ago = time.time() - STALE_TMP_SECONDS - 60
    os.utime(left, (long_ago, long_ago))
    info = read_model_info(model)
    earlier = EarlierText()
    earlier.add([4, 5], [4, 5, 6, 7])
    save_copy_cache(cache, info, earlier)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copies.json"]
    assert load_copy_cache(cache, info, EarlierText()) == 1


def _read_only(folder, *argv, env=None) -> subprocess.CompletedProcess:
    """argv run with `folder` mounted read-only for it alone (a mount namespace of its own): root ignores
    permission bits, a read-only mount it does not. Skipped where this machine cannot make one."""
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    try:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", mount, str(folder), "touch", str(folder / "probe")],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot mount a folder read-only here: {probe.stderr.strip()}")
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, str(folder), *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_an_existing_copy_cache_in_a_read_only_folder_is_refused_before_decoding(tiny_models, tmp_path, capsys):
    cache = tmp_path / "kept" / "copies.json"
    cache.parent.mkdir()
    model = str(tiny_models["olmoe"])
    rc, _, err = run_cli(capsys, "generate", "-m", model, "-p", "hello", "-n", "4", "-t", "1", "--copy-cache", cache)
    assert rc == 0, err
    kept = cache.read_bytes()
    # --events prints a line per decoding iteration: a refusal after decoding would come after them
    done = _read_only(
        cache.parent,
        sys.executable,
        "-m",
        "s2moe.app.cli",
        "generate",
        "-m",
        model,
        "-p",
        "hi",
        "-n",
        "8",
        "-t",
        "1",
        "--ignore-eos",
        "--events",
        "--copy-cache",
        cache,
    )
    assert_one_line(done.returncode, done.stderr, f"cannot write copy cache {cache}: Read-only file system")
    assert done.stdout == "" and cache.read_bytes() == kept


def test_a_trace_for_a_read_only_folder_is_refused_before_decoding(tiny_models, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    done = _read_only(
        folder,
        sys.executable,
        "-m",
        "s2moe.app.cli",
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hi",
        "-n",
        "8",
        "-t",
        "1",
        "--ignore-eos",
        "--events",
        "--trace",
        folder / "t.jsonl",
    )
    assert_one_line(done.returncode, done.stderr, f"cannot write trace {folder / 't.jsonl'}: Read-only file system")
