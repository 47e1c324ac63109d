"""data=shards: tar shards with an index, made from the embedded clips (uneven lengths) into a
local folder and into a real S3 endpoint (moto's server, reached through s3fs), read back
sample for sample, trained on to the folder's weights on several layouts, resumed exactly, and
robust to missing / corrupt shards and to a flaky network."""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("webdataset")

from dit_train.compose import compose  # noqa: E402
from dit_train.config.errors import ConfigError, DataFailure, DataUnreachable  # noqa: E402
from dit_train.data_pipelines import source_for  # noqa: E402
from dit_train.data_pipelines.packing import step_samples  # noqa: E402
from dit_train.data_pipelines.shard_store import ShardCache, ShardReader  # noqa: E402
from dit_train.data_pipelines.video_io import VideoReadError  # noqa: E402
from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers  # noqa: E402
from dit_train.tools.make_shards import main as make_shards  # noqa: E402
from tests.conftest import TINY, TINY_MODEL, train_in_process  # noqa: E402

# the embedded clips of the tiny setup (uneven lengths); READ: how both sources read them
CLIPS = [o for o in TINY if o.startswith("data.")] + ["data=synthetic_video"]
READ = ["data.max_frames=8", "data.resolution_buckets=[]", "data.decoded_cache_items=0"]
PER_SHARD = 5  # 16 clips -> 4 shards, the last one short


def _make(out: str, cache: str, *extra: str) -> int:
    return make_shards(["--out", out, "--samples-per-shard", str(PER_SHARD), "--no-progress", "--workers", "2",
                        *CLIPS, f"data.cache_dir={cache}", *extra])


def _shards_cfg(s3, prefix: str, cache: str, *extra: str):
    cfg = compose([*TINY_MODEL, *s3.overrides(prefix), *READ, f"data.cache_dir={cache}", *extra])
    cfg.data.num_workers = 0
    return cfg


@pytest.fixture(scope="module")
def s3_clips(s3_endpoint, tiny_cfg, data_cache):
    """The tiny setup's clips written straight to the bucket."""
    assert _make(s3_endpoint.url("clips"), data_cache, "--storage-options", json.dumps(s3_endpoint.options)) == 0
    return "clips"


def _datasets(s3, prefix, tiny_cfg, data_cache):
    folder = compose([*TINY, *READ, f"data.cache_dir={data_cache}"])
    shards = _shards_cfg(s3, prefix, data_cache)
    return (source_for(folder.data, folder.model).open(), source_for(shards.data, shards.model).open())


def test_shards_on_s3_hold_the_folders_clips(s3_endpoint, s3_clips, tiny_cfg, data_cache):
    """Same ids, lengths, pixels and captions as the folder; lengths need no read of the shards."""
    folder, shards = _datasets(s3_endpoint, s3_clips, tiny_cfg, data_cache)
    assert type(shards).__name__ == "ShardClipDataset"
    assert shards.lengths() == folder.lengths() and len(set(folder.lengths())) > 3  # uneven
    assert shards.reader.stats["remote_reads"] == 0  # the plan is made from the index alone
    for i in range(len(folder)):
        a, b = folder[i], shards[i]
        assert torch.equal(a.pixels, b.pixels) and a.caption == b.caption, i
    assert shards.reader.stats["remote_reads"] == len(folder)  # one range request per sample


def test_the_shards_are_webdataset_tars_and_reruns_skip_finished_ones(tmp_path, tiny_cfg, data_cache):
    import webdataset

    out = tmp_path / "set"
    assert _make(str(out), data_cache) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["wids_version"] == 1 and [s["nsamples"] for s in index["shardlist"]] == [5, 5, 5, 1]
    samples = list(webdataset.WebDataset([str(out / s["url"]) for s in index["shardlist"]], shardshuffle=False))
    assert len(samples) == 16 and all({"mp4", "txt", "json"} <= set(s) for s in samples)
    tars = sorted(out.glob("*.tar"))
    stamps = {p: p.stat().st_mtime_ns for p in tars}
    assert _make(str(out), data_cache) == 0  # all finished: nothing rewritten
    assert all(p.stat().st_mtime_ns == stamps[p] for p in tars)
    (out / "shard-000002.json").unlink()  # shard 2 unfinished (its tar may be half written)
    (out / "shard-000002.tar").write_bytes(b"half")
    assert _make(str(out), data_cache) == 0
    assert [p for p in tars if p.stat().st_mtime_ns != stamps[p]] == [out / "shard-000002.tar"]
    assert json.loads((out / "index.json").read_text())["shardlist"] == index["shardlist"]
    # other clips into the same set: refused (the old shards hold other samples)
    assert _make(str(out), data_cache, "data.num_clips=12") == 1


