"""An exported LTX-2 run samples with sound in diffusers' LTX2Pipeline (issue 49).

`ltx2_tiny` trains 2 steps on the embedded world with sound (full weights; and LoRA on both
streams), `tools.export_weights --diffusers` writes it (the LoRA run: its base and its adapter
file), and LTX2Pipeline built from tiny random components (video VAE, audio VAE, vocoder, text
connectors; nothing downloaded: the captions are given as prompt_embeds, no Gemma) runs 2
steps of it at guidance 2: video frames and a stereo waveform of the lengths the pipeline's
components give. Every transformer call the pipeline makes (CFG's negative and positive rows:
two clips of one pack for ours) is compared with our packed forward of the run's weights on the
same inputs (the pipeline's latents, timestep, RoPE coordinates from frame_rate, caption
embeddings), both streams: this is what fails when the export's keys are wrong (seen
failing with the export's audio self- and text-attention weights swapped, same shapes: the
audio output off by 0.18 of its largest value, the video by 2e-5 through the a2v attention).

The export is a pipeline's transformer only when it has LTX-2's token layout: patch [1, 1, 1]
(LTX2Pipeline packs latents of transformer.config.in_channels with its patch_size, which our
export's in_channels already multiply), the video VAE's latent channels as model.in_channels, the
audio VAE's latent_channels x mel_bins / 4 as model.audio_patch, the VAE's compression as
model.vae_scale and model.fps as the pipeline's frame_rate. The tiny run below is shaped so; the
pictures and sound it makes are noise (it learnt 3-channel pixels and raw waveform samples, not the
VAEs' latents: docs/audio-video.md).
"""
from __future__ import annotations

import math

import pytest
import torch

from dit_train.kernels import VarlenLayout
from dit_train.tasks.video import patchify

CAPTION = 32  # the transformer's caption_channels (model.text_dim): the connectors' output width
LAYERS = 2  # "text encoder layers" the connectors read (prompt_embeds: [B, Lc, CAPTION x LAYERS])
MEL_BINS, AUDIO_LATENT = 64, 8  # audio VAE: 64 mel bins / 4 x 8 latent channels = 128 features a token
UPSAMPLE = [8, 4, 5]  # vocoder: 160 waveform samples a mel frame (the audio VAE's hop): 16 kHz out
FRAMES, SIZE, FPS = 9, 32, 8.0  # what the pipeline generates: 9 frames of 32 x 32 at the world's 8 fps


