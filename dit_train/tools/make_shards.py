"""Turn a data source into webdataset-format tar shards with an index, for `data=shards data.url=URL`.

    python -m dit_train.tools.make_shards --out s3://bucket/videos data=video_folder data.root=videos/
    python -m dit_train.tools.make_shards --out shards/latents data=latent_cache data.root=latents/videos
    python -m dit_train.tools.make_shards --out s3://bucket/x --storage-options '{"profile": "training"}' ...

The source is chosen with the same data overrides as training: a folder or manifest of videos and
images (`data=video_folder data.root=...`), the embedded clips (`data=synthetic_video`) or a latent
cache (`data=latent_cache data.root=...`). Video and image files go into the shards as they are
(with their caption and probed size, and a clip's mask and control files, clip.mask.mp4 /
clip.control.mp4 or the manifest's columns, beside it), latents as the cache stores them. `--out` is a local folder
or any fsspec URL; `--storage-options` (JSON) are its filesystem's options (s3fs: key, secret,
profile, client_kwargs.endpoint_url, ...; without them s3fs finds credentials as the AWS tools
do). `--workers` threads write shards side by side; shards already finished are skipped, so an
interrupted run is resumed by running the same command again. The index (index.json) is written
once every shard is there. Layout and index: data_pipelines/shard_index.py; docs/data-at-scale.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from dit_train.compose import compose
from dit_train.config.errors import RunFailed
from dit_train.data_pipelines import latent_cache as lc, prepare_data, source_for
from dit_train.data_pipelines.companions import KINDS
from dit_train.data_pipelines.latent_cache_source import LatentCacheSource
from dit_train.data_pipelines.shard_index import NULL_TEXT, check_or_write_meta, fingerprint, merge_index
from dit_train.data_pipelines.shard_store import join, open_url, put_bytes
from dit_train.data_pipelines.shard_writer import latent_sample, pixel_shard, shard_count, slice_of, write_shards
from dit_train.data_pipelines.video_source import PixelVideoSource
from dit_train.tools.args import POSITIVE_INT, ToolParser

# read settings of pixel sources: they apply when training reads the shards, not to what is written
READ_KEYS = ("max_frames", "frame_stride", "fps", "resolution_buckets")


def digest(items: list[str]) -> str:
    """What identifies the list of samples written (a changed folder must not continue old shards)."""
    return hashlib.sha1("\n".join(items).encode()).hexdigest()[:16]


def storage_options(text: str) -> dict:
    try:
        options = json.loads(text or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"--storage-options {text!r} is not JSON ({err.msg}); e.g. '{{\"profile\": \"training\"}}'") from err
    if not isinstance(options, dict):
        raise ValueError(f"--storage-options {text!r} must be a JSON object")
    return options


def pixel_plan(source: PixelVideoSource, per_shard: int) -> tuple[dict, int, object, list]:
    """(meta, samples, produce, skipped) of a pixel source."""
    entries, skipped = source.entries()
    identity = {k: v for k, v in source.cache_settings().items() if k not in READ_KEYS}
    settings = {"kind": "pixels", "source": identity, "samples_per_shard": per_shard,
                "sources": digest([e.path for e in entries])}
    held = [k for k in KINDS if any(e.companions.has(k) for e in entries)]
    if held:  # the clips' mask / control files go in too (data.masks, cond.control); a set without them keeps its fingerprint
        settings["companions"] = held
    meta = {"kind": "pixels", "settings": settings, "fingerprint": fingerprint(settings)}
    return meta, len(entries), pixel_shard(entries, per_shard), [list(s) for s in skipped]


def latent_plan(root: Path, per_shard: int) -> tuple[dict, int, object, list]:
    """(meta, samples, produce, skipped) of a latent cache folder."""
    info = lc.read_cache_info(root)
    manifest = root / lc.MANIFEST
    if not manifest.is_file():
        raise ValueError(f"{manifest} not found: the cache tool did not finish; run it again (it resumes)")
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    settings = {"kind": "latents", "cache": info["fingerprint"], "samples_per_shard": per_shard,
                "sources": digest([r["source"] for r in rows])}
    meta = {"kind": "latents", "settings": settings, "fingerprint": fingerprint(settings), "latent": info}

    def sample(p: int):
        row = rows[p]
        try:
            return latent_sample(p, (root / row["file"]).read_bytes(), row)
        except OSError as err:
            return (row["source"], f"cannot read {root / row['file']}: {err.strerror or err}")

    return meta, len(rows), lambda k: (sample(p) for p in slice_of(k, per_shard, len(rows))), []


def make_shards(overrides: list[str], out: str, options: dict, per_shard: int, workers: int, progress: bool) -> dict:
    data = compose(list(overrides)).data
    source = source_for(data, None, KINDS)  # a folder's entries with their mask / control files
    fs, root = open_url(out, options, key="--out")
    if isinstance(source, PixelVideoSource):
        prepare_data(data)  # the embedded clips / the folder's probe index
        meta, total, produce, skipped = pixel_plan(source, per_shard)
    elif isinstance(source, LatentCacheSource):
        if not data.root:
            raise ValueError("data=latent_cache needs data.root=<folder written by python -m dit_train.tools.cache_latents>")
        meta, total, produce, skipped = latent_plan(Path(data.root).expanduser(), per_shard)
        if meta["latent"].get("null_text_emb"):
            put_bytes(fs, join(root, NULL_TEXT), (Path(data.root).expanduser() / lc.NULL_TEXT).read_bytes())
    else:
        raise ValueError(f"data={data.name} cannot be written to shards; use data=video_folder data.root=..., "
                         f"data=synthetic_video or data=latent_cache data.root=...")
    check_or_write_meta(fs, root, meta, write=True, where=out)
    report = write_shards(fs, root, total, per_shard, produce, workers=workers, progress=progress)
    index = merge_index(fs, root, shard_count(total, per_shard), meta, out, skipped)
    return {**report, "samples": index["samples"], "shards": len(index["shardlist"]), "skipped": index["skipped"]}


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.make_shards", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides choosing the source, e.g. data=video_folder data.root=videos/")
    ap.add_argument("--out", required=True, help="folder or URL of the shard set (then train with data=shards data.url=<out>)")
    ap.add_argument("--storage-options", default="{}", help="JSON: fsspec options of --out's filesystem")
    ap.add_argument("--samples-per-shard", type=POSITIVE_INT, default=256,
                    help="samples per tar (aim at shards of ~0.5-2 GB)")
    ap.add_argument("--workers", type=POSITIVE_INT, default=4, help="threads writing shards side by side")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_intermixed_args(argv)
    try:
        report = make_shards(args.overrides, args.out, storage_options(args.storage_options), args.samples_per_shard,
                             args.workers, not args.no_progress)
    except (ValueError, RunFailed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{report['samples']} samples in {report['shards']} shards at {args.out} ({report['written']} written now, "
          f"{report['reused']} already there); {len(report['skipped'])} skipped (listed in "
          f"{join(args.out.rstrip('/'), 'index.json')}). Train with: data=shards data.url={args.out}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
