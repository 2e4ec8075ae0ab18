"""What the engine needs to know about a GGUF before llama.cpp touches it.

Reading the header ourselves turns a missing, foreign, truncated or dense file into one clear message
instead of a llama.cpp log dump, and tells the native hook how this architecture routes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError
from .files import open_regular

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
    n_expert: int          # 0 for a dense model
    n_expert_used: int     # k
    gating: int
    weight_norm: bool
    biased_selection: bool  # selection scores carry a per-expert bias (DeepSeek-V3 style)
    expert_tensor_bytes: int  # bytes of all *_exps tensors
    file_bytes: int
    fingerprint: str

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


_MAX_HEADER_BYTES = 1 << 20


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    path = Path(path)
    with open_regular(path, "model file", ModelError) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            head = f.read(_MAX_HEADER_BYTES)
        except OSError as e:
            raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (bad magic): {path}")

    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception:  # gguf-py raises ValueError/IndexError/struct errors on damaged files
        raise ModelError(f"damaged or truncated GGUF: {path} ({size} bytes)") from None

    end = 0
    expert_bytes = 0
    biased = False
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
        if "_exps." in t.name:
            expert_bytes += int(t.n_bytes)
        if t.name.endswith("exp_probs_b.bias"):
            biased = True
    if end > size:
        raise ModelError(f"truncated GGUF: tensor data needs {end} bytes but {path} has {size}")

    arch = str(_field(reader, "general.architecture", "") or "")
    if not arch:
        raise ModelError(f"GGUF without general.architecture: {path}")

    def hp(key, default=0):
        value = _field(reader, f"{arch}.{key}", default)
        return default if value is None else value

    n_layer = int(hp("block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    gating = int(hp("expert_gating_func", 0) or _GATING_BY_ARCH.get(arch, GATING_SOFTMAX))
    norm_default = _WEIGHT_NORM_BY_ARCH.get(arch, False)
    weight_norm = bool(hp("expert_weights_norm", norm_default)) if arch not in ("qwen3moe",) else True
    return ModelInfo(
        path=path,
        arch=arch,
        name=str(_field(reader, "general.name", path.stem) or path.stem),
        n_layer=n_layer,
        n_embd=int(hp("embedding_length")),
        n_ctx_train=int(hp("context_length", 0)),
        n_vocab=n_vocab,
        n_expert=int(hp("expert_count", 0)),
        n_expert_used=int(hp("expert_used_count", 0)),
        gating=gating,
        weight_norm=weight_norm,
        biased_selection=biased or arch in ("llama4", "grovemoe"),
        expert_tensor_bytes=expert_bytes,
        file_bytes=size,
        fingerprint=fingerprint(path, head[: min(len(head), 1 << 16)], size),
    )
