"""What the engine needs to know about a GGUF before llama.cpp touches it.

Reading the header ourselves turns a missing, foreign, truncated or dense file into one clear message
instead of a llama.cpp log dump, and tells the native hook how this architecture routes.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from .errors import ModelError
from .files import open_regular

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_MAGIC = b"GGUF"

# How llama.cpp turns router logits into probabilities and selection scores, per architecture
# (build_moe_ffn's gating_op). Missing metadata means softmax, as in llama.cpp.
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3
_GATING_BY_ARCH = {"gpt-oss": GATING_SOFTMAX_WEIGHT, "llama4": GATING_SIGMOID}
# Architectures that renormalise the kept weights unconditionally (the rest read expert_weights_norm).
_WEIGHT_NORM_BY_ARCH = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True, "mixtral": True}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_ctx_train: int
    n_vocab: int
    n_expert: int  # 0 for a dense model
    n_expert_used: int  # k
    gating: int
    weight_norm: bool
    biased_selection: bool  # selection scores carry a per-expert bias (DeepSeek-V3 style)
    expert_tensor_bytes: int  # bytes of all *_exps tensors
    file_bytes: int
    fingerprint: str
    # K and V values one token keeps in the cache over all layers (attn_k and attn_v rows); 0 where the
    # attention has no such tensors (fused or compressed)
    kv_rows: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 1 and self.n_expert_used >= 1

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in one layer (gate + up + down slices)."""
        if not self.is_moe:
            return 0
        n_moe_layers = max(1, self.n_layer)
        return self.expert_tensor_bytes // (self.n_expert * n_moe_layers)


def fingerprint(path: Path, header: bytes, size: int) -> str:
    """Identity of a model file that survives renames and copies but not a different model."""
    h = hashlib.sha256()
    h.update(str(size).encode())
    h.update(header)
    return h.hexdigest()[:16]


# llama.cpp's own limits (llama-hparams.h, as built by llama-cpp-python 0.3.36): a file beyond them stops
# the process in an assertion.
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
# Gating functions llama.cpp builds (softmax, sigmoid, softmax of the weights, sigmoid of the weights); 0
# means "the architecture's own" where it has one, and stops the graph of those that do not.
LLAMA_GATING_FUNCS = 4
_GATING_REQUIRED = ("dots1",)
# Architectures whose llama.cpp graph asserts that keys, values and rotary dimensions share one head size.
_ONE_HEAD_SIZE = ("llama", "olmoe", "qwen3moe", "dots1")
_MAX_HEADER_BYTES = 1 << 20


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (ValueError, UnicodeDecodeError, IndexError):  # a string field that is not UTF-8, a bad array
        raise ModelError(f"GGUF field {key} cannot be read") from None


@overload
def _typed(reader: GGUFReader, key: str, kind: Literal["u32"], name: str) -> int | None: ...
@overload
def _typed(reader: GGUFReader, key: str, kind: Literal["f32"], name: str) -> float | None: ...
@overload
def _typed(reader: GGUFReader, key: str, kind: Literal["bool"], name: str) -> bool | None: ...
def _typed(reader: GGUFReader, key: str, kind: Literal["u32", "f32", "bool"], name: str) -> Any:
    """A scalar of the GGUF type llama.cpp reads `key` as (u32, f32, bool), or None when absent. llama.cpp
    accepts no other type for these keys."""
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return None
    want = {"u32": gguf.GGUFValueType.UINT32, "f32": gguf.GGUFValueType.FLOAT32, "bool": gguf.GGUFValueType.BOOL}[kind]
    if list(f.types) != [want]:
        got = (
            "an array"
            if f.types and f.types[0] == gguf.GGUFValueType.ARRAY
            else (f.types[0].name if f.types else "nothing")
        )
        raise ModelError(f"{name}: {key} must be a GGUF {want.name}, got {got}")
    return _field(reader, key)


