"""diffusers' LTX2VideoTransformer3DModel (LTX-2: video + audio) through our packed path (model.name=ltx2).

1. The packed model (clips of different sizes, each with its own number of audio tokens, one
   without audio, padding) equals diffusers' own forward run clip by clip, in fp64: both
   streams' outputs and every weight's gradient. Seen failing with the per-sample restriction of
   the audio<->video cross-attention removed (every video token attending every audio token of
   the pack): the video outputs differed by up to 1.2.
"""
from __future__ import annotations

import pytest
import torch

from dit_train.kernels import VarlenLayout
from dit_train.models import model_config
from dit_train.models.diffusers_family import to_diffusers
from dit_train.tasks.video import patchify
from tests.families import PATCH, random_model, assert_grads_match

SHAPES = [(2, 4, 6), (3, 2, 4), (1, 2, 2)]  # (F, H, W): 12, 6 and 1 video tokens
AUDIO = [5, 0, 3]  # audio tokens of each clip (the second has no sound)
AUDIO_PATCH = 6  # features of an audio token


def tiny_ltx2_cfg(**kw):
    # dim 36 / audio_dim 24: the RoPE's leftover channels (dim % 6, audio 24 % 2 ...) exercised
    base = dict(dim=36, heads=2, depth=2, text_dim=10, text_len=6, in_channels=4, patch_size=list(PATCH),
                init="normal", audio_patch=AUDIO_PATCH, audio_dim=24, audio_heads=2, fps=8.0, vae_scale=[1, 1, 1])
    return model_config("ltx2", **(base | kw))


def pack(clips, sounds, pad: int = 3):
    """x [L, max(video, audio features)], pos, seg, stream, order of clip k's video tokens, then its
    audio tokens (pos (j, 0, 0): j-th of its track), then `pad` padding tokens."""
    width = max(clips[0].shape[0] * PATCH[0] * PATCH[1] * PATCH[2], AUDIO_PATCH)
    widen = lambda y: torch.nn.functional.pad(y, (0, width - y.shape[1]))  # noqa: E731
    xs, pos, seg, stream, order = [], [], [], [], []
    for i, (c, a) in enumerate(zip(clips, sounds)):
        tk, grid = patchify(c, PATCH)
        n, m = tk.shape[0], a.shape[0]
        xs += [widen(tk), widen(a)]
        pos += [grid, torch.stack([torch.arange(m), torch.zeros(m, dtype=torch.long), torch.zeros(m, dtype=torch.long)], 1)]
        seg.append(torch.full((n + m,), i))
        stream.append(torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(m, dtype=torch.long)]))
        order.append(torch.arange(n + m))
    xs.append(torch.zeros(pad, width, dtype=clips[0].dtype))
    pos.append(torch.zeros(pad, 3, dtype=torch.long))
    seg.append(torch.full((pad,), -1))
    stream.append(torch.zeros(pad, dtype=torch.long))
    order.append(torch.arange(pad))
    return (torch.cat(xs), torch.cat(pos), torch.cat(seg), torch.cat(stream), torch.cat(order))


def test_packed_forward_and_grads_match_diffusers_per_clip():
    cfg = tiny_ltx2_cfg()
    ours = random_model(cfg).double()
    ref = to_diffusers(ours.state_dict(), cfg).double()  # diffusers' own module, same weights
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(4, *s, generator=g, dtype=torch.float64) for s in SHAPES]
    sounds = [torch.randn(n, AUDIO_PATCH, generator=g, dtype=torch.float64) for n in AUDIO]
    t = torch.tensor([0.3, 0.85, 0.6])
    context = torch.randn(3, 5, 10, generator=g, dtype=torch.float64)
    context_len = torch.tensor([3, 5, 2])
    x, pos, seg, stream, order = pack(clips, sounds)
    out = ours(x, pos, seg, t, VarlenLayout.build(seg, order, causal=False), context, context_len, stream=stream)

    from diffusers import LTX2Pipeline

    loss_ours, loss_ref, off = 0.0, 0.0, 0
    for i, (clip, sound) in enumerate(zip(clips, sounds)):
        tokens = LTX2Pipeline._pack_latents(clip[None], PATCH[1], PATCH[0])  # [1, n, C·pt·p·p]
        n, m = tokens.shape[1], sound.shape[0]
        mask = (torch.arange(5) < context_len[i]).long()[None]
        # LTX2Pipeline's call: timestep = 1000·t for both streams, the caption padding masked; a
        # clip without sound: one dummy audio token and the cross-modal attention off (nothing to hear)
        audio = sound[None] if m else torch.zeros(1, 1, AUDIO_PATCH, dtype=torch.float64)
        theirs_v, theirs_a = ref(tokens, audio, context[i:i + 1], context[i:i + 1], t[i:i + 1] * 1000,
                                 encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                                 num_frames=clip.shape[1], height=clip.shape[2], width=clip.shape[3], fps=8.0,
                                 audio_num_frames=max(m, 1), isolate_modalities=m == 0, return_dict=False)
        mine_v, mine_a = out[off:off + n, :tokens.shape[2]], out[off + n:off + n + m, :AUDIO_PATCH]
        off += n + m
        torch.testing.assert_close(mine_v, theirs_v[0], rtol=1e-10, atol=1e-10)
        if m:
            torch.testing.assert_close(mine_a, theirs_a[0], rtol=1e-10, atol=1e-10)
        for mine, theirs in ((mine_v, theirs_v[0]), (mine_a, theirs_a[0][:m])):
            probe = torch.randn(theirs.shape, generator=g, dtype=torch.float64)
            loss_ours = loss_ours + (mine * probe).sum()
            loss_ref = loss_ref + (theirs * probe).sum()
    assert torch.isfinite(out[off:]).all()  # padding tokens: finite, ignored

    loss_ours.backward()
    loss_ref.backward()
    assert {n for n, _ in ref.named_parameters()} == {n for n, _ in ours.named_parameters()}  # diffusers' state dict
    assert_grads_match(ours, ref, rel=1e-9)


