"""GPU placement: the flags, the C array llama.cpp reads them from, when the offload threshold is set, the
profile's copy cost, and the copy-mode measurements. Tests marked `gpu` need a GPU build of llama.cpp on a
machine with a GPU (scripts/gpu-check.sh runs them) and are skipped elsewhere."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
from s2moe.app.cli import main
from s2moe.app.parser import build_parser
from s2moe.engine.decoding import gpu, llama_process
from s2moe.engine.decoding.decoder import Decoder
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.decoding.gpu import EXPERT_TENSORS, NEVER, BuftOverrides, Placement
from s2moe.engine.decoding.runtime import LlamaRuntime
from s2moe.engine.errors import ConfigError
from s2moe.engine.events import Finished
from s2moe.engine.model_info import read_model_info
from s2moe.engine.profiles import cost_for_model, validate_profile

HAS_GPU = gpu.gpu_backend()


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_GPU, reason="no GPU backend in this llama.cpp build")(test))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def llama_log():
    """Every line llama.cpp logs while the test runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("s2moe.llama")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)


# -- the overrides -----------------------------------------------------------------------------------------
def test_the_override_array_holds_the_patterns_the_cpu_buffer_type_and_a_null_end():
    cpu = gpu.cpu_buffer_type()
    assert cpu and gpu.buffer_type_name(cpu) == "CPU"
    assert gpu.device_buffer_type(gpu.GGML_BACKEND_DEVICE_TYPE_CPU) == cpu  # the CPU device's own buffer type
    patterns = Placement(n_cpu_moe=3).patterns()
    overrides = BuftOverrides(patterns, cpu)
    array = (gpu._Override * 4).from_address(overrides.address)  # as llama.cpp reads it
    assert [array[i].pattern for i in range(3)] == [rf"blk\.{i}{EXPERT_TENSORS}".encode() for i in range(3)]
    assert [array[i].buft for i in range(3)] == [cpu] * 3
    assert array[3].pattern is None and array[3].buft is None
    assert BuftOverrides([], cpu).array[0].pattern is None
    assert Placement(cpu_moe=True).patterns() == [EXPERT_TENSORS] and Placement().patterns() == []


def test_the_patterns_match_expert_tensors_only():
    def host(placement, name):
        return any(re.search(p, name) for p in placement.patterns())

    every = Placement(cpu_moe=True)
    for name in (
        "blk.0.ffn_up_exps.weight",
        "blk.3.ffn_gate_exps.weight",
        "blk.12.ffn_down_exps.weight",
        "blk.1.ffn_gate_up_exps.weight",
        "blk.2.ffn_down_chexps.weight",
        "blk.0.ffn_up_exps.bias",
    ):
        assert host(every, name), name
    for name in (
        "blk.0.ffn_gate_inp.weight",
        "blk.0.ffn_up_shexp.weight",
        "blk.0.ffn_up.weight",
        "blk.0.attn_q.weight",
        "token_embd.weight",
        "blk.0.exp_probs_b.bias",
    ):
        assert not host(every, name), name
    first_two = Placement(n_cpu_moe=2)
    assert host(first_two, "blk.1.ffn_up_exps.weight") and not host(first_two, "blk.2.ffn_up_exps.weight")
    assert not host(first_two, "blk.10.ffn_up_exps.weight") and not host(first_two, "blk.11.ffn_up_exps.weight")


@pytest.mark.parametrize("placement, layers", [(Placement(n_cpu_moe=2), {0, 1}), (Placement(cpu_moe=True), {0, 1, 2})])
def test_llama_cpp_keeps_exactly_the_matched_tensors_in_host_memory(tiny_models, llama_log, placement, layers):
    rt = LlamaRuntime(read_model_info(tiny_models["olmoe"]), n_ctx=64, n_threads=1, placement=placement)
    rt.close()
    moved = {m.group(1) for line in llama_log if (m := re.match(r"tensor (\S+) .*buffer type overridden to CPU", line))}
    names = set(gpu.expert_tensor_names(tiny_models["olmoe"]))
    assert moved == {n for n in names if int(n.split(".")[1]) in layers} and moved