def _validate(reader: GGUFReader, arch: str, name: str) -> None:
    """Reject the values that stop llama.cpp in an assertion (an abort, not an error it can return) and
    those that can only give non-finite results, whatever the file's kind."""

    def u32(key: str) -> int | None:
        return _typed(reader, f"{arch}.{key}", "u32", name)

    n_layer = u32("block_count")  # required: llama.cpp says so itself when it is missing
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        raise ModelError(f"{name}: block_count {n_layer} is outside llama.cpp's 1–{LLAMA_MAX_LAYERS} layers")
    n_expert, n_used = u32("expert_count") or 0, u32("expert_used_count") or 0
    if n_expert > LLAMA_MAX_EXPERTS:
        raise ModelError(f"{name}: expert_count {n_expert} is above llama.cpp's limit of {LLAMA_MAX_EXPERTS}")
    if n_expert == 0 and n_used:
        raise ModelError(f"{name}: expert_used_count is {n_used} but the model has no experts (expert_count 0)")
    if n_expert and not 1 <= n_used <= n_expert:
        raise ModelError(f"{name}: expert_used_count {n_used} must be between 1 and expert_count ({n_expert})")
    gating = u32("expert_gating_func")
    if gating is None and arch in _GATING_REQUIRED and n_expert:
        raise ModelError(f"{name}: {arch} needs expert_gating_func (1–{LLAMA_GATING_FUNCS}), and the file has none")
    if gating is not None and not (1 if arch in _GATING_REQUIRED else 0) <= gating <= LLAMA_GATING_FUNCS:
        raise ModelError(f"{name}: expert_gating_func {gating} is not one of llama.cpp's (1–{LLAMA_GATING_FUNCS})")
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base"):
        v = _typed(reader, f"{arch}.{key}", "f32", name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ModelError(f"{name}: {key} must be a finite number above 0, got {v}")
    if arch in _ONE_HEAD_SIZE:
        n_embd = u32("embedding_length")
        n_head = None if _is_array(reader, f"{arch}.attention.head_count") else u32("attention.head_count")
        default = n_embd // n_head if n_embd and n_head else None  # llama.cpp's default head size
        k, v = _given(u32("attention.key_length"), default), _given(u32("attention.value_length"), default)
        rot = _given(u32("rope.dimension_count"), k)
        if k is not None and not k == v == rot:
            raise ModelError(
                f"{name}: the key, value and rotary head sizes must be equal for {arch} "
                f"(attention.key_length {k}, attention.value_length {v}, rope.dimension_count {rot})"
            )
        n_head_kv = (
            None
            if _is_array(reader, f"{arch}.attention.head_count_kv")
            else _given(u32("attention.head_count_kv"), n_head)
        )
        if k and v and n_head and n_head_kv:
            _check_attention(reader, name, {"attn_q": n_head * k, "attn_k": n_head_kv * k, "attn_v": n_head_kv * v})


def _given(value: int | None, default: int | None) -> int | None:
    """A key's value where the file has it (0 included: llama.cpp takes it as written), else the default."""
    return default if value is None else value


def _check_tokenizer(reader: GGUFReader, name: str) -> None:
    """A SentencePiece vocabulary ("llama") spells a byte it has no piece for as <0xXX>: without those
    tokens llama.cpp's tokenizer throws where nothing catches it, and the process aborts."""
    if _field(reader, "tokenizer.ggml.model") != "llama":
        return
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    if not isinstance(tokens, list):
        return  # not a list of tokens: llama.cpp refuses the file itself
    have = set(t for t in tokens if isinstance(t, str) and t.startswith("<0x"))
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in have]
    if missing:
        raise ModelError(
            f"{name}: a SentencePiece vocabulary without the byte token {missing[0]} "
            f"({len(missing)} of the 256 <0xXX> tokens missing)"
        )


def _check_attention(reader: GGUFReader, name: str, rows: dict[str, int]) -> None:
    """The attention projections have the rows the head counts and sizes give: llama.cpp checks this when
    loading some architectures and reshapes by them in the graph of others (dots1), where a mismatch stops
    it in an assertion."""
    for t in reader.tensors:
        part = t.name.split(".")[-2] if t.name.startswith("blk.") and t.name.endswith(".weight") else None
        if part in rows and len(t.shape) == 2 and int(t.shape[1]) != rows[part]:
            raise ModelError(
                f"{name}: tensor {t.name} has {int(t.shape[1])} rows, but the head count and size "
                f"in the metadata make {rows[part]}"
            )