def test_shards_are_written_side_by_side_with_a_progress_bar(tmp_path, capsys):
    """make_shards' --workers: shards are made at the same time (each of two shards waits until
    the other is being made too), and the bar counts finished shards."""
    from dit_train.data_pipelines.shard_store import open_url
    from dit_train.data_pipelines.shard_writer import ShardSample, write_shards

    both = threading.Barrier(2, timeout=10)

    def produce(k: int):
        both.wait()  # passes only while another shard is being made
        yield ShardSample(f"{k:09d}", {"txt": f"sample {k}"}, {"k": k})

    fs, root = open_url(str(tmp_path / "set"))
    report = write_shards(fs, root, 4, 1, produce, workers=2, progress=True, desc="writing shards")
    assert (report["written"], report["samples_written"]) == (4, 4)
    assert "writing shards: 100%" in capsys.readouterr().err and (tmp_path / "set" / "shard-000003.json").is_file()


@pytest.mark.slow
def test_same_weights_as_the_folder_on_every_layout(s3_endpoint, s3_clips, tiny_cfg, data_cache):
    """The one-process folder run is the oracle; data=shards from the bucket on 1 process and on
    DP / CP / accumulation layouts must give its weights (and EMA weights)."""
    folder = apply_layout(tiny_cfg, {})
    folder.model.depth = 1  # one block: the runs are Python-bound, and what is read needs no second
    folder.optim.max_grad_norm = 0.05
    folder.train.ema_decay = 0.9
    folder.data.resolution_buckets, folder.data.decoded_cache_items = [], 0
    shards = _shards_cfg(s3_endpoint, s3_clips, data_cache)
    shards.optim, shards.train = folder.optim, folder.train
    shards.model.depth = 1
    layouts = ["1", "dp_shard=2", "dp_shard=2,cp_ulysses=2,grad_accum=2", "dp_replicate=2,dp_shard=2,micro_batch_tokens=600"]
    results = train_on_workers([folder] + [apply_layout(shards, parse_layout(spec)) for spec in layouts])
    oracle = results[0]
    assert relative_difference(oracle, results[1]) < 1e-5  # 1 process: the same samples, bytes and steps
    for spec, got in zip(layouts[1:], results[2:]):
        assert relative_difference(oracle, got) <= 1e-4, spec


