"""Where every expert lives in the GGUF file, and which experts are hot."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ModelError


@dataclass(frozen=True)
class ExpertMap:
    """Byte ranges of every expert (gate/up/down slices of the *_exps tensors) and of everything else.

    ranges[layer, expert, part] = (file offset, length); part follows `parts[layer]` (tensor names).
    An expert tensor of ggml shape [..., n_expert] stores expert e as the contiguous slab
    [data_offset + e·n_bytes/n_expert, + n_bytes/n_expert).
    """

    path: Path
    file_bytes: int
    n_layer: int
    n_expert: int
    ranges: npt.NDArray[np.int64]  # [n_layer, n_expert, n_parts, 2] int64
    parts: tuple[tuple[str, ...], ...]  # per layer: names of its expert tensors
    non_expert: tuple[tuple[int, int], ...]  # (offset, length) of every other tensor
    moe_layers: tuple[int, ...]
    non_expert_names: tuple[str, ...] = ()

    def pinnable(self) -> list[tuple[int, int]]:
        """Non-expert ranges worth pinning: all but the token embedding table when the model has a separate
        output matrix (a decode reads one embedding row per token; pinning the table wastes the budget)."""
        names = self.non_expert_names or ("",) * len(self.non_expert)
        untied = "output.weight" in names
        return [r for r, n in zip(self.non_expert, names) if not (untied and n == "token_embd.weight")]

    @property
    def expert_bytes(self) -> npt.NDArray[np.int64]:
        """[n_layer] bytes of one expert of each layer (0 for a layer without experts)."""
        per_layer: npt.NDArray[np.int64] = self.ranges[:, 0, :, 1].sum(axis=1)
        return per_layer

    @property
    def total_expert_bytes(self) -> int:
        return int(self.ranges[..., 1].sum())

    @property
    def non_expert_bytes(self) -> int:
        return int(sum(n for _, n in self.non_expert))

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        return [(int(o), int(n)) for o, n in self.ranges[layer, expert] if n > 0]


def expert_map(path: str | os.PathLike[str]) -> ExpertMap:
    from ..model_info import gguf_reader

    path = Path(path)
    try:
        reader = gguf_reader(path)
    except Exception:
        raise ModelError(f"damaged or truncated GGUF: {path}") from None
    by_layer: dict[int, list[Any]] = {}  # gguf's ReaderTensor
    non_expert: list[tuple[int, int]] = []
    names: list[str] = []
    n_expert = 0
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if "_exps." in t.name and m:
            ne = int(t.shape[-1])
            n_expert = max(n_expert, ne)
            by_layer.setdefault(int(m.group(1)), []).append(t)
        else:
            non_expert.append((int(t.data_offset), int(t.n_bytes)))
            names.append(t.name)
    if not by_layer:
        raise ModelError(f"{path.name} has no expert tensors (*_exps): it is not a Mixture-of-Experts model")
    n_layer = max(by_layer) + 1
    n_parts = max(len(v) for v in by_layer.values())
    ranges = np.zeros((n_layer, n_expert, n_parts, 2), np.int64)
    parts = []
    for layer in range(n_layer):
        tensors = sorted(by_layer.get(layer, []), key=lambda t: int(t.data_offset))
        parts.append(tuple(t.name for t in tensors))
        for p, t in enumerate(tensors):
            ne = int(t.shape[-1])
            slab = int(t.n_bytes) // ne
            ranges[layer, :ne, p, 0] = int(t.data_offset) + np.arange(ne, dtype=np.int64) * slab
            ranges[layer, :ne, p, 1] = slab
    return ExpertMap(
        path,
        path.stat().st_size,
        n_layer,
        n_expert,
        ranges,
        tuple(parts),
        tuple(non_expert),
        tuple(sorted(by_layer)),
        tuple(names),
    )


# -- hot experts -----------------------------------------------------------------------------------------
def select_hot_experts(
    counts: npt.ArrayLike, expert_bytes: float | npt.NDArray[np.integer[Any]], budget_bytes: int
) -> list[tuple[int, int]]:
    """Most-routed experts first, as many as fit in budget_bytes. counts: [n_layer, n_expert] routing
    frequencies; expert_bytes: bytes of one expert (scalar or per layer). Experts never routed are skipped."""
    frequencies = np.asarray(counts, dtype=np.float64)
    n_layer, n_expert = frequencies.shape
    size = np.broadcast_to(
        np.asarray(expert_bytes, dtype=np.int64).reshape(-1, 1) if np.ndim(expert_bytes) else np.int64(expert_bytes),
        (n_layer, n_expert),
    )
    order = sorted(
        (-frequencies[layer, e], layer, e)
        for layer in range(n_layer)
        for e in range(n_expert)
        if frequencies[layer, e] > 0
    )
    out: list[tuple[int, int]] = []
    used = 0
    for _, layer, expert in order:
        b = int(size[layer, expert])
        if b <= 0 or used + b > budget_bytes:
            continue
        used += b
        out.append((int(layer), int(expert)))
    return out


def rank_counts(ranked: Sequence[Sequence[int]], emap: ExpertMap) -> npt.NDArray[np.float64]:
    """Pseudo-counts that keep a ranked [layer, expert] list's order (most routed first)."""
    counts = np.zeros((emap.n_layer, emap.n_expert))
    n = len(ranked)
    for i, (layer, expert) in enumerate(ranked):
        if 0 <= layer < emap.n_layer and 0 <= expert < emap.n_expert:
            counts[layer, expert] = n - i
    return counts
