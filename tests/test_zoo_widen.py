"""Widened models (`make-synthetic --from … --widen N`): N× the expert bytes, the same greedy output."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import ARCHS
from s2moe.app.cli import main
from s2moe.engine.decoding.decoder import Decoder, run
from s2moe.engine.decoding.generation_config import GenerationConfig
from s2moe.engine.errors import ConfigError, ModelError
from s2moe.engine.events import Iteration
from s2moe.engine.zoo import model_path
from s2moe.engine.zoo.widen import widen

PROMPTS = ["hello there the world", "in the beginning", "once upon a time re"]
FACTOR = 4


def greedy_tokens(path, prompts=PROMPTS, n=16) -> list[list[int]]:
    d = Decoder(str(path), n_ctx=256, n_threads=1)
    try:
        out = []
        for prompt in prompts:
            events = run(d, prompt, GenerationConfig(mode="ar", n_predict=n, stop_at_eos=False))
            out.append([t for e in events if isinstance(e, Iteration) for t in e.committed])
        return out
    finally:
        d.close()


def rewrite(src, dst, *, arch=None, alignment=None, drop=(), rename=None):
    """A copy of a GGUF under another architecture name / alignment, without some tensors: model variants
    that tinygguf does not write (Mixtral-style llama with experts, merged gate+up experts)."""
    r = gguf.GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old)
    if alignment:
        w.add_custom_alignment(alignment)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name.replace(f"{old}.", f"{arch or old}.", 1), f.contents(), f.types[0])
    for t in r.tensors:
        if not any(d in t.name for d in drop):
            w.add_tensor((rename or {}).get(t.name, t.name), np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def expert_widened(name: str, arch: str) -> bool:
    # dots1 sizes its shared expert from the experts' FFN length, so that one widens with them
    return "_exps." in name or (arch == "dots1" and "_shexp." in name)


def check_widened(src, out, factor):
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    arch = a.fields["general.architecture"].contents()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    widened = 0
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type
        if expert_widened(ta.name, arch):
            assert tb.n_bytes == factor * ta.n_bytes, ta.name
            widened += 1
        else:
            assert tb.n_bytes == ta.n_bytes and np.array_equal(ta.data.view(np.uint8), tb.data.view(np.uint8)), ta.name
        assert tb.data_offset % b.alignment == 0
    assert widened >= 3
    assert b.alignment == a.alignment
    changed = {f"{arch}.expert_feed_forward_length", f"{arch}.feed_forward_length", "general.name"}
    for name, f in a.fields.items():
        if name in changed or name.startswith("GGUF."):
            continue
        g = b.fields[name]
        assert g.types == f.types and g.contents() == f.contents(), name
    n_ff = next(int(t.shape[1]) for t in a.tensors if t.name.endswith("ffn_gate_exps.weight"))
    updated = [
        k
        for k in (f"{arch}.expert_feed_forward_length", f"{arch}.feed_forward_length")
        if k in b.fields and b.fields[k].contents() == factor * n_ff
    ]
    assert updated
    assert b.fields["s2moe.widened.factor"].contents() == factor
    return updated


@pytest.mark.parametrize("variant", ARCHS)
def test_widened_tiny_model_is_token_identical_and_n_times_larger(tiny_models, tmp_path, variant):
    src = tiny_models[variant]
    out = widen(src, tmp_path / "w.gguf", FACTOR)
    updated = check_widened(src, out, FACTOR)
    arch = variant.split("-")[0]
    # OLMoE sizes its experts with feed_forward_length (the tiny model has no expert key), the others with
    # expert_feed_forward_length
    assert f"{arch}.{'feed' if arch == 'olmoe' else 'expert_feed'}_forward_length" in updated
    assert greedy_tokens(out) == greedy_tokens(src)
    assert not list(tmp_path.glob("*.tmp"))


def test_mixtral_style_llama_updates_feed_forward_length(tiny_models, tmp_path):
    src = rewrite(
        tiny_models["olmoe"], tmp_path / "mixtral.gguf", arch="llama", alignment=64, drop=("attn_q_norm", "attn_k_norm")
    )
    out = widen(src, tmp_path / "w.gguf", 3)
    assert check_widened(src, out, 3) == ["llama.feed_forward_length"]
    assert gguf.GGUFReader(str(out)).alignment == 64
    assert greedy_tokens(out) == greedy_tokens(src)


def test_shipped_q8_0_model_widened_through_the_cli(tmp_path, capsys):
    out = tmp_path / "w2.gguf"
    assert main(["make-synthetic", "--from", "olmoe-64x8", "--widen", "2", "--out", str(out)]) == 0
    assert "51.0 KB → 102.0 KB" in capsys.readouterr().out
    src = model_path("olmoe-64x8")
    assert {t.tensor_type for t in gguf.GGUFReader(str(src)).tensors if "_exps." in t.name} == {
        gguf.GGMLQuantizationType.Q8_0
    }
    assert sorted(check_widened(src, out, 2)) == ["olmoe.expert_feed_forward_length", "olmoe.feed_forward_length"]
    assert greedy_tokens(out, ["def fib(n):", "import os\n"]) == greedy_tokens(src, ["def fib(n):", "import os\n"])


def test_same_seed_same_file(tiny_models, tmp_path):
    a = widen(tiny_models["qwen3moe"], tmp_path / "a.gguf", 2, seed=5).read_bytes()
    assert a == widen(tiny_models["qwen3moe"], tmp_path / "b.gguf", 2, seed=5).read_bytes()
    assert a != widen(tiny_models["qwen3moe"], tmp_path / "c.gguf", 2, seed=6).read_bytes()


def test_bad_input(tiny_models, tmp_path):
    with pytest.raises(ModelError, match="not a Mixture-of-Experts"):
        widen(tiny_models["llama"], tmp_path / "w.gguf", 2)
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(tiny_models["olmoe"].read_bytes()[:100_000])
    with pytest.raises(ModelError, match="truncated"):
        widen(truncated, tmp_path / "w.gguf", 2)
    with pytest.raises(ModelError, match="not found"):
        widen(tmp_path / "nope.gguf", tmp_path / "w.gguf", 2)
    for factor in (1, 0, 2.0):
        with pytest.raises(ConfigError, match="at least 2"):
            widen(tiny_models["olmoe"], tmp_path / "w.gguf", factor)
    with pytest.raises(ConfigError, match="directory"):
        widen(tiny_models["olmoe"], tmp_path, 2)
    with pytest.raises(ConfigError, match="does not exist"):
        widen(tiny_models["olmoe"], tmp_path / "no" / "w.gguf", 2)
    merged = rewrite(
        tiny_models["olmoe"],
        tmp_path / "merged.gguf",
        rename={f"blk.{i}.ffn_gate_exps.weight": f"blk.{i}.ffn_gate_up_exps.weight" for i in range(3)},
    )
    with pytest.raises(ModelError, match="merged gate"):
        widen(merged, tmp_path / "w.gguf", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.gguf", "t.gguf"]


def test_interrupted_widening_leaves_no_file(tiny_models, tmp_path):
    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        widen(tiny_models["olmoe"], tmp_path / "w.gguf", 4, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_folder(tiny_models, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):  # root writes anyway; /proc refuses everyone
            folder = Path("/proc")
        with pytest.raises(ConfigError, match="cannot write"):
            widen(tiny_models["olmoe"], folder / "w.gguf", 2)
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--widen", "2"], "exactly one of --preset"),
        (["--from", "olmoe-64x8", "--preset", "tiny", "--widen", "2"], "exactly one of --preset"),
        (["--from", "olmoe-64x8"], "needs --widen"),
        (["--from", "olmoe-64x8", "--widen", "1"], "at least 2"),
        (["--from", "olmoe-64x8", "--widen", "2.5"], "whole number"),
        (["--preset", "tiny", "--widen", "2"], "--widen applies to --from"),
        (["--from", "olmoe-64x8", "--widen", "2", "--dtype", "q8_0"], "--dtype apply to --preset only"),
        (["--from", "no-such-model", "--widen", "2"], "no shipped model"),
        (["--from", "DENSE", "--widen", "2"], "not a Mixture-of-Experts"),
        (["--from", "CORRUPT", "--widen", "2"], "not a GGUF"),
    ],
)
def test_cli_errors_are_one_line(tiny_models, tmp_path, capsys, argv, needle):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_text("not a model\n")
    argv = [{"DENSE": str(tiny_models["llama"]), "CORRUPT": str(corrupt)}.get(a, a) for a in argv]
    assert main(["make-synthetic", *argv, "--out", str(tmp_path / "w.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "w.gguf").exists()


def test_cli_out_is_a_directory(tiny_models, tmp_path, capsys):
    assert main(["make-synthetic", "--from", str(tiny_models["olmoe"]), "--widen", "2", "--out", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err


def test_preset_mode_still_works(tmp_path, capsys):
    out = tmp_path / "s.gguf"
    assert main(["make-synthetic", "--preset", "tiny", "--n-layer", "1", "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert out.exists() and "wrote" in said.out
    # not a terminal: what is being written as the writing starts, then a line at each tenth, on stderr
    err = said.err.splitlines()
    assert err[0].startswith("writing s.gguf: random f16 weights, preset tiny (") and err[0].endswith(" MB)…")
    percents = [int(line.split("%")[0]) for line in err[1:]]
    assert len(percents) >= 5 and percents == sorted(percents) and percents[-1] == 100


def test_widening_says_what_it_writes_as_it_starts(tiny_models, tmp_path, capsys):
    out = tmp_path / "w.gguf"
    assert main(["make-synthetic", "--from", str(tiny_models["olmoe"]), "--widen", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("widening olmoe.gguf 2× into w.gguf (") and err[-1].startswith("  100% (")