def test_without_overrides_llama_cpp_moves_nothing(tiny_models, llama_log):
    LlamaRuntime(read_model_info(tiny_models["olmoe"]), n_ctx=64, n_threads=1).close()
    assert llama_log and not any("overridden" in line for line in llama_log)


def test_experts_in_host_memory_decode_the_same_tokens(tiny_models, decoders):
    """On a CPU build (here with -ngl too) the override names the buffer type the experts had anyway: the
    model loads and decodes exactly as before (lossless modes token-identical to ar)."""

    def tokens(decoder, **kw):
        events = decoder.generate("def add(a, b):", GenerationConfig(n_predict=12, stop_at_eos=False, **kw))
        return [e for e in events if isinstance(e, Finished)][0].tokens

    ar = tokens(decoders["olmoe"], mode="ar")
    layers = 0 if HAS_GPU else -1  # on a GPU the other layers' numerics would differ from the CPU's
    d = Decoder(
        str(tiny_models["olmoe"]), n_ctx=512, n_threads=1, placement=Placement(cpu_moe=True, n_gpu_layers=layers)
    )
    try:
        assert d.rt.placement.cpu_moe
        assert tokens(d, mode="ar") == ar
        assert tokens(d, mode="s2moe", reuse_strength=0.0) == ar
    finally:
        d.close()


# -- the flags ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "bench", "calibrate", "app"])
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--n-cpu-moe", "-1"], "--n-cpu-moe: must be a whole number ≥ 0, got -1"),
        (["--cpu-moe", "--n-cpu-moe", "2"], "--cpu-moe and --n-cpu-moe 2 contradict each other"),
        (["--op-offload-min-batch", "0"], "--op-offload-min-batch: must be at least 1, got 0"),
        (["-ngl", "-2"], "must be -1 (all layers), 0 or a number of layers, got -2"),
    ],
)
def test_bad_placement_flags_are_one_line_before_any_load(tiny_models, capsys, command, argv, needle):
    extra = ["-p", "hi"] if command == "generate" else []
    rc, _, err = run_cli(capsys, command, "-m", tiny_models["olmoe"], *extra, *argv)
    assert needle in one_line(rc, err)


@pytest.mark.parametrize("command, rest", [("generate", ["-p", "x"]), ("bench", []), ("calibrate", []), ("app", [])])
def test_every_command_that_loads_a_model_takes_the_placement_flags(command, rest):
    args = build_parser().parse_args([command, *rest, "-ngl", "-1", "--n-cpu-moe", "3", "--op-offload-min-batch", "2"])
    assert (args.gpu_layers, args.cpu_moe, args.n_cpu_moe, args.op_offload_min_batch) == (-1, False, 3, 2)
    assert build_parser().parse_args([command, *rest, "--cpu-moe"]).cpu_moe


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_placement_flags_checked_against_the_model(tiny_models, capsys, command):
    extra = ["-p", "hi", "-n", "2", "--mode", "ar"] if command == "generate" else ["--no-save", "--repeats", "1"]
    rc, _, err = run_cli(capsys, command, "-m", tiny_models["olmoe"], *extra, "--threads", "1", "--n-cpu-moe", "4")
    assert "--n-cpu-moe 4 is more than the 3 layers of olmoe.gguf" in one_line(rc, err)
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["llama"], "-p", "hi", "--mode", "ar", "--cpu-moe")
    assert "--cpu-moe: dense.gguf has no expert tensors that llama.cpp's pattern" in one_line(rc, err)


