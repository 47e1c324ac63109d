"""diffusers' MiniMaxH3Transformer3DModel (MiniMax-H3: caption, audio and video tokens of a clip in
one sequence) through our packed path (model.name=minimax_h3).

1. The packed model (clips of different sizes, each with its caption's valid tokens as text slots
   and its own number of audio tokens, one without audio, padding) equals diffusers' own forward
   run clip by clip on the layout diffusers' modular pipeline builds (its
   `build_packed_sequence`: positions, tags, row order), in fp64: both streams' outputs (sign
   flipped: MiniMax predicts x0 − ε) and every weight's gradient, within 1e-6 (the rotary angles
   are float32 in both, from positions computed in another order).
2. A folder of another size is refused from its config.json; context parallelism is refused
   before the run.
"""
from __future__ import annotations

import math

import pytest
import torch

from dit_train.kernels import VarlenLayout
from dit_train.models import model_config
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.tasks.joint_audio import join_audio_tokens
from dit_train.tasks.joint_text import join_text_tokens
from dit_train.tasks.video import pack_clips
from tests.families import assert_grads_match, PATCH, pretrained_folder, random_model

SHAPES = [(2, 4, 6), (3, 2, 4), (7, 2, 2)]  # (F, H, W) latents: 12, 6 and 7 video tokens (7 frames: into the clock's 2nd period)
AUDIO = [5, 0, 3]  # audio tokens of each clip (the second has no sound)
TEXT = [3, 6, 1]  # valid caption tokens of each clip
AUDIO_PATCH, TEXT_DIM, C = 6, 10, 4


def tiny_cfg(**kw):
    base = dict(dim=32, heads=2, head_dim=16, ffn_dim=48, depth=2, refiner_depth=1, text_dim=TEXT_DIM, text_len=6,
                in_channels=C, patch_size=list(PATCH), init="normal", audio_patch=AUDIO_PATCH, freq_dim=16,
                time_hidden=24, time_dim=20, rope_freq_dim=2)
    return model_config("minimax_h3", **(base | kw))


