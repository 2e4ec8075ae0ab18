"""Native helpers compiled on first use against the llama.cpp that llama-cpp-python installed.

The routing hook runs for every node of every decode, so it is C. It is built once per source/llama
build into the user's cache directory (or S2MOE_NATIVE_DIR) with the system C compiler and loaded
with ctypes. Nothing here patches or vendors llama.cpp.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from ..engine.errors import S2MoEError

SOURCES = ("s2moe_hook.c", "s2moe_offload.c")


class NativeBuildError(S2MoEError, RuntimeError):
    """The native helper library could not be built or loaded (said in one line, as every user error)."""


def _llama_cpp_dirs() -> tuple[Path, Path]:
    """(include dir with ggml.h, lib dir with libggml-base) of the installed llama-cpp-python. Found without
    importing it: a build may run in a process that must not load llama.cpp (run_in_budget's parent)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        raise NativeBuildError("llama-cpp-python is not installed")
    pkg = Path(spec.origin).resolve().parent
    lib = pkg / "lib"
    for inc in (pkg / "include", pkg.parent / "include", pkg / "vendor" / "llama.cpp" / "ggml" / "include"):
        if (inc / "ggml.h").is_file() and (inc / "ggml-backend.h").is_file():
            return inc, lib
    raise NativeBuildError("llama-cpp-python is installed without its ggml headers (ggml.h, ggml-backend.h)")


def _cache_dir() -> Path:
    explicit = os.environ.get("S2MOE_NATIVE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "s2moe" / "native"


def _fingerprint(inc: Path, lib: Path) -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        h.update((here / name).read_bytes())
    for header in ("ggml.h", "ggml-backend.h"):
        h.update((inc / header).read_bytes())
    for so in sorted(lib.glob("libggml-base*")):
        st = so.stat()
        h.update(f"{so.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(sys.platform.encode())
    return h.hexdigest()[:16]


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise NativeBuildError("no C compiler found (tried $CC, cc, gcc, clang): install one, e.g. `apt-get install gcc`")


def build(force: bool = False) -> Path:
    """Compile the helper library if needed and return its path. Safe against concurrent builds."""
    inc, lib = _llama_cpp_dirs()
    target = _cache_dir() / f"libs2moe-{_fingerprint(inc, lib)}.so"
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [
        _compiler(),
        "-O2",
        "-std=c11",
        "-fPIC",
        "-shared",
        "-Wall",
        "-pthread",
        f"-I{inc}",
        *[str(here / s) for s in SOURCES],
        f"-L{lib}",
        "-lggml-base",
        f"-Wl,-rpath,{lib}",
        "-lm",
        "-pthread",
        "-o",
        tmp,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeBuildError("building the native routing hook failed:\n" + done.stderr.strip())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class _Hook(ctypes.Structure):
    """Opaque: only pointers to it cross the boundary."""


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The loaded helper library with typed entry points."""
    import llama_cpp  # noqa: F401  (loads libllama/libggml first: our library binds to the copies already loaded)

    path = build()
    lib = ctypes.CDLL(str(path))
    hp = ctypes.POINTER(_Hook)
    i32p = ctypes.POINTER(ctypes.c_int32)
    f32p = ctypes.POINTER(ctypes.c_float)
    sigs = {
        "s2_hook_new": (hp, [ctypes.c_int] * 5),
        "s2_hook_free": (None, [hp]),
        "s2_hook_bind": (None, [hp, i32p, i32p, f32p, i32p, i32p, i32p]),
        "s2_hook_configure": (None, [hp, ctypes.c_float, ctypes.c_int, ctypes.c_int]),
        "s2_hook_off": (None, [hp]),
        "s2_hook_observe": (None, [hp]),
        "s2_hook_draft": (None, [hp, ctypes.c_int]),
        "s2_hook_draft_masked": (None, [hp, ctypes.c_int, ctypes.POINTER(ctypes.c_uint8)]),
        "s2_hook_skip": (None, [hp, i32p]),
        "s2_hook_uniform": (None, [hp, ctypes.c_int]),
        "s2_hook_prefer_memory": (None, [hp, ctypes.c_float, ctypes.POINTER(ctypes.c_uint8)]),
        "s2_hook_gate": (None, [hp, ctypes.c_float, ctypes.c_int, f32p]),
        "s2_hook_set_route": (None, [hp, ctypes.c_void_p, ctypes.c_void_p]),
        "s2_hook_set_resident": (None, [hp, ctypes.c_void_p, ctypes.c_void_p]),
        "s2_hook_set_stage": (None, [hp, ctypes.c_void_p, ctypes.c_void_p]),
        "s2_hook_set_backend_copy": (None, [hp, ctypes.c_int]),
        "s2_hook_set_distinct_min_rows": (None, [hp, ctypes.c_int]),
        "s2_hook_hooked": (ctypes.c_int64, [hp]),
        "s2_hook_skipped": (ctypes.c_int64, [hp]),
        "s2_hook_mask_fallbacks": (ctypes.c_int64, [hp]),
        "s2_hook_mask_evicted": (ctypes.c_int64, [hp]),
        "s2_hook_narrowed": (ctypes.c_int64, [hp]),
        "s2_hook_unwidened": (ctypes.c_int64, [hp]),
        "s2_hook_end": (None, [hp]),
        "s2_hook_pregate": (None, [hp, ctypes.c_int, ctypes.c_int, ctypes.c_int, i32p]),
        "s2_hook_set_predict": (None, [hp, ctypes.c_void_p, ctypes.c_void_p]),
        "s2_hook_pregate_stats": (ctypes.c_int64, [hp, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def eval_callback_address() -> int:
    """Address of the C cb_eval, to be placed in llama_context_params."""
    address = ctypes.cast(library().s2_hook_eval, ctypes.c_void_p).value
    assert address is not None  # a symbol the library exports never sits at address 0
    return address