def same_outputs(cfg, weights, diffusers_model, sound: int = 7):
    """Our packed model with `weights` vs `diffusers_model` on one 4x16x24 pixel clip with `sound`
    audio tokens: max |diff| / max over both streams (tests/test_diffusers_families.py)."""
    from dataclasses import replace

    from diffusers import LTX2Pipeline

    from dit_train.models import build_model

    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(cfg.in_channels, 4, 16, 24, generator=g)
    audio = torch.randn(sound, cfg.audio_patch, generator=g)
    ctx = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g)
    patch = tuple(cfg.patch_size)
    tok, grid = patchify(clip, patch)
    n, width = tok.shape[0], max(tok.shape[1], cfg.audio_patch)
    x = torch.cat([torch.nn.functional.pad(tok, (0, width - tok.shape[1])),
                   torch.nn.functional.pad(audio, (0, width - cfg.audio_patch))])
    pos = torch.cat([grid, torch.stack([torch.arange(sound), torch.zeros(sound, dtype=torch.long),
                                        torch.zeros(sound, dtype=torch.long)], 1)])
    seg = torch.zeros(n + sound, dtype=torch.long)
    stream = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(sound, dtype=torch.long)])
    with torch.no_grad():
        mine = ours(x, pos, seg, torch.tensor([0.4]), VarlenLayout.build(seg, torch.arange(n + sound), False), ctx,
                    torch.tensor([ctx.shape[1]]), stream=stream)
        video, sound_out = diffusers_model(LTX2Pipeline._pack_latents(clip[None], patch[1], patch[0]), audio[None], ctx,
                                           ctx, torch.tensor([400.0]), num_frames=4, height=16, width=24, fps=cfg.fps,
                                           audio_num_frames=sound, return_dict=False)
    theirs = torch.cat([video[0].flatten(), sound_out[0].flatten()])
    got = torch.cat([mine[:n, :tok.shape[1]].flatten(), mine[n:, :cfg.audio_patch].flatten()])
    return float((got - theirs).abs().max() / theirs.abs().max())


def test_pretrained_of_another_size_or_family_is_refused_from_its_config(tmp_path):
    """model.pretrained is checked from config.json alone (no weights read, before any worker
    starts): an LTX-2 folder of another audio width, and an LTX-Video folder, are one line each."""
    from dataclasses import replace

    from dit_train.models import model_spec
    from tests.families import pretrained_folder

    cfg = tiny_ltx2_cfg()
    folder = pretrained_folder(replace(cfg, audio_heads=4, audio_dim=32), tmp_path / "wide").parent
    (line,) = model_spec(cfg).checks(replace(cfg, pretrained=str(folder)))
    assert "audio_num_attention_heads=4 (model.audio_heads gives 2)" in line, line
    assert model_spec(cfg).checks(replace(cfg, pretrained=str(pretrained_folder(cfg, tmp_path / "same").parent))) == []
    ltx = model_config("ltx", dim=32, heads=2, depth=1, text_dim=10, in_channels=4, patch_size=list(PATCH))
    (line,) = model_spec(cfg).checks(replace(cfg, pretrained=str(pretrained_folder(ltx, tmp_path / "ltx").parent)))
    assert "holds a LTXVideoTransformer3DModel, not an LTX2VideoTransformer3DModel" in line, line


def test_audio_heads_that_ulysses_cannot_split_are_refused_before_the_run():
    """model.audio_heads (LTX-2's audio and audio<->video attention) must divide by cp_ulysses,
    like model.heads: one error line before any worker starts, not a ValueError in the first
    attention."""
    from dit_train.compose import compose
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError, match=r"model.audio_heads=3 must be divisible by parallel.cp_ulysses=2"):
        check_config(compose(["model=ltx2_tiny", "data.audio=true", "model.audio_heads=3", "model.audio_dim=48",
                              "parallel.cp_ulysses=2", "parallel.dp_shard=1"]))


def test_a_pack_without_audio_keeps_its_width():
    """A training pack (stream given) whose clips have no sound — e.g. a rank's micro-batch of
    silent films, or its empty one — is only as wide as the video: the output must be too (the
    loss compares it with the pack's target). Audio (24 features) wider than video (16)."""
    cfg = tiny_ltx2_cfg(audio_patch=24)
    ours = random_model(cfg)
    g = torch.Generator().manual_seed(0)
    for shapes in ([(2, 4, 6), (1, 2, 2)], []):  # silent films; an empty pack (padding only)
        clips = [torch.randn(4, *s, generator=g) for s in shapes]
        x, pos, seg, stream, order = pack(clips, [torch.zeros(0, 16)] * len(clips)) if clips else (
            torch.zeros(3, 16), torch.zeros(3, 3, dtype=torch.long), torch.full((3,), -1),
            torch.zeros(3, dtype=torch.long), torch.arange(3))
        S = max(1, len(clips))
        out = ours(x, pos, seg, torch.full((S,), 0.5), VarlenLayout.build(seg, order, causal=False),
                   torch.randn(S, 5, 10, generator=g), torch.full((S,), 5), stream=stream)
        assert out.shape == x.shape, (shapes, tuple(out.shape), tuple(x.shape))