@pytest.mark.slow
def test_resume_from_the_bucket_is_exact(s3_endpoint, s3_clips, tmp_path, data_cache):
    from safetensors.torch import load_file

    base = [*TINY_MODEL, *s3_endpoint.overrides(s3_clips), *READ, f"data.cache_dir={data_cache}", "train.steps=4",
            "train.ema_decay=0.9"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=2", "train.keep_last=5"], full)
    # resumed on another layout, with background readers and a local shard cache
    train_in_process([*base, "parallel.dp_shard=2", "data.num_workers=3", "data.shard_cache_gb=1",
                      f"train.resume={full / 'checkpoints' / 'step_00000001'}"], part)
    for name in ("weights.safetensors", "weights_ema.safetensors"):
        a, b = load_file(full / name), load_file(part / name)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5, name


def _copy_set(s3, src: str, dst: str) -> None:
    fs = s3.fs()
    for path in fs.ls(s3.url(src)):
        fs.copy(path, path.replace(f"/{src}/", f"/{dst}/"))


def test_missing_and_corrupt_shards_are_skipped_and_counted(s3_endpoint, s3_clips, tmp_path, data_cache):
    _copy_set(s3_endpoint, s3_clips, "damaged")
    fs = s3_endpoint.fs()
    fs.rm(s3_endpoint.url("damaged/shard-000001.tar"))  # missing: samples 5..9
    tar = fs.cat_file(s3_endpoint.url("damaged/shard-000003.tar"))
    fs.pipe_file(s3_endpoint.url("damaged/shard-000003.tar"), tar[:2000] + bytes(len(tar) - 2000))  # sample 15 zeroed
    cfg = _shards_cfg(s3_endpoint, "damaged", data_cache)
    ds = source_for(cfg.data, cfg.model).open()
    with pytest.raises(VideoReadError, match="shard-000001.tar is missing"):
        ds[6]
    with pytest.raises(VideoReadError, match="shard-000003.tar is corrupt"):
        ds[15]
    assert ds[4].pixels.numel() and ds[10].pixels.numel()  # the other shards still read
    # a run: 6 of 16 samples cannot be read -> over data.max_dropped_fraction=0.05 the run stops...
    run = [*TINY_MODEL, *s3_endpoint.overrides("damaged"), *READ, f"data.cache_dir={data_cache}", "train.steps=3"]
    with pytest.raises(DataFailure, match=r"data.max_dropped_fraction=0.05; e.g. shard s3://dit-train/damaged/shard-00000"):
        train_in_process(run, tmp_path / "strict")
    # ...and with a higher threshold it trains on the rest, every planned read of a bad sample counted
    train_in_process([*run, "data.max_dropped_fraction=0.6"], tmp_path / "lenient")
    summary = json.loads((tmp_path / "lenient" / "summary.json").read_text())
    bad = {5, 6, 7, 8, 9, 15}
    planned = [i for step in range(3) for i in step_samples(step, 16, cfg.train.global_batch, cfg.train.seed)]
    assert summary["status"] == "completed" and summary["samples_dropped"] == sum(i in bad for i in planned) > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoint_options(s3, port: int) -> dict:
    """s3_endpoint's storage options aimed at 127.0.0.1:`port`, with botocore's own retries off
    (what is tested is ours: data.read_retries)."""
    return {**s3.options, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}}}


def _options_override(options: dict) -> str:
    """+data.storage_options=... in Hydra's override grammar (quoted strings, bare keys)."""
    def value(v):
        return "{" + ", ".join(f"{k}: {value(x)}" for k, x in v.items()) + "}" if isinstance(v, dict) else (
            f"'{v}'" if isinstance(v, str) else str(v))

    return f"+data.storage_options={value(options)}"


def test_network_errors_are_retried_then_one_clear_error(s3_endpoint, s3_clips, tmp_path, data_cache):
    """An endpoint that is down for a while is waited for (retries with backoff); one that stays
    down stops the run with DataUnreachable naming the URL: before step 0 when the index cannot
    be read, and mid-run when a sample cannot (never a skipped, counted sample)."""
    from moto.server import ThreadedMotoServer

    from dit_train.tasks import build_task

    port = _free_port()
    options = _endpoint_options(s3_endpoint, port)
    # the set's URL (not the session endpoint's options), reached through `port`
    run = [*TINY_MODEL, *s3_endpoint.overrides(s3_clips)[:2], *READ, f"data.cache_dir={data_cache}",
           "data.num_workers=0", "data.read_retries=2", "data.retry_backoff_s=0.05", _options_override(options)]
    # nobody listens on the port: the run is refused before step 0 (the CLI prints this one line)
    with pytest.raises(DataUnreachable, match=r"s3://dit-train/clips/index.json could not be read after 3 tries"):
        train_in_process(run, tmp_path / "down")
    # the endpoint goes away mid-run (after the plan was made from the index): the step stops with
    # DataUnreachable; the sample is not dropped and counted (moto's buckets live in this process,
    # so a second server on another port serves the same objects)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    cfg = compose(run)
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    assert len(task.lengths()) == 16
    server.stop()
    with pytest.raises(DataUnreachable, match=r"s3://dit-train/clips/shard-00000\d.tar could not be read after 3 tries"):
        task.build([0, 1], step=0)
    assert not task.failed
    # the endpoint comes back 0.5 s after the first failed try: the retries wait for it
    piece = json.loads(s3_endpoint.fs().cat_file(s3_endpoint.url(f"{s3_clips}/shard-000000.json")))
    start, size, shard_size = piece["offsets"][0], piece["sizes"][0], piece["size"]
    later = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    threading.Timer(0.5, later.start).start()
    try:
        flaky = ShardReader(s3_endpoint.url(s3_clips), options, retries=6, backoff_s=0.1)
        t0 = time.perf_counter()
        assert len(flaky.read("shard-000000.tar", start, size, shard_size)) == size
        assert time.perf_counter() - t0 > 0.3
    finally:
        time.sleep(0.2)
        later.stop()


