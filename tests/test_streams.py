"""Per-stream exact loss (audio + video, docs/audio-video.md): the pure per-stream weights and
their counts through the metadata sync on dp_shard=2 × cp_ulysses=2 against one process."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import PackedBatch
from dit_train.loss import sync_counts, token_weights

VIDEO, AUDIO = 0, 1


def _pack(clips: list[tuple[int, int, int]]) -> PackedBatch:
    """clips: (dataset id, video tokens, audio tokens); each sample's video tokens, then its audio."""
    seg, stream, order = [], [], []
    for i, (_, nv, na) in enumerate(clips):
        seg += [i] * (nv + na)
        stream += [VIDEO] * nv + [AUDIO] * na
        order += list(range(nv + na))
    seg_t = torch.tensor(seg, dtype=torch.long)
    return PackedBatch(seg=seg_t, pos=torch.zeros(len(seg), 1, dtype=torch.long), order=torch.tensor(order),
                       valid=torch.ones(len(seg), dtype=torch.bool), stream=torch.tensor(stream),
                       sample_ids=torch.tensor([c[0] for c in clips]))


def _losses(b: PackedBatch) -> torch.Tensor:
    """[L] a loss per token that depends only on (dataset id, stream, order): the same on any layout."""
    ids = b.sample_ids[b.seg.clamp(min=0)]
    stream = torch.zeros_like(b.seg) if b.stream is None else b.stream
    return torch.where(b.seg >= 0, 1.0 + 0.37 * ids + 0.11 * b.order + 0.5 * stream, 0.0).float()


def _weights(batches, lambdas=(1.0, 1.0)):
    meta = sync_counts(batches, None, None, streams=2)
    return meta, [token_weights("sample_mean", b.seg, b.loss_weight(), meta, k, stream=b.stream, lambdas=lambdas)
                  for k, b in enumerate(batches)]


def _per_clip(batches, weights) -> dict[tuple[int, int], float]:
    """{(dataset id, stream): Σ a over the clip's tokens of that stream}."""
    out: dict[tuple[int, int], float] = {}
    for b, w in zip(batches, weights):
        for t in range(b.num_tokens):
            if b.seg[t] >= 0:
                key = (int(b.sample_ids[b.seg[t]]), int(b.stream[t]))
                out[key] = out.get(key, 0.0) + float(w[t])
    return out


def test_stream_weights_are_the_per_stream_hierarchical_mean():
    """Σ a·l = Σ_s λ_s · mean over the samples having s of their token mean in s."""
    batches = [_pack([(0, 7, 3), (1, 4, 0)]), _pack([(2, 9, 5)]), _pack([(3, 2, 1), (4, 6, 0)])]
    lambdas = (1.0, 0.25)
    meta, weights = _weights(batches, lambdas)
    assert meta.stream_samples == [5, 3] and meta.num_samples == 5
    got = sum(float((w * _losses(b)).sum()) for b, w in zip(batches, weights))
    want = 0.0
    for s, lam in enumerate(lambdas):
        means = [_losses(b)[(b.seg == i) & (b.stream == s)].mean() for b in batches for i in range(b.num_samples)
                 if bool(((b.seg == i) & (b.stream == s)).any())]
        want += lam * float(torch.stack(means).mean())
    assert got == pytest.approx(want, rel=1e-6)


def test_a_clip_without_audio_changes_no_other_clips_audio_weight():
    """Adding a video-only clip to a micro-batch leaves every other clip's audio weight as it was
    (B_audio counts only clips with audio) while the video weights shrink to 1/B_video."""
    before = [_pack([(0, 7, 3)]), _pack([(1, 4, 6)])]
    after = [_pack([(0, 7, 3), (9, 12, 0)]), _pack([(1, 4, 6)])]
    meta0, w0 = _weights(before)
    meta1, w1 = _weights(after)
    assert meta0.stream_samples == [2, 2] and meta1.stream_samples == [3, 2]
    c0, c1 = _per_clip(before, w0), _per_clip(after, w1)
    for clip in (0, 1):
        assert c1[(clip, AUDIO)] == pytest.approx(c0[(clip, AUDIO)], rel=1e-7) == 0.5
        assert c1[(clip, VIDEO)] == pytest.approx(1 / 3, rel=1e-6)
    assert (9, AUDIO) not in c1


def test_one_stream_reduces_to_sample_mean():
    """Packs whose tokens are all video: the per-stream weights are sample_mean's."""
    batches = [_pack([(0, 5, 0), (1, 3, 0)]), _pack([(2, 8, 0)])]
    meta, weights = _weights(batches)
    plain = sync_counts(batches, None, None)
    for k, (b, w) in enumerate(zip(batches, weights)):
        torch.testing.assert_close(w, token_weights("sample_mean", b.seg, b.loss_weight(), plain, k), rtol=1e-7, atol=0)


