"""The settings a runtime is made with (context, batch, threads) and the checks that refuse bad ones.

The checks run before llama.cpp is asked for anything, so that a typo in a command-line option is a
one-line ConfigError, not a context that holds gigabytes or threads that only wait for each other; the
commands that take these options check them with the same functions before they load a model.
"""

from __future__ import annotations

from ..errors import OPTION, ConfigError
from ..measure.device import default_threads, memory_bytes
from ..model_info import ModelInfo
from ..offload.sizes import fmt_bytes

# llama.cpp keeps n_ctx in 32 bits and rounds it up; far below that, a context this large is a typo.
MAX_CTX = 1 << 24
# The start-up cost measurement decodes a 32-token prefix in one batch, and llama.cpp caps a batch at
# the context size asked for.
MIN_CTX = 32
# Tokens per llama.cpp batch (n_batch = n_ubatch): a prompt is prefilled in chunks of this many, and the
# compute buffers are sized for one (llama.cpp's default).
DEFAULT_BATCH = 512
# More threads than this many per CPU only wait for each other (999 threads on two cores did not finish
# four tokens in two minutes); ggml allows at most 512.
THREADS_PER_CPU = 4
GGML_MAX_THREADS = 512


def max_threads() -> int:
    return min(GGML_MAX_THREADS, THREADS_PER_CPU * default_threads())


def check_threads(n_threads: int | None) -> None:
    """ConfigError for a thread count that cannot help (None: the default)."""
    if n_threads is None:
        return
    if n_threads < 1:
        raise ConfigError(f"{OPTION} must be at least 1", option="n_threads")
    if n_threads > max_threads():
        cpus = default_threads()
        raise ConfigError(
            f"{OPTION} {n_threads} is more than {max_threads()} ({THREADS_PER_CPU} × the {cpus} "
            f"CPU{'s' if cpus != 1 else ''} this process may run on): extra threads only wait for "
            "each other",
            option="n_threads",
        )


def check_ctx(n_ctx: int, min_ctx: int = MIN_CTX) -> None:
    if n_ctx < min_ctx:
        raise ConfigError(
            f"{OPTION} {n_ctx} is too small: the context must hold at least {min_ctx} tokens "
            "(a verification batch and the start-up cost measurement)",
            option="n_ctx",
        )
    if n_ctx > MAX_CTX:
        raise ConfigError(
            f"{OPTION} {n_ctx} is above the largest context s2moe accepts ({MAX_CTX} tokens)", option="n_ctx"
        )


# llama.cpp's default cache type (f16): bytes per K or V value
KV_VALUE_BYTES = 2


def available_memory() -> int | None:
    """Memory the kernel could give this process now (MemAvailable: free plus reclaimable page cache),
    else the physical memory; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return memory_bytes()


def check_ctx_memory(info: ModelInfo, n_ctx: int, on_gpu: bool = False) -> None:
    """ConfigError for a context whose KV cache would take more than half the memory available: the rest
    is for the model's pages, the compute buffers and everything else running. llama.cpp allocates the
    whole cache up front, so a typo in --ctx would otherwise hold gigabytes for nothing. A cache on the
    GPU (-ngl) is llama.cpp's to refuse."""
    available = available_memory()
    need = n_ctx * info.kv_rows * KV_VALUE_BYTES
    if on_gpu or not need or available is None or need <= available // 2:
        return
    trained = info.n_ctx_train * info.kv_rows * KV_VALUE_BYTES
    raise ConfigError(
        f"{OPTION} {n_ctx} needs {fmt_bytes(need)} of KV cache, more than half the "
        f"{fmt_bytes(available)} of memory available; {info.path.name} was trained on a context of "
        f"{info.n_ctx_train} tokens ({fmt_bytes(trained)})",
        option="n_ctx",
    )
