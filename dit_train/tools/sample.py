"""Generate videos from a trained run with your prompts.

    python -m dit_train.tools.sample RUN_DIR --prompt "a red circle moving up and left on a navy background" \\
        --frames 16 --height 32 --width 64 --steps 30 --guidance 3 --seed 0 --num 4
    python -m dit_train.tools.sample RUN_DIR --prompt "..." --prompt "..." --no-ema --out my_samples/
    python -m dit_train.tools.sample RUN_DIR --prompt "..." --layout cp_ulysses=2      # 2 local workers, context parallel
    python -m dit_train.tools.sample RUN_DIR --prompt "..." --shift 3                   # another timestep shift
    python -m dit_train.tools.sample RUN_DIR --data-captions 48          # the run's validation, on 48 clips
    python -m dit_train.tools.sample HIGH_RUN --low-noise LOW_RUN --prompt "..."   # Wan 2.2 A14B's two experts
    python -m dit_train.tools.sample BOTH_RUN --prompt "..." --guidance 4 --guidance-scale-2 3   # model.expert=both

Weights: the run's EMA weights (weights_ema.safetensors) when it has them, else
weights.safetensors; `--no-ema` forces the training weights, `--ema` requires the EMA ones.
The time grid is shifted like the run's training (loss.timestep_shift, and per clip size with
loss.shift_reference_tokens), or for a model sampled with its pipeline's schedule (LTX with
model.pipeline_shift) as that pipeline does; `--shift S` samples every clip with shift S instead.
`--stochastic` / `--no-stochastic` picks diffusers' stochastic Euler step or the deterministic
one (default: the run's train.stochastic_sampling).
A run dir without exported weights uses its newest checkpoint. Prompts are encoded the way the
run's data was (byte embeddings on pixel data; the cache's text encoder for latent-cache runs,
whose samples are decoded with the cache's VAE). Output (default RUN_DIR/generated/<time>/):
one mp4 per clip, grid.png with the prompts, samples.safetensors (pixels in [-1, 1]),
captions.json and info.json — and, for runs on the embedded shapes world, the quality figures
of the samples against their prompts.
`--data-captions N` samples the captions and sizes of the run's first N training samples instead
of prompts, with the run's sampler steps, guidance and seed unless given: the run's validation
with train.num_samples=N (the same clips and noise), a larger re-score of a finished run.
A conditioned run (cond.kind, docs/conditioning.md) continues given frames:

    python -m dit_train.tools.sample RUN_DIR --prompt "..." --image first.png [--last-image last.png]
    python -m dit_train.tools.sample RUN_DIR --prompt "..." --video prefix.mp4 --prefix-frames 4
    python -m dit_train.tools.sample RUN_DIR --data-captions 48     # from the held-out clips' first frames
    python -m dit_train.tools.sample RUN_DIR --prompt "..." --control ctrl.mp4     # a run trained with cond.control
A run with sound trained with cond.given_stream (docs/audio-video.md) generates one stream for the other:

    python -m dit_train.tools.sample V2A_RUN --prompt "..." --video clip.mp4 --frames 8 --height 32 --width 32  # its sound
    python -m dit_train.tools.sample A2V_RUN --prompt "..." --audio sound.wav --frames 8 --height 32 --width 32  # its frames
A block-causal run (model.causal_block_frames, docs/causal.md) streams its prompts block by block
with a KV cache; past its training length with a sliding window:

    python -m dit_train.tools.sample CAUSAL_RUN --prompt "..." --frames 32 --overlap-frames 4
    python -m dit_train.tools.sample CAUSAL_RUN --prompt "..." --frames 8 --full-sequence   # all blocks at once
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dit_train.checkpoint.export import run_weights
from dit_train.compose import load_config
from dit_train.config.errors import CheckpointError
from dit_train.config.cond import cond_active
from dit_train.data_pipelines import SOURCES, run_source, source_for
from dit_train.engine.build import build_parallel_model
from dit_train.engine.checks import Range
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.layout_equivalence import apply_layout, parse_layout, world_of
from dit_train.engine.run_folder import data_record_of
from dit_train.models.init import load_full_weights
from dit_train.models.wan_experts import check_pair, ExpertPair
from dit_train.parallel.mesh import init_parallel
from dit_train.precision import autocast
from dit_train.sampling import pipeline_shift, sampling_boundary, scored_view, source_requests, to_pixels, VideoSampler, write_samples
from dit_train.sampling.conditioned import (condition_on_clips, control_from_file, control_on_clips, given_from_files,
                                            given_flags, given_latents_from_files, given_scores, i2v_from_files, i2v_on_clips,
                                            validation_task)
from dit_train.data_pipelines.latent_cache import read_cache_info
from dit_train.sampling.cross_stream import check_flags, give_streams
from dit_train.sampling.prompts import prompt_requests, prompt_space
from dit_train.sampling.sound import sound_info, sound_scores
from dit_train.sampling.streaming import StreamingSampler, stream_check
from dit_train.tasks import build_task
from dit_train.tasks.video_inputs import video_inputs
from dit_train.tools.args import POSITIVE_INT, ToolParser, ranged


def data_requests(cfg: Any, num: int, device: Any, decoder: bool, heldout: bool = False) -> tuple[list, Any, Any]:
    """(requests, empty caption, decoder) for the first `num` samples, as validation picks them:
    their captions and sizes (a conditioned run: also their first frames, from the held-out
    clips when it has some; `heldout`: the held-out clips for any run), the task's own empty
    caption, and for latent-cache runs (`decoder`: on the rank that writes) the cache's VAE
    decoder (no text encoder needed: captions come encoded)."""
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)
    if heldout:
        task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, split="heldout", cond=cfg.cond)
        if task is None:
            raise ValueError("--heldout: the run holds no clip out (data.heldout_fraction=0)")
    else:
        task = validation_task(cfg, task)
    source = source_for(cfg.data, cfg.model)
    requests = source_requests(task, source, num)
    if cfg.cond.active:
        condition_on_clips(requests, [task.dataset[r.noise_id].pixels for r in requests], cfg.cond, task.patch[0])
    if task.control:
        control_on_clips(requests, task)
    if task.inputs.i2v_mask:
        i2v_on_clips(requests, task)
    decode = source.decoder(device) if decoder else None
    return requests, task.null_caption() if task.text_dim else None, decode


def run_defaults(args: argparse.Namespace, train: Any) -> None:
    """Fill --steps/--guidance/--guidance-scale-2/--seed left unset: the run's validation settings
    with --data-captions (so it reproduces the run's validation), else 30 / 3 / 0 (= --guidance) / 0."""
    data = bool(args.data_captions)
    for name, key, fallback in (("steps", "sample_steps", 30), ("guidance", "guidance_scale", 3.0),
                                ("guidance_scale_2", "guidance_scale_2", 0.0), ("seed", "seed", 0)):
        if getattr(args, name) is None:
            setattr(args, name, getattr(train, key) if data else fallback)


def low_noise_weights(args: argparse.Namespace, cfg: Any) -> dict | None:
    """--low-noise RUN2: the low-noise expert's full weights, after checking that RUN_DIR and
    RUN2 are the high- and low-noise experts of one Wan 2.2 A14B model (None without the flag)."""
    if args.low_noise is None:
        return None
    check_pair(cfg.model, load_config(args.low_noise).model, str(args.run_dir), str(args.low_noise))
    return run_weights(args.low_noise, args.ema)[0]


def expert_boundary(args: argparse.Namespace, cfg: Any) -> float:
    """Where sampling switches experts (and to --guidance-scale-2): model.boundary_ratio with
    --low-noise or for a model.expert=both run, 0 for one transformer; --guidance-scale-2 with
    one transformer is refused (ValueError), as WanPipeline refuses guidance_scale_2 without a
    boundary_ratio."""
    boundary = cfg.model.boundary_ratio if args.low_noise is not None else sampling_boundary(cfg.model)
    if args.guidance_scale_2 and not boundary:
        raise ValueError("--guidance-scale-2 guides Wan 2.2 A14B's low-noise expert: give a model.expert=both run, or "
                         "--low-noise LOW_RUN with the high-noise expert's run")
    return boundary


def _worker(cfg: Any, state_dict: dict, args: argparse.Namespace, out_dir: str, source: str,
            low_noise: dict | None = None) -> dict | None:
    """One rank: build the (parallelized) model, load the weights, sample; rank 0 writes.
    With `low_noise` weights, a second model of the same shape holds them and the two sample as
    Wan 2.2 A14B's experts (switching per clip at model.boundary_ratio)."""
    ctx = init_parallel(cfg.parallel)
    model = build_parallel_model(cfg, ctx)
    load_full_weights(model, state_dict)
    if low_noise is not None:
        low = build_parallel_model(cfg, ctx)
        load_full_weights(low, low_noise)
        model = ExpertPair(model, low, cfg.model.boundary_ratio)
    if args.data_captions:
        requests, null, decode = data_requests(cfg, args.data_captions, ctx.device, decoder=ctx.is_main,
                                               heldout=args.heldout)
    else:
        space = prompt_space(cfg, ctx.device, recorded_source(args, cfg))
        requests = prompt_requests(space, args.prompt, args.num, args.frames, args.height, args.width)
        null, decode = space.null, space.decode
        for r in requests:  # read and checked by main() before any worker started
            if args.given is not None:
                r.given, r.given_patches = args.given[:2]
                r.cond_latents, r.image = args.given[2:] if len(args.given) > 2 else (None, None)
            r.control = args.control_clip
        if args.given_videos or args.given_audios:  # cross-stream: read and checked by main() first, read here again
            give_streams(requests, args.given_videos, args.given_audios, args.num, cfg.model.audio_patch,
                         str(getattr(cfg.model, "audio_features", "wave")))
    # the run's training shift (per clip size with loss.shift_reference_tokens) ...
    shift, reference = cfg.loss.timestep_shift, cfg.loss.shift_reference_tokens
    pipeline = pipeline_shift(cfg.model)  # ... or the model's pipeline schedule (LTX: model.pipeline_shift) ...
    if args.shift is not None:  # ... unless --shift names one for every clip
        shift, reference, pipeline = args.shift, 0, None
    kind, stream = VideoSampler, {}
    if args.streaming:  # block by block with a KV cache (sampling/streaming.py)
        kind, stream = StreamingSampler, dict(block_frames=cfg.model.causal_block_frames, overlap_frames=args.overlap_frames,
                                              window_frames=training_frames(cfg), ar_step=args.ar_step)
    sampler = kind(requests, video_inputs(cfg.model, cfg.cond), null, ctx, args.steps, args.guidance, args.seed,
                   shift, reference,
                   stochastic=cfg.train.stochastic_sampling if args.stochastic is None else args.stochastic,
                   guidance_scale_2=args.guidance_scale_2, boundary=args.boundary, pipeline=pipeline,
                   sound=recorded_source(args, cfg).sound(ctx.device), audio_guidance_scale=args.audio_guidance,
                   **stream)
    started = time.perf_counter()
    clips = sampler.sample(model, lambda: autocast(cfg.train.precision, ctx.device, False), progress=ctx.is_main)
    seconds = time.perf_counter() - started
    if not ctx.is_main:
        return None
    pixels = to_pixels(clips, decode)
    try:
        data_source = recorded_source(args, cfg)
        scores = data_source.score(scored_view(requests, pixels), [r.caption for r in requests]) or {}
        scores |= given_scores(data_source, requests, pixels, cfg.model.patch_size[0]) if scores else {}
        scores |= sound_scores([r.caption for r in requests], pixels, sampler.sounds) if scores else {}
    except ValueError:
        scores = {}
    info = {"weights": source, "prompts": [r.caption for r in requests] if args.data_captions else args.prompt,
            "data_captions": args.data_captions, "num": args.num, "steps": args.steps,
            "guidance_scale": args.guidance, "guidance_scale_2": sampler.guidance_2 if args.boundary else None,
            "audio_guidance_scale": args.audio_guidance or None,
            "seed": args.seed, "shifts": sampler.shifts,
            "stochastic_sampling": sampler.stochastic, "scores": scores,
            "given": {"image": args.image, "last_image": args.last_image, "video": args.video,
                      "prefix_frames": args.prefix_frames} if given_files(args) else None,
            "given_stream": {"video": args.given_videos, "audio": args.given_audios}
            if args.given_videos or args.given_audios else None,
            "control": args.control or None, "streamed": args.streaming, "overlap_frames": args.overlap_frames,
            **sound_info(sampler.sounds), "sampling_seconds": seconds,
            "seconds_per_frame": seconds / max(1, sum(r.shape[1] for r in requests))}
    write_samples(Path(out_dir), requests, pixels, info, sounds=sampler.sounds)
    return scores


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a run dir (config.yaml + weights or checkpoints)")
    ap.add_argument("--prompt", action="append", default=[], help="a caption (repeat for several)")
    ap.add_argument("--data-captions", type=int, default=0, metavar="N",
                    help="instead of prompts: the captions and sizes of the run's first N training samples")
    ap.add_argument("--num", type=POSITIVE_INT, default=1, help="clips per prompt (different noise; prompts only)")
    ap.add_argument("--frames", type=ranged(int, Range(1, note="1 = a still image")), default=16, help="1 = a still image")
    ap.add_argument("--height", type=POSITIVE_INT, default=32)
    ap.add_argument("--width", type=POSITIVE_INT, default=64)
    ap.add_argument("--steps", type=POSITIVE_INT, default=None,
                    help="Euler steps of the flow-matching sampler (default 30; with --data-captions the run's "
                         "train.sample_steps)")
    ap.add_argument("--guidance", type=float, default=None,
                    help="classifier-free guidance scale, 1 = off (default 3; with --data-captions the run's "
                         "train.guidance_scale)")
    ap.add_argument("--guidance-scale-2", type=float, default=None, metavar="G2",
                    help="Wan 2.2 A14B: the guidance of the low-noise expert's steps (below model.boundary_ratio; "
                         "WanPipeline's guidance_scale_2; default: --guidance; with --data-captions the run's "
                         "train.guidance_scale_2)")
    ap.add_argument("--audio-guidance", type=float, default=0.0, metavar="GA",
                    help="a run with sound: the guidance of the sound (LTX2Pipeline's audio_guidance_scale; default "
                         "0 = --guidance)")
    ap.add_argument("--seed", type=int, default=None,
                    help="noise seed (default 0; with --data-captions the run's train.seed)")
    ap.add_argument("--shift", type=float, default=None,
                    help="timestep shift of every clip (default: the run's loss.timestep_shift, per clip with "
                         "loss.shift_reference_tokens)")
    ap.add_argument("--stochastic", action=argparse.BooleanOptionalAction, default=None,
                    help="re-noise with fresh noise at every step (diffusers' stochastic_sampling; default: the "
                         "run's train.stochastic_sampling)")
    ema = ap.add_mutually_exclusive_group()
    ema.add_argument("--ema", dest="ema", action="store_true", default=None, help="require the EMA weights")
    ema.add_argument("--no-ema", dest="ema", action="store_false", help="use the training weights")
    ap.add_argument("--image", default="", help="first frame to continue from (a run trained with cond.kind="
                    "first_frame or first_last); resized to cover --height x --width, centre-cropped")
    ap.add_argument("--last-image", default="", help="last frame (cond.kind=first_last), like --image")
    ap.add_argument("--video", action="append", default=[], help="a video whose first --prefix-frames frames are "
                    "continued (cond.kind=prefix); on a run trained with cond.given_stream=video, the clip whose sound "
                    "is generated (its first --frames frames; repeat: one per --prompt)")
    ap.add_argument("--audio", action="append", default=[], help="a run trained with cond.given_stream=audio: the "
                    "sound whose frames are generated (its first --frames at the run's fps; repeat: one per --prompt)")
    ap.add_argument("--prefix-frames", type=ranged(int, Range(0, note="0 = the run's cond.prefix_frames")), default=0,
                    help="frames of --video given (a multiple of the temporal patch; default: the run's "
                         "cond.prefix_frames)")
    ap.add_argument("--control", default="", help="control video (a run trained with cond.control): its first --frames "
                    "frames, resized to cover --height x --width and centre-cropped; an image stands for every frame")
    ap.add_argument("--heldout", action="store_true",
                    help="with --data-captions: the run's held-out clips (data.heldout_fraction > 0) instead of "
                         "its training clips (conditioned runs use them by default, like their validation)")
    ap.add_argument("--low-noise", type=Path, default=None, metavar="RUN2",
                    help="Wan 2.2 A14B: the low-noise expert's run (model.expert=low); RUN_DIR is the high-noise "
                         "expert's; each clip switches to RUN2's weights below model.boundary_ratio, as WanPipeline")
    ap.add_argument("--overlap-frames", type=ranged(int, Range(0)), default=0, metavar="N",
                    help="a block-causal run streaming past its training length (data.max_frames): frames of the "
                         "last window that open the next one (a multiple of model.causal_block_frames)")
    ap.add_argument("--ar-step", type=ranged(int, Range(0)), default=0, metavar="N",
                    help="a block-causal run: SkyReels-V2's asynchronous schedule, block i running N denoising steps "
                         "behind block i-1 (the blocks in progress in one forward, each at its own level); 0 = "
                         "block by block (synchronous, the default)")
    ap.add_argument("--full-sequence", action="store_true",
                    help="a block-causal run: denoise all blocks at once (the validation sampler) instead of streaming")
    ap.add_argument("--layout", default="", help="parallel layout to sample on, e.g. cp_ulysses=2 (starts local workers)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/generated/<time>)")
    args = ap.parse_args(argv)

    try:
        cfg = load_config(args.run_dir)
        args.record = data_record_of(args.run_dir)  # what the run kept of its data: prompts need no data
        if cfg.mode != "video":
            raise ValueError(f"{args.run_dir} trained mode={cfg.mode}; for text use python -m dit_train.tools.generate")
        if args.prompt and args.data_captions:
            raise ValueError("give --prompt (one or more) or --data-captions N, not both")
        if not args.prompt and not args.data_captions:
            raise ValueError("nothing to sample: give --prompt \"a caption\" (repeat for several) or --data-captions N")
        if args.data_captions < 0:
            raise ValueError(f"--data-captions={args.data_captions} must be >= 1")
        if args.data_captions:
            check_data_at_hand(cfg)
        else:  # the source as the run folder recorded it: a record it cannot use is this line, not a worker's traceback
            recorded_source(args, cfg)
        if video_inputs(cfg.model, cfg.cond).i2v_mask and args.prompt and not given_files(args):  # its CLIP tokens need an image
            raise ValueError(f"this run trained diffusers' Wan 2.1 I2V layout (model.mask_channels={cfg.model.mask_channels}): "
                             f"give {given_flags(cfg.cond)}")
        cross_stream_files(args, cfg)
        check_given(args, cfg.cond)
        args.given = read_given(args, cfg)
        args.control_clip = read_control(args, cfg)
        run_defaults(args, cfg.train)
        args.streaming = check_streaming(args, cfg)
        if args.num < 1 or args.steps < 1 or args.guidance < 1:
            raise ValueError("--num and --steps must be >= 1 and --guidance >= 1")
        if args.audio_guidance and (args.audio_guidance < 1 or not getattr(cfg.model, "audio_patch", 0)):
            raise ValueError(f"--audio-guidance={args.audio_guidance:g} guides a run's sound: it needs a model with an "
                             f"audio stream (model.audio_patch > 0) and a value >= 1 (1 = no guidance)")
        if args.guidance_scale_2 and args.guidance_scale_2 < 1:
            raise ValueError(f"--guidance-scale-2={args.guidance_scale_2} must be >= 1 (1 = no guidance)")
        if not args.data_captions:  # the data's own sizes need no check
            check_memory(cfg, args)
        args.boundary = expert_boundary(args, cfg)
        if args.shift is not None and not args.shift > 0:
            raise ValueError(f"--shift={args.shift} must be > 0 (1 = no shift)")
        cfg = apply_layout(cfg, parse_layout(args.layout))
        cfg.parallel.device = args.device
        if hasattr(cfg.model, "pretrained"):
            cfg.model.pretrained = ""  # the run's weights are loaded below
        cfg.model.lora.rank = 0  # a LoRA run's weights come merged (weights.safetensors, checkpoint_weights)
        state_dict, source = run_weights(args.run_dir, args.ema)
        low_noise = low_noise_weights(args, cfg)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "generated" / time.strftime("%Y%m%d-%H%M%S")
    world = world_of(cfg)
    call = (cfg, state_dict, args, str(out), source, low_noise)
    scores = _worker(*call) if world == 1 else launch.launch_local(_worker, call, world, cfg.launcher)[0]
    print(f"wrote {args.data_captions or len(args.prompt) * args.num} clip(s) from {source} to {out}")
    if line := quality_line(scores):
        print(line)
    return 0


def check_memory(cfg: Any, args: argparse.Namespace) -> None:
    """Refuse sizes that cannot fit before anything is built (--height 100000 --width 100000 was a
    traceback deep in the sampler): the clips in pixels (noise, the model's input and the decoded
    output: ~3 copies) and, for pixel-space runs, one step's pack of tokens (x2 with guidance) at
    ~16 activations of model.dim each, against the device's memory (all of it: a busy machine may
    still swap, but a size over the whole memory never runs)."""
    clips = len(args.prompt) * args.num
    pixels = clips * args.frames * args.height * args.width * 3 * 4 * 3
    need = float(pixels)
    if not SOURCES[cfg.data.name].may_be_latent():  # pixel space: the model sees the pixels' patches
        tokens = clips * 2 * args.frames * args.height * args.width / math.prod(cfg.model.patch_size)
        need += tokens * getattr(cfg.model, "dim", 0) * 4 * 16
    if args.device != "cpu" and torch.cuda.is_available():
        have = float(torch.cuda.mem_get_info()[1])
    else:
        have = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    if need > have:
        raise ValueError(f"{clips} clip(s) of {args.frames} x {args.height} x {args.width} need ~{need / 2**30:.0f} GiB "
                         f"to sample, more than the {have / 2**30:.0f} GiB here: lower --height/--width/--frames or --num")


def recorded_source(args: argparse.Namespace, cfg: Any) -> Any:
    """The run's data source as its folder recorded it (main reads run.json into args.record; a
    caller without one gets the data's own source)."""
    return run_source(cfg.data, cfg.model, getattr(args, "record", {}))


def check_data_at_hand(cfg: Any) -> None:
    """--data-captions samples the run's training clips: a source that must read its data to know
    what it is (a shard set's index) says here, in one line, that it cannot, not in a worker."""
    try:
        source_for(cfg.data, cfg.model)
    except (ValueError, OSError) as err:
        raise ValueError(f"--data-captions samples the run's training clips, which cannot be read ({err}); put the data "
                         f"back, or sample --prompt captions (they need no data)") from None


def cross_stream_files(args: argparse.Namespace, cfg: Any) -> None:
    """Split --video / --audio: on a run trained with cond.given_stream they are the given streams
    (args.given_videos / given_audios, read once here so a bad file is one `error:` line before any
    worker); otherwise --video is cond.kind=prefix's one video (args.video)."""
    check_flags(cfg.cond, args.video, args.audio, args.prompt, args.data_captions)
    args.given_videos, args.given_audios = (args.video, args.audio) if cfg.cond.cross_stream else ([], [])
    if cfg.cond.cross_stream:
        args.video = ""
        if args.given_videos or args.given_audios:
            requests = prompt_requests(prompt_space(cfg, source=recorded_source(args, cfg)), args.prompt, args.num,
                                       args.frames, args.height, args.width)
            give_streams(requests, args.given_videos, args.given_audios, args.num, cfg.model.audio_patch,
                         str(getattr(cfg.model, "audio_features", "wave")))
        return
    if len(args.video) > 1:
        raise ValueError("--video is given once (the video whose first frames are continued)")
    args.video = args.video[0] if args.video else ""


def given_files(args: argparse.Namespace) -> bool:
    return bool(args.image or args.last_image or args.video)


def check_given(args: argparse.Namespace, cond: Any) -> None:
    """Refuse given frames a run cannot use, and a conditioned-only run sampled without them
    (ValueError naming the flag)."""
    if given_files(args) and args.data_captions:
        raise ValueError("--data-captions samples from the clips' own first frames; --image/--last-image/--video "
                         "go with --prompt")
    if given_files(args) and not cond_active(cond):
        raise ValueError("--image/--last-image/--video: this run trained without conditioning (cond.kind=none; "
                         "generating a video's sound needs cond.given_stream=video)")
    if args.prefix_frames and not args.video:
        raise ValueError("--prefix-frames goes with --video")
    if cond_active(cond) and cond.prob >= 1 and args.prompt and not given_files(args):
        raise ValueError(f"this run trained every sample with cond.kind={cond.kind} (cond.prob=1): give {given_flags(cond)}")


def read_given(args: argparse.Namespace, cfg: Any) -> tuple | None:
    """(given clip, given temporal patches) from --image/--last-image/--video, at the size the
    prompts sample (None without them); ValueError naming the flag when they do not fit."""
    if not given_files(args):
        return None
    space = prompt_space(cfg, source=recorded_source(args, cfg))
    shape = space.shape(args.frames, args.height, args.width)
    if video_inputs(cfg.model, cfg.cond).i2v_mask:  # Wan 2.1 I2V: [image, zeros...(, last)] through the VAE, CLIP tokens
        return i2v_from_files(cfg.cond, shape, space.codec, read_cache_info(cfg.data.root), args.image, args.last_image,
                              args.video)
    if space.codec is not None:  # a latent-cache run: the files go through the cache's VAE
        return given_latents_from_files(cfg.cond, shape, cfg.model.patch_size[0], space.codec, args.image,
                                        args.last_image, args.video, args.prefix_frames)
    return given_from_files(cfg.cond, shape, cfg.model.patch_size[0], args.image, args.last_image, args.video,
                            args.prefix_frames)


def read_control(args: argparse.Namespace, cfg: Any) -> Any:
    """The --control clip at the size the prompts sample (None without it); ValueError naming the
    flag when the run cannot use it or needs it."""
    trained = bool(cfg.cond.control)
    if args.control and args.data_captions:
        raise ValueError("--data-captions samples with the clips' own control videos; --control goes with --prompt")
    if args.control and not trained:
        raise ValueError("--control: this run trained without a control video (cond.control=false)")
    if trained and args.prompt and not args.control:
        raise ValueError("this run trained with a control video (cond.control=true): give --control ctrl.mp4")
    if not args.control:
        return None
    # a latent run's control goes through the cache's VAE (space.codec)
    space = prompt_space(cfg, source=recorded_source(args, cfg))
    return control_from_file(args.control, space.shape(args.frames, args.height, args.width), space.codec,
                             getattr(cfg.model, "vace_mask_channels", 0))


def quality_line(scores: dict[str, float] | None) -> str:
    """The line reporting the samples' quality figures ("" when the run's data has no metric)."""
    if not scores:
        return ""
    figures = " ".join(f"{k[5:]}={v:.2f}" for k, v in scores.items() if not k.startswith("eval/num"))
    if figures:
        return f"quality against the prompts: {figures}"
    # a shapes-world run, but no prompt reads as one of its captions: say so, not an empty list
    return ("quality against the prompts: not scored (no prompt is a caption of the shapes world, e.g. "
            "\"a red circle moving up and left on a navy background\")")

def training_frames(cfg: Any) -> int:
    """The longest clip a run trained on, in the model's frames (data.max_frames; 0 = unknown)."""
    return int(getattr(cfg.data, "max_frames", 0) or 0)


def check_streaming(args: argparse.Namespace, cfg: Any) -> bool:
    """Whether the prompts stream block by block (a block-causal run, not --full-sequence);
    ValueError (one `error:` line) for what cannot be streamed or needs the cache."""
    k = getattr(cfg.model, "causal_block_frames", 0)
    if args.ar_step and (not k or args.full_sequence or args.data_captions):
        raise ValueError(f"--ar-step {args.ar_step} staggers the blocks of a streamed block-causal run: drop "
                         f"--full-sequence / --data-captions (or --ar-step), or sample a run with "
                         f"model.causal_block_frames > 0")
    if not k:
        if args.overlap_frames or args.full_sequence:
            raise ValueError(f"--overlap-frames and --full-sequence are for block-causal runs (model.causal_block_frames "
                             f"> 0); {args.run_dir} is bidirectional: it samples whole clips up to its training length")
        return False
    window = training_frames(cfg)
    if args.full_sequence or args.data_captions:
        if args.overlap_frames:
            raise ValueError("--overlap-frames slides the streaming window: drop --full-sequence / --data-captions")
        if args.full_sequence and window and args.frames > window:
            raise ValueError(f"--frames {args.frames} is longer than the run's training length ({window} frames): past it "
                             f"a causal run samples with its KV cache only (drop --full-sequence, give --overlap-frames)")
        return False  # --data-captions: the run's validation (whole clips, the data's sizes)
    why = stream_check(args.frames, k, window, args.overlap_frames)
    if why is None and SOURCES[cfg.data.name].may_be_latent():
        why = (f"streaming a run on VAE latents (data={cfg.data.name}) is not built yet (--frames counts pixel frames, "
               f"the blocks latent ones): use --full-sequence")
    if why is None and (cond_active(cfg.cond) or getattr(cfg.cond, "control", False)):
        why = f"streaming a conditioned run (cond.kind={cfg.cond.kind}) is not built yet: use --full-sequence"
    if why is None and world_of(apply_layout(cfg, parse_layout(args.layout))) > 1:
        why = f"streaming runs on one process (--layout {args.layout}): drop --layout, or use --full-sequence"
    if why is not None:
        raise ValueError(why)
    return True


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
