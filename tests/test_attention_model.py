"""Packed attention never mixes samples; the DiT treats each sample of a pack on its own."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import PackedBatch
from dit_train.models import model_config
from dit_train.models import build_model, init_weights
from dit_train.kernels import VarlenLayout, attention_mask, attention_with_lse, merge_partials, varlen_attention


def _pack(lens, H=2, D=8, seed=0, causal=False):
    g = torch.Generator().manual_seed(seed)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    L = seg.numel()
    q, k, v = (torch.randn(L, H, D, generator=g) for _ in range(3))
    return q, k, v, VarlenLayout.build(seg, order, causal)


BACKENDS = ["sdpa", "sdpa_dense", "flex"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_tokens_of_two_samples_never_see_each_other(backend, causal):
    """Changing every key/value of sample 1 must not change any output of samples 0 and 2."""
    lens = [5, 7, 4]
    q, k, v, meta = _pack(lens, causal=causal)
    out = varlen_attention(q, k, v, meta, backend)
    k2, v2 = k.clone(), v.clone()
    s1 = slice(5, 12)
    k2[s1] += 10 * torch.randn_like(k2[s1])
    v2[s1] += 10 * torch.randn_like(v2[s1])
    out2 = varlen_attention(q, k2, v2, meta, backend)
    others = torch.cat([torch.arange(0, 5), torch.arange(12, 16)])
    assert torch.allclose(out[others], out2[others], atol=1e-5)
    assert not torch.allclose(out[s1], out2[s1], atol=1e-3)  # the perturbed sample itself changes


@pytest.mark.parametrize("causal", [False, True])
def test_backends_agree(causal):
    q, k, v, meta = _pack([9, 3, 12, 1], causal=causal, seed=1)
    ref = varlen_attention(q, k, v, meta, "sdpa_dense")
    for backend in ["sdpa", "flex"]:
        torch.testing.assert_close(varlen_attention(q, k, v, meta, backend), ref, atol=1e-5, rtol=1e-5)


def test_causal_mask_hides_the_future():
    q, k, v, meta = _pack([6], causal=True, seed=2)
    out = varlen_attention(q, k, v, meta, "sdpa")
    k2, v2 = k.clone(), v.clone()
    k2[4:] += 5
    v2[4:] += 5
    out2 = varlen_attention(q, k2, v2, meta, "sdpa")
    assert torch.allclose(out[:4], out2[:4], atol=1e-6) and not torch.allclose(out[4:], out2[4:])


def test_lse_merge_over_key_blocks_is_exact():
    q, k, v, meta = _pack([10, 14], seed=3)
    full = varlen_attention(q, k, v, meta, "sdpa_dense")
    parts = [slice(0, 7), slice(7, 16), slice(16, 24)]
    outs, lses = [], []
    for p in parts:
        m = attention_mask(meta.seg, meta.pos, meta.seg[p], meta.pos[p], False)
        o, lse = attention_with_lse(q, k[p], v[p], m)
        outs.append(o)
        lses.append(lse)
    torch.testing.assert_close(merge_partials(outs, lses), full, atol=1e-5, rtol=1e-5)


def test_gpu_only_backends_refuse_cpu_with_a_clear_message():
    from dit_train.kernels import resolve_backend

    assert resolve_backend("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("xformers", "cpu")


def _tiny_dit(init="normal", std=0.02, **keys):
    cfg = model_config("dit", dim=32, depth=2, heads=4, patch_size=[1, 4, 4], init=init, **keys)
    model = build_model(cfg)
    init_weights(model, seed=0, scheme=init, std=std)
    return model, cfg


@pytest.mark.parametrize("captions", [False, True])
def test_dit_samples_in_a_pack_are_independent(captions):
    """A sample's prediction is the same alone or packed with others (attention, RoPE and
    adaLN conditioning all stay per sample). With captions of different lengths, the pack pads
    them to the longest: cross-attention and the pooled caption (model.pooled_text) must read
    only each sample's own valid caption tokens."""
    # std 0.2: with the default 0.02 the caption's effect on the output is below the tolerance
    model, cfg = _tiny_dit(**({"text_dim": 8, "pooled_text": True, "std": 0.2} if captions else {}))
    Dp = 3 * 16
    g = torch.Generator().manual_seed(0)
    grids = [(2, 2, 3), (1, 3, 3), (3, 2, 2)]
    xs = [torch.randn(f * h * w, Dp, generator=g) for f, h, w in grids]
    poss = [torch.stack(torch.meshgrid(*(torch.arange(n) for n in gr), indexing="ij"), -1).reshape(-1, 3) for gr in grids]
    ts = torch.tensor([0.2, 0.5, 0.9])
    caption_lens = [7, 3, 5]
    caps = [torch.randn(n, 8, generator=g) for n in caption_lens]

    def run(idx):
        x = torch.cat([xs[i] for i in idx])
        pos = torch.cat([poss[i] for i in idx])
        seg = torch.cat([torch.full((xs[i].shape[0],), k) for k, i in enumerate(idx)])
        order = torch.cat([torch.arange(xs[i].shape[0]) for i in idx])
        text = {}
        if captions:
            context = torch.zeros(len(idx), max(caption_lens[i] for i in idx), 8)
            for k, i in enumerate(idx):
                context[k, :caption_lens[i]] = caps[i]
            text = {"context": context, "context_len": torch.tensor([caption_lens[i] for i in idx])}
        return model(x, pos, seg, ts[idx], VarlenLayout.build(seg, order, False), **text)

    packed = run([0, 1, 2])
    alone = run([1])
    n0, n1 = xs[0].shape[0], xs[1].shape[0]
    torch.testing.assert_close(packed[n0:n0 + n1], alone, atol=1e-5, rtol=1e-5)