def diffusers_call(ref, clip, sound, ctx, t, patch=PATCH):
    """diffusers' forward on one clip as its pipeline lays it out ([text | audio | video], one mono
    audio channel, every row at MiniMax timestep 1 − t): (video rows [Nv, C·vol], audio rows [Na, P])."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, patchify_video_latents

    _, F, H, W = clip.shape
    # the pipeline counts latent frames (its patch is (1, 2, 2)); a temporal patch pt > 1 is one of ours
    pos, tags, iv, ia, it, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(ctx.shape[0], dtype=torch.long), F // patch[0], H, W, sound.shape[0], patch, 1, audio_tag=2, video_tag=0)
    out = ref(hidden_states=patchify_video_latents(clip[None], patch)[None], audio_hidden_states=sound[None],
              encoder_hidden_states=ctx[None], timestep=(1 - t).reshape(1), timestep_indices=torch.zeros_like(tags),
              token_tags=tags, position_ids=pos, video_indices=iv, audio_indices=ia, text_indices=it)
    return out.sample[0], out.audio_sample[0]


def packed(model, clips, sounds, ctx, ctx_len, t, patch=PATCH, pad: int = 8):
    """Our forward on one pack of the clips (video, then audio tokens (j, 0, 0), then caption
    slots; padded to a multiple of `pad`): (output [L, width], the pack)."""
    index = lambda n: torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)], 1)  # noqa: E731
    batch = pack_clips({"x": clips}, patch, clips[0].shape[0] * math.prod(patch), {}, torch.arange(len(clips)))
    batch = join_audio_tokens(batch, sounds, None, [index(s.shape[0]) for s in sounds])
    batch = join_text_tokens(batch, ctx_len).pad_to_multiple(pad)  # padding tokens too
    meta = VarlenLayout.build(batch.seg, batch.order, causal=False)
    assert meta.cu_seqlens is not None  # each clip's video, audio and text: one contiguous run
    return model(batch.tokens["x"], batch.pos, batch.seg, t, meta, ctx, ctx_len, stream=batch.stream,
                 text=batch.tokens["text"]), batch


def same_outputs(cfg, weights, diffusers_model, sound: int = 7):
    """Our packed model with `weights` vs `diffusers_model` on one 4x16x24 pixel clip with `sound`
    audio tokens and a 5-token caption: max |diff| / max over both streams
    (tests/test_diffusers_families.py)."""
    from dataclasses import replace

    from dit_train.models import build_model

    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(cfg.in_channels, 4, 16, 24, generator=g)
    audio = torch.randn(sound, cfg.audio_patch, generator=g)
    ctx, t, patch = torch.randn(1, 5, cfg.text_dim, generator=g), torch.tensor([0.4]), tuple(cfg.patch_size)
    with torch.no_grad():
        out, batch = packed(ours, [clip], [audio], ctx, torch.tensor([5]), t, patch)
        video, sound_out = diffusers_call(diffusers_model, clip, audio, ctx[0], t[0], patch)
    text, stream = batch.tokens["text"], batch.stream
    mine = torch.cat([out[(batch.seg == 0) & (text == 0) & (stream == 0)][:, : video.shape[1]].flatten(),
                      out[(batch.seg == 0) & (stream == 1)][:, : cfg.audio_patch].flatten()])
    theirs = -torch.cat([video.flatten(), sound_out.flatten()])
    return float((mine - theirs).abs().max() / theirs.abs().max())


def test_packed_forward_and_grads_match_diffusers_per_clip():
    cfg = tiny_cfg()
    ours = random_model(cfg).double()
    ref = to_diffusers(ours.state_dict(), cfg).double()  # diffusers' own module, same weights
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(C, *s, generator=g, dtype=torch.float64) for s in SHAPES]
    sounds = [torch.randn(n, AUDIO_PATCH, generator=g, dtype=torch.float64) for n in AUDIO]
    ctx = torch.randn(3, 6, TEXT_DIM, generator=g, dtype=torch.float64)  # garbage past each valid length
    ctx_len, t = torch.tensor(TEXT), torch.tensor([0.3, 0.85, 0.6], dtype=torch.float64)
    out, batch = packed(ours, clips, sounds, ctx, ctx_len, t)
    text, stream = batch.tokens["text"], batch.stream
    assert stream.shape == text.shape and int(batch.weight_units()[text > 0].sum()) == 0  # slots weigh nothing
    assert torch.equal(out[text > 0], torch.zeros_like(out[text > 0]))

    loss_ours, loss_ref = 0.0, 0.0
    for i, clip in enumerate(clips):
        video, audio = diffusers_call(ref, clip, sounds[i], ctx[i, :TEXT[i]], t[i])
        mine_v = out[(batch.seg == i) & (text == 0) & (stream == 0)][:, : video.shape[1]]
        mine_a = out[(batch.seg == i) & (stream == 1)][:, :AUDIO_PATCH]
        torch.testing.assert_close(mine_v, -video, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine_a, -audio, rtol=1e-6, atol=1e-6)
        for mine, theirs in ((mine_v, -video), (mine_a, -audio)):
            probe = torch.randn(theirs.shape, generator=g, dtype=torch.float64)
            loss_ours, loss_ref = loss_ours + (mine * probe).sum(), loss_ref + (theirs * probe).sum()
    pad = batch.seg < 0
    assert pad.any() and torch.isfinite(out[pad]).all()
    loss_ours.backward()
    loss_ref.backward()
    assert_grads_match(ours, ref, rel=1e-6)


def test_pretrained_folder_reads_and_another_size_is_refused(tmp_path):
    cfg = tiny_cfg()
    path = pretrained_folder(cfg, tmp_path)
    state = read_pretrained(str(tmp_path), cfg)
    assert state.keys() == random_model(cfg).state_dict().keys()
    assert "hidden_size=32 (model.dim gives 48)" in str(pytest.raises(ValueError, read_pretrained, str(path),
                                                                       tiny_cfg(dim=48)).value)