def test_local_shard_cache_keeps_whole_shards_under_its_limit(s3_endpoint, s3_clips, tmp_path, data_cache):
    cfg = _shards_cfg(s3_endpoint, s3_clips, data_cache, f"data.cache_dir={tmp_path}", "data.shard_cache_gb=1")
    ds = source_for(cfg.data, cfg.model).open()
    first = [ds[i].pixels for i in range(len(ds))]
    stats = ds.reader.stats
    assert stats["shards_copied"] == 4 and stats["remote_reads"] == 0  # each shard copied on its first read
    assert all(torch.equal(a, ds[i].pixels) for i, a in enumerate(first)) and stats["local_reads"] == 2 * len(ds)
    sizes = sorted(p.stat().st_size for p in (tmp_path / "shards").rglob("*.tar"))
    # a limit that holds two of the big shards, with another set's old shard in the way: that one
    # goes; this set's own shards are never evicted for each other (the rest is read by ranges)
    other = tmp_path / "small" / "shards" / "0000other"
    other.mkdir(parents=True)
    (other / "old.tar").write_bytes(bytes(sizes[-1]))
    os.utime(other / "old.tar", (1, 1))
    limit = sizes[-1] + sizes[-2] + sizes[0]
    reader = ShardReader(cfg.data.url, cfg.data.storage_options,
                         cache=ShardCache(str(tmp_path / "small"), cfg.data.url, limit))
    index = ds.reader  # noqa: F841  (the dataset's reader holds the set's URL)
    small = ShardClipDataset_over(ds, reader)
    for i in range(len(small)):
        assert torch.equal(small[i].pixels, first[i])
    used = sum(p.stat().st_size for p in (tmp_path / "small" / "shards").rglob("*") if p.is_file())
    assert not (other / "old.tar").exists() and used <= limit
    assert 0 < reader.stats["shards_copied"] < 4 and reader.stats["remote_reads"] > 0


def test_the_cache_skips_copies_renamed_while_it_lists(tmp_path, monkeypatch):
    # Local ranks share the cache folder: one rank lists it to make room while another renames its
    # `.part` copy into place (CI saw FileNotFoundError from the stat of such a file).
    cache = ShardCache(str(tmp_path), "s3://bucket/set", limit_bytes=100)
    other = tmp_path / "shards" / "0000other"
    other.mkdir(parents=True)
    (other / "old.tar").write_bytes(bytes(60))
    listing = Path.rglob

    def listed_then_renamed(self, pattern):
        yield from listing(self, pattern)
        part = cache.dir / "shard-000001.tar.kknm978x.part"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.touch()
        yield part  # exists when listed, renamed before the listing ends
        part.unlink()

    monkeypatch.setattr(Path, "rglob", listed_then_renamed)
    assert cache.used() == 60
    assert cache.want("shard-000002.tar", 50)  # the other set's old shard makes room
    assert not (other / "old.tar").exists()


def ShardClipDataset_over(ds, reader):
    """The same clips as `ds`, read through another reader."""
    from dit_train.data_pipelines.shard_datasets import ShardClipDataset

    return ShardClipDataset(ds.entries, reader, patch=ds.patch, max_frames=ds.max_frames, frame_stride=ds.frame_stride,
                            fps=ds.fps, buckets=ds.buckets, cache_items=0)


def test_refusals_name_the_key_before_step_0(tmp_path, s3_endpoint, data_cache):
    from dit_train.tasks import check_data

    def refused(*overrides):
        with pytest.raises(ConfigError) as err:
            check_data(compose([*TINY_MODEL, *READ, f"data.cache_dir={data_cache}", *overrides]))
        return str(err.value)

    assert "data=shards needs data.url=" in refused("data=shards")
    assert "holds no index.json" in refused("data=shards", f"data.url={tmp_path}")
    assert "holds no index.json" in refused(*s3_endpoint.overrides("nothing-here"))
    assert "gcsfs" in refused("data=shards", "data.url=gs://bucket/shards")  # the package to install


