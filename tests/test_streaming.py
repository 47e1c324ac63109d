"""Streaming generation of a block-causal run (dit_train/sampling/streaming.py, docs/causal.md):
the cached forward, block by block, equals the full causal forward (fp64); the sampler streams
whole clips, beyond the training window with an overlap; tools.sample refuses what it cannot
stream in one error line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dit_train.config import ParallelConfig
from dit_train.kernels import VarlenLayout
from dit_train.models.dit import DiTConfig, build
from dit_train.models.layers import Attention
from dit_train.parallel.mesh import init_parallel
from dit_train.sampling import SampleRequest
from dit_train.sampling import streaming
from dit_train.sampling.streaming import KVCache, StreamingSampler, block_forward, stream_check
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.video import pack_clips
from dit_train.tasks.video_inputs import VideoInputs
from tests.conftest import bidirectional_copy

PATCH = (1, 2, 2)
K = 2  # frames (= temporal patches) per block


def _model(text_dim: int = 8):
    torch.manual_seed(0)
    cfg = DiTConfig(dim=32, depth=3, heads=2, patch_size=list(PATCH), in_channels=3, init="normal",
                    causal_block_frames=K, text_dim=text_dim, pooled_text=bool(text_dim))
    model = build(cfg).double().eval()
    for p in model.parameters():  # adaLN-zero and zero projections would hide most of the model
        torch.nn.init.normal_(p, std=0.2)
    return model


def _full_causal_forward(model, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """The reference: clip x [3, F, H, W] packed alone, block-causal, each block at its t [1, B],
    captioned by ctx [Lt, 8]; the model's output for every token [L, 12]."""
    samples = {}
    samples["context"], samples["context_len"] = pad_contexts([ctx], 8)
    b = pack_clips({"x": [x]}, PATCH, 12, samples, torch.zeros(1, dtype=torch.long), causal_block=K)
    return model(b.tokens["x"], b.pos, b.seg, t, VarlenLayout.build(b.seg, b.mask_order, b.causal), block=b.block,
                 context=samples["context"], context_len=samples["context_len"])


def test_cached_forward_equals_full_causal_forward():
    """A clip of 4 blocks (each at its own t): block j's output with the cache of blocks 0..j−1
    (each committed with its own input and t) equals the full block-causal forward's, fp64."""
    model = _model()
    x = torch.randn(3, 4 * K, 4, 6, dtype=torch.float64)
    t = torch.tensor([[0.0, 0.3, 0.6, 0.9]], dtype=torch.float64)
    ctx = torch.randn(5, 8, dtype=torch.float64)
    full = _full_causal_forward(model, x, t, ctx)
    cache, per_block = KVCache(), 4 * 6 // 4  # tokens of one frame: (4/2)·(6/2)
    for j in range(4):
        xj, tj = x[:, j * K:(j + 1) * K], float(t[0, j])
        got = block_forward(model, xj, j * K, tj, cache, PATCH, ctx)
        want = full[j * K * per_block:(j + 1) * K * per_block]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"block {j}")
        block_forward(model, xj, j * K, tj, cache, PATCH, ctx, record=True)
    assert cache.tokens == 4 * K * per_block
    # the layers get their own attention back
    assert all(type(m.attention_fn).__name__ == "LocalAttention" for m in model.modules() if isinstance(m, Attention))


def _sampler(frames: int, window: int = 0, overlap: int = 0, guidance: float = 1.0):
    requests = [SampleRequest(f"c{k}", (3, frames, 4, 4), "", torch.randn(3, 8), k) for k in range(2)]
    return StreamingSampler(requests, VideoInputs(PATCH, text_dim=8, causal_block=K), torch.zeros(3, 8),
                            init_parallel(ParallelConfig(device="cpu")), 3, guidance, 0, block_frames=K,
                            window_frames=window, overlap_frames=overlap)


def test_streaming_sampler_generates_whole_clips_and_slides_the_window(monkeypatch):
    """Two clips of 6 frames (3 blocks) with guidance; then 8 frames (4 blocks) through a 4-frame
    window (2 blocks) with 2 frames of overlap: finite clips of the asked length, and the cache
    never holds more than one block (8 tokens) before the window slides, then the overlap block
    committed again."""
    model = _model().float()
    clips = _sampler(6, guidance=2.0).sample(model)
    assert [tuple(c.shape) for c in clips] == [(3, 6, 4, 4)] * 2 and all(torch.isfinite(c).all() for c in clips)
    seen = []
    real = streaming.cached

    def spy(model, cache):
        seen.append((cache.tokens, cache.record))
        return real(model, cache)

    monkeypatch.setattr(streaming, "cached", spy)
    clips = _sampler(8, window=4, overlap=2).sample(model)
    assert [tuple(c.shape) for c in clips] == [(3, 8, 4, 4)] * 2
    # per clip: block 0 (3 steps + commit) on 0 tokens, block 1 on 8; slide: overlap recommitted on 0,
    # block 2 on 8 tokens; slide again, block 3 on 8
    one = [(0, False)] * 3 + [(0, True)] + [(8, False)] * 3 + [(8, True)]
    one += [(0, True)] + [(8, False)] * 3 + [(8, True)]
    one += [(0, True)] + [(8, False)] * 3 + [(8, True)]
    assert seen == one * 2, seen


