"""Widened models: a MoE GGUF whose experts weigh N times as much and compute exactly the same function.

Every expert's FFN gets (N−1)·n_ff extra neurons. Their gate and up rows are random at the scale of the
expert's own rows (fixed seed, stored in the tensor's own type); their down-projection columns are zero, in
whole quantisation blocks, so their outputs are multiplied by zero. Routing, text and acceptance stay those
of the source while every expert fetch and every expert matmul costs N times as much: a systems-scale proxy
for a real model, made from a small one in seconds.

    widen(source, out, 32, progress=lambda done, total: ...)

Streams tensor by tensor (one expert at a time, in chunks of a few MB), so memory stays bounded whatever
the model's size. Everything but the expert tensors is copied byte for byte, in the source's order and
alignment; metadata is copied key by key with the expert FFN length updated. The file appears atomically
(a temporary file next to it, then os.replace).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ..errors import ConfigError, ModelError
from ..model_info import read_model_info

CHUNK_BYTES = 16 << 20
# Written by GGUFWriter itself (header counts, and the architecture it takes in its constructor).
_WRITER_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
_FFN = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)(_exps|_shexp|)\.weight$")

Progress = Callable[[int, int], None]
Bytes = npt.NDArray[np.uint8]


def _raw(t: gguf.ReaderTensor) -> Bytes:
    """The tensor's bytes as uint8, shaped (…, bytes per row), a view of the memory-mapped source."""
    return t.data.view(np.uint8)


def _encode(rows: npt.NDArray[np.float32], qt: QT) -> Bytes:
    """float32 rows → their bytes in type qt, shaped (rows, bytes per row)."""
    out = gguf.quants.quantize(rows, qt)
    return np.ascontiguousarray(out).view(np.uint8).reshape(rows.shape[0], -1)


def _can_encode(qt: QT, n: int) -> bool:
    try:
        _encode(np.zeros((1, n), np.float32), qt)
    except NotImplementedError:
        return False
    return True


def _zero_block_decodes_to_zero(qt: QT) -> bool:
    block, size = gguf.GGML_QUANT_SIZES[qt]
    try:
        values = gguf.quants.dequantize(np.zeros((1, size), np.uint8), qt)
    except NotImplementedError:
        return False
    return bool(np.all(np.asarray(values, np.float32) == 0))


def _source_scale(raw_expert: Bytes, qt: QT) -> float:
    """Standard deviation of one expert's rows (0 where it cannot be decoded or has no finite values)."""
    try:
        values = np.asarray(gguf.quants.dequantize(raw_expert, qt), np.float32)
    except NotImplementedError:
        return 0.0
    values = values[np.isfinite(values)]
    return float(values.std()) if values.size else 0.0


class _Stream:
    """Enough of an ndarray for GGUFWriter.write_tensor_data (nbytes, tofile): writes chunks as they are made."""

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[Bytes]], advance: Callable[[int], None]):
        self.nbytes, self._chunks, self._advance = nbytes, chunks, advance

    def tofile(self, fout: BinaryIO) -> None:
        written = 0
        for c in self._chunks():
            fout.write(np.ascontiguousarray(c).data.cast("B"))
            written += c.nbytes
            self._advance(c.nbytes)
        if written != self.nbytes:
            raise AssertionError(f"wrote {written} bytes of a {self.nbytes}-byte tensor")


def _copy_chunks(raw: Bytes) -> Iterator[Bytes]:
    flat = raw.reshape(-1)
    for i in range(0, flat.size, CHUNK_BYTES):
        yield flat[i : i + CHUNK_BYTES]


