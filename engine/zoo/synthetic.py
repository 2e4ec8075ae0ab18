"""Random-weight GGUF files with the dimensions of real MoE models (for I/O, offloading and latency work at
real scale; the text they produce is meaningless). Needs only numpy + gguf.

    write_synthetic("olmoe", "olmoe-1b-7b", "olmoe-synth.gguf", n_layer=4)    # real dims, fewer layers
    write_synthetic(None, "qwen3-30b-a3b", "q3.gguf", dtype="q8_0", n_layer=2)
    write_synthetic("qwen3moe", "tiny", "tiny.gguf")                          # tests

Tensors are declared first and then generated and written one chunk (one expert / a block of rows) at a
time, so memory stays at a few MB whatever the model size. Values are N(0, 0.02²) (norm weights 1),
reproducible from `seed`. The file appears atomically (written as <out>.tmp, then os.replace).
The vocabulary is the zoo's BPE tokenizer padded with unused tokens to the preset's vocab size, so
prompts tokenise normally.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as QT

from .export import DTYPES, HParams, Shape, encode, encoded_nbytes, storage_type, tensor_layout, write_metadata
from .tokenizer import GGUF_PRE, gguf_vocab

PRESETS: dict[str, HParams] = {
    # OLMoE-1B-7B: 16 layers, d 2048, 16 heads x 128, 64 experts top-8, expert FFN 1024, vocab 50304
    "olmoe-1b-7b": dict(
        arch="olmoe",
        n_layer=16,
        n_embd=2048,
        n_head=16,
        n_head_kv=16,
        head_dim=128,
        n_expert=64,
        k=8,
        expert_ff=1024,
        vocab_size=50304,
        ctx=4096,
        rope_base=10000.0,
        norm_eps=1e-5,
    ),
    # Qwen3-30B-A3B: 48 layers, d 2048, 32 q heads / 4 kv heads x 128, 128 experts top-8, expert FFN 768
    "qwen3-30b-a3b": dict(
        arch="qwen3moe",
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        k=8,
        expert_ff=768,
        vocab_size=151936,
        ctx=40960,
        rope_base=1000000.0,
        norm_eps=1e-6,
    ),
    # seconds to write, for tests
    "tiny": dict(
        arch="olmoe",
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_head_kv=2,
        head_dim=32,
        n_expert=8,
        k=2,
        expert_ff=64,
        vocab_size=4096,
        ctx=256,
        rope_base=10000.0,
        norm_eps=1e-5,
    ),
}
TOKENIZER_JSON = Path(__file__).resolve().parent / "data" / "tokenizer.json"
ROWS_PER_CHUNK = 2048


class _ChunkedTensor:
    """Looks enough like an ndarray for GGUFWriter.write_tensor_data (nbytes, tofile), but generates and
    writes its data chunk by chunk."""

    def __init__(
        self,
        shape: Shape,
        kind: str,
        qt: QT,
        rng: np.random.Generator,
        advance: Callable[[int], None],
        std: float = 0.02,
    ):
        self.shape, self.kind, self.qt, self.rng, self.std = tuple(shape), kind, qt, rng, std
        self.advance = advance  # called with each chunk's bytes as it is written
        self.nbytes = encoded_nbytes(self.shape, qt)

    def _chunks(self) -> Iterator[npt.NDArray[np.float32]]:
        if self.kind == "norm":
            yield np.ones(self.shape, np.float32)
            return
        if len(self.shape) == 3:  # one expert at a time
            for _ in range(self.shape[0]):
                yield self.rng.standard_normal(self.shape[1:], dtype=np.float32) * self.std
            return
        rows = self.shape[0]
        for r in range(0, rows, ROWS_PER_CHUNK):
            n = min(ROWS_PER_CHUNK, rows - r)
            yield self.rng.standard_normal((n,) + self.shape[1:], dtype=np.float32) * self.std

    def tofile(self, fout: BinaryIO) -> None:
        written = 0
        for c in self._chunks():
            b = encode(c, self.qt)
            b.tofile(fout)
            written += b.nbytes
            self.advance(b.nbytes)
        assert written == self.nbytes, (written, self.nbytes)


def preset_hparams(preset: str, arch: str | None = None, **overrides: int | None) -> HParams:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    hp = dict(PRESETS[preset])
    if arch:
        hp["arch"] = arch
    hp.update({k: v for k, v in overrides.items() if v is not None})
    return hp


def estimate_bytes(hp: HParams, dtype: str = "f16") -> int:
    return sum(encoded_nbytes(s, storage_type(k, s, dtype)) for _, s, k in tensor_layout(hp))


def write_synthetic(
    arch: str | None,
    preset: str,
    out_path: str | os.PathLike[str],
    *,
    dtype: str = "f16",
    seed: int = 0,
    n_layer: int | None = None,
    n_expert: int | None = None,
    k: int | None = None,
    ctx: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight GGUF; returns the path. `progress(done_bytes, total_bytes)` is optional: called
    with 0 once the file is planned, then as each chunk of tensor data is written (an expert, 2048 rows)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
    hp = preset_hparams(preset, arch, n_layer=n_layer, n_expert=n_expert, k=k, ctx=ctx)
    vocab = gguf_vocab(TOKENIZER_JSON)
    vocab["pre"] = GGUF_PRE
    if hp["vocab_size"] < len(vocab["tokens"]):
        raise ValueError("vocab_size smaller than the tokenizer")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    layout = tensor_layout(hp)
    w = gguf.GGUFWriter(None, hp["arch"])
    try:
        write_metadata(w, hp, vocab, f"synthetic-{preset}-{hp['arch']}", dtype)
        w.add_string("s2moe.synthetic", "random weights; real architecture dimensions")
        tensors: list[_ChunkedTensor] = []
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        for i, (name, shape, kind) in enumerate(layout):
            qt = storage_type(kind, shape, dtype)
            t = _ChunkedTensor(shape, kind, qt, np.random.default_rng([seed, i]), advance)
            # a non-uint8 dtype makes gguf-py take `shape` as the element shape for any raw_dtype
            w.add_tensor_info(name, shape, np.dtype(np.float32), t.nbytes, raw_dtype=qt)
            tensors.append(t)
        total = sum(t.nbytes for t in tensors)
        if progress:
            progress(0, total)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(t)  # type: ignore[arg-type]  # gguf-py uses only its nbytes and tofile
        w.close()
        os.replace(tmp, out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a random-weight MoE GGUF with real dimensions")
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out")
    ap.add_argument("--arch", choices=["olmoe", "qwen3moe"], default=None)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-expert", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    p = write_synthetic(a.arch, a.preset, a.out, dtype=a.dtype, seed=a.seed, n_layer=a.n_layer, n_expert=a.n_expert)
    print(p, p.stat().st_size)


if __name__ == "__main__":
    main()
