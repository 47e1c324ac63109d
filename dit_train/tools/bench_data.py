"""Does the input pipeline keep up? Samples/s and tokens/s that one rank's reader delivers from a
folder, from local shards and from shards behind an S3 endpoint, beside what a training step
consumes, and which of them is the bottleneck.

    python -m dit_train.tools.bench_data                                   # the embedded clips, tiny DiT
    python -m dit_train.tools.bench_data data=video_folder data.root=videos/ data.num_workers=16
    python -m dit_train.tools.bench_data --s3 s3://bucket/bench --storage-options '{"profile": "x"}'

Each reader is the one training uses (`data.num_workers` background threads, the step plan's
order, the next step announced ahead): it reads the global batches of `--steps` steps as one
rank of a data-parallel group of `--dp` would (its share of each step; no decoded clip kept in
memory). The step's rate is a training step of the configured model on this machine (1
process), timed on samples already in memory: what a rank consumes. The shards are written by
tools.make_shards into a temporary folder and, for the S3 row, to `--s3` (default: moto's S3
server started on 127.0.0.1 in a separate process, when moto is installed; its figures measure
this machine's loopback and moto's Python server, not a cloud bucket).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from dit_train.compose import compose
from dit_train.data_pipelines import open_dataset, prepare_data, source_for
from dit_train.data_pipelines.packing import plan_step
from dit_train.engine.build import build_run
from dit_train.perf.bench import format_table, write_json
from dit_train.tasks import check_data, resolve_config
from dit_train.tasks.video import VideoTask
from dit_train.tools.args import POSITIVE_INT, ToolParser
from dit_train.tools.make_shards import make_shards, storage_options


def step_ids(lengths: list[int], cfg: Any, steps: int, dp: int) -> list[list[int]]:
    """Rank 0's sample ids of each of the first `steps` steps (dp ranks share each global batch)."""
    t = cfg.train
    return [[i for mb in plan_step(s, dict(enumerate(lengths)), t.global_batch, dp, 1, 10 ** 9, t.seed).micro_batches[0]
             for i in mb] for s in range(steps)]


def read_rate(data_cfg: Any, model_cfg: Any, steps: list[list[int]]) -> dict:
    """Read `steps` (ids per step) as the trainer does: announce this step and the next, then read
    this step's samples. Returns samples, tokens, seconds and what the reader counted."""
    ds = open_dataset(data_cfg, model_cfg)
    lengths = ds.lengths()
    ds[steps[0][0]]  # one-time costs (the video reader's first use, a connection) are not the rate
    t0 = time.perf_counter()
    samples = tokens = 0
    for s, ids in enumerate(steps):
        if hasattr(ds, "prefetch"):
            ds.prefetch(ids + (steps[s + 1] if s + 1 < len(steps) else []))
        for i in ids:
            ds[i]
            samples += 1
            tokens += lengths[i]
    seconds = time.perf_counter() - t0
    if hasattr(ds, "close"):
        ds.close()
    reader = getattr(getattr(ds, "dataset", ds), "reader", None)
    return {"samples": samples, "tokens": tokens, "seconds": seconds, "reads": dict(reader.stats) if reader else {}}


class Preloaded:
    """The samples of a dataset already decoded (the rest of it, e.g. null_text_emb, passed
    through): times the step alone."""

    def __init__(self, ds: Any, ids: set[int]):
        self.dataset, self._items = ds, {i: ds[i] for i in ids}

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return self.dataset.lengths()

    def __getitem__(self, i: int) -> Any:
        return self._items[i]


