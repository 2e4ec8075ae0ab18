"""Synthetic random-weight GGUFs: llama.cpp loads them with the requested dimensions."""

import pytest
from s2moe.engine.zoo import synthetic

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("arch", ["olmoe", "qwen3moe"])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_tiny_synthetic_loads(tmp_path, arch, dtype):
    out = tmp_path / f"tiny-{arch}.gguf"
    p = synthetic.write_synthetic(arch, "tiny", out, dtype=dtype, n_expert=16, k=4)
    assert p == out and out.exists() and not list(tmp_path.glob("*.tmp"))
    hp = synthetic.preset_hparams("tiny", arch, n_expert=16, k=4)
    assert abs(out.stat().st_size - synthetic.estimate_bytes(hp, dtype)) < 512 * 1024  # + metadata
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=1, verbose=False)
    md = llm.metadata
    assert md["general.architecture"] == arch
    assert int(md[f"{arch}.expert_count"]) == 16
    assert int(md[f"{arch}.expert_used_count"]) == 4
    assert int(md[f"{arch}.block_count"]) == hp["n_layer"]
    assert llama_cpp.llama_model_n_embd(llm.model) == hp["n_embd"]
    assert llm.n_vocab() == hp["vocab_size"]
    text = llm.create_completion("def ", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    assert isinstance(text, str)


def test_same_seed_same_bytes(tmp_path):
    a = synthetic.write_synthetic(None, "tiny", tmp_path / "a.gguf", seed=3)
    b = synthetic.write_synthetic(None, "tiny", tmp_path / "b.gguf", seed=3)
    assert a.read_bytes() == b.read_bytes()


def test_real_presets_have_real_dimensions():
    o = synthetic.preset_hparams("olmoe-1b-7b")
    assert (o["n_layer"], o["n_embd"], o["n_expert"], o["k"], o["expert_ff"]) == (16, 2048, 64, 8, 1024)
    q = synthetic.preset_hparams("qwen3-30b-a3b")
    assert (q["n_layer"], q["n_expert"], q["k"], q["n_head_kv"], q["expert_ff"]) == (48, 128, 8, 4, 768)
    # about 6.9 B and 30.5 B parameters
    assert 13e9 < synthetic.estimate_bytes(o, "f16") < 15e9
    assert 58e9 < synthetic.estimate_bytes(q, "f16") < 63e9


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        synthetic.write_synthetic(None, "nope", tmp_path / "x.gguf")
    with pytest.raises(ValueError):
        synthetic.write_synthetic(None, "tiny", tmp_path / "x.gguf", dtype="q4_0")