def test_padding_and_empty_packs_are_harmless():
    model, _ = _tiny_dit()
    empty = PackedBatch(seg=torch.zeros(0, dtype=torch.long), pos=torch.zeros(0, 3, dtype=torch.long),
                        order=torch.zeros(0, dtype=torch.long), valid=torch.zeros(0, dtype=torch.bool),
                        tokens={"x": torch.zeros(0, 48)}, samples={"t": torch.zeros(0)}).pad_to_multiple(4)
    assert empty.num_tokens == 4 and not empty.valid.any()
    out = model(empty.tokens["x"], empty.pos, empty.seg, empty.samples["t"], VarlenLayout.build(empty.seg, empty.order, False))
    assert torch.isfinite(out).all()


def test_init_depends_only_on_seed_and_names():
    a, _ = _tiny_dit("adaln_zero")
    b, _ = _tiny_dit("adaln_zero")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    zero = [n for n, p in a.named_parameters() if "adaLN_modulation" in n or n.startswith("final.linear")]
    params = dict(a.named_parameters())
    assert zero and all(float(params[n].detach().abs().max()) == 0 for n in zero)


def test_flex_builds_one_block_mask_per_pack(monkeypatch):
    """Every layer of a step attends over the same pack: flex's block mask is built once per
    layout (VarlenLayout.cache), not once per attention call; the result stays the dense one's."""
    import torch.nn.attention.flex_attention as fa

    built = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    seg = torch.tensor([0] * 5 + [1] * 11 + [2] * 3)
    meta = VarlenLayout.build(seg, torch.cat([torch.arange(5), torch.arange(11), torch.arange(3)]), causal=False)
    q, k, v = (torch.randn(19, 2, 8) for _ in range(3))
    outs = [varlen_attention(q, k, v, meta, "flex") for _ in range(3)]
    assert len(built) == 1
    for o in outs:
        torch.testing.assert_close(o, varlen_attention(q, k, v, meta, "sdpa_dense"))
