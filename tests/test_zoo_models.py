"""The packaged zoo models: present, listed, loadable by stock llama.cpp, MoE with the declared shape."""

import json

import pytest
from s2moe.engine import zoo

llama_cpp = pytest.importorskip("llama_cpp")


def test_default_model_exists_and_is_listed():
    p = zoo.default_model_path()
    assert p.exists() and p.suffix == ".gguf"
    models = zoo.list_models()
    assert models[0]["default"] and models[0]["path"] == p
    assert sum(m["default"] for m in models) == 1
    for m in models:
        for key in ("name", "path", "arch", "n_layer", "n_expert", "k", "params", "size_bytes", "default"):
            assert key in m, (m["name"], key)
    assert p.stat().st_size <= 30 * 2**20
    assert sum(m["size_bytes"] for m in models) <= 60 * 2**20


def test_manifest_has_metrics():
    man = json.loads(zoo.MANIFEST.read_text())
    for m in man["models"]:
        met = m["metrics"]
        assert met["parity"]["top1_agreement"] >= 0.99
        assert met["heldout_ppl"] > 1
        assert len(met["routing"]["top10pct_share_per_layer"]) == m["n_layer"]


@pytest.mark.parametrize("model", zoo.list_models(), ids=lambda m: m["name"])
def test_loads_in_llama_cpp_with_declared_shape(model):
    llm = llama_cpp.Llama(model_path=str(model["path"]), n_ctx=64, n_batch=64, n_threads=1, verbose=False)
    md = llm.metadata
    arch = md["general.architecture"]
    assert arch == model["arch"] and arch in ("olmoe", "qwen3moe")
    assert int(md[f"{arch}.expert_count"]) == model["n_expert"]
    assert int(md[f"{arch}.expert_used_count"]) == model["k"]
    assert int(md[f"{arch}.block_count"]) == model["n_layer"]
    assert llama_cpp.llama_model_n_embd(llm.model) == model["n_embd"]
    assert llm.n_vocab() == model["vocab_size"]
    if model["default"]:
        assert arch == "olmoe" and model["n_expert"] >= 64 and model["k"] == 8
    # it runs and is deterministic under greedy decoding
    a = llm.create_completion("def ", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    llm.reset()
    b = llm.create_completion("def ", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert a == b and len(a) > 0
