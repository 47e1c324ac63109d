"""Block-causal video (model.causal_block_frames): the mask through every CPU kernel against a dense
fp64 reference built here from frame indices, on uneven clips, packed and zigzag-permuted, single
pass and as ring steps; the pack's block keys; and the DiT's causality end to end (a block's output
does not depend on later blocks)."""
from __future__ import annotations

import pytest
import torch

from dit_train.config import ParallelConfig
from dit_train.kernels import VarlenLayout, block_attention_with_lse, merge_partials, sample_blocks, varlen_attention
from dit_train.models.dit import DiTConfig, _checks, build
from dit_train.parallel.mesh import init_parallel
from dit_train.sampling import SampleRequest, VideoSampler
from dit_train.tasks.video import pack_clips
from dit_train.tasks.video_inputs import VideoInputs, video_inputs
from tests.test_block_attention import LAYOUTS, _block_vs_dense, _splits

HW = 3  # tokens per temporal patch ("frame") in the kernel tests
BLOCK = 2  # temporal patches per causal block


def _video_pack(seed: int, L: int, H: int = 3, D: int = 8):
    """Uneven clips (1..6 frames of HW tokens, so a clip's last block may be short), trailing padding
    (seg -1, in-order keys of its own), fp64 q/k/v; returns seg, block key, frame, q, k, v, g."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < L - 3 * HW:
        n = HW * int(torch.randint(1, 7, (1,), generator=g))
        if total + n > L - 1:
            break
        lens.append(n)
        total += n
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((L - total,), -1)])
    frame = torch.cat([torch.arange(n) // HW for n in lens] + [torch.arange(L - total)])
    block = torch.cat([torch.arange(n) // HW // BLOCK for n in lens] + [torch.arange(L - total)])
    q, k, v = (torch.randn(L, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    return seg, block, frame, q, k, v, g


def _reference(seg, frame, q, k, v):
    """Dense fp64 softmax attention with the mask spelled out from frames: same clip, and the key's
    frame // BLOCK <= the query's (padding, seg -1, is token-causal within itself)."""
    same = seg[:, None] == seg[None, :]
    pad = seg[:, None] < 0
    blk_q, blk_k = (frame // BLOCK)[:, None], (frame // BLOCK)[None, :]
    keep = same & torch.where(pad, frame[None, :] <= frame[:, None], blk_k <= blk_q)
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_dense", "flex"])
@pytest.mark.parametrize("permuted", [False, True], ids=["packed", "zigzag"])
def test_block_causal_kernels_equal_dense_reference(backend, permuted):
    """Every CPU backend, on the packed order and on a zigzag permutation: values equal the
    reference and (but flex, forward only on the CPU) so do the gradients of q, k, v, in fp64. The
    packed order must not take the contiguous is_causal path (equal keys are not positions + 1)."""
    seg, block, frame, q, k, v, g = _video_pack(7, 92)
    perm = torch.cat(_splits(92, "zigzag2", g)) if permuted else torch.arange(92)
    meta = VarlenLayout.build(seg[perm], block[perm], True)
    dout = torch.randn_like(q)
    results = []
    for which in ("reference", backend):
        xs = [t[perm].clone().requires_grad_(backend != "flex") for t in (q, k, v)]
        out = _reference(seg[perm], frame[perm], *xs) if which == "reference" else varlen_attention(*xs, meta, backend)
        if backend != "flex":
            out.backward(dout[perm])
        results.append([out.detach()] + ([x.grad for x in xs] if backend != "flex" else []))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_causal_ring_steps_equal_dense_reference(layout, backend):
    """Each (query rank, key rank) step of a ring over block keys: out, lse and gradients equal the
    dense masked reference (tests/test_block_attention.py's check), and merging a query rank's steps
    gives the reference attention."""
    seg, block, frame, q, k, v, g = _video_pack(3 + LAYOUTS.index(layout), 96)
    sets = _splits(96, layout, g)
    full = _reference(seg, frame, q, k, v)
    kinds = set()
    for iq in sets:
        parts = []
        for ik in sets:
            errs, plan = _block_vs_dense(seg, block, q, k, v, iq, ik, True, backend, g)
            assert max(errs.values()) < 1e-12, (layout, errs)
            kinds |= {gr.kind for gr in plan.groups}
            parts.append(block_attention_with_lse(q[iq], k[ik], v[ik], plan, backend))
        merged = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
        torch.testing.assert_close(merged, full[iq], atol=1e-12, rtol=1e-12)
    assert "masked" in kinds  # a block's staircase is not token-causal


def test_pack_block_keys_follow_frames():
    """pack_clips: a token's block is its temporal patch // blocks; the pack is causal; padding gets
    in-order keys of its own; a clip whose frames do not fill its last block keeps it short."""
    clips = [torch.randn(3, F, 8, 8) for F in (6, 2, 10)]  # patch [2, 4, 4]: 3, 1, 5 temporal patches
    b = pack_clips({"x": clips}, (2, 4, 4), 96, {}, torch.arange(3), causal_block=2)
    assert b.causal and torch.equal(b.block, b.pos[:, 0] // 2)
    assert torch.equal(b.mask_order, b.block)
    assert b.block[b.seg == 2].unique().tolist() == [0, 1, 2]  # 5 patches: blocks of 2, 2, 1
    p = b.pad_to_multiple(7)
    assert torch.equal(p.block[p.seg < 0], torch.arange(int((p.seg < 0).sum())))
    assert pack_clips({"x": clips}, (2, 4, 4), 96, {}, torch.arange(3)).block is None


def test_dit_block_causal_end_to_end():
    """The DiT with a block-causal pack: changing a clip's frames of block j changes its outputs in
    blocks >= j only; other clips never change. The bidirectional pack sees everything."""
    torch.manual_seed(0)
    cfg = DiTConfig(dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=3, init="normal",
                    causal_block_frames=2)
    model = build(cfg).double()
    clips = [torch.randn(3, F, 4, 4, dtype=torch.float64) for F in (5, 3)]
    t = torch.tensor([0.3, 0.7])

    def run(clips, causal_block=2):
        b = pack_clips({"x": clips}, (1, 2, 2), 12, {}, torch.arange(2), causal_block=causal_block)
        meta = VarlenLayout.build(b.seg, b.mask_order, b.causal)
        return b, model(b.tokens["x"].double(), b.pos, b.seg, t, meta)

    b, out = run(clips)
    changed = [clips[0].clone(), clips[1]]
    changed[0][:, 2] += 1.0  # frame 2 = block 1 of clip 0
    _, out2 = run(changed)
    moved = (out2 - out).abs().amax(dim=1) > 1e-12
    in_clip0, later = b.seg == 0, b.pos[:, 0] >= 2  # frames 2.. are blocks 1.. (spelled from frames)
    assert not moved[in_clip0 & ~later].any() and moved[in_clip0 & later].all()
    assert not moved[b.seg == 1].any()
    _, bi = run(clips, 0)
    _, bi2 = run(changed, 0)
    assert ((bi2 - bi).abs().amax(dim=1) > 1e-12)[in_clip0].all()


def test_causal_block_frames_checked():
    """A block holds whole temporal patches: K must be a multiple of model.patch_size[0]."""
    assert _checks(DiTConfig(patch_size=[2, 4, 4], causal_block_frames=3))
    assert _checks(DiTConfig(patch_size=[2, 4, 4], causal_block_frames=-2))
    assert not _checks(DiTConfig(patch_size=[2, 4, 4], causal_block_frames=4))
    # training and the sampler read the blocks from the model's inputs: temporal patches per block
    assert video_inputs(DiTConfig(patch_size=[2, 4, 4], causal_block_frames=4)).causal_block == 2
    assert video_inputs(DiTConfig(patch_size=[2, 4, 4])).causal_block == 0


def test_sampler_uses_the_block_mask():
    """A block-causal model samples under the mask it trained with: every forward of the sampler
    gets a causal layout keyed by the temporal block (here frames // 2), on uneven clips."""
    layouts = []

    class Recorder(torch.nn.Module):
        def forward(self, x, pos, seg, t, meta, **kw):
            layouts.append((meta, pos))
            return torch.zeros(x.shape[0], 12)

    model = Recorder()

    requests = [SampleRequest(f"c{k}", shape, "", None, k) for k, shape in enumerate([(3, 5, 4, 4), (3, 2, 4, 4)])]
    inputs = VideoInputs((1, 2, 2), causal_block=2)
    VideoSampler(requests, inputs, None, init_parallel(ParallelConfig(device="cpu")), 2, 1.0, 0).sample(model)
    assert layouts
    for meta, pos in layouts:
        assert meta.causal and torch.equal(meta.pos, pos[:, 0] // 2)