def step_rate(cfg: Any, steps: int, dp: int) -> dict:
    """Samples and tokens a training step consumes per second on one process (data preloaded),
    scaled to one rank of `dp` (its share of the global batch takes the same time)."""
    lengths = check_data(cfg)
    cfg = resolve_config(cfg, lengths)
    ds = open_dataset(dataclasses.replace(cfg.data, num_workers=0), cfg.model)
    timed = list(range(1, steps + 1))  # step 0 warms up
    ids = {i for s in [0, *timed] for i in plan_step(s, dict(enumerate(lengths)), cfg.train.global_batch, 1, 1,
                                                      cfg.train.micro_batch_tokens, cfg.train.seed).sample_ids}
    task = VideoTask(Preloaded(ds, ids), cfg.model, cfg.loss, cfg.train.seed, caption_dropout=cfg.data.caption_dropout)
    run = build_run(cfg, task=task)
    run.trainer.step(0)
    t0 = time.perf_counter()
    samples = tokens = 0
    for s in timed:
        res = run.trainer.step(s)
        samples, tokens = samples + res.samples, tokens + res.tokens
    seconds = time.perf_counter() - t0
    return {"samples": samples / dp, "tokens": tokens / dp, "seconds": seconds}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_endpoint() -> Iterator[tuple[str, dict]]:
    """moto's S3 server in a separate process on 127.0.0.1 with a bucket `bench`: (URL, options)."""
    if importlib.util.find_spec("moto") is None:
        raise ValueError("the S3 row needs moto's server (pip install 'dit_train[test]'), or --s3 URL")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # up within 20 s
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.1)
        # CreateBucket is a bare PUT (moto checks no signature; s3fs's mkdir sends a location moto refuses)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"), timeout=10).close()
        yield "s3://bench/shards", {"key": "bench", "secret": "bench",
                                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    finally:
        server.terminate()
        server.wait(timeout=10)


def bench(overrides: list[str], steps: int, dp: int, s3: str, options: dict, per_shard: int,
          workers: list[int] | None = None) -> dict:
    """The table's rows (each reader at each number of background threads, then the step), a
    verdict per row and the machine's load. workers: data.num_workers values (default: the config's)."""
    cfg = compose(list(overrides))
    prepare_data(cfg.data, cfg.model)
    lengths = check_data(cfg)
    cfg = resolve_config(cfg, lengths)
    threads = workers or [cfg.data.num_workers]
    plan = step_ids(lengths, cfg, steps, dp)
    shards_data = {k: getattr(cfg.data, k) for k in ("max_frames", "frame_stride", "fps", "resolution_buckets", "decoder")
                   if hasattr(cfg.data, k)}
    rows = []

    def row(name: str, data_cfg: Any) -> None:
        for n in threads:
            r = read_rate(dataclasses.replace(data_cfg, num_workers=n), cfg.model, plan)
            rows.append({"reader": name, "data.num_workers": n, "samples/s per rank": r["samples"] / r["seconds"],
                         "tokens/s per rank": r["tokens"] / r["seconds"],
                         **({"range reads": r["reads"].get("remote_reads", 0)} if r["reads"] else {})})

    folder_data = dataclasses.replace(cfg.data, decoded_cache_items=0) if hasattr(cfg.data, "decoded_cache_items") else cfg.data
    row(f"{cfg.data.name} (as configured)", folder_data)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        local = os.path.join(tmp, "shards")
        make_shards(list(overrides), local, {}, per_shard, 4, progress=False)
        shard_cfg = compose(["data=shards", f"data.url={local}", *[o for o in overrides if o.startswith(("model", "train"))]])
        shard_cfg = dataclasses.replace(shard_cfg, data=dataclasses.replace(
            shard_cfg.data, cache_dir=cfg.data.cache_dir, decoded_cache_items=0, **shards_data))
        source_for(shard_cfg.data, shard_cfg.model)  # refuses a model that cannot read the shards
        row("shards, local folder", shard_cfg.data)
        with (moto_endpoint() if not s3 else _given(s3, options)) as (url, opts):
            url = f"{url.rstrip('/')}/{uuid.uuid4().hex[:8]}"
            make_shards(list(overrides), url, opts, per_shard, 4, progress=False)
            remote = dataclasses.replace(shard_cfg.data, url=url, storage_options=opts, cache_dir=tmp)
            row("shards over S3 (moto on 127.0.0.1)" if not s3 else f"shards at {s3}", remote)
    step = step_rate(cfg, steps, dp)
    consumed = step["samples"] / step["seconds"]
    rows.append({"reader": f"training step consumes (model={cfg.model.name}, 1 of dp={dp})",
                 "samples/s per rank": consumed, "tokens/s per rank": step["tokens"] / step["seconds"]})
    for r in rows[:-1]:
        r["vs step"] = r["samples/s per rank"] / consumed
    return {"rows": rows, "bottleneck": verdicts(rows[:-1]), "steps": steps, "dp": dp, "load": load_average()}


@contextmanager
def _given(url: str, options: dict) -> Iterator[tuple[str, dict]]:
    yield url, options


def verdicts(rows: list[dict]) -> list[str]:
    """One line per reader: which side is the bottleneck."""
    out = []
    for r in rows:
        who = f"{r['reader']}, data.num_workers={r['data.num_workers']}"
        if r["vs step"] < 1:
            out.append(f"{who}: the DATA is the bottleneck (it reads {r['vs step']:.2f}x what a step consumes): "
                       f"raise data.num_workers, or keep shards local (data.shard_cache_gb)")
        else:
            out.append(f"{who}: the training step is the bottleneck (data is read {r['vs step']:.1f}x as fast)")
    return out


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.bench_data", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides (data, model, train) as for training")
    ap.add_argument("--steps", type=POSITIVE_INT, default=8, help="steps of samples read per reader")
    ap.add_argument("--dp", type=POSITIVE_INT, default=1, help="data-parallel ranks sharing each global batch")
    ap.add_argument("--samples-per-shard", type=POSITIVE_INT, default=16)
    ap.add_argument("--workers", default="", help="data.num_workers values to measure, e.g. 0,4 (default: the config's)")
    ap.add_argument("--s3", default="", help="s3:// (or any fsspec) URL to write the benchmark's shards under; "
                                            "default: moto's server on 127.0.0.1")
    ap.add_argument("--storage-options", default="{}", help="JSON: fsspec options of --s3")
    ap.add_argument("--out", default="", help="JSON results (default benchmarks/results/data.json)")
    a = ap.parse_intermixed_args(argv)
    try:
        workers = [int(w) for w in a.workers.split(",") if w.strip()] if a.workers else None
        res = bench(a.overrides, a.steps, a.dp, a.s3, storage_options(a.storage_options), a.samples_per_shard, workers)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"load average {res['load']} (other work on the machine slows every row alike; compare ratios)")
    print(format_table(res["rows"]))
    print("\n".join(res["bottleneck"]))
    print(f"wrote {write_json(a.out, 'data', {'args': vars(a), **res})}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