def test_streams_need_sample_mean_and_stream_counts():
    b = _pack([(0, 3, 2)])
    with pytest.raises(ValueError, match="sample_mean"):
        token_weights("token_mean", b.seg, b.loss_weight(), sync_counts([b], None, None, streams=2), 0, stream=b.stream)
    with pytest.raises(ValueError, match="per stream"):
        token_weights("sample_mean", b.seg, b.loss_weight(), sync_counts([b], None, None), 0, stream=b.stream)


# The global step of the layout test: DP rank r's micro-batches. Clip 0's pack is cut by CP=2 so
# that CP rank 0 holds only its video (no audio token); clips 3 and 5 have no audio.
STEP = [
    [[(0, 9, 3)], [(1, 2, 4), (3, 5, 0)]],   # DP rank 0: two micro-batches
    [[(2, 3, 1), (4, 1, 7)], [(5, 6, 0)]],   # DP rank 1
]


def _stream_sync_worker():
    """On dp_shard=2 × cp_ulysses=2: this rank's per-token weights keyed by (clip, stream, order)."""
    from dit_train.config.schema import ParallelConfig
    from dit_train.parallel.context_parallel import split_for_cp
    from dit_train.parallel.mesh import init_parallel

    ctx = init_parallel(ParallelConfig(dp_shard=2, cp_ulysses=2, dp_mode="none", device="cpu"))
    local = [split_for_cp(_pack(clips), 2, ctx.cp_rank, "contiguous")[0] for clips in STEP[ctx.dp_rank]]
    meta = sync_counts(local, ctx.cp_group, ctx.dp_group, world=4, streams=2)
    out, audio_tokens = {}, 0
    for k, b in enumerate(local):
        w = token_weights("sample_mean", b.seg, b.loss_weight(), meta, k, stream=b.stream, lambdas=(1.0, 0.5))
        audio_tokens += int(((b.stream == AUDIO) & (b.seg >= 0) & (b.sample_ids[b.seg.clamp(min=0)] == 0)).sum())
        for t in range(b.num_tokens):
            if b.seg[t] >= 0:
                out[(int(b.sample_ids[b.seg[t]]), int(b.stream[t]), int(b.order[t]))] = float(w[t])
    return {"weights": out, "B_s": meta.stream_samples, "clip0_audio_here": audio_tokens}


@pytest.mark.slow
def test_stream_counts_are_layout_exact_on_dp_and_cp():
    """Per-token weights on dp_shard=2 × cp_ulysses=2 equal the one-process weights of the same
    step, with clips without audio and a CP rank that holds none of clip 0's audio tokens."""
    from dit_train.engine.launch import launch_local

    oracle_batches = [_pack(clips) for rank in STEP for clips in rank]
    _, oracle_w = _weights(oracle_batches, (1.0, 0.5))
    want = {}
    for b, w in zip(oracle_batches, oracle_w):
        for t in range(b.num_tokens):
            want[(int(b.sample_ids[b.seg[t]]), int(b.stream[t]), int(b.order[t]))] = float(w[t])
    results = launch_local(_stream_sync_worker, (), 4)
    assert sorted(r["clip0_audio_here"] for r in results.values()) == [0, 0, 0, 3]  # a CP rank without audio
    got = {}
    for r in results.values():
        for key, a in r["weights"].items():
            assert got.setdefault(key, a) == a  # the DP replicas of a CP shard agree
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in want)
    assert worst < 1e-6, worst
    assert all(r["B_s"] == [6, 4] for r in results.values())


def test_stream_shift_measures_the_per_micro_batch_mistake():
    """tools.stream_shift: the exact audio weight of every clip is λ_a/B_audio on every layout;
    the per-micro-batch sum of stream means moves it with the layout."""
    from dit_train.tools.stream_shift import AUDIO, LAYOUTS, make_clips, stream_shift

    clips = make_clips(16, 0)
    exact, naive = stream_shift(clips, (1.0, 0.5))
    with_audio = [i for i, (_, a) in clips.items() if a]
    for lay in LAYOUTS:
        for i in with_audio:
            assert exact[lay][(i, AUDIO)] == pytest.approx(0.5 / len(with_audio), rel=1e-6)
    spread = max(max(naive[lay][(i, AUDIO)] for lay in LAYOUTS) / min(naive[lay][(i, AUDIO)] for lay in LAYOUTS)
                 for i in with_audio)
    assert spread > 2


def test_negative_stream_weights_are_refused_before_the_run():
    from dit_train.compose import compose
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError, match=r"loss.stream_weights.audio=-1.0 must be >= 0"):
        check_config(compose(["loss.stream_weights.audio=-1"]))
    with pytest.raises(ConfigError, match="loss.stream_weights video=0.0 audio=0.0: not both 0"):
        check_config(compose(["loss.stream_weights.audio=0", "loss.stream_weights.video=0"]))