def _is_array(reader: GGUFReader, key: str) -> bool:
    import gguf

    f = reader.fields.get(key)
    return f is not None and bool(f.types) and f.types[0] == gguf.GGUFValueType.ARRAY


def gguf_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """gguf-py's reader of the file. llama.cpp's libraries load first: gguf imports sentencepiece where it
    is installed, and a CUDA build's libggml-cuda carries copies of libstdc++ symbols that, with another
    extension's libstdc++ loaded before it, left llama.cpp's stream output crashing in llama_model::print_info
    (CUDA 13, llama-cpp-python 0.3.36)."""
    import llama_cpp  # noqa: F401, I001
    import gguf

    return gguf.GGUFReader(str(path), "r")


_KV_TENSOR = re.compile(r"blk\.\d+\.attn_[kv]\.weight")


# What this process has read of model files: gguf-py parses every metadata array into Python objects, ~2 s
# for a 50k-token vocabulary, and a run reads its model several times (the CPU path, the decoder, ...).
_read: dict[tuple[int, int, int, int, bytes], ModelInfo] = {}


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    path = Path(path)
    with open_regular(path, "model file", ModelError) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        try:
            head = f.read(_MAX_HEADER_BYTES)
        except OSError as e:
            raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic): {path}")
    # the same file, unchanged: its identity, size, time and the bytes that hold its metadata
    key = (st.st_dev, st.st_ino, size, st.st_mtime_ns, hashlib.sha256(head).digest())
    if key in _read:
        return replace(_read[key], path=path)
    info = _parse(path, head, size)
    if len(_read) >= 16:
        _read.clear()
    _read[key] = info
    return info


def _parse(path: Path, head: bytes, size: int) -> ModelInfo:
    try:
        reader = gguf_reader(path)
    except Exception:  # gguf-py raises ValueError/IndexError/struct errors on damaged files
        raise ModelError(f"damaged or truncated GGUF: {path} ({size} bytes)") from None

    end = 0
    expert_bytes = 0
    biased = False
    kv_rows = 0
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
        if _KV_TENSOR.fullmatch(t.name) and len(t.shape) == 2:
            kv_rows += int(t.shape[1])
        if "_exps." in t.name:
            expert_bytes += int(t.n_bytes)
        if t.name.endswith("exp_probs_b.bias"):
            biased = True
    if end > size:
        raise ModelError(f"truncated GGUF: tensor data needs {end} bytes but {path} has {size}")

    arch = _field(reader, "general.architecture", "")
    if not arch or not isinstance(arch, str):
        raise ModelError(f"GGUF without general.architecture: {path}")
    _validate(reader, arch, path.name)
    _check_tokenizer(reader, path.name)

    def u32(key: str, default: int = 0) -> int:
        value = _typed(reader, f"{arch}.{key}", "u32", path.name)
        return default if value is None else value

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    gating = u32("expert_gating_func") or _GATING_BY_ARCH.get(arch, GATING_SOFTMAX)
    norm = _typed(reader, f"{arch}.expert_weights_norm", "bool", path.name)
    weight_norm = True if arch == "qwen3moe" else (_WEIGHT_NORM_BY_ARCH.get(arch, False) if norm is None else norm)
    name = _field(reader, "general.name", path.stem)
    return ModelInfo(
        path=path,
        arch=arch,
        name=name if isinstance(name, str) and name else path.stem,
        n_layer=u32("block_count"),
        n_embd=u32("embedding_length"),
        n_ctx_train=u32("context_length"),
        n_vocab=n_vocab,
        n_expert=u32("expert_count"),
        n_expert_used=u32("expert_used_count"),
        gating=gating,
        weight_norm=bool(weight_norm),
        biased_selection=biased or arch in ("llama4", "grovemoe"),
        expert_tensor_bytes=expert_bytes,
        file_bytes=size,
        fingerprint=fingerprint(path, head[: min(len(head), 1 << 16)], size),
        kv_rows=kv_rows,
    )