@pytest.fixture
def loads(monkeypatch):
    """The placement of every LlamaRuntime made while the test runs."""
    asked = []
    real = LlamaRuntime.__init__

    def init(self, info, **kw):
        asked.append(kw.get("placement"))
        real(self, info, **kw)

    monkeypatch.setattr(LlamaRuntime, "__init__", init)
    return asked


def test_placement_flags_reach_the_runtime_in_generate_and_bench(tiny_models, capsys, loads, tmp_path):
    flags = ["--threads", "1", "-ngl", "2", "--n-cpu-moe", "1"]
    want = Placement(n_gpu_layers=2, n_cpu_moe=1)
    rc, _, err = run_cli(capsys, "generate", "-m", tiny_models["olmoe"], "-p", "hi", "-n", "2", "--mode", "ar", *flags)
    assert rc == 0, err
    assert loads == [want]
    loads.clear()
    report = tmp_path / "bench.json"
    rc, _, err = run_cli(
        capsys,
        "bench",
        "-m",
        tiny_models["olmoe"],
        "--modes",
        "ar",
        "--n-prompts",
        "1",
        "-n",
        "2",
        "--draft-max",
        "8",
        "--reuse-strength",
        "0.5",
        "--no-quality",
        "--no-reference",
        "--no-warmup",
        "--json",
        report,
        *flags,
    )
    assert rc == 0, err
    assert loads and all(p == want for p in loads)
    assert json.loads(report.read_text())["config"]["placement"] == want.as_dict()


def test_calibrate_uses_the_placement_and_says_why_it_skips_the_gpu_step(
    tiny_models, capsys, loads, tmp_path, monkeypatch
):
    monkeypatch.setenv("S2MOE_CGROUP_ROOT", str(tmp_path / "none"))
    rc, _, err = run_cli(
        capsys,
        "calibrate",
        "-m",
        tiny_models["olmoe"],
        "--no-save",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--no-plot",
        "--cpu-moe",
        "-ngl",
        "3",
    )
    assert rc == 0, err
    assert loads and all(p == Placement(n_gpu_layers=3, cpu_moe=True) for p in loads)
    if not HAS_GPU:
        assert "[6] gpu: skipped: no GPU backend in this llama.cpp build" in err


def test_the_app_loads_with_the_placement_flags(tiny_models):
    from s2moe.app.cmd_app import build_app

    args = build_parser().parse_args(
        ["app", "-m", str(tiny_models["olmoe"]), "-t", "1", "-c", "256", "--cpu-moe", "-ngl", "1"]
    )
    session = build_app(args).session
    assert session.placement == Placement(n_gpu_layers=1, cpu_moe=True)
    try:
        session.load()
        assert session.decoder.rt.placement == session.placement
    finally:
        session._close_decoder()


# -- the offload threshold ---------------------------------------------------------------------------------
def test_a_threshold_asked_for_after_the_backend_started_is_one_line(tiny_models, capsys):
    llama_process.init_backend()
    started = llama_process.backend_min_batch
    other = "12345" if started != "12345" else "54321"
    rc, _, err = run_cli(
        capsys,
        "generate",
        "-m",
        tiny_models["olmoe"],
        "-p",
        "hi",
        "--mode",
        "ar",
        "-n",
        "2",
        "--op-offload-min-batch",
        other,
    )
    assert (
        f"--op-offload-min-batch {other} comes too late: llama.cpp's backend in this process started with "
        f"GGML_OP_OFFLOAD_MIN_BATCH="
    ) in one_line(rc, err)
    if started is not None:  # the value it started with is no conflict
        rc, _, err = run_cli(
            capsys,
            "generate",
            "-m",
            tiny_models["olmoe"],
            "-p",
            "hi",
            "--mode",
            "ar",
            "-n",
            "2",
            "--threads",
            "1",
            "--op-offload-min-batch",
            started,
        )
        assert rc == 0, err


