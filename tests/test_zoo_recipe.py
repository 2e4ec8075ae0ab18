"""The training recipe: deterministic file split; (with torch) the MoE layer computes what it claims and
an exported checkpoint gives llama.cpp the same logits as PyTorch."""

import pytest
from s2moe.engine.zoo import data


def test_split_is_deterministic_by_file():
    assert data.split_of("os.py") == data.split_of("os.py")
    files = data.stdlib_files()
    assert len(files) > 100
    held = [r for r, _ in files if data.split_of(r) == "heldout"]
    assert 0.02 < len(held) / len(files) < 0.09
    assert all("site-packages" not in r for r, _ in files)


def test_natural_text_present():
    assert len(data.natural_text()) > 3000


def _tiny_model(arch):
    torch = pytest.importorskip("torch")
    from s2moe.engine.zoo.model import MoEConfig, MoELM

    torch.manual_seed(0)
    m = MoELM(
        MoEConfig(
            arch=arch,
            vocab_size=4096,
            n_layer=2,
            n_embd=64,
            n_head=2,
            head_dim=32,
            n_expert=8,
            k=3,
            expert_ff=64,
            ctx=64,
        )
    )
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
        m.embed.weight.mul_(10)
    return m.eval()


@pytest.mark.parametrize("arch", ["olmoe", "qwen3moe"])
def test_moe_matches_naive_loop(arch):
    torch = pytest.importorskip("torch")
    moe = _tiny_model(arch).blocks[0].moe
    x = torch.randn(37, 64)
    y, st = moe(x)
    probs = moe.router(x).softmax(-1)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, idx = probs[t].topk(3)
        if arch == "qwen3moe":
            w = w / w.sum()
        for wi, e in zip(w, idx):
            h = torch.nn.functional.silu(moe.w_gate[e] @ x[t]) * (moe.w_up[e] @ x[t])
            ref[t] += wi * (moe.w_down[e] @ h)
    assert torch.allclose(y, ref, atol=1e-5)
    assert st["counts"].sum() == 37 * 3


@pytest.mark.parametrize("arch", ["olmoe", "qwen3moe"])
def test_export_parity_with_llama_cpp(tmp_path, arch):
    pytest.importorskip("torch")
    pytest.importorskip("llama_cpp")
    import numpy as np
    from s2moe.engine.zoo import evaluate, export, synthetic, tokenizer

    m = _tiny_model(arch)
    hp = export.hparams(m.cfg.to_dict())
    vocab = tokenizer.gguf_vocab(synthetic.TOKENIZER_JSON)
    arrays = export.state_to_arrays(m.state_dict(), hp)
    out = export.write_gguf(tmp_path / "m.gguf", hp, vocab, arrays, "parity", dtype="f32")
    seqs = np.random.default_rng(0).integers(1, 4096, size=(2, 48))
    ref, _ = evaluate.torch_logits(m, seqs)
    got = evaluate.llama_logits(out, seqs)
    assert (ref.argmax(-1) == got.argmax(-1)).mean() == 1.0
    assert np.abs(ref - got).max() < 1e-2


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, monkeypatch):
    """What makes the shipped files reproducible: batches are drawn per step from (seed, step), and the
    checkpoint holds the model and optimiser state, so stopping and resuming changes nothing."""
    torch = pytest.importorskip("torch")
    from s2moe.engine.zoo import train

    monkeypatch.setitem(train.CONFIGS, "smoke", dict(train.CONFIGS["smoke"], max_steps=6, warmup=2))
    monkeypatch.setitem(train.COMMON, "eval_every", 3)
    monkeypatch.setitem(train.COMMON, "eval_batches", 1)
    monkeypatch.setattr(train, "prepare_data", lambda: _tiny_data(tmp_path / "data"))
    weights = {}
    for name, stops in (("straight", [None]), ("resumed", [2, 4, None])):
        monkeypatch.setattr(train, "RUN_ROOT", tmp_path / name)
        for stop in stops:
            train.train("smoke", resume=True, stop_at=stop)
        st = torch.load(tmp_path / name / "smoke" / "ckpt.pt", map_location="cpu", weights_only=False)
        assert st["step"] == 6
        weights[name] = st["model"]
    for key, value in weights["straight"].items():
        assert torch.equal(value, weights["resumed"][key]), key


def _tiny_data(d):
    """Token streams of the shape prepare_data writes, from random ids (no tokenizer training)."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("heldout", 4_000)):
        np.save(d / f"{split}.npy", rng.integers(0, 4096, size=n).astype(np.uint16))
    (d / "tokenizer.json").write_text("{}")
    return d
