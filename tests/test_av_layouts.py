"""The two-stream DiT (audio + video, model.audio_patch) trains layout-exact: dp_shard=2 ×
cp_ulysses=2 and dp_shard=2 × cp_ring=2 against one process, on the embedded set with sound
(clips with and without audio, uneven lengths), with a CP rank that holds no audio token of a
clip, captions on (both streams read them: docs/audio-video.md)."""
from __future__ import annotations

import pytest
import torch

from tests.families import family_run_cfg
from tests.layout_cases import Case, assert_exact, run_cases

AV = ["data.audio=true", "model.audio_patch=500", "model.prediction=velocity", "train.micro_batch_tokens=600"]
LAYOUTS = {"ulysses": "dp_shard=2,cp_ulysses=2", "ring": "dp_shard=2,cp_ring=2"}


@pytest.fixture(scope="module")
def av_cfg(data_cache):
    cfg = family_run_cfg(AV, data_cache)
    assert cfg.model.text_dim > 0 and cfg.data.caption_dropout > 0  # captions (and their dropout) on both streams
    return cfg  # TINY, data prepared; always clips: the global norm must be exact too


def one_block(cfg):
    """cfg with one transformer block, for the layout runs: they are Python-bound (a step costs its
    blocks' calls, not their width), and both streams share every block, so the CP splits of the
    joint sequence, the per-stream counts and the shards need no second."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.model.depth = 1
    return cfg


@pytest.fixture(scope="module")
def layouts(av_cfg):
    return run_cases({name: Case(one_block(av_cfg), spec) for name, spec in LAYOUTS.items()})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_stream_training_matches_one_process(name, layouts):
    assert_exact(*layouts[name], f"audio + video on {LAYOUTS[name]}")


def test_the_layout_case_is_not_vacuous(av_cfg):
    """The steps trained hold clips with and without sound, and a pack whose CP split leaves a
    rank with video tokens of a clip but none of its audio."""
    from dit_train.batch import cp_token_index
    from dit_train.data_pipelines.packing import plan_step
    from dit_train.tasks import build_task

    c = av_cfg
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed)
    assert task.streams == 2
    with_audio = without = rank_without_audio = 0
    for step in range(c.train.steps):
        plan = plan_step(step, task.lengths(), c.train.global_batch, 2, 1, c.train.micro_batch_tokens, c.train.seed)
        for packs in plan.micro_batches:
            for ids in packs:
                full = task.build(ids, step).pad_to_multiple(2)
                has = torch.bincount(full.seg[(full.stream == 1) & (full.seg >= 0)], minlength=full.num_samples)
                with_audio += int((has > 0).sum())
                without += int((has == 0).sum())
                for r in range(2):
                    idx = cp_token_index(full.num_tokens, 2, r, "contiguous")
                    seg, stream = full.seg[idx], full.stream[idx]
                    for k in torch.unique(seg[seg >= 0]).tolist():
                        if has[k] > 0 and not bool(((seg == k) & (stream == 1)).any()):
                            rank_without_audio += 1
    assert with_audio > 0 and without > 0 and rank_without_audio > 0, (with_audio, without, rank_without_audio)


def test_audio_tokens_follow_each_clips_video_and_share_its_t():
    """join_audio_tokens: clip k's audio tokens right after its video tokens (stream 1, in-clip
    order after the video), x and target widened to the wider stream with zeros."""
    from dit_train.batch import PackedBatch
    from dit_train.tasks.joint_audio import join_audio_tokens

    seg = torch.tensor([0, 0, 0, 1, 1])
    batch = PackedBatch(seg=seg, pos=torch.zeros(5, 3, dtype=torch.long), order=torch.tensor([0, 1, 2, 0, 1]),
                        valid=torch.ones(5, dtype=torch.bool),
                        tokens={"x": torch.ones(5, 4), "target": torch.ones(5, 4)}, sample_ids=torch.tensor([7, 9]))
    x = [torch.full((2, 6), 2.0), torch.zeros(0, 6)]  # clip 1 has no sound
    out = join_audio_tokens(batch, x, x, [torch.zeros(2, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)])
    assert out.seg.tolist() == [0, 0, 0, 0, 0, 1, 1] and out.stream.tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert out.order.tolist() == [0, 1, 2, 3, 4, 0, 1] and out.tokens["x"].shape == (7, 6)
    assert out.tokens["x"][0].tolist() == [1, 1, 1, 1, 0, 0] and out.tokens["x"][3].tolist() == [2.0] * 6


def test_each_streams_share_of_the_loss_is_logged(av_cfg):
    """loss/video and loss/audio (Σ w·l per stream, in the step's one stats all-reduce) add up to
    the logged loss."""
    from dit_train.engine.build import build_run
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.parallel.mesh import init_parallel

    cfg = apply_layout(av_cfg, {})
    run = build_run(cfg, init_parallel(cfg.parallel))
    res = run.trainer.step(0)
    assert res.extras["loss/video"] > 0 and res.extras["loss/audio"] > 0
    assert res.extras["loss/video"] + res.extras["loss/audio"] == pytest.approx(res.loss, rel=1e-6)


def test_audio_tokens_read_their_own_clips_caption():
    """One block (its self-attention runs before the cross-attention, so the caption can reach an
    audio token only through its own cross-attention): changing clip 0's caption changes clip 0's
    audio outputs, and leaves clip 1's (video and audio) as they were."""
    from dit_train.kernels import VarlenLayout
    from dit_train.models.dit import VideoDiT

    torch.manual_seed(0)
    model = VideoDiT(patch_dim=12, dim=32, depth=1, heads=4, mlp_ratio=2.0, text_dim=8, audio_dim=6).eval()
    for p in model.parameters():  # no zero-initialised output: every path carries signal
        torch.nn.init.normal_(p, std=0.3)
    seg = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    stream = torch.tensor([0, 0, 1, 1, 0, 1, 1])
    order = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    x, pos = torch.randn(7, 12), torch.zeros(7, 3, dtype=torch.long)
    ctx, other = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    other[1] = ctx[1]

    def run(context):
        return model(x, pos, seg, torch.tensor([0.3, 0.7]), VarlenLayout.build(seg, order, False), context=context,
                     context_len=torch.tensor([5, 4]), stream=stream)

    with torch.no_grad():
        a, b = run(ctx), run(other)
    audio0 = (seg == 0) & (stream == 1)
    assert (a[audio0] - b[audio0]).abs().max() > 1e-3
    assert torch.equal(a[seg == 1], b[seg == 1])


def test_each_tokens_error_is_the_mean_over_its_own_streams_features(av_cfg):
    """Rows are zero-padded to the wider stream (500 audio samples; a video patch has 2·8·8·3 =
    384 features): a token's MSE is over its own stream's features, not diluted by the padding."""
    import dataclasses

    from dit_train.batch import video_forward
    from dit_train.kernels import VarlenLayout
    from dit_train.models import build_model
    from dit_train.tasks import build_task

    c = av_cfg
    loss_cfg = dataclasses.replace(c.loss, weighting="none")
    task = build_task(c.mode, c.data, c.model, loss_cfg, c.train.seed)
    torch.manual_seed(0)
    model = build_model(c.model)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    batch = task.build(list(range(4)), 0)
    attn = VarlenLayout.build(batch.seg, batch.mask_order, batch.causal)
    with torch.no_grad():
        got = task.per_token_loss(model, batch, attn)
        out = video_forward(model, batch, attn).float()
    heard = batch.stream == 1
    assert heard.any() and (~heard).any()
    D, P = task.patch_dim, c.model.audio_patch
    assert D < P
    err = (out - batch.tokens["target"]).pow(2)
    torch.testing.assert_close(got[~heard], err[~heard, :D].mean(-1))
    torch.testing.assert_close(got[heard], err[heard, :P].mean(-1))


@pytest.mark.parametrize("given", ["video", "audio"])
def test_a_given_stream_is_clean_context_out_of_its_count(av_cfg, given):
    """cond.given_stream (probability 1 here): each clip with sound has the given stream's
    tokens clean (x = the clean patches / waveform), flagged clean (timestep 0) and weightless,
    so the clip is out of that stream's T_{b,s} and B_s; the other stream is a noisy target as
    before, and a clip without sound is untouched (video, weight 1)."""
    import copy

    from dit_train.tasks import build_task
    from dit_train.tasks.joint_audio import audio_tokens
    from dit_train.tasks.video import patchify

    c = copy.deepcopy(av_cfg)
    c.cond.given_stream, c.cond.given_stream_prob = given, 1.0
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed, cond=c.cond)
    ids = list(range(8))
    batch = task.build(ids, 0)
    s = 0 if given == "video" else 1
    w = batch.local_stream_weights(2)
    D, P = task.patch_dim, c.model.audio_patch
    heard = 0
    for k, sid in enumerate(batch.sample_ids.tolist()):
        item = task.dataset[sid]
        mine = batch.seg == k
        if item.audio is None:
            assert not bool(batch.tokens["clean"][mine].any()) and int(w[k, 0]) > 0 and int(w[k, 1]) == 0
            continue
        heard += 1
        gave = mine & (batch.stream == s)
        assert bool(batch.tokens["clean"][gave].all()) and not bool(batch.tokens["clean"][mine & ~gave].any())
        assert int(w[k, s]) == 0 and int(w[k, 1 - s]) > 0
        clean = patchify(item.pixels, task.patch)[0] if s == 0 else audio_tokens(item.audio, P)
        torch.testing.assert_close(batch.tokens["x"][gave][:, : clean.shape[1]], clean.float())
    assert heard > 0 and heard < len(ids)


