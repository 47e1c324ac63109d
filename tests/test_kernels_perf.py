"""The batched per-run SDPA path (equal-length neighbours in one call, split/cat instead of
slice writes) gives the dense-mask reference's outputs and gradients."""
from __future__ import annotations

import pytest
import torch

from dit_train.kernels import VarlenLayout, varlen_attention



def _tiny_pack(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, VarlenLayout]:
    """pos [L, 3], seg [L] and attention metadata of a pack of clips with `lens` tokens each
    (positions on a (t, 2, 2) patch grid)."""
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    pos = torch.stack([order // 4, order % 4 // 2, order % 2], -1)
    return pos, seg, VarlenLayout.build(seg, order, False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[4, 4, 4, 7, 7, 3, 4], [5], [6, 6], [2, 9, 9, 9]])
def test_sdpa_runs_match_dense_forward_and_backward(lens, causal):
    g = torch.Generator().manual_seed(len(lens))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    meta = VarlenLayout.build(seg, order, causal)
    L, H, D = seg.numel(), 3, 8
    base = [torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(3)]
    grad_out = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    results = {}
    for backend in ("sdpa", "sdpa_dense"):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out = varlen_attention(q, k, v, meta, backend)
        out.backward(grad_out)
        results[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for a, b in zip(results["sdpa"], results["sdpa_dense"]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_equal_length_neighbours_do_not_attend_to_each_other():
    lens = [5, 5, 5]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    meta = VarlenLayout.build(seg, torch.cat([torch.arange(n) for n in lens]), False)
    q, k, v = (torch.randn(15, 2, 4) for _ in range(3))
    out = varlen_attention(q, k, v, meta, "sdpa")
    k2, v2 = k.clone(), v.clone()
    k2[5:10] += 10
    v2[5:10] += 10
    out2 = varlen_attention(q, k2, v2, meta, "sdpa")
    keep = torch.cat([torch.arange(0, 5), torch.arange(10, 15)])
    assert torch.allclose(out[keep], out2[keep], atol=1e-6) and not torch.allclose(out[5:10], out2[5:10])


@pytest.mark.parametrize("case", ["mixed", "equal", "all_padding"])
def test_packed_cross_attention_matches_masked_reference(case):
    """Batched per-run cross-attention (split/cat) = one dense masked attention over all
    captions, outputs and gradients, in fp64: padding tokens (-1) and a caption-less sample
    get zero rows, equal-shape neighbours share a call without seeing each other's captions."""
    from dit_train.kernels import packed_cross_attention

    g = torch.Generator().manual_seed(7)
    seg = {"mixed": [0] * 4 + [1] * 4 + [2] * 4 + [3] * 6 + [-1] * 3 + [4] * 4,
           "equal": [0] * 5 + [1] * 5 + [2] * 5,
           "all_padding": [-1] * 6}[case]
    seg = torch.tensor(seg)
    S = max(int(seg.max()) + 1, 1)
    kv_len = torch.tensor([3, 3, 5, 3, 0][:S] if case == "mixed" else [4] * S)
    L, H, D, Lc = seg.numel(), 2, 4, 6
    base = [torch.randn(L, H, D, generator=g, dtype=torch.float64),
            torch.randn(S, Lc, H, D, generator=g, dtype=torch.float64),
            torch.randn(S, Lc, H, D, generator=g, dtype=torch.float64)]
    grad_out = torch.randn(L, H, D, generator=g, dtype=torch.float64)

    q, k, v = (t.clone().requires_grad_(True) for t in base)
    out = packed_cross_attention(q, k, v, seg, kv_len)
    out.backward(grad_out)

    qr, kr, vr = (t.clone().requires_grad_(True) for t in base)
    kk, vv = kr.reshape(S * Lc, H, D), vr.reshape(S * Lc, H, D)
    key_seg = torch.arange(S).repeat_interleave(Lc)
    key_ok = torch.arange(Lc).repeat(S) < kv_len.repeat_interleave(Lc)
    mask = (seg[:, None] == key_seg[None, :]) & key_ok[None, :]
    scores = torch.einsum("qhd,khd->hqk", qr, kk) * D ** -0.5
    p = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1).nan_to_num(0.0)
    ref = torch.einsum("hqk,khd->qhd", p, vv)
    ref.backward(grad_out)
    for a, b in ((out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert (out[seg < 0] == 0).all()


def test_compiled_blocks_match_eager_forward_and_backward():
    """`train.compile` (torch.compile per block, dynamic shapes) traces the whole block —
    custom autograd functions (RoPE) included; the per-run attention loops stay eager — and
    gives the eager outputs and gradients on packs of different run structures (each a new
    graph: inductor once failed on the second one's sizes). Guards against ops inductor cannot
    trace (e.g. `out=`)."""
    from dit_train.models import model_config
    from dit_train.models import build_model, init_weights
    from dit_train.parallel.parallelize import apply_compile

    cfg = model_config("dit", dim=32, depth=1, heads=2, patch_size=[1, 2, 2], in_channels=4, init="normal", text_dim=8)
    model = build_model(cfg)
    init_weights(model, seed=0, scheme="normal")
    g = torch.Generator().manual_seed(0)
    packs = []
    for lens, text in (([8, 8, 12], [5, 3, 0]), ([12, 4, 4, 8], [2, 5, 5, 4])):
        pos, seg, meta = _tiny_pack(lens)
        packs.append((torch.randn(seg.numel(), 16, generator=g), pos, seg, torch.rand(len(lens), generator=g), meta,
                      torch.randn(len(lens), 5, 8, generator=g), torch.tensor(text)))

    def run(args):
        model.zero_grad(set_to_none=True)
        out = model(*args)
        (out ** 2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    eager = [run(args) for args in packs]
    apply_compile(model.blocks)
    for args, want in zip(packs, eager):
        got = run(args)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dit", "wan"])
def test_fsdp_mixed_precision_keeps_flow_time_fp32(name, tmp_path):
    """Under FSDP2 bf16 parameters (the CUDA bf16 path, run here on a 1-rank gloo mesh) the
    per-clip time t reaches the timestep embedding in fp32 (the root's policy must not cast
    it: bf16 rounds Wan's 1000·t by up to ~2), and forward/backward run in bf16 with the
    model casting its own inputs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dit_train.models import model_config
    from dit_train.models import build_model, init_weights
    from dit_train.parallel.parallelize import fsdp_mp_policies

    common = dict(dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4, init="normal", text_dim=8)
    cfg = model_config("dit", **common) if name == "dit" else model_config("wan", ffn_dim=64, freq_dim=32, text_len=6,
                                                                 **common)
    model = build_model(cfg)
    init_weights(model, seed=0, scheme="normal")
    embedder = model.t_embedder if name == "dit" else model.condition_embedder
    seen = {}
    embedder.register_forward_pre_hook(lambda mod, args: seen.update(t=args[0].detach().clone()))
    g = torch.Generator().manual_seed(0)
    pos, seg, meta = _tiny_pack([8, 12])
    args = (torch.randn(seg.numel(), 16, generator=g), pos, seg, torch.tensor([0.3337, 0.7771]), meta,
            torch.randn(2, 5, 8, generator=g), torch.tensor([5, 3]))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        root_mp, block_mp = fsdp_mp_policies(torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=block_mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        out = model(*args)
        out.float().square().mean().backward()
    finally:
        dist.destroy_process_group()
    t = args[3]
    expected = t if name == "dit" else torch.cat([t, t.new_zeros(1)]) * 1000  # Wan's timestep, fp32
    assert seen["t"].dtype == torch.float32 and torch.equal(seen["t"], expected)  # not rounded through bf16
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