FRESH = r"""
import ctypes, json, os, sys
import llama_cpp
from s2moe.engine.errors import ConfigError
from s2moe.engine.decoding.gpu import Placement
from s2moe.engine.model_info import read_model_info
from s2moe.engine.decoding.runtime import LlamaRuntime

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
seen = {}
for name in ("llama_backend_init", "llama_supports_gpu_offload"):
    real = getattr(llama_cpp, name)
    def spy(real=real, name=name):
        seen.setdefault(name, libc.getenv(b"GGML_OP_OFFLOAD_MIN_BATCH"))
        return real()
    setattr(llama_cpp, name, spy)
info = read_model_info(sys.argv[1])
LlamaRuntime(info, n_ctx=64, n_threads=1, placement=Placement(op_offload_min_batch=7)).close()
LlamaRuntime(info, n_ctx=64, n_threads=1, placement=Placement(op_offload_min_batch=7)).close()
try:
    LlamaRuntime(info, n_ctx=64, n_threads=1, placement=Placement(op_offload_min_batch=9))
    late = None
except ConfigError as e:
    late = e.worded({"op_offload_min_batch": "--op-offload-min-batch"})
print(json.dumps({k: v.decode() if v else None for k, v in seen.items()} | {"late": late}))
"""


def test_the_threshold_is_in_the_environment_before_the_backend_starts(tiny_models):
    env = {k: v for k, v in __import__("os").environ.items() if k != gpu.MIN_BATCH_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(tiny_models["olmoe"])], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["llama_backend_init"] == seen["llama_supports_gpu_offload"] == "7"
    assert (
        seen["late"].startswith("--op-offload-min-batch 9 comes too late")
        and "=7 and reads it only then" in seen["late"]
    )


# -- the profile -------------------------------------------------------------------------------------------
def _profile(**block):
    base = {"t_ar_ms": 10.0, "c_draft_ms": 4.0, "t_exp_ms": 0.05, "t_tok_ms": 1.0, "intercept_ms": 0.5}
    return {
        "schema": 1,
        "name": "g",
        "kind": "measured",
        "device": {"kind": "gpu", "host_to_device_gb_s": 25.0},
        "models": {"0123456789abcdef": {**base, **block}},
    }


def test_the_copy_cost_replaces_t_exp_with_experts_in_host_memory():
    prof = validate_profile(
        _profile(
            t_exp_copy_ms=0.2,
            copy_min_batch=2,
            fit_copy={"intercept_ms": 3.0, "t_exp_ms": 0.2, "t_tok_ms": 0.1, "r2": 0.9, "mape": 0.05, "n": 9},
        )
    )
    resident = cost_for_model(prof, "0123456789abcdef")
    copied = cost_for_model(prof, "0123456789abcdef", experts_in_host=True)
    assert resident.t_exp == pytest.approx(0.05e-3) and resident.source == "profile:g"
    assert copied.t_exp == pytest.approx(0.2e-3) and copied.intercept == pytest.approx(3e-3)
    assert copied.t_tok == pytest.approx(0.1e-3) and copied.r2 == 0.9 and "copied" in copied.source
    # a profile measured without a GPU has no copy cost: the resident one stands
    assert (
        cost_for_model(validate_profile(_profile()), "0123456789abcdef", experts_in_host=True).t_exp == resident.t_exp
    )
    assert Placement(cpu_moe=True, n_gpu_layers=-1).copies_experts and not Placement(cpu_moe=True).copies_experts