def tiny_components() -> dict:
    """LTX2Pipeline's components other than the transformer, tiny and random (seeded)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    # 3 latent channels (the run's in_channels), 2x in time (after the first frame) and space
    vae = AutoencoderKLLTX2Video(in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8,),
                                 decoder_block_out_channels=(8,), layers_per_block=(1,),
                                 decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
                                 decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
                                 downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
                                 timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
                                 decoder_causal=False)
    # the pipeline normalises the packed audio tokens with latents_mean/std of base_channels values
    audio_vae = AutoencoderKLLTX2Audio(base_channels=AUDIO_LATENT * MEL_BINS // 4, ch_mult=(1,), num_res_blocks=1,
                                       resolution=32, latent_channels=AUDIO_LATENT, mel_bins=MEL_BINS)
    # kernel - factor even in every upsampling: exactly factor x the length (as LTX-2's own vocoder)
    vocoder = LTX2Vocoder(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2,
                          upsample_kernel_sizes=[16, 8, 15], upsample_factors=UPSAMPLE, resnet_kernel_sizes=[3],
                          resnet_dilations=[[1, 3, 5]], output_sampling_rate=16000)
    heads = dict(num_attention_heads=2, attention_head_dim=CAPTION // 2, num_layers=1, num_learnable_registers=None)
    connectors = LTX2TextConnectors(caption_channels=CAPTION, text_proj_in_factor=LAYERS,
                                    connector_rope_base_seq_len=32, rope_double_precision=False,
                                    **{f"{s}_connector_{k}": v for s in ("video", "audio") for k, v in heads.items()})
    # our runs feed both streams one caption embedding (PackedLTX2's context): the audio connector
    # is the video one, so the pipeline's two streams read what training gave them
    connectors.audio_connector.load_state_dict(connectors.video_connector.state_dict())
    return dict(vae=vae, audio_vae=audio_vae, vocoder=vocoder, connectors=connectors,
                scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None)


def packed_denoiser(model: torch.nn.Module, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our packed forward on the inputs of one LTX2VideoTransformer3DModel call of the pipeline (its
    keyword arguments): its B batch rows (under CFG the negative and the positive caption) are B
    clips of one pack. Returns (video [B, n, C], audio [B, m, audio_patch]) as the call does."""
    from diffusers import LTX2Pipeline

    video, audio = call["hidden_states"], call["audio_hidden_states"]  # [B, n, C] (patch 1), [B, m, A]
    latents = LTX2Pipeline._unpack_latents(video, call["num_frames"], call["height"], call["width"])  # [B, C, F, H, W]
    B, (n, m) = video.shape[0], (video.shape[1], audio.shape[1])
    width = max(video.shape[2], audio.shape[2])
    zeros = torch.zeros(m, dtype=torch.long)
    xs, pos = [], []
    for b in range(B):
        tok, grid = patchify(latents[b], (1, 1, 1))
        assert torch.equal(tok, video[b])  # the pipeline's token order is ours
        xs += [torch.nn.functional.pad(tok, (0, width - tok.shape[1])),
               torch.nn.functional.pad(audio[b], (0, width - audio.shape[2]))]
        pos += [grid, torch.stack([torch.arange(m), zeros, zeros], 1)]  # an audio token: its index in the track
    assert torch.equal(call["encoder_hidden_states"], call["audio_encoder_hidden_states"])  # tied connectors
    assert bool(call["encoder_attention_mask"].bool().all())  # every caption slot valid: context_len = Lc
    seg = torch.arange(B).repeat_interleave(n + m)
    stream = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(m, dtype=torch.long)]).repeat(B)
    ctx = call["encoder_hidden_states"]  # [B, Lc, CAPTION]
    layout = VarlenLayout.build(seg, torch.arange(n + m).repeat(B), False)
    with torch.no_grad():
        out = model(torch.cat(xs), torch.cat(pos), seg, call["timestep"].float() / 1000, layout, ctx,
                    torch.full((B,), ctx.shape[1]), stream=stream).view(B, n + m, width)
    return out[:, :n, :video.shape[2]], out[:, n:, :audio.shape[2]]


