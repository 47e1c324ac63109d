"""Encode a video source once into a latent cache for `data=latent_cache`.

    python -m dit_train.tools.cache_latents --vae /models/Wan2.1-T2V-1.3B-Diffusers --text-encoder /models/Wan2.1-T2V-1.3B-Diffusers \\
        --out latents/my_videos data=video_folder data.root=videos/ data.max_frames=81 'data.resolution_buckets=[[480,832]]'
    python -m dit_train.tools.cache_latents --workers 4 ...          # 4 local processes (one GPU each when there are 4),
                                                                     #   started like training's local workers
    python -m dit_train.tools.cache_latents --i2v first_frame --image-encoder /models/Wan2.1-I2V-14B-480P-Diffusers ...
                                                                     # + Wan 2.1 I2V's condition latents and CLIP tokens
    python -m dit_train.tools.cache_latents --masks --control ...    # + each clip's mask and control video (data.masks,
                                                                     #   cond.control: docs/conditioning.md)
    python -m dit_train.tools.cache_latents --audio-vae /models/LTX-2 ...  # + each clip's sound as LTX-2's audio latents
                                                                     #   (data.audio=true: docs/audio-video.md)
    torchrun --nproc-per-node 8 tools/cache_latents.py ... # or any launcher that sets RANK / WORLD_SIZE

The source is chosen with the same data overrides as `python -m dit_train` (`data=video_folder
data.root=...`, or the embedded `data=synthetic_video`), with its frame rate / stride / length
and resolution buckets. Clips of `data=video_folder` are resized to the model preset's sizes
(`model.default_buckets`): Wan 2.1's 480p unless the command names another `model=...`;
`data.resolution_buckets=...` sets others, `data.resolution_buckets=null` keeps native sizes.
`--vae` / `--text-encoder` take a model folder or a whole diffusers pipeline folder (its vae/,
text_encoder/, tokenizer/ are used). Without `--text-encoder` only latents are cached. Clip i
goes to rank i % world; each clip's file is written atomically, so an interrupted run is resumed
by running the same command again (done clips are skipped). Unreadable videos are skipped and
listed in <out>/report.json. `--masks` / `--control` read each clip's mask / control video as
training does (clip.mask.mp4, clip.control.mp4 or the manifest's columns; a clip without one is
skipped and listed) and store the mask summed over each latent voxel's pixels and the control
video's latents, for `data.masks=true` / `cond.control=true` on the cache. `--audio-vae` (an
AutoencoderKLLTX2Audio folder, or an LTX-2 pipeline folder with audio_vae/ and vocoder/) reads each
clip's sound (data.audio=true is implied) and stores it as LTX-2's audio latents covering the
frames the video VAE keeps; clips without usable sound stay video-only and are counted in
report.json (data_pipelines/audio_latents.py).

With `--shards`, or an `--out` URL such as s3://bucket/latents (any fsspec URL; `--storage-options`
JSON for its filesystem), the latents are written as indexed tar shards for `data=shards
data.url=<out>` (docs/data-at-scale.md): shard k holds clips k·S .. (k+1)·S - 1
(`--samples-per-shard`), rank r encodes shards k ≡ r (mod world) on its own device, a rerun skips
finished shards, and rank 0 merges the index once every rank is done:

    torchrun --nnodes 4 --nproc-per-node 8 ... -m dit_train.tools.cache_latents --out s3://bucket/latents ...
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from safetensors.torch import save as safetensors_bytes

from dit_train.compose import compose
from dit_train.config import LauncherConfig
from dit_train.config.errors import RunFailed, WorkerFailure
from dit_train.data_pipelines import latent_cache as lc, prepare_data, source_for
from dit_train.data_pipelines.audio_latents import AudioLatentCodec
from dit_train.data_pipelines.companions import KINDS
from dit_train.data_pipelines.i2v_cache import I2V_KINDS, I2VEncoder, ImageEncoder
from dit_train.data_pipelines.shard_index import NULL_TEXT, check_or_write_meta, fingerprint, merge_index
from dit_train.data_pipelines.shard_store import is_remote, join, open_url, put_bytes
from dit_train.data_pipelines.shard_writer import latent_sample, shard_count, slice_of, write_shards
from dit_train.data_pipelines.video_io import VideoReadError
from dit_train.data_pipelines.video_source import PixelVideoSource
from dit_train.engine import launch  # launch.launch_local at call time: the tests route it to their worker pool
from dit_train.engine.launch import interrupt_on_signals, interruption
from dit_train.tools.args import POSITIVE_INT, ToolParser
from dit_train.tools.make_shards import digest, storage_options


# the model whose preset sizes (model.default_buckets) data=video_folder's clips are resized to
# when the command names none: a latent cache is for a latent model, and Wan 2.1's 480p sizes
# are what its VAE and transformer were trained at (the default model=dit_tiny is a pixel model)
CACHE_MODEL = "wan_1_3b"


def compose_data(overrides: list[str]):
    """cfg.data from conf/ with `overrides` (the same groups and keys as training); without a
    `model=` override, with model=CACHE_MODEL (its default resolution buckets)."""
    named = any(o.lstrip("+~").split("=")[0] == "model" for o in overrides)
    return compose(list(overrides) if named else [f"model={CACHE_MODEL}", *overrides]).data


def pick_device(spec: str, local_rank: int) -> str:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and torch.cuda.device_count() > 0:
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return spec


def run_rank(rank: int, world: int, local_rank: int, args: argparse.Namespace, data, init_method: str | None) -> dict | None:
    """One rank's share; rank 0 also writes meta.json, the null caption and, once every rank
    is done, manifest.jsonl and report.json. Returns the report on rank 0. A default process group
    that exists already (the local launcher's pooled workers in the tests, a caller's) is used if
    it holds `world` processes and left as it was; otherwise, with world > 1, one is made (gloo)."""
    if dist.is_initialized() and dist.get_world_size() != world:
        raise ValueError(f"a process group of {dist.get_world_size()} processes exists but this cache run is for {world}")
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(hours=24))  # ranks may wait long for the slowest
    try:
        kinds = companion_kinds(args, data)
        source = source_for(data, None, kinds)
        out = Path(args.out).expanduser()
        device, dtype = pick_device(args.device, local_rank), lc.DTYPES[args.dtype]
        vae = lc.VaeCodec(args.vae, device, dtype, tiling=args.vae_tiling, allow_pickle=args.allow_pickle_weights)
        text = lc.TextEncoder(args.text_encoder, args.tokenizer, args.max_text_len, device, dtype,
                              allow_pickle=args.allow_pickle_weights) if args.text_encoder else None
        bad = [b for b in data.resolution_buckets or [] if b[0] % vae.spatial or b[1] % vae.spatial]
        if bad:
            raise ValueError(f"data.resolution_buckets {bad} are not multiples of the VAE's spatial factor {vae.spatial}")
        i2v = i2v_encoder(args, vae, device, dtype)
        companions = lc.CompanionEncoder(vae, kinds) if kinds else None
        audio = AudioLatentCodec(args.audio_vae, device, dtype, args.vocoder, args.allow_pickle_weights) if args.audio_vae else None
        settings = lc.CacheSettings(vae=vae.path, text_encoder=text.path if text else "",
                                    tokenizer=text.tokenizer_path if text else "", max_text_len=args.max_text_len if text else 0,
                                    dtype=args.dtype, source=source.cache_settings(),
                                    i2v=i2v.meta() if i2v else None, companions=list(kinds) or None,
                                    audio=audio.meta() if audio else None).as_dict()
        encoders = {"i2v": i2v, "companions": companions, "audio": audio}
        meta = lc.build_meta(vae, text, settings, audio)
        if shards_mode(args):
            return encode_shards(rank, world, args, data, source, vae, text, meta, encoders)
        lc.check_or_write_meta(out, meta, write=rank == 0)
        if rank == 0 and text is not None and not (out / lc.NULL_TEXT).is_file():
            lc.write_null_text(out, text)
        if rank == 0:
            prepare_data(data)  # embedded clips / folder index, once
        if world > 1:
            dist.barrier()
        dataset = source.pixel_dataset((1, vae.spatial, vae.spatial), cache_items=0)
        report = lc.encode_shard(dataset, out, vae, text, rank, world, progress=not args.no_progress, **encoders)
        reports = [report]
        if world > 1:
            reports = [None] * world
            dist.all_gather_object(reports, report)  # also the barrier: every rank has finished
        if rank == 0:
            return lc.write_manifest(out, dataset, reports)
        return None
    finally:
        if own_group:
            dist.destroy_process_group()


def i2v_encoder(args: argparse.Namespace, vae: lc.VaeCodec, device: str, dtype: torch.dtype) -> I2VEncoder | None:
    """--i2v: the Wan 2.1 I2V tensors of every clip (condition latents; CLIP tokens with --image-encoder)."""
    if not args.i2v:
        if args.image_encoder:
            raise ValueError("--image-encoder needs --i2v first_frame|first_last (what the image tokens condition)")
        return None
    image = ImageEncoder(args.image_encoder, device, dtype, allow_pickle=args.allow_pickle_weights) if args.image_encoder else None
    return I2VEncoder(vae, args.i2v, image)


def companion_kinds(args: argparse.Namespace, data) -> tuple[str, ...]:
    """The companions to cache: --masks (or data.masks=true among the overrides) and --control."""
    return tuple(k for k, on in zip(KINDS, (args.masks or getattr(data, "masks", False), args.control)) if on)


def shards_mode(args: argparse.Namespace) -> bool:
    """Latent shards (not a cache folder): asked for, or the output is a URL (a folder cache is local)."""
    return args.shards or is_remote(args.out)


def encode_shards(rank: int, world: int, args: argparse.Namespace, data, source, vae, text, cache_meta: dict,
                  encoders: dict) -> dict | None:
    """This rank's shards of latent shards at args.out (shards k ≡ rank mod world; finished ones
    skipped); rank 0 merges the index once every rank is done. Returns the report on rank 0.
    `encoders`: lc.clip_tensors' i2v and companions (what a cache folder's sample files hold too)."""
    fs, root = open_url(args.out, storage_options(args.storage_options), key="--out")
    if rank == 0:
        prepare_data(data)  # embedded clips / folder index, once
    if world > 1:
        dist.barrier()
    dataset = source.pixel_dataset((1, vae.spatial, vae.spatial), cache_items=0)
    per = args.samples_per_shard
    settings = {"kind": "latents", "cache": cache_meta["fingerprint"], "samples_per_shard": per,
                "sources": digest([e.path for e in dataset.entries])}
    meta = {"kind": "latents", "settings": settings, "fingerprint": fingerprint(settings), "latent": cache_meta}
    check_or_write_meta(fs, root, meta, write=rank == 0, where=args.out)
    if rank == 0 and text is not None:
        put_bytes(fs, join(root, NULL_TEXT), safetensors_bytes({"text_emb": text.encode("")}, {"caption": ""}))

    def sample(p: int):
        entry = dataset.entries[p]
        try:
            clip = dataset[p]
        except VideoReadError as err:
            return (entry.path, str(err))
        span = dataset.span_samples(p) if encoders.get("audio") is not None else 0
        tensors = lc.clip_tensors(clip, entry.caption, vae, text, **encoders, audio_span=span)
        raw = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, {"caption": entry.caption, "source": entry.path})
        row = {"source": entry.path, "caption": entry.caption, "latent_shape": list(tensors["latents"].shape),
               "text_len": int(tensors["text_emb"].shape[0]) if text is not None else 0}
        if "audio_latents" in tensors:
            row["audio_len"] = int(tensors["audio_latents"].shape[0])
        return latent_sample(p, raw, row)

    total = len(dataset)
    count = shard_count(total, per)
    report = write_shards(fs, root, total, per, lambda k: (sample(p) for p in slice_of(k, per, total)),
                          shards=list(range(rank, count, world)), progress=not args.no_progress,
                          desc=f"latent shards (rank {rank}/{world})")
    report["audio_outcomes"] = dict(dataset.audio_outcomes)  # the sound reader's, over the clips read here
    reports = [report]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, report)  # also the barrier: every rank has finished
    if rank != 0:
        return None
    index = merge_index(fs, root, count, meta, args.out, [list(s) for s in dataset.skipped])
    summary = {"samples": index["samples"], "shards": count,
               "encoded": sum(r["samples_written"] for r in reports), "reused": sum(r["samples_reused"] for r in reports),
               "unreadable": [u for r in reports for u in r["skipped"]],
               "skipped_by_source": [list(s) for s in dataset.skipped]}
    if encoders.get("audio") is not None:
        summary |= lc.audio_report([json.dumps(i) for piece in index["shardlist"] for i in piece["info"]], reports)
    put_bytes(fs, join(root, lc.REPORT), json.dumps(summary, indent=2).encode())
    return summary


def _local_worker(args: argparse.Namespace, data) -> dict | None:
    """One of --workers N local processes started by `launch.launch_local` (RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_* set by it): the CPU's threads shared between them, then `run_rank`."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return run_rank(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)), args, data, "env://")


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.cache_latents", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides choosing the source, e.g. data=video_folder data.root=videos/")
    ap.add_argument("--out", required=True, help="cache folder (then train with data=latent_cache data.root=<out>), "
                    "or with --shards / a URL (s3://...) the shard set (then data=shards data.url=<out>)")
    ap.add_argument("--shards", action="store_true", help="write indexed tar shards (implied by a URL --out)")
    ap.add_argument("--samples-per-shard", type=POSITIVE_INT, default=256, help="clips per shard (with --shards)")
    ap.add_argument("--storage-options", default="{}", help="JSON: fsspec options of --out's filesystem (with --shards)")
    ap.add_argument("--vae", required=True, help="local diffusers VAE folder (e.g. AutoencoderKLWan), or a pipeline folder")
    ap.add_argument("--text-encoder", default="", help="local transformers encoder folder (T5/UMT5/...), or a pipeline folder")
    ap.add_argument("--tokenizer", default="", help="tokenizer folder (default: the text encoder's)")
    ap.add_argument("--max-text-len", type=POSITIVE_INT, default=512, help="captions are truncated to this many tokens")
    ap.add_argument("--i2v", default="", choices=["", *I2V_KINDS],
                    help="also cache what diffusers' Wan 2.1 I2V layout needs per clip: the VAE encoding of "
                    "[first frame, zeros...] (first_last: [first, zeros..., last]) for model=wan_i2v_*")
    ap.add_argument("--masks", action="store_true", help="also cache each clip's loss mask (clip.mask.mp4, the manifest's "
                    "mask / mask_boxes) at the latent grid, for data.masks=true")
    ap.add_argument("--control", action="store_true", help="also cache each clip's control video's latents "
                    "(clip.control.mp4, the manifest's control), for cond.control=true")
    ap.add_argument("--image-encoder", default="", help="with --i2v: CLIPVisionModel folder, or a Wan I2V pipeline folder "
                    "(its image_encoder/ and image_processor/): caches the image tokens (model.image_dim)")
    ap.add_argument("--audio-vae", default="", help="AutoencoderKLLTX2Audio folder, or an LTX-2 pipeline folder: also "
                    "cache each clip's sound as LTX-2's audio latents (implies data.audio=true)")
    ap.add_argument("--vocoder", default="", help="with --audio-vae: LTX2Vocoder folder for sampling sound from the cache "
                    "(default: the pipeline folder's vocoder/)")
    ap.add_argument("--workers", type=POSITIVE_INT, default=1, help="local processes to start (ignored under torchrun)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="fp32", choices=sorted(["fp32", "bf16", "fp16"]), help="VAE / text encoder precision")
    ap.add_argument("--vae-tiling", action="store_true", help="tiled VAE encoding (large frames, less memory)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--allow-pickle-weights", action="store_true",
                    help="also read .bin/.pt weights (a pickle can run code: only from a source you trust)")
    args = ap.parse_intermixed_args(argv)
    try:
        for flag, path in (("--vae", args.vae), ("--text-encoder", args.text_encoder), ("--tokenizer", args.tokenizer),
                           ("--image-encoder", args.image_encoder), ("--audio-vae", args.audio_vae),
                           ("--vocoder", args.vocoder)):
            if path and not Path(path).expanduser().is_dir():  # before any worker starts: one line, not one per rank
                raise ValueError(f"{flag} {path}: no such folder (a local diffusers / transformers folder, or a "
                                 f"pipeline folder; hub ids are not downloaded)")
        audio_named = any(o.split("=")[0] == "data.audio" for o in args.overrides)
        data = compose_data(args.overrides + (["data.audio=true"] if args.audio_vae and not audio_named else []))
        if args.audio_vae and not getattr(data, "audio", False):
            raise ValueError("--audio-vae reads each clip's sound: leave data.audio=true (it is implied)")
        if not isinstance(source_for(data, None), PixelVideoSource):
            raise ValueError(f"data={data.name} is not a video source; use data=video_folder data.root=... (or data=synthetic_video)")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / SLURM-style launcher
            report = run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                              int(os.environ.get("LOCAL_RANK", 0)), args, data, "env://")
        elif args.workers > 1:
            # the launcher of every local run: forked workers, one line when one fails (WorkerFailure)
            report = launch.launch_local(_local_worker, (args, data), args.workers, LauncherConfig())[0]
        else:
            report = run_rank(0, 1, 0, args, data, None)
    except (ValueError, RunFailed, WorkerFailure) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C / SIGTERM: a traceback before; the samples written are kept
        how, code = interruption(err)
        print(f"error: cache_latents was {how}; the clips encoded so far are kept in {args.out}: run the same "
              f"command again to go on (it encodes only what is missing)", file=sys.stderr)
        return code
    if report is not None:
        print(f"{report['samples']} clips in {args.out} ({report['encoded']} encoded now, {report['reused']} already there); "
              f"{len(report['unreadable'])} unreadable, {len(report['skipped_by_source'])} skipped by the source "
              f"(listed in {join(args.out.rstrip('/'), lc.REPORT)})"
              + (f"; train with data=shards data.url={args.out}" if shards_mode(args) else ""))
    return 0


if __name__ == "__main__":
    interrupt_on_signals()  # SIGTERM ends it like Ctrl-C: one line, exit 143
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
