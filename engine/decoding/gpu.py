"""Where llama.cpp keeps a model's weights on a machine with a GPU, and what copying experts costs there.

llama.cpp as llama-cpp-python vendors it has the paper's GPU regime without a patch: the expert tensors
stay in host memory (llama_model_params.tensor_buft_overrides, as llama.cpp's `--cpu-moe` and
`--n-cpu-moe N`) while the other layers run on the GPU, and with llama_context_params.op_offload an op on
host weights runs on the GPU from a batch of GGML_OP_OFFLOAD_MIN_BATCH tokens: for MUL_MAT_ID the
scheduler copies only the experts the batch's ids use. The routing hook decides those ids, so what crosses
the bus is the union S²-MoE's utility rule prices.

Placement carries these settings from the flags to the runtime; BuftOverrides is the C array llama.cpp
reads them from. transfer_rate and measure_copy_mode are the measurements calibrate makes on a GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import OPTION, ConfigError

if TYPE_CHECKING:
    from ..model_info import ModelInfo

# llama.cpp's own pattern for expert tensors (LLM_FFN_EXPS_REGEX in its common library): split and fused
# gate/up, down, and the chunked experts some architectures have. Searched in each tensor's name.
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
MIN_BATCH_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
MIN_BATCH_DEFAULT = 32  # what the CUDA backend uses when the variable is unset
# A batch size no decode reaches: experts in host memory always run on the CPU.
NEVER = 1 << 30

GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1
GGML_BACKEND_DEVICE_TYPE_IGPU = 2  # Jetson's GPU shares the host's memory
GGML_TYPE_F32 = 0


@dataclass(frozen=True)
class Placement:
    """Which weights llama.cpp puts on the GPU. The defaults load everything into host memory."""

    n_gpu_layers: int = 0  # -1: all
    cpu_moe: bool = False  # every layer's expert tensors stay in host memory
    n_cpu_moe: int = 0  # ... the first n_cpu_moe layers' expert tensors
    op_offload_min_batch: int | None = None  # GGML_OP_OFFLOAD_MIN_BATCH for this process (None: as set)

    @property
    def experts_in_host(self) -> bool:
        return self.cpu_moe or self.n_cpu_moe > 0

    @property
    def copies_experts(self) -> bool:
        """Experts in host memory beside layers on a GPU: a batch from the offload threshold copies the
        experts it uses, and a profile's copy cost applies."""
        return self.experts_in_host and self.n_gpu_layers != 0

    def validate(self, info: ModelInfo | None = None) -> None:
        """ConfigError for values no load can use; with a ModelInfo, also against that model."""
        if self.n_gpu_layers < -1:
            raise ConfigError(
                f"{OPTION} must be -1 (all layers), 0 or a number of layers, got {self.n_gpu_layers}",
                option="n_gpu_layers",
            )
        if self.n_cpu_moe < 0:
            raise ConfigError(f"{OPTION} must be a whole number ≥ 0, got {self.n_cpu_moe}", option="n_cpu_moe")
        if self.cpu_moe and self.n_cpu_moe:
            raise ConfigError(
                f"--cpu-moe and {OPTION} {self.n_cpu_moe} contradict each other: --cpu-moe keeps every "
                "layer's experts in host memory",
                option="n_cpu_moe",
            )
        if self.op_offload_min_batch is not None and self.op_offload_min_batch < 1:
            raise ConfigError(
                f"{OPTION} must be at least 1, got {self.op_offload_min_batch}", option="op_offload_min_batch"
            )
        if info is None or not self.experts_in_host:
            return
        if self.n_cpu_moe > info.n_layer:
            raise ConfigError(
                f"{OPTION} {self.n_cpu_moe} is more than the {info.n_layer} layers of {info.path.name}",
                option="n_cpu_moe",
            )
        if not expert_tensor_names(info.path):
            flag = "--cpu-moe" if self.cpu_moe else "--n-cpu-moe"
            raise ConfigError(
                f"{flag}: {info.path.name} has no expert tensors that llama.cpp's pattern "
                f"(blk.N.ffn_{{up,gate,down,gate_up}}_exps) matches, so none can be kept in host memory"
            )

    def patterns(self) -> list[str]:
        """The tensor-name patterns whose tensors stay in host memory (first match wins in llama.cpp)."""
        if self.cpu_moe:
            return [EXPERT_TENSORS]
        return [rf"blk\.{i}{EXPERT_TENSORS}" for i in range(self.n_cpu_moe)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def expert_tensor_names(path: str | os.PathLike[str]) -> list[str]:
    """Names of the model's tensors that llama.cpp's expert pattern matches."""
    from ..model_info import gguf_reader

    pattern = re.compile(EXPERT_TENSORS)
    return [t.name for t in gguf_reader(path).tensors if pattern.search(t.name)]


class _Override(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class BuftOverrides:
    """The null-terminated llama_model_tensor_buft_override array for a set of patterns, one buffer type for
    all. llama.cpp keeps the pointer in the model's parameters and reads it again when a context is made:
    the object must live as long as the model (LlamaRuntime holds it)."""

    def __init__(self, patterns: list[str], buft: int):
        self.patterns = [p.encode() for p in patterns]
        self.array = (_Override * (len(self.patterns) + 1))()  # zeroed: the last slot's null pattern ends it
        for slot, pattern in zip(self.array, self.patterns):
            slot.pattern = pattern
            slot.buft = buft

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def _ggml(name: str, restype: type[Any] | None, *argtypes: type[Any]) -> Any:
    """A ggml function by name; libggml's dependencies (ggml-base) resolve through its handle."""
    from llama_cpp import _ggml

    fn = getattr(_ggml.libggml, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def cpu_buffer_type() -> int:
    """ggml's host buffer type, what llama.cpp's --cpu-moe names as CPU."""
    buft: int = _ggml("ggml_backend_cpu_buffer_type", ctypes.c_void_p)()
    return buft


def device_buffer_type(device_type: int) -> int | None:
    """The default buffer type of the first device of a type (None: no such device). Starts ggml's device
    registry: call it only after the runtime's backend is up (GGML_OP_OFFLOAD_MIN_BATCH is read there)."""
    dev = _ggml("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(device_type)
    if not dev:
        return None
    buft: int | None = _ggml("ggml_backend_dev_buffer_type", ctypes.c_void_p, ctypes.c_void_p)(dev)
    return buft


def buffer_type_name(buft: int) -> str:
    name: bytes = _ggml("ggml_backend_buft_name", ctypes.c_char_p, ctypes.c_void_p)(buft)
    return name.decode()


def gpu_backend() -> bool:
    """Whether this llama.cpp build has a GPU device to offload to (a CUDA, Metal or Vulkan build on a
    machine that has one)."""
    import llama_cpp

    from .llama_process import init_backend

    init_backend()
    return bool(llama_cpp.llama_supports_gpu_offload())


def gpu_device_type() -> int | None:
    """GGML_BACKEND_DEVICE_TYPE_GPU or _IGPU (an integrated GPU such as Jetson's), None without one."""
    for kind in (GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU):
        if device_buffer_type(kind) is not None:
            return kind
    return None


class _InitParams(ctypes.Structure):
    # struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; }
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def transfer_rate(device_type: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of copies from ordinary (pageable) host memory into a buffer of the first device of
    `device_type`, through ggml's own tensor_set, as op offload copies experts; the median of `repeats`
    copies after one warm-up. Reads the buffer back once and raises RuntimeError if it does not hold what
    was written. Needs the runtime's backend up (see device_buffer_type); on the CPU device it measures a
    host-to-host copy through the same calls."""
    buft = device_buffer_type(device_type)
    if buft is None:
        raise RuntimeError(f"no ggml device of type {device_type} in this llama.cpp build")
    n = max(1, nbytes // 4)
    ctx = _ggml("ggml_init", ctypes.c_void_p, _InitParams)(_InitParams(1 << 16, None, True))
    buffer = None
    try:
        tensor = _ggml("ggml_new_tensor_1d", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)(
            ctx, GGML_TYPE_F32, n
        )
        size = _ggml("ggml_nbytes", ctypes.c_size_t, ctypes.c_void_p)(tensor)
        buffer = _ggml("ggml_backend_buft_alloc_buffer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(buft, size)
        if not buffer:
            raise RuntimeError(f"could not allocate {size} bytes on the device")
        base = _ggml("ggml_backend_buffer_get_base", ctypes.c_void_p, ctypes.c_void_p)(buffer)
        status = _ggml("ggml_backend_tensor_alloc", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
            buffer, tensor, base
        )
        if status != 0:
            raise RuntimeError(f"ggml could not place a tensor in the device buffer (status {status})")
        tensor_set = _ggml(
            "ggml_backend_tensor_set", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
        )
        src = np.random.default_rng(0).random(n, dtype=np.float32)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            tensor_set(tensor, src.ctypes.data, 0, size)  # returns once the copy is done
            if i:
                times.append(time.perf_counter() - t0)
        back = np.empty(min(n, 1 << 16), np.float32)
        _ggml("ggml_backend_tensor_get", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)(
            tensor, back.ctypes.data, 0, back.nbytes
        )
        if not np.array_equal(back, src[: len(back)]):
            raise RuntimeError("the device buffer did not hold what was copied into it")
        return float(size / np.median(times))
    finally:
        if buffer:
            _ggml("ggml_backend_buffer_free", None, ctypes.c_void_p)(buffer)
        _ggml("ggml_free", None, ctypes.c_void_p)(ctx)


# -- the copy-mode measurement -----------------------------------------------------------------------------
def _time_batches(cfg: dict[str, Any]) -> dict[str, Any]:
    """In a process of its own (the threshold is read once per process): load the model as `placement`
    says and time verification batches of each size; {"samples": [(experts, tokens, seconds)], "min_batch":
    the threshold the backend started with}."""
    from ..measure.costmodel import iter_verify_samples
    from ..model_info import read_model_info
    from .runtime import LlamaRuntime

    placement = Placement(**cfg["placement"])
    rt = LlamaRuntime(
        read_model_info(cfg["model"]),
        n_ctx=256,
        n_threads=cfg.get("threads"),
        max_verify_rows=max(cfg["sizes"]),
        placement=placement,
        use_extra_bufts=cfg.get("extra_buffers", True),
    )
    try:
        gen = iter_verify_samples(
            rt,
            max(cfg["sizes"]) - 1,
            seed=cfg.get("seed", 3),
            repeats=cfg["repeats"],
            sizes=cfg["sizes"],
            variants=("random",),
        )
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return {"samples": [list(s) for s in stop.value], "min_batch": os.environ.get(MIN_BATCH_ENV)}
    finally:
        rt.close()


def _run_timing(cfg: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "s2moe.engine.decoding.gpu", "--time-batches", json.dumps(cfg)],
        capture_output=True,
        text=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(err[-1] if err else f"the timing process ended with status {proc.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["samples"] = [tuple(s) for s in result["samples"]]
    want = cfg["placement"].get("op_offload_min_batch")
    if want is not None and result.get("min_batch") != str(want):
        raise RuntimeError(f"the timing process started with {MIN_BATCH_ENV}={result.get('min_batch')}, not {want}")
    return result


@dataclass(frozen=True)
class CopyMode:
    """Verification batches with the experts in host memory, copied to the device (op offload from batch
    size 1) against run on the CPU (op offload never)."""

    sizes: list[int]
    copy_s: list[float]  # median seconds per batch size, experts copied
    cpu_s: list[float]  # ... experts on the CPU
    copy_samples: list[tuple[float, ...]]  # (distinct experts over layers, tokens, seconds)
    crossover: int | None  # the smallest batch size from which copying is faster at every size measured

    def as_dict(self) -> dict[str, Any]:
        return {
            "sizes": self.sizes,
            "copy_ms": [x * 1e3 for x in self.copy_s],
            "cpu_ms": [x * 1e3 for x in self.cpu_s],
            "crossover": self.crossover,
        }


def crossover(sizes: list[int], copy_s: list[float], cpu_s: list[float]) -> int | None:
    """The smallest size from which copying beats the CPU at this and every larger size measured."""
    best = None
    for size, c, h in sorted(zip(sizes, copy_s, cpu_s), reverse=True):
        if c >= h:
            break
        best = size
    return best


def measure_copy_mode(
    model: str,
    *,
    sizes: list[int],
    n_gpu_layers: int = -1,
    threads: int | None = None,
    repeats: int = 3,
    use_extra_bufts: bool = True,
) -> Generator[tuple[int, int], None, CopyMode]:
    """Generator (yields (done, 2)); returns a CopyMode. Times verification batches of `sizes` tokens on
    `model` loaded with `n_gpu_layers` on the GPU and every expert in host memory, twice, each in a process
    of its own (the threshold is read once per process): with op offload from batch size 1 (each batch
    copies the union of its experts to the device) and never (the experts run on the CPU). Raises
    RuntimeError with the last line a timing process printed when one fails."""
    runs: list[list[tuple[float, ...]]] = []
    for min_batch in (1, NEVER):
        placement = Placement(n_gpu_layers=n_gpu_layers, cpu_moe=True, op_offload_min_batch=min_batch)
        runs.append(
            _run_timing(
                {
                    "model": str(model),
                    "threads": threads,
                    "sizes": list(sizes),
                    "repeats": repeats,
                    "placement": placement.as_dict(),
                    "extra_buffers": use_extra_bufts,
                }
            )["samples"]
        )
        yield len(runs), 2
    copied, on_cpu = runs

    def by_size(samples: Sequence[tuple[float, ...]]) -> list[float]:
        return [float(np.median([s[2] for s in samples if s[1] == size])) for size in sizes]

    copy_s, cpu_s = by_size(copied), by_size(on_cpu)
    return CopyMode(list(sizes), copy_s, cpu_s, copied, crossover(list(sizes), copy_s, cpu_s))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--time-batches":
        print(json.dumps(_time_batches(json.loads(argv[1]))), flush=True)
        return 0
    print("usage: s2moe calibrate (this module's own entry point is internal)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