@pytest.mark.parametrize(
    "where, value, needle",
    [
        ("device", {"host_to_device_gb_s": 0}, "field host_to_device_gb_s must be a positive number"),
        ("model", {"copy_min_batch": 0}, "field copy_min_batch must be a positive whole number"),
        ("model", {"copy_min_batch": 1.5}, "field copy_min_batch must be a positive whole number"),
        ("model", {"t_exp_copy_ms": -1}, "field t_exp_copy_ms must be a non-negative number"),
        ("model", {"fit_copy": {"r2": 2}}, "fit_copy: field r2 must be a number ≤ 1"),
    ],
)
def test_bad_gpu_fields_name_the_field(where, value, needle):
    prof = _profile()
    target = prof["device"] if where == "device" else prof["models"]["0123456789abcdef"]
    target.update(value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        validate_profile(prof)


# -- the measurements --------------------------------------------------------------------------------------
def test_crossover_is_where_copying_wins_from_then_on():
    sizes = [1, 2, 4, 8]
    assert gpu.crossover(sizes, [5, 4, 3, 2], [1, 3, 4, 6]) == 4
    assert gpu.crossover(sizes, [1, 1, 1, 1], [2, 2, 2, 2]) == 1
    assert gpu.crossover(sizes, [5, 1, 5, 1], [2, 2, 2, 2]) == 8  # a win below a loss does not count
    assert gpu.crossover(sizes, [3, 3, 3, 3], [2, 2, 2, 2]) is None


def test_transfer_rate_copies_through_ggml_and_checks_what_arrived():
    # the CPU device: the same calls as into a GPU's memory, here a host-to-host copy
    assert gpu.transfer_rate(gpu.GGML_BACKEND_DEVICE_TYPE_CPU, nbytes=8 << 20, repeats=2) > 0
    if not HAS_GPU:
        with pytest.raises(RuntimeError, match="no ggml device of type 1"):
            gpu.transfer_rate(gpu.GGML_BACKEND_DEVICE_TYPE_GPU)


def test_the_timing_processes_start_with_their_own_threshold(tiny_models):
    """Each timing process sets its threshold before its backend starts, and says which it started with."""
    for min_batch in (1, NEVER):
        placement = Placement(cpu_moe=True, op_offload_min_batch=min_batch)
        result = gpu._run_timing(
            {
                "model": str(tiny_models["olmoe"]),
                "threads": 1,
                "sizes": [1, 3],
                "repeats": 1,
                "placement": placement.as_dict(),
            }
        )
        assert result["min_batch"] == str(min_batch)
        assert sorted(s[1] for s in result["samples"]) == [1, 3] and all(
            s[0] > 0 and s[2] > 0 for s in result["samples"]
        )
    gen = gpu.measure_copy_mode(str(tiny_models["olmoe"]), sizes=[1, 2], n_gpu_layers=0, threads=1, repeats=1)
    progress = []
    while True:
        try:
            progress.append(next(gen))
        except StopIteration as stop:
            mode = stop.value
            break
    assert progress == [(1, 2), (2, 2)]
    assert mode.sizes == [1, 2] and len(mode.copy_s) == len(mode.cpu_s) == 2 and min(mode.copy_s + mode.cpu_s) > 0
    assert mode.crossover in (None, 1, 2)


# -- on a GPU ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_device(tiny_models):
    info = read_model_info(tiny_models["olmoe"])
    host = LlamaRuntime(info, n_ctx=128, n_threads=1)
    device = LlamaRuntime(info, n_ctx=128, n_threads=1, placement=Placement(n_gpu_layers=-1))
    # Ids in device buffers never repeat within a row (CUDA's MUL_MAT_ID aborts on a repeat): the host
    # runtime is held to the same rule so that the two route alike.
    host.hook.distinct_from(1)
    yield host, device
    host.close()
    device.close()


BATCH = np.random.default_rng(11).integers(0, 256, size=9).tolist()


def _routed(rt, mode: str, backend_copy: bool = False):
    rt.hook.force_backend_copy(backend_copy)
    try:
        rt.kv_clear()
        k = rt.info.n_expert_used
        if mode == "observe":
            rt.hook.observe()
        elif mode == "draft":
            rt.hook.draft(2)
        else:
            rt.hook.gate(1.0, k + 1, np.linspace(1.0, 0.3, len(BATCH)))
        return rt.decode(BATCH, 0, "all"), rt.hook.snapshot(len(BATCH))
    finally:
        rt.hook.force_backend_copy(False)
        rt.kv_clear()


@on_gpu
@pytest.mark.parametrize("mode", ["observe", "draft", "gate"])
def test_hook_on_device_buffers_routes_as_on_the_cpu(on_device, mode):
    host, device = on_device
    host_logits, h = _routed(host, mode)
    dev_logits, d = _routed(device, mode)
    for field in ("orig", "used", "rows"):
        np.testing.assert_array_equal(getattr(h, field), getattr(d, field))
    # The routing decisions must agree exactly; the values cannot: CUDA's matmuls round their inputs
    # (F16 activations beside F16 weights, TF32 beside F32), so a router weight differs from the CPU's in
    # the third digit (up to 3.5e-3 relative, seen on an H200).
    np.testing.assert_allclose(h.weight, d.weight, rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(host_logits, dev_logits, rtol=1e-2, atol=1e-2)


@on_gpu
@pytest.mark.parametrize("mode", ["observe", "draft", "gate"])
def test_hook_on_device_buffers_is_bit_identical_run_to_run(on_device, mode):
    _, device = on_device
    first_logits, first = _routed(device, mode)
    again_logits, again = _routed(device, mode, backend_copy=True)
    np.testing.assert_array_equal(first_logits, again_logits)
    for field in ("orig", "used", "weight", "rows"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))


@on_gpu
def test_experts_in_host_memory_beside_a_gpu_decode_like_resident(tiny_models, on_device):
    _, device = on_device
    copied = LlamaRuntime(
        read_model_info(tiny_models["olmoe"]),
        n_ctx=128,
        n_threads=1,
        placement=Placement(n_gpu_layers=-1, cpu_moe=True),
    )
    try:
        a, b = _routed(device, "observe"), _routed(copied, "observe")
        np.testing.assert_array_equal(a[1].used, b[1].used)
        np.testing.assert_allclose(a[0], b[0], rtol=1e-3, atol=1e-3)
    finally:
        copied.close()


@on_gpu
def test_host_to_device_rate_and_copy_mode_on_the_gpu(tiny_models):
    assert gpu.transfer_rate(gpu.gpu_device_type(), nbytes=64 << 20) > 1e8
    gen = gpu.measure_copy_mode(str(tiny_models["olmoe"]), sizes=[1, 2, 9], threads=1, repeats=1)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            mode = stop.value
            break
    assert len(mode.copy_s) == 3 and min(mode.copy_s + mode.cpu_s) > 0


def test_a_calibration_without_a_gpu_counts_the_gpu_step_as_skipped_not_failed():
    from s2moe.app.tui.calibrate_steps import step_outcome
    from s2moe.engine.measure.calibration_events import StepResult
    from s2moe.engine.measure.calibration_steps import NO_GPU, NO_GPU_DEVICE

    for why in (NO_GPU, NO_GPU_DEVICE):
        outcome = step_outcome(StepResult(6, "gpu", why, {"skipped": why}))
        assert outcome.state == "skipped" and outcome.reason == why[len("skipped: ") :]
    assert step_outcome(StepResult(6, "gpu", "failed: x", {"skipped": "failed: x"})).state == "failed"


@pytest.mark.parametrize(
    "reader",
    [
        "s2moe.engine.model_info:read_model_info",
        "s2moe.engine.decoding.gpu:expert_tensor_names",
        "s2moe.engine.offload.experts:expert_map",
    ],
)
def test_llama_cpp_loads_before_gguf_whoever_reads_the_model_first(tiny_models, reader):
    """A CUDA build crashed at model load when gguf (and the sentencepiece it imports) loaded before
    llama.cpp's libraries: every reader of a GGUF loads llama.cpp first."""
    module, name = reader.split(":")
    code = (
        f"import sys; from {module} import {name}; {name}({str(tiny_models['olmoe'])!r}); "
        "order = list(sys.modules); print(order.index('llama_cpp') < order.index('gguf'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
