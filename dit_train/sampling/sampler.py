"""A flow-matching Euler sampler over packed clips, CP-aware.

All ranks run the same sampling (FSDP needs every shard holder in each forward, and under CP
each rank computes its share of the tokens). What is sampled is a list of `SampleRequest`s:
a clip shape, a caption (and its embedding) and a noise id. Validation takes the first
`train.num_samples` readable clips of the dataset (their sizes and captions), so successive
validations are comparable; `python -m dit_train.tools.sample` takes the user's prompts. The
starting noise of a request comes from the "sampling" random stream of (seed, noise id): any
layout produces the same videos. The time grid and the Euler update are diffusers'
`FlowMatchEulerDiscreteScheduler` (sigma = our t, timestep = 1000·t, x ← x + (σ' − σ)·v),
or with `stochastic` its stochastic step (x̂0 = x − σ·v re-noised to σ' with fresh noise:
x ← (1 − σ')·x̂0 + σ'·ε, the noise drawn from the "sampling" stream of (seed, noise id, step),
so it too is the same on every layout), shifted like training (`loss.timestep_shift`, and
with `loss.shift_reference_tokens` each clip by the shift of its own token count: see
`schedulers`).
With `guidance_scale` > 1 and captions, each clip is packed twice — with its caption and with
the empty caption — and v = v_uncond + g·(v_cond − v_uncond) (classifier-free guidance). A
model of two experts (Wan 2.2 A14B, `boundary` > 0) takes g = `guidance_scale` while a clip's
t >= boundary (the high-noise expert) and `guidance_scale_2` below, as diffusers' WanPipeline.
A conditioned model (`inputs.feed`, tasks/conditioning.py) gets each request's given frames at
every step: with the timestep feed they are put back clean (x = the given frames, timestep 0)
before every model call and in the result; with the concat feed they arrive as the extra input
channels (zeros and an all-zero mask for a request without given frames). Both CFG branches
see them (only the caption is dropped), as Wan's image-to-video pipelines do. A model trained
with a control video (cond.control) gets each request's `control` as more input channels at
every step, in both branches too.
A model with an audio stream (model.audio_patch > 0) generates each clip's sound with its
pictures: its audio tokens follow its video tokens in every pack, at the clip's noise level, and
step with their own scheduler of the same sigmas (sampling/sound.py); `sounds` holds the result.
A request may give one of the two streams (`given_video`: video-to-audio, `given_sound`:
audio-to-video, a run trained with cond.given_stream): the given stream's tokens are in every
pack clean, flagged clean (timestep 0, as training gives them: tasks/video.py) in both guidance
branches, and never stepped; it comes back bit for bit.
A model with a sync encoder (model.sync_encoder, tasks/av_sync.py) reads the frame events of a
clean picture through its audio tokens: a given video's at every step (in the captioned branch
only: the guidance branch gets zeros, so guidance amplifies the events); a request that gives
neither stream gets its pictures first (with a sound the model makes without them), then its
sound again from those pictures, as a video-to-audio request (`sound_from_pictures`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm
import torch
import torch.distributed as dist

from dit_train.batch import PackedBatch, video_forward
from dit_train.data_pipelines.audio_features import decode
from dit_train.objectives.flow_matching import PipelineShift, sample_shift, velocity_from_output
from dit_train.parallel.context_parallel import split_for_cp
from dit_train.parallel.mesh import ParallelContext
from dit_train.rng import sample_generator
from dit_train.tasks.captions import pad_contexts
from dit_train.tasks.conditioning import ClipInputs, clip_inputs, i2v_inputs
from dit_train.sampling.sound import sound_noise, sound_tokens, start_sound
from dit_train.tasks.av_sync import clip_sync
from dit_train.tasks.joint_audio import audio_positions, join_audio_tokens
from dit_train.tasks.joint_text import join_text_tokens, video_rows
from dit_train.tasks.video import num_patches, pack_clips, unpatchify
from dit_train.tasks.video_inputs import VideoInputs
from dit_train.kernels import VarlenLayout

log = logging.getLogger(__name__)


@dataclass
class SampleRequest:
    """One clip to generate.

    key: name of the outputs (`sample_<id>` for dataset clips, `prompt_<k>` for prompts).
    shape: (C, F, H, W) in model space (pixels, or latents for latent-cache runs).
    caption: the text; context: its embedding [Lt, text_dim] (None for unconditional models).
    noise_id: picks the starting noise (sampling stream of (seed, noise_id)).
    fps: frame rate of the written video.
    still: a still image (its clip repeats one frame to fill a temporal patch; scored as an image).
    given: [C, F, H, W] a clip holding the given frames (conditioning), or None (unconditioned);
    given_patches: [F/pt] bool which temporal patches of `given` are given (the rest is generated).
    control: [C, F, H, W] the control video (a model trained with cond.control), or None.
    cond_latents: [C, F, H, W] Wan 2.1 I2V's condition latents (the VAE encoding of [image, zeros...]),
    image: [Li, image_dim] its CLIP image tokens; None unless the model has that layout.
    given_video: [C, F, H, W] the clip's frames given clean (video-to-audio, a run trained with
    cond.given_stream=video): only its sound is generated, the frames come back unchanged.
    given_sound: [n, audio_patch] the clip's sound tokens given clean (audio-to-video,
    cond.given_stream=audio; n = sound_tokens of its frames): only its frames are generated.
    """

    key: str
    shape: tuple[int, int, int, int]
    caption: str
    context: torch.Tensor | None
    noise_id: int
    fps: float = 8.0
    still: bool = False
    given: torch.Tensor | None = None
    given_patches: torch.Tensor | None = None
    control: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None
    image: torch.Tensor | None = None
    given_video: torch.Tensor | None = None
    given_sound: torch.Tensor | None = None


def dataset_requests(task: Any, num: int, fps: Callable[[int], float] | None = None,
                     still: Callable[[int], bool] | None = None) -> list[SampleRequest]:
    """The first `num` readable samples of the task's dataset (sizes, captions); when it holds
    both still images and clips, up to half of them are stills (both kinds get scored)."""
    order = list(range(len(task.dataset)))
    if still is not None:
        stills = [i for i in order if still(i)]
        clips = [i for i in order if not still(i)]
        if stills and clips:
            half = min(len(stills), num // 2)
            order = clips[: num - half] + stills[:half] + clips[num - half:] + stills[half:]
    out = []
    for sid in order:
        if len(out) == num:
            break
        try:
            item = task.dataset[sid]
        except Exception as err:  # noqa: BLE001 - an unreadable clip is skipped here as in training
            log.warning("validation: skipping sample %d (%s)", sid, err)
            continue
        emb = task.caption_embedding(item) if task.text_dim else None
        out.append(SampleRequest(f"sample_{sid}", tuple(item.pixels.shape), item.caption, emb, sid,
                                 fps(sid) if fps else 8.0, bool(still and still(sid))))
    return out


def source_requests(task: Any, source: Any, num: int) -> list[SampleRequest]:
    """`dataset_requests` with the data source's frame rate and still-image flag per sample:
    the clips validation samples (and `tools.sample --data-captions`)."""
    inner = getattr(task.dataset, "dataset", task.dataset)  # through the background prefetcher
    return dataset_requests(task, num, lambda i: source.fps(inner, i), lambda i: source.is_still(inner, i))


def pipeline_shift(model_cfg: Any) -> PipelineShift | None:
    """The token-count schedule of the model's diffusers pipeline when its config asks to sample
    with it (LTX: model.pipeline_shift), else None (the run's loss.timestep_shift)."""
    return model_cfg.pipeline_schedule() if hasattr(model_cfg, "pipeline_schedule") else None


def sampling_boundary(model_cfg: Any) -> float:
    """The flow time where a model of two experts switches (Wan 2.2 A14B's model.expert=both:
    model.boundary_ratio), 0 for a model of one transformer."""
    return model_cfg.sampling_boundary() if hasattr(model_cfg, "sampling_boundary") else 0.0


def run_sampling(cfg: Any) -> dict[str, Any]:
    """The VideoSampler keywords of a run's own sampler (its validation's): the training shift,
    the stochastic step, the second expert's guidance and boundary, the pipeline's schedule."""
    return dict(shift=cfg.loss.timestep_shift, shift_reference_tokens=cfg.loss.shift_reference_tokens,
                stochastic=cfg.train.stochastic_sampling, guidance_scale_2=cfg.train.guidance_scale_2,
                boundary=sampling_boundary(cfg.model), pipeline=pipeline_shift(cfg.model))


@torch.no_grad()
def predict_velocity(model: torch.nn.Module, batch: PackedBatch, ctx: ParallelContext) -> torch.Tensor:
    """The model's output for every token of a full pack: [L, patch_dim] on every rank (the
    velocity, or x̂0 for a model with model.prediction=x0: see `velocity_from_output`).

    Under CP each rank runs its share of the pack (the same split as training) and the shares
    are all-gathered over the CP group (`ctx.cp_group`) to rebuild the whole pack. This is
    evaluation, not the loss path, so the collective lives here.
    """
    L = batch.num_tokens
    cp = ctx.dims.cp
    if cp > 1:
        local, attn = split_for_cp(batch, cp, ctx.cp_rank, "contiguous")
        attn = attn.to(ctx.device)
        local = local.to(ctx.device)
        out = video_forward(model, local, attn).float()
        shares = [torch.empty_like(out) for _ in range(cp)]
        dist.all_gather(shares, out.contiguous(), group=ctx.cp_group)
        full = torch.empty((attn.seg.numel(), out.shape[-1]), dtype=out.dtype, device=out.device)
        for c in range(cp):
            full[attn.index[c]] = shares[c]
        return full[:L]
    b = batch.to(ctx.device)
    attn = VarlenLayout.build(b.seg, b.mask_order, b.causal)
    return video_forward(model, b, attn).float()


def given_stream_check(r: SampleRequest, audio_patch: int, width: int) -> None:
    """ValueError unless request r's given stream (if any) fits it: one stream at most, a model
    with an audio stream, the video of r.shape, the sound of its frames' sound_tokens of `width` features."""
    if r.given_video is None and r.given_sound is None:
        return
    if r.given_video is not None and r.given_sound is not None:
        raise ValueError(f"{r.key}: give its video or its sound, not both (nothing would be generated)")
    if not audio_patch:
        raise ValueError(f"{r.key}: a given video or sound needs a model with an audio stream (model.audio_patch > 0)")
    if r.given_video is not None and tuple(r.given_video.shape) != tuple(r.shape):
        raise ValueError(f"{r.key}: the given video is {tuple(r.given_video.shape)}, the request {tuple(r.shape)}")
    want = (sound_tokens(r.shape[1], r.fps, audio_patch), width)
    if r.given_sound is not None and tuple(r.given_sound.shape) != want:
        raise ValueError(f"{r.key}: the given sound is {tuple(r.given_sound.shape)} tokens, its {r.shape[1]} frames at "
                         f"{r.fps:g} fps take {want}")


class VideoSampler:
    """Generates `requests` with the model (see the module docstring).

    inputs: what the model receives (tasks/video_inputs.py): its patch (pt, ph, pw), caption width
    text_dim (0 = unconditional), what it outputs (prediction, x0_min_t), its conditioning's feed
    ("" when it trained unconditioned), whether every request brings a `control` video
    (cond.control), and diffusers' Wan 2.1 I2V layout (i2v_mask > 0; gives_last: first_last),
    where the requests' given frames arrive as its mask and their `cond_latents`, with their
    `image` tokens.
    null_caption: [Lt, text_dim] embedding of the empty caption (the CFG negative).
    shift, shift_reference_tokens: the run's loss.timestep_shift and loss.shift_reference_tokens;
    clip k samples with shifts[k] = sample_shift(shift, shift_reference_tokens, its tokens).
    stochastic: diffusers' `stochastic_sampling` step (module docstring). Fresh noise at every
    step lets later steps correct what the deterministic path fixes at high noise (a square
    drawn with round corners stays round along an ODE path); it needs a well-trained model
    (docs/quality.md has the measurements).
    boundary, guidance_scale_2: a model of two experts switching at flow time `boundary` (0 =
    one model) guides clips below it with guidance_scale_2 (0 = guidance_scale), as WanPipeline.
    pipeline: a diffusers pipeline's token-count schedule (LTXPipeline's, `PipelineShift`)
    instead of `shift`: each clip's sigmas are the ones that pipeline uses for its token count.
    audio_guidance_scale: the guidance of the sound (a model with an audio stream; 0 = the
    pictures'), as LTX2Pipeline's `audio_guidance_scale`: one uncaptioned pass serves both streams.
    """

    def __init__(self, requests: list[SampleRequest], inputs: VideoInputs, null_caption: torch.Tensor | None,
                 ctx: ParallelContext, steps: int, guidance_scale: float, seed: int, shift: float = 1.0,
                 shift_reference_tokens: int = 0, stochastic: bool = False, guidance_scale_2: float = 0.0,
                 boundary: float = 0.0, pipeline: PipelineShift | None = None, sound: Any = None,
                 audio_guidance_scale: float = 0.0):
        from diffusers import FlowMatchEulerDiscreteScheduler  # deferred: diffusers takes ~2 s to import

        self.inputs, self.control = inputs, inputs.control
        if inputs.i2v_mask and any(r.given is not None and r.cond_latents is None for r in requests):
            raise ValueError("a Wan 2.1 I2V model needs each conditioned clip's condition latents (cond_latents)")
        if self.control and any(r.control is None for r in requests):
            raise ValueError("a model trained with cond.control needs a control video for every clip")
        for r in requests:  # cross-stream conditioning: one stream given, of the request's own size
            given_stream_check(r, inputs.audio_patch, inputs.audio_width)
        self.requests, self.patch, self.text_dim, self.null_caption = requests, inputs.patch, inputs.text_dim, null_caption
        self.ctx, self.steps, self.guidance, self.seed, self.shift = ctx, steps, guidance_scale, seed, shift
        self.prediction, self.x0_min_t = inputs.prediction, inputs.x0_min_t  # what the model outputs (model.prediction)
        self.stochastic = stochastic
        self.guidance_2, self.boundary = guidance_scale_2 or guidance_scale, boundary
        self.pipeline = pipeline
        self.audio_guidance = audio_guidance_scale
        tokens = [num_patches(r.shape, self.patch) for r in requests]
        self.shifts = ([math.exp(pipeline.mu(math.prod(r.shape[1:]))) for r in requests] if pipeline is not None else
                       [sample_shift(shift, shift_reference_tokens, n) for n in tokens])
        self.scheduler_cls = FlowMatchEulerDiscreteScheduler
        self.joint_text = False  # the model's caption tokens are slots of the pack (set by `sample`)
        self.audio_patch = inputs.audio_patch  # > 0: each clip's sound is generated too (sampling/sound.py)
        self.sounds: list[torch.Tensor] | None = None  # after `sample`: float32 [N] 16 kHz mono per clip
        # audio tokens that are not waveform samples (DataSource.sound: a cache's LTX-2 audio latents):
        # how many a clip gets, and the audio VAE + vocoder that turn them into sound
        self.latent_sound = sound
        self.sync: list[torch.Tensor] | None = None  # per clip [n_k] its audio tokens' sync feature (set by `sample`)

    def schedulers(self) -> list[Any]:
        """One diffusers scheduler per clip (each keeps its own step counter), set to `steps`.

        Every clip starts from the same unshifted grid (diffusers' shift-1 grid: `steps` values
        from 1 down to 1/1000) and its scheduler applies the clip's shift to it, so the sigmas are
        exactly shift_timestep(grid, shifts[k]) — the training map. The grid is passed
        explicitly because diffusers' default `set_timesteps(n)` with shift ≠ 1 starts from an
        already shifted lower end (its sigma_min is shifted in __init__) and so shifts that end
        twice. With shift 1 the sigmas are the default ones, bit for bit.

        With `pipeline` (a PipelineShift) each clip's scheduler is the pipeline's own: its config
        and set_timesteps(sigmas=linspace(1, 1/steps, steps), mu of the clip's size), as
        LTXPipeline calls it, so the sigmas (shift_terminal stretch included) are the pipeline's.
        The size is LTXPipeline's `video_sequence_length`: latent frames × height × width (the
        tokens for LTX-Video's patch 1).
        """
        if self.pipeline is not None:
            return [self._pipeline_scheduler(math.prod(r.shape[1:])) for r in self.requests]
        plain = self.scheduler_cls(num_train_timesteps=1000)
        plain.set_timesteps(self.steps)
        grid = plain.sigmas[:-1].tolist()  # decreasing from 1, without the final 0
        out = []
        for s in self.shifts:
            sched = self.scheduler_cls(num_train_timesteps=1000, shift=s, stochastic_sampling=self.stochastic)
            sched.set_timesteps(sigmas=grid)
            out.append(sched)
        return out

    def guidance_at(self, t: float) -> float:
        """The guidance scale of a clip at flow time t: guidance_scale_2 below the experts'
        boundary (WanPipeline's low-noise stage), else guidance_scale."""
        return self.guidance_2 if 0 < self.boundary and t < self.boundary else self.guidance

    def _pipeline_scheduler(self, positions: int) -> Any:
        sched = self.scheduler_cls(num_train_timesteps=1000, stochastic_sampling=self.stochastic,
                                   **self.pipeline.scheduler_config())
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / self.steps, self.steps), mu=self.pipeline.mu(positions))
        return sched

    def _step(self, k: int, i: int, v: torch.Tensor, offsets: list[int], scale: float, cfg: bool, x: torch.Tensor,
              sched: Any, gen: torch.Generator | None, shape: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> torch.Tensor:
        """Step i of one stream of clip k (its pictures or its sound): v [rows, width] the stream's
        velocities of the pack in clip order (the uncaptioned copies after the captioned ones,
        `offsets` their bounds), guided v = v_u + scale·(v_c − v_u); `shape` turns clip k's rows into
        the shape of x (pictures: unpatchify); `gen` the stochastic step's noise. Returns the new x."""
        n = len(self.requests)
        vk = v[offsets[k]:offsets[k + 1]]
        if cfg:
            vu = v[offsets[n + k]:offsets[n + k + 1]]
            vk = vu + scale * (vk - vu)
        return sched.step(shape(vk) if shape else vk, sched.timesteps[i], x, generator=gen).prev_sample

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        pt, ph, pw = self.patch
        return shape[1] // pt, shape[2] // ph, shape[3] // pw

    def given(self, k: int, x: torch.Tensor) -> ClipInputs | None:
        """Request k's conditioned inputs around its current x (None for an unconditioned model):
        x with the given frames put back (timestep feed), the clean flags or the concat channels."""
        if not self.inputs.feed:
            return None
        r = self.requests[k]
        if self.inputs.i2v_mask:
            return i2v_inputs(x, r.given_patches if r.given is not None else None, self.inputs.gives_last,
                              self.inputs.i2v_mask, r.cond_latents, self.patch)
        given = r.given.to(x.dtype) if r.given is not None else torch.zeros_like(x)
        return clip_inputs(given, x, r.given_patches if r.given is not None else None, self.inputs.concat, self.patch)

    def _pack(self, xs: list[torch.Tensor], ts: list[float], ctxs: list[torch.Tensor] | None,
              given: list[ClipInputs | None], controls: list[torch.Tensor | None],
              sound: list[torch.Tensor] | None = None) -> PackedBatch:
        samples = {"t": torch.tensor(ts, dtype=torch.float32)}
        if ctxs is not None:
            samples["context"], samples["context_len"] = pad_contexts(ctxs, self.text_dim)
        fields, per_token = {"x": xs}, None
        if self.inputs.concat:
            fields["cond"] = [g.cond for g in given]
        elif self.inputs.clean:
            per_token = {"clean": [g.clean for g in given]}
        reqs = self.requests * (len(xs) // len(self.requests))  # the guidance copies after the captioned clips
        cross = any(r.given_video is not None or r.given_sound is not None for r in self.requests)
        if cross:  # cross-stream conditioning: the given stream's tokens at timestep 0, as training flags them
            per_token = {"clean": [torch.full((math.prod(self._grid(x.shape)),), r.given_video is not None)
                                   for x, r in zip(xs, reqs)]}
        if self.control:  # after the concat channels, as in training (batch.input_tokens)
            fields["control"] = [c.to(xs[0].dtype) for c in controls]
        if self.requests[0].image is not None:  # both CFG branches see the image, as WanImageToVideoPipeline
            images = [r.image for r in self.requests]
            samples["image"] = torch.stack(images * (len(xs) // len(images)))
        dims = {name: clips[0].shape[0] * math.prod(self.patch) for name, clips in fields.items()}
        # a block-causal model (model.causal_block_frames) samples the whole clip under its mask
        batch = pack_clips(fields, self.patch, dims, samples, torch.arange(len(xs)), per_token=per_token,
                           causal_block=self.inputs.causal_block)
        if sound is not None:  # each clip's audio tokens after its video tokens, as in training (stream 1)
            pos = [audio_positions(a.shape[0], self.audio_patch, r.fps, self.patch[0], self.inputs.audio_index)
                   for a, r in zip(sound, reqs)]
            clean = [torch.full((a.shape[0],), r.given_sound is not None) for a, r in zip(sound, reqs)] if cross else None
            # the guidance copies read no frame events, as they read no caption: guidance then
            # pushes the sound towards the events as well (a given video's held-out clicks at the
            # bounce 0.43 -> 0.61 of the clips that bounce, docs/audio-video.md)
            copies = len(xs) // len(self.requests) - 1
            sync = self.sync + [torch.zeros_like(v) for v in self.sync] * copies if self.sync is not None else None
            batch = join_audio_tokens(batch, sound, None, pos, clean=clean, sync=sync)
        # a joint-attention model's caption tokens join each clip's run (tasks/joint_text.py)
        return join_text_tokens(batch, samples["context_len"]) if self.joint_text and ctxs is not None else batch

    def start_sound(self) -> list[torch.Tensor] | None:
        """Each clip's sound's starting noise [n_k, audio_patch] (None for a video-only model)."""
        if not self.audio_patch:
            return None
        noise = [start_sound(r.shape, r.fps, self.audio_patch, self.seed, r.noise_id, self.latent_sound,
                             self.inputs.audio_width)
                 for r in self.requests]
        return [a if r.given_sound is None else r.given_sound.to(a.dtype).clone() for a, r in zip(noise, self.requests)]

    def _start(self) -> tuple[list[torch.Tensor], bool, list[torch.Tensor] | None]:
        """Each clip's starting noise (its own seeded stream), whether guidance runs (cfg), and the
        contexts of one call: the captions, then the null caption per clip when guided."""
        xs = [torch.randn(r.shape, generator=sample_generator(self.seed, r.noise_id, 0, "sampling")) for r in self.requests]
        xs = [x if r.given_video is None else r.given_video.to(x.dtype).clone() for x, r in zip(xs, self.requests)]
        scales = (self.guidance, self.guidance_2 if self.boundary > 0 else 1.0, self.audio_guidance if self.audio_patch else 1.0)
        cfg = max(scales) > 1.0 and self.text_dim > 0
        ctxs = None
        if self.text_dim:
            ctxs = [r.context for r in self.requests]
            if cfg:
                ctxs = ctxs + [self.null_caption] * len(ctxs)
        return xs, cfg, ctxs

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, autocast: Callable[[], Any] | None = None,
               progress: bool = False) -> list[torch.Tensor]:
        """Run the sampler; returns the clips [C, F, H, W] (model space: pixels or latents).
        progress: a bar over the steps (tools.sample on the writing rank; a long sampling printed
        nothing for minutes)."""
        autocast = autocast or contextlib.nullcontext
        xs, cfg, ctxs = self._start()
        sound = self.start_sound()  # [n_k, audio_patch] per clip, or None
        if sound is not None and self.inputs.sync_encoder:  # each clip's sync feature from its given picture (zeros without)
            self.sync = [clip_sync(self.inputs.sync_encoder, r.given_video, a.shape[0], self.audio_patch, r.fps)
                         for a, r in zip(sound, self.requests)]
        scheds = self.schedulers()
        sound_scheds = self.schedulers() if sound is not None else None  # the same sigmas, their own step counters
        sigmas = [s.sigmas.tolist() for s in scheds]  # per clip: decreasing from 1 to 0, steps + 1 values
        was_training = model.training
        self.joint_text = bool(getattr(model, "joint_text", False))
        model.eval()
        n = len(xs)
        sizes = [math.prod(self._grid(x.shape)) for x in xs]
        offsets = np.cumsum([0] + (sizes + sizes if cfg else sizes)).tolist()
        n_sound = [a.shape[0] for a in sound] if sound is not None else [0] * n
        sound_offsets = np.cumsum([0] + (n_sound + n_sound if cfg else n_sound)).tolist()
        for i in tqdm(range(self.steps), desc=f"sampling {n} clip(s)", unit="step", disable=not progress):
            ts = [sig[i] for sig in sigmas]  # each clip's own noise level (they differ with per-clip shifts)
            given = [self.given(k, xs[k]) for k in range(n)]
            if self.inputs.clean:  # the given frames, clean, at every step
                xs = [g.x for g in given]
            controls = [r.control for r in self.requests]
            batch = self._pack(xs + xs if cfg else xs, ts + ts if cfg else ts, ctxs, given + given if cfg else given,
                               controls + controls if cfg else controls,
                               (sound + sound if cfg else sound) if sound is not None else None)
            with autocast():
                out = predict_velocity(model, batch, self.ctx).cpu()
            video = video_rows(batch)  # the clips' tokens in clip order (text slots dropped)
            if sound is not None:  # the clips' audio rows, in clip order, apart
                heard = batch.stream == 1
                video = video & ~heard
                aw = self.inputs.audio_width
                a = velocity_from_output(out[heard, :aw], batch.tokens["x"][heard, :aw],
                                         batch.samples["t"][batch.seg[heard]], self.prediction, self.x0_min_t)
            t_tok = batch.samples["t"][batch.seg[video].clamp_min(0)]  # [L] each token's clip noise level (no padding here)
            width = self.inputs.patch_dim if sound is not None else out.shape[1]  # an audio model's rows are zero-padded
            v = velocity_from_output(out[video, :width], batch.tokens["x"][video, :width], t_tok, self.prediction,
                                     self.x0_min_t)
            for k, r in enumerate(self.requests):  # a given stream (cross-stream conditioning) is never stepped
                # step i draws its noise from step i + 1 of each stream (step 0 drew the start)
                if sound is not None and r.given_sound is None:
                    gen = sound_noise(self.seed, r.noise_id, i + 1) if self.stochastic else None
                    scale = self.audio_guidance or self.guidance_at(ts[k])
                    sound[k] = self._step(k, i, a, sound_offsets, scale, cfg, sound[k], sound_scheds[k], gen)
                if r.given_video is None:
                    gen = sample_generator(self.seed, r.noise_id, i + 1, "sampling") if self.stochastic else None
                    grid, C = self._grid(xs[k].shape), xs[k].shape[0]
                    xs[k] = self._step(k, i, v, offsets, self.guidance_at(ts[k]), cfg, xs[k], scheds[k], gen,
                                       lambda vk: unpatchify(vk, grid, self.patch, C))
        model.train(was_training)
        hear = (self.latent_sound.waveform if self.latent_sound is not None else
                lambda s: decode(s, self.audio_patch, self.inputs.audio_features))  # samples, or Griffin-Lim
        self.sounds = [hear(s) for s in sound] if sound is not None else None
        if self.inputs.clean:  # the result shows the given frames as they were given
            xs = [self.given(k, xs[k]).x for k in range(n)]
        if sound is not None and self.inputs.sync_encoder:
            self.sound_from_pictures(model, xs, autocast, progress)
        return xs

    def sound_from_pictures(self, model: torch.nn.Module, xs: list[torch.Tensor], autocast: Callable[[], Any],
                            progress: bool) -> None:
        """A sync-encoder model's sound of the requests that gave neither stream, made again from
        their sampled pictures xs [C, F, H, W] (video-to-audio requests of the same noise ids, run
        by this sampler's settings): the joint pass could not read the frame events of pictures it
        was still making. Replaces those clips' `sounds`."""
        todo = [k for k, r in enumerate(self.requests) if r.given_video is None and r.given_sound is None]
        if not todo:
            return
        second = copy.copy(self)
        second.requests = [replace(self.requests[k], given_video=xs[k].clamp(-1, 1)) for k in todo]  # the picture as written
        second.shifts = [self.shifts[k] for k in todo]
        second.sample(model, autocast, progress)
        for k, heard in zip(todo, second.sounds):
            self.sounds[k] = heard