def run_pipeline(transformer, lora=None):
    """LTX2Pipeline with `transformer` (and `lora`, a folder of adapters) for 2 steps at guidance 2:
    (the pipeline, its output, [(kwargs, (video, audio))] of each transformer call)."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline(transformer=transformer, **tiny_components())
    if lora is not None:
        pipe.load_lora_weights(str(lora))
        assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda mod, args, kw, out: calls.append((kw, out)),
                                                  with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    emb, negative = torch.randn(2, 1, 16, CAPTION * LAYERS, generator=g)
    mask = torch.ones(1, 16, dtype=torch.long)
    # classifier-free guidance on both streams (one transformer call a step on [negative, positive]);
    # STG and modality isolation off: our forward has no perturbed blocks nor isolation on demand
    guidance = dict(guidance_scale=2.0, audio_guidance_scale=2.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                    spatio_temporal_guidance_blocks=None)
    with torch.no_grad():
        out = pipe(prompt_embeds=emb, prompt_attention_mask=mask, negative_prompt_embeds=negative,
                   negative_prompt_attention_mask=mask, height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=FPS,
                   num_inference_steps=2, output_type="pt", generator=g, **guidance)
    hook.remove()
    return pipe, out, calls


BASE = ["model=ltx2_tiny", "model.text_len=16", "data.audio=true", "model.patch_size=[1,1,1]",
        f"model.text_dim={CAPTION}", f"model.audio_patch={AUDIO_LATENT * MEL_BINS // 4}", "model.vae_scale=[2,2,2]",
        f"model.fps={FPS}", "train.steps=2", "train.global_batch=2", "train.micro_batch_tokens=0", "train.ckpt_every=2",
        # the training clips need not be the pipeline's 9 x 32 x 32: 2 frames of 32 x 16 (1024 tokens a
        # clip, not 4 x 32 x 32's 4096) train every weight the export maps (25.6 -> 13.2 CPU-s)
        "data.widths=[32]", "data.heights=[16]", "data.max_frames=2"]


@pytest.mark.slow  # two tiny trainings: ~13 CPU-s on the shared 2-core machine
def test_an_exported_ltx2_run_samples_video_and_sound_in_ltx2pipeline(data_cache, tmp_path, capsys):
    from diffusers import LTX2VideoTransformer3DModel

    from dit_train.checkpoint import find_checkpoint
    from dit_train.checkpoint.export import checkpoint_model
    from dit_train.tools.export_weights import main as export
    from tests.conftest import TINY, train_in_process

    base = [BASE[0], *TINY, *BASE[1:]]
    train_in_process(base, tmp_path / "full", cache_dir=data_cache)
    assert export([str(tmp_path / "full"), "--diffusers", str(tmp_path / "full_dif")]) == 0
    train_in_process([*base, "model.lora.rank=2"], tmp_path / "lora", cache_dir=data_cache)
    assert export([str(tmp_path / "lora"), "--base", "--diffusers", str(tmp_path / "lora_base")]) == 0
    assert export([str(tmp_path / "lora"), "--diffusers", str(tmp_path / "lora_dif")]) == 0
    assert "note: " not in capsys.readouterr().out  # pipeline-shaped: no "no LTX2Pipeline transformer" note
    runs = {"full": (tmp_path / "full", tmp_path / "full_dif", None),
            "lora": (tmp_path / "lora", tmp_path / "lora_base", tmp_path / "lora_dif")}
    videos = {}
    for name, (run, folder, lora) in runs.items():
        transformer = LTX2VideoTransformer3DModel.from_pretrained(str(folder))
        pipe, out, calls = run_pipeline(transformer, lora)
        assert list(transformer.config.vae_scale_factors) == [pipe.vae_temporal_compression_ratio,
                                                              pipe.vae_spatial_compression_ratio,
                                                              pipe.vae_spatial_compression_ratio]
        # the pictures: FRAMES decoded frames; the sound: the audio latents of FRAMES / FPS seconds (25 a
        # second), each 4 mel frames (the first 1: causal), each 160 samples at 16 kHz, stereo
        latents = round(FRAMES / FPS * 16000 / 160 / 4)
        assert out.frames.shape == (1, FRAMES, 3, SIZE, SIZE) and bool(torch.isfinite(out.frames).all()), name
        assert out.audio.shape == (1, 2, ((latents - 1) * 4 + 1) * math.prod(UPSAMPLE)), (name, out.audio.shape)
        assert bool(torch.isfinite(out.audio).all()) and float(out.audio.abs().max()) > 0, name
        # the denoiser the pipeline ran is the run's: our packed forward on each call's inputs
        _, ours = checkpoint_model(find_checkpoint(run))
        assert len(calls) == 2 and all(kw["hidden_states"].shape[0] == 2 for kw, _ in calls)  # CFG's 2 rows
        for kw, (theirs_v, theirs_a) in calls:
            mine_v, mine_a = packed_denoiser(ours.float().eval(), kw)
            for mine, theirs in ((mine_v, theirs_v), (mine_a, theirs_a)):
                err = float((mine - theirs).abs().max() / theirs.abs().max())
                assert err <= 1e-5, (name, float(kw["timestep"][0]), err)
        videos[name] = out.frames
    assert float((videos["full"] - videos["lora"]).abs().max()) > 1e-4  # two different transformers


def test_an_export_ltx2pipeline_cannot_use_says_so(tmp_path, capsys):
    """`export_weights --diffusers` of an LTX-2 run whose patch is not [1, 1, 1] (ltx2_tiny's
    [2, 8, 8]) writes the folder (it loads with from_pretrained) and prints one note that it is no
    LTX2Pipeline transformer; LTX-2's own shape (ltx2_19b) gets none."""
    from dit_train.checkpoint import save_safetensors
    from dit_train.config import to_yaml
    from dit_train.models import build_model
    from dit_train.models.ltx2 import LTX2
    from dit_train.tools.export_weights import main as export
    from tests.conftest import compose_config

    cfg = compose_config(["model=ltx2_tiny", "data.audio=true"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))
    save_safetensors(build_model(cfg.model).state_dict(), tmp_path / "run" / "weights.safetensors")
    assert export([str(tmp_path / "run" / "weights.safetensors"), "--diffusers", str(tmp_path / "dif")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "model.patch_size=[2, 8, 8]" in notes[0] and "LTX2Pipeline" in notes[0], notes
    assert (tmp_path / "dif" / "config.json").is_file()
    assert LTX2.export_notes(compose_config(["model=ltx2_19b"]).model) == []