def test_stream_check():
    assert stream_check(8, 4, 8, 0) is None and stream_check(16, 4, 8, 4) is None
    assert "multiple" in stream_check(6, 4, 8, 0)
    assert "--overlap-frames" in stream_check(16, 4, 8, 0)
    assert "less than" in stream_check(16, 4, 8, 8)


def _sample_tool(run_dir, out, *extra):
    from dit_train.tools.sample import main

    return main([str(run_dir), "--prompt", "a red circle moving up and left on a navy background", "--height", "32",
                 "--width", "32", "--steps", "2", "--guidance", "2", "--out", str(out), *extra])


def test_sample_tool_streams_a_causal_run_past_its_length(causal_run, tmp_path, capsys):
    """tools.sample on a causal run: 16 frames through the 8-frame window with a 4-frame overlap,
    streamed; the full-sequence sampler within the length; one error line for what it cannot do."""
    assert _sample_tool(causal_run, tmp_path / "a", "--frames", "16", "--overlap-frames", "4") == 0
    got = load_file(str(tmp_path / "a" / "samples.safetensors"))["prompt_0_0"]
    info = json.loads((tmp_path / "a" / "info.json").read_text())
    assert got.shape == (3, 16, 32, 32) and info["streamed"] and info["seconds_per_frame"] > 0
    assert _sample_tool(causal_run, tmp_path / "b", "--frames", "8", "--full-sequence") == 0
    assert not json.loads((tmp_path / "b" / "info.json").read_text())["streamed"]
    capsys.readouterr()
    for extra, says in [(["--frames", "6"], "not a multiple"),
                        (["--frames", "16"], "--overlap-frames"),
                        (["--frames", "16", "--full-sequence"], "KV cache only"),
                        (["--frames", "16", "--overlap-frames", "8"], "less than")]:
        assert _sample_tool(causal_run, tmp_path / "c", *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and says in err and "\n" not in err, err
    bidirectional = bidirectional_copy(causal_run, tmp_path / "bidirectional")
    assert _sample_tool(bidirectional, tmp_path / "d", "--frames", "16", "--overlap-frames", "4") == 2
    assert "block-causal runs" in capsys.readouterr().err


# --------------------------------------------------------------------------- --ar-step (asynchronous)


@pytest.mark.parametrize("blocks,steps,ar_step", [(3, 4, 1), (4, 3, 2), (2, 5, 5), (5, 2, 1)])
def test_ar_schedule_is_the_df_pipelines(blocks, steps, ar_step):
    """ar_schedule's rows are SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix's step
    indices (one window, a block per frame), the rows where some block takes a step."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    template = torch.linspace(1000, 100, steps)
    _, index, update, _ = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
        None, blocks, template, blocks, ar_step, 0, 1)
    theirs = [row.tolist() for row, u in zip(index, update) if bool(u.any())]
    ours = streaming.ar_schedule(blocks, steps, ar_step)
    assert ours == theirs
    # staggered: while both are in progress, block b is ar_step steps behind block b - 1
    assert all(r[b - 1] - r[b] == ar_step for r in ours for b in range(1, blocks) if 1 <= r[b] and r[b - 1] <= steps)


def test_several_blocks_in_one_cached_forward_equal_the_full_causal_forward():
    """The asynchronous schedule's forward: blocks 2 and 3 together at their own t (block-causal
    among themselves) over the cache of blocks 0-1 equal the full block-causal forward, fp64."""
    model = _model()
    x = torch.randn(3, 4 * K, 4, 6, dtype=torch.float64)
    t = torch.tensor([[0.0, 0.0, 0.4, 0.8]], dtype=torch.float64)
    ctx = torch.randn(5, 8, dtype=torch.float64)
    full = _full_causal_forward(model, x, t, ctx)
    cache, per_block = KVCache(), K * 6
    for j in range(2):
        block_forward(model, x[:, j * K:(j + 1) * K], j * K, 0.0, cache, PATCH, ctx, record=True)
    got = block_forward(model, x[:, 2 * K:], 2 * K, [0.4, 0.8], cache, PATCH, ctx)
    torch.testing.assert_close(got, full[2 * per_block:], rtol=1e-10, atol=1e-10)


def test_ar_step_0_is_todays_streaming_and_the_async_levels_are_staggered(monkeypatch):
    """--ar-step 0 streams exactly as before; --ar-step 1 runs the blocks in progress together,
    block b one grid step behind block b − 1 (the levels each forward is given), and gives other
    finite clips of the asked length."""
    model = _model().float()
    torch.manual_seed(1)  # _sampler draws its captions
    today = _sampler(6, guidance=2.0).sample(model)
    torch.manual_seed(1)
    s0 = _sampler(6, guidance=2.0)
    s0.ar_step = 0
    assert all(torch.equal(a, b) for a, b in zip(today, s0.sample(model)))
    seen = []
    real = streaming.block_forward

    def spy(model, x, start, t, cache, *a, record=False, **kw):
        if not record:
            seen.append((start, t))
        return real(model, x, start, t, cache, *a, record=record, **kw)

    monkeypatch.setattr(streaming, "block_forward", spy)
    torch.manual_seed(1)
    s1 = _sampler(6, guidance=2.0)
    s1.ar_step = 1
    clips = s1.sample(model)
    assert [tuple(c.shape) for c in clips] == [(3, 6, 4, 4)] * 2 and all(torch.isfinite(c).all() for c in clips)
    assert max(float((a - b).abs().max()) for a, b in zip(today, clips)) > 1e-4
    sigmas = s1.schedulers()[0].sigmas.tolist()
    want = []
    for row in streaming.ar_schedule(3, 3, 1):
        active = [b for b in range(3) if 1 <= row[b] <= 3]
        ts = [sigmas[row[b] - 1] for b in active]
        want += [(active[0] * K, ts)] * 2  # guidance: the caption's and the empty caption's forward
    assert seen[:len(want)] == [(s, pytest.approx(t)) for s, t in want]


def _async_plan(count: int, offset: int, sigmas: list[float], committed_before: int) -> list[tuple]:
    """The forwards of one window's new blocks under --ar-step 1, by hand: (start, levels or 0.0,
    record, cached tokens) — the blocks in progress together, a block committed clean once it
    has left the forward; `committed_before` blocks of the window already cached (the overlap)."""
    out, committed = [], 0
    for row in streaming.ar_schedule(count, 3, 1):
        active = [b for b in range(count) if 1 <= row[b] <= 3]
        for j in range(committed, active[0]):
            out.append(((offset + j) * K, 0.0, True, (committed_before + j) * 8))
        committed = active[0]
        levels = [sigmas[row[b] - 1] for b in range(active[0], active[-1] + 1)]
        out.append(((offset + active[0]) * K, pytest.approx(levels), False, (committed_before + committed) * 8))
    return out


def test_ar_step_slides_the_window_as_the_synchronous_stream(monkeypatch):
    """--ar-step with --overlap-frames: 10 frames (5 blocks) through a 6-frame window (3 blocks)
    with a 2-frame overlap. With ar_step = steps (one block at a time) the clips equal the
    synchronous stream's across the windows; with ar_step 1 the forwards are, window after
    window, the staggered schedule of the window's new blocks over its overlap block committed
    clean at position 0 (levels, positions and the cache's size at every forward)."""
    model = _model().float()
    torch.manual_seed(1)
    sync = _sampler(10, window=6, overlap=2).sample(model)
    torch.manual_seed(1)
    one_at_a_time = _sampler(10, window=6, overlap=2)
    one_at_a_time.ar_step = 3
    for a, b in zip(sync, one_at_a_time.sample(model)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    seen = []
    real = streaming.block_forward

    def spy(model, x, start, t, cache, *a, record=False, **kw):
        seen.append((start, t, record, cache.tokens))
        return real(model, x, start, t, cache, *a, record=record, **kw)

    monkeypatch.setattr(streaming, "block_forward", spy)
    torch.manual_seed(1)
    s1 = _sampler(10, window=6, overlap=2)
    s1.ar_step = 1
    clips = s1.sample(model)
    assert [tuple(c.shape) for c in clips] == [(3, 10, 4, 4)] * 2 and all(torch.isfinite(c).all() for c in clips)
    sigmas = s1.schedulers()[0].sigmas.tolist()
    # window 1: blocks 0-2 from position 0; window 2: block 2 again at 0 (clean), blocks 3-4 from position 1
    want = _async_plan(3, 0, sigmas, 0) + [(0, 0.0, True, 0)] + _async_plan(2, 1, sigmas, 1)
    assert seen == want * 2, seen


def test_sample_tool_ar_step(causal_run, tmp_path, capsys):
    """tools.sample --ar-step 1 streams the causal run's 8 frames (2 blocks) asynchronously, and
    16 frames through its 8-frame window with --overlap-frames 4; with --full-sequence it is one
    error line."""
    assert _sample_tool(causal_run, tmp_path / "a", "--frames", "8", "--ar-step", "1") == 0
    got = load_file(str(tmp_path / "a" / "samples.safetensors"))["prompt_0_0"]
    assert got.shape == (3, 8, 32, 32) and bool(torch.isfinite(got).all())
    assert _sample_tool(causal_run, tmp_path / "b", "--frames", "16", "--overlap-frames", "4", "--ar-step", "1") == 0
    got = load_file(str(tmp_path / "b" / "samples.safetensors"))["prompt_0_0"]
    assert got.shape == (3, 16, 32, 32) and bool(torch.isfinite(got).all())
    capsys.readouterr()
    for extra in (["--frames", "8", "--full-sequence"],):
        assert _sample_tool(causal_run, tmp_path / "c", "--ar-step", "1", *extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --ar-step 1") and "\n" not in err, err