def _widen_rows_chunks(
    raw: Bytes, qt: QT, n_in: int, extra: int, rng: np.random.Generator, encodable: bool
) -> Iterator[Bytes]:
    """gate/up, (experts, n_ff, row bytes): each expert's rows, then `extra` new rows at its scale."""
    for e in range(raw.shape[0]):
        src = raw[e]
        yield from _copy_chunks(src)
        if encodable:
            std = _source_scale(src, qt)
            per = max(1, CHUNK_BYTES // (4 * n_in))
            for start in range(0, extra, per):
                n = min(per, extra - start)
                yield _encode(rng.standard_normal((n, n_in), dtype=np.float32) * np.float32(std), qt)
        else:
            # gguf-py cannot quantise to this type: new rows are copies of the expert's own rows
            per = max(1, CHUNK_BYTES // src.shape[1])
            for start in range(0, extra, per):
                n = min(per, extra - start)
                yield src[rng.integers(0, src.shape[0], size=n)]


def _widen_cols_chunks(raw: Bytes, factor: int) -> Iterator[Bytes]:
    """down, (experts, n_embd, n_ff bytes): every row followed by (factor−1)·n_ff zero-valued bytes."""
    n_exp, n_rows, width = raw.shape
    per = max(1, CHUNK_BYTES // (factor * width))
    for e in range(n_exp):
        for start in range(0, n_rows, per):
            src = raw[e, start : start + per]
            out = np.zeros((src.shape[0], factor * width), np.uint8)
            out[:, :width] = src
            yield out


def _kv_value(field: gguf.ReaderField) -> tuple[Any, VT, VT | None]:
    """A reader field's value as GGUFWriter takes it, exactly (strings as bytes, numbers by their own type)."""
    vtype = field.types[0]
    if vtype == VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype != VT.ARRAY:
        return field.parts[field.data[0]].tolist()[0], vtype, None
    if len(field.types) != 2 or not field.data:
        what = "an empty array" if not field.data else "a nested array"
        raise ModelError(f"metadata key {field.name} is {what}, which gguf-py cannot write")
    sub = field.types[1]
    if sub == VT.STRING:
        return [bytes(field.parts[i]) for i in field.data], vtype, sub
    return np.concatenate([field.parts[i] for i in field.data]).tolist(), vtype, sub


def _plan(reader: gguf.GGUFReader, arch: str) -> tuple[dict[str, str], int, list[str]]:
    """Which tensors widen how ('rows' or 'cols' by name), the experts' n_ff, and the metadata keys to update."""
    n_ff = None
    shared: list[tuple[gguf.ReaderTensor, str]] = []  # with their part: gate, up or down
    dense = False
    how: dict[str, str] = {}
    for t in reader.tensors:
        m = _FFN.match(t.name)
        if "_exps." in t.name:
            if "gate_up_exps" in t.name:
                raise ModelError(f"{t.name}: merged gate+up expert tensors cannot be widened")
            if not m or m.group(3) != "_exps":
                raise ModelError(f"{t.name}: widening does not know this expert tensor")
            kind = m.group(2)
            dims = [int(x) for x in t.shape]
            if len(dims) != 3:
                raise ModelError(f"{t.name}: expected 3 dimensions, found {len(dims)}")
            ff = dims[0] if kind == "down" else dims[1]
            if n_ff is not None and ff != n_ff:
                raise ModelError(f"{t.name}: experts of different FFN sizes ({ff} and {n_ff}) cannot be widened")
            n_ff = ff
            how[t.name] = "cols" if kind == "down" else "rows"
            continue
        if m and m.group(3) == "_shexp":
            shared.append((t, m.group(2)))
        elif m:
            dense = True
    if n_ff is None:
        raise ModelError("no expert tensors (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps) to widen")

    def scalar(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        if f is None:
            return None
        if f.types[0] == VT.ARRAY:
            raise ModelError(f"{arch}.{key} is per-layer, which widening does not handle")
        return int(f.parts[f.data[0]][0])

    keys = []
    exp_ff, ff_length = scalar("expert_feed_forward_length"), scalar("feed_forward_length")
    if exp_ff is not None:
        if exp_ff != n_ff:
            raise ModelError(f"{arch}.expert_feed_forward_length is {exp_ff} but the expert tensors have {n_ff}")
        keys.append(f"{arch}.expert_feed_forward_length")
    # Without dense FFN layers, a feed_forward_length equal to the experts' can only be theirs (OLMoE and
    # Mixtral-style llama size their experts with it); with dense layers it sizes those.
    if ff_length == n_ff and not dense:
        keys.append(f"{arch}.feed_forward_length")
    if not keys:
        raise ModelError(f"cannot tell which metadata key of this {arch} model sizes its experts (FFN {n_ff})")
    # A shared expert whose width is n_ff × its count, with no key of its own, is sized by the loader from the
    # experts' length (DeepSeek-style, dots1): it must widen with them, inertly too.
    if shared and scalar("expert_shared_feed_forward_length") is None:
        n_shared = scalar("expert_shared_count") or 1
        for t, kind in shared:
            width = int(t.shape[0] if kind == "down" else t.shape[1])
            if width == n_ff * n_shared:
                how[t.name] = "cols" if kind == "down" else "rows"
    return how, n_ff, keys


def widen(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    factor: int,
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """Write `source` with every expert FFN `factor` times as wide (inert neurons) to `out`; returns out.
    `progress(done_bytes, total_bytes)` is called with 0 once the source is checked and the file planned, then
    as tensor data is written."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise ConfigError(f"widening factor must be a whole number of at least 2, got {factor!r}")
    source, out = Path(source), Path(out)
    if out.is_dir():
        raise ConfigError(f"output path is a directory: {out}")
    if not out.parent.is_dir():
        raise ConfigError(f"output folder {out.parent} does not exist")
    info = read_model_info(source)
    if not info.is_moe:
        raise ModelError(f"{source.name} is not a Mixture-of-Experts model: it has no experts to widen")
    if out.exists() and out.resolve() == source.resolve():
        raise ConfigError(f"the output would overwrite the source model {source}")
    reader = gguf.GGUFReader(str(source), "r")
    if reader.byte_order != "I":
        raise ModelError(f"{source.name}: GGUF of the other byte order; widening reads native-order files only")
    arch = info.arch
    how, n_ff, keys = _plan(reader, arch)

    w = gguf.GGUFWriter(None, arch)
    for name, field in reader.fields.items():
        if name in _WRITER_KEYS:
            continue
        if name == "general.alignment":
            w.add_custom_alignment(int(field.parts[field.data[0]][0]))
            continue
        value, vtype, sub = _kv_value(field)
        if name in keys:
            value = factor * n_ff
        elif name == "general.name" and vtype == VT.STRING:
            value = value + f"-w{factor}".encode()
        w.add_key_value(name, value, vtype, sub_type=sub)
    w.add_string(
        "s2moe.widened",
        f"expert FFN widened x{factor} ({n_ff} -> {factor * n_ff}) with inert neurons "
        f"(random gate/up rows, zero down columns) from {source.name}",
    )
    w.add_uint32("s2moe.widened.factor", factor)

    streams = []
    done = [0]
    total = 0

    def advance(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    for i, t in enumerate(reader.tensors):
        qt, raw = t.tensor_type, _raw(t)
        shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order: outermost first
        mode = how.get(t.name)
        if mode is None:
            nbytes = raw.nbytes
            chunks: Callable[[], Iterator[Bytes]] = functools.partial(_copy_chunks, raw)
        elif mode == "rows":
            shape[-2] *= factor
            nbytes = raw.nbytes * factor
            rng = np.random.default_rng([seed, i])
            encodable = _can_encode(qt, shape[-1])
            raw3 = raw.reshape((-1,) + raw.shape[-2:])
            chunks = functools.partial(
                _widen_rows_chunks, raw3, qt, shape[-1], (factor - 1) * raw3.shape[1], rng, encodable
            )
        else:
            block = gguf.GGML_QUANT_SIZES[qt][0]
            if shape[-1] % block:
                raise ModelError(f"{t.name}: FFN size {shape[-1]} is not a whole number of {qt.name} blocks of {block}")
            if not _zero_block_decodes_to_zero(qt):
                raise ModelError(
                    f"{t.name}: cannot write zero columns in {qt.name} (no all-zero block decodes to zero)"
                )
            shape[-1] *= factor
            nbytes = raw.nbytes * factor
            raw3 = raw.reshape((-1,) + raw.shape[-2:])
            chunks = functools.partial(_widen_cols_chunks, raw3, factor)
        # a non-uint8 dtype makes gguf-py take `shape` as the element shape for any raw_dtype
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=qt)
        streams.append(_Stream(nbytes, chunks, advance))
        total += nbytes

    if progress:
        progress(0, total)  # planned and checked: the writing starts
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for s in streams:
            w.write_tensor_data(s)  # type: ignore[arg-type]  # gguf-py uses only its nbytes and tofile
        w.close()
        os.replace(tmp, out)
    except OSError as e:
        w.close()
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
