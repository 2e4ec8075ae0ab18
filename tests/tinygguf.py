"""Tiny random-weight GGUF models that stock llama.cpp loads, written with gguf-py in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (byte-level BPE vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@dataclass
class TinySpec:
    # "olmoe" (softmax, no weight norm) | "qwen3moe" (softmax, weight norm) | "dots1" (sigmoid gating, a
    # per-expert selection bias, weight norm, one shared expert: the DeepSeek-V3 routing) | "llama" (dense)
    arch: str = "olmoe"
    n_layer: int = 2
    n_expert: int = 8
    k: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 48
    n_ctx: int = 512
    seed: int = 0
    router_scale: float = 1.0
    output_scale: float = 2.0
    selection_bias: bool = True  # dots1: write the per-expert selection bias (exp_probs_b)
    # (layer, expert) pairs whose expert weights are filled with NaN
    poison: list[tuple[int, int]] = field(default_factory=list)
    # metadata written as given: key ("{arch}" stands for the architecture) → (value, GGUFValueType[, the
    # element type of an ARRAY]), or None to leave the key out; for files llama.cpp must refuse
    metadata: dict = field(default_factory=dict)
    # tokenizer.chat_template; its turn markers (e.g. ChatML's <|im_start|>, <|im_end|>) as control tokens
    chat_template: str | None = None
    chat_specials: tuple[str, ...] = ()
    # "f32", or "q8_0": attention and expert weights in Q8_0 and the token embedding in F16, as quantized
    # Mixtral-style files are (the weights llama.cpp's CPU extra buffer types, AMX among them, take)
    weights: str = "f32"


def _tokenizer(w: gguf.GGUFWriter, spec: TinySpec) -> int:
    tokens = byte_symbols()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = ["<|bos|>", "<|eos|>"]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials)
    bos = len(tokens)
    tokens += specials
    tokens += spec.chat_specials
    types += [gguf.TokenType.CONTROL] * len(spec.chat_specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(bos + 1)
    w.add_add_bos_token(True)
    if spec.chat_template is not None:
        w.add_chat_template(spec.chat_template)
    return len(tokens)


def write_tiny(path: str | Path, spec: TinySpec | None = None, **overrides) -> Path:
    spec = spec or TinySpec()
    for key, value in overrides.items():
        setattr(spec, key, value)
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny-{spec.arch}")
    n_vocab = _tokenizer(w, spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    moe = spec.arch != "llama"
    if moe:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.k)
    if spec.arch in ("qwen3moe", "dots1"):
        w.add_expert_feed_forward_length(spec.n_ff)
        w.add_key_length(hd)
        w.add_value_length(hd)
    if spec.arch == "dots1":
        w.add_expert_shared_count(1)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(1.0)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(0)

    def rand(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def add_weight(name: str, data: np.ndarray) -> None:
        if spec.weights == "q8_0":
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, data)

    embd = (rng.standard_normal((n_vocab, d)) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", embd.astype(np.float16) if spec.weights == "q8_0" else embd)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", rand(n_vocab, d, scale=spec.output_scale * np.sqrt(d) / 4))
    qk_norm = d if spec.arch == "olmoe" else hd
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add_weight(p + name + ".weight", rand(d, d))
        if spec.arch in ("olmoe", "qwen3moe", "dots1"):
            w.add_tensor(p + "attn_q_norm.weight", np.ones(qk_norm, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(qk_norm, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        if not moe:
            w.add_tensor(p + "ffn_gate.weight", rand(spec.n_ff, d))
            w.add_tensor(p + "ffn_up.weight", rand(spec.n_ff, d))
            w.add_tensor(p + "ffn_down.weight", rand(d, spec.n_ff))
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", rand(spec.n_expert, d, scale=4.0 * spec.router_scale))
        gate = rand(spec.n_expert, spec.n_ff, d)
        up = rand(spec.n_expert, spec.n_ff, d)
        down = rand(spec.n_expert, d, spec.n_ff)
        for layer, expert in spec.poison:
            if layer == i:
                gate[expert] = np.nan
                up[expert] = np.nan
                down[expert] = np.nan
        add_weight(p + "ffn_gate_exps.weight", gate)
        add_weight(p + "ffn_up_exps.weight", up)
        add_weight(p + "ffn_down_exps.weight", down)
        if spec.arch == "dots1" and spec.selection_bias:
            # a bias large enough to reorder the selection, so that paths that ignore it show
            w.add_tensor(p + "exp_probs_b.bias", (rng.standard_normal(spec.n_expert) * 0.5).astype(np.float32))
        if spec.arch == "dots1":
            w.add_tensor(p + "ffn_gate_shexp.weight", rand(spec.n_ff, d))
            w.add_tensor(p + "ffn_up_shexp.weight", rand(spec.n_ff, d))
            w.add_tensor(p + "ffn_down_shexp.weight", rand(d, spec.n_ff))
    for key, typed in spec.metadata.items():
        key = key.replace("{arch}", spec.arch)
        if typed is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = gguf.GGUFValue(value=typed[0], type=typed[1], sub_type=(typed[2:] or (None,))[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