@pytest.mark.slow
def test_cross_stream_conditioning_is_layout_exact(av_cfg, tmp_path_factory):
    """Half of the clips with sound given their video clean (video-to-audio), their audio tokens
    with the sync feature of those frames (model.sync_encoder: a per-token field that CP splits
    like the tokens), two steps on dp_shard=2 × cp_ulysses=2 against one process."""
    from tests.test_av_sync import random_encoder

    c = one_block(av_cfg)
    c.cond.given_stream, c.cond.given_stream_prob = "video", 0.5
    c.model.sync_encoder = random_encoder(tmp_path_factory.mktemp("sync"))
    got = run_cases({"v2a": Case(c, LAYOUTS["ulysses"])})
    assert_exact(*got["v2a"], "video-to-audio on " + LAYOUTS["ulysses"])


def test_each_audio_token_has_its_own_time(av_cfg):
    """The two-stream DiT's audio tokens sit at their own time (fractional, in temporal patches):
    the 8 tokens of a 2-frame patch (4 a frame at 8 fps) get 8 positions, each within the patch
    its first sample falls in, and the video keeps its integer positions. The same token content
    then gives different outputs at two tokens of one patch — one position for all of them (the
    old floor) made them interchangeable, so a click could not be put in one of them."""
    from dit_train.kernels import VarlenLayout
    from dit_train.models.dit import VideoDiT
    from dit_train.tasks import build_task
    from dit_train.tasks.joint_audio import audio_positions

    c = av_cfg
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed)
    batch = task.build(list(range(8)), 0)
    heard = 0
    for k in range(batch.num_samples):
        t_a = batch.pos[(batch.seg == k) & (batch.stream == 1), 0]
        t_v = batch.pos[(batch.seg == k) & (batch.stream == 0), 0]
        assert torch.equal(t_v, t_v.round()) and t_v.min() == 0
        if t_a.numel():
            heard += 1
            assert bool((t_a[1:] > t_a[:-1]).all()) and t_a.floor().max() <= t_v.max(), (t_a, t_v)
    assert heard > 0

    torch.manual_seed(0)
    model = VideoDiT(patch_dim=12, dim=32, depth=1, heads=4, mlp_ratio=2.0, audio_dim=6).eval()
    for p in model.parameters():  # no zero-initialised output: every path carries signal
        torch.nn.init.normal_(p, std=0.3)
    pos_a = audio_positions(8, 500, 8.0, 2)  # one temporal patch's 8 audio tokens
    assert pos_a[:, 0].unique().numel() == 8 and bool((pos_a[:, 0].floor() == 0).all())
    pos = torch.cat([torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]).float(), pos_a])
    seg, stream = torch.zeros(12, dtype=torch.long), torch.tensor([0] * 4 + [1] * 8)
    x = torch.cat([torch.randn(4, 12), torch.randn(1, 12).expand(8, 12)])  # the same content on every audio token
    with torch.no_grad():
        out = model(x, pos, seg, torch.tensor([0.9]), VarlenLayout.build(seg, torch.arange(12), False), stream=stream)
    assert (out[4] - out[8]).abs().max() > 1e-3  # frame 0's first token, frame 1's