def test_bench_data_compares_readers_with_the_step(tiny_cfg, data_cache, tmp_path, capsys):
    """The benchmark runs end to end on the tiny setup (its figures come from the full run in
    docs/data-at-scale.md, never from tests)."""
    from dit_train.tools.bench_data import main

    out = tmp_path / "data.json"
    assert main([*TINY, f"data.cache_dir={data_cache}", "--steps", "1", "--samples-per-shard", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    readers = [r["reader"] for r in res["rows"]]
    assert readers[:3] == ["synthetic_video (as configured)", "shards, local folder", "shards over S3 (moto on 127.0.0.1)"]
    assert readers[3].startswith("training step consumes")
    assert all(r["samples/s per rank"] > 0 and r["tokens/s per rank"] > 0 for r in res["rows"])
    assert res["rows"][2]["range reads"] == 1 + 6  # a warm-up read, then a step of 6 samples: one request each
    assert len(res["bottleneck"]) == 3 and "bottleneck" in capsys.readouterr().out


@pytest.mark.parametrize("forged", ["../../../../etc/passwd", "/etc/passwd", "file:///etc/passwd"])
def test_an_index_naming_a_shard_outside_its_set_is_refused(tmp_path, tiny_cfg, data_cache, forged):
    """index.json is input from whoever wrote the set: a shard url that leaves it is one error
    naming the index, before any shard is read (only the CRC stopped such a read before)."""
    from dit_train.data_pipelines.shard_index import load_index

    out = tmp_path / "set"
    assert _make(str(out), data_cache) == 0
    index = json.loads((out / "index.json").read_text())
    index["shardlist"][1]["url"] = forged
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="a data file may only name files inside its own folder") as err:
        load_index(str(out))
    assert f"{out}/index.json" in str(err.value) and repr(forged) in str(err.value)


@pytest.mark.parametrize("damage, says", [
    ("not_json", "index.json is not a readable index"),
    ("negative_size", "has size=-5 (an integer >= 0)"),
    ("no_frames", "is damaged (KeyError: 'frames')"),
])
def test_a_damaged_index_is_one_error_at_once_not_blamed_on_the_network(tmp_path, tiny_cfg, data_cache, damage, says):
    """A corrupt local index.json was retried for 15 s and blamed on "the endpoint, the network and
    the credentials"; a negative size or a sample without `frames` was a traceback in the plan."""
    from dit_train.data_pipelines.shard_index import load_index

    out = tmp_path / "set"
    assert _make(str(out), data_cache) == 0
    index = json.loads((out / "index.json").read_text())
    if damage == "not_json":
        (out / "index.json").write_text('{"kind": "pixels", "shardl')
    else:
        if damage == "negative_size":
            index["shardlist"][0]["size"] = -5
        else:
            del index["shardlist"][0]["info"][1]["frames"]
        (out / "index.json").write_text(json.dumps(index))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        load_index(str(out))
    assert time.perf_counter() - t0 < 2 and "network" not in str(err.value) and "make_shards" in str(err.value)


def test_an_index_whose_sizes_do_not_match_the_clip_skips_the_clip_naming_it(tmp_path, tiny_cfg, data_cache):
    """index.json with a clip's height and width swapped trained with rc 0 on other tokens than
    planned (the plan is made from the index): the decoded size is checked against it, and the
    clip is skipped and counted like an unreadable one, naming the shard."""
    out = tmp_path / "set"
    assert _make(str(out), data_cache) == 0
    index = json.loads((out / "index.json").read_text())
    info = index["shardlist"][0]["info"][0]
    if info["height"] == info["width"]:
        pytest.skip("the first clip is square")
    info["height"], info["width"] = info["width"], info["height"]
    (out / "index.json").write_text(json.dumps(index))
    cfg = compose([*TINY_MODEL, "data=shards", f"data.url={out}", *READ, f"data.cache_dir={data_cache}"])
    cfg.data.num_workers = 0
    ds = source_for(cfg.data, cfg.model).open()
    with pytest.raises(VideoReadError, match=r"shard-000000.tar .*decodes to \d+x\d+"):
        ds[0]
    assert ds[1].pixels.numel()
