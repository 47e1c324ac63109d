"""Masks and control videos off a latent cache and latent shards (`tools.cache_latents --masks
--control [--shards]`), and Wan 2.1 I2V's tensors into latent shards (`--i2v --shards`): what the
training reader gets from them is what the raw folder's clips give, computed the raw path's way."""
from __future__ import annotations

import pytest
import torch

from dit_train.batch import WEIGHT_ONE
from tests.conftest import TEXT_DIM, TINY_MODEL, Z_DIM, compose_config, companion_cache_args

LATENT_PATCH = (1, 2, 2)


def latent_cfg(overrides: list[str]):
    return compose_config([*TINY_MODEL, "model=wan_tiny", "model.heads=2", "model.patch_size=[1,2,2]",
                           f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}", "train.global_batch=4",
                           "train.micro_batch_tokens=0", "data.num_workers=0", *overrides])


def task_of(cfg):
    from dit_train.tasks import build_task

    return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)


@pytest.fixture(scope="module")
def raw_clips(companion_folder, companion_cache):
    """{source path: VideoSample} of the folder's clips read as the cache tool reads them (the
    VAE's (1, s, s) crop), with their 8-bit masks and control pixels: the raw path."""
    from dit_train.data_pipelines import source_for
    from dit_train.tools.cache_latents import compose_data

    data = compose_data(["data=video_folder", f"data.root={companion_folder}", "data.max_frames=9",
                         f"data.cache_dir={companion_cache.parent / 'probe_cache'}", "data.resolution_buckets=null"])
    ds = source_for(data, None, ("mask", "control")).pixel_dataset((1, 8, 8), cache_items=0)
    return {e.path: ds[i] for i, e in enumerate(ds.entries)}


@pytest.fixture(scope="module")
def companion_shards(models, companion_folder, tmp_path_factory):
    from dit_train.tools.cache_latents import main

    out = tmp_path_factory.mktemp("companion_shards")
    assert main(companion_cache_args(models, companion_folder, out, "--shards", "--samples-per-shard", "3")) == 0
    return out


@pytest.mark.parametrize("where", ["cache", "shards"])
def test_cached_mask_weights_and_control_equal_the_raw_clips(where, companion_cache, companion_shards, raw_clips,
                                                             models):
    """Each token of a pack built off the cache (or the latent shards) weighs the mean of the raw
    8-bit mask over the token's pixels — mask_weight_units of the folder clip's mask at the patch
    (t·pt, s·ph, s·pw), latent frame 0 standing for pixel frame 0 repeated t times — to the unit,
    and its control tokens are the VAE encoding of the raw control video; T_b is the weights' sum."""
    from dit_train.data_pipelines.companions import mask_weight_units
    from dit_train.data_pipelines.latent_cache import VaeCodec
    from dit_train.loss import sync_counts
    from dit_train.tasks.video import patchify

    data = (["data=latent_cache", f"data.root={companion_cache}"] if where == "cache"
            else ["data=shards", f"data.url={companion_shards}"])
    task = task_of(latent_cfg([*data, "data.masks=true", "cond.control=true"]))
    ids = list(range(len(task.lengths())))
    assert len(ids) == 4
    pack = task.build(ids, 0)
    units, counts = pack.weight_units(), sync_counts([pack], None, None)
    vae = VaeCodec(str(models / "vae"))
    t, s = vae.temporal, vae.spatial
    fractional = 0
    for k, sid in enumerate(ids):
        clip = raw_clips[task.dataset.rows[sid]["source"]]
        mask = clip.mask[: vae.usable_frames(clip.mask.shape[0])]
        frames = torch.cat([mask[:1].expand(t, *mask.shape[1:]), mask[1:]])  # latent frame 0 = pixel frame 0
        want = mask_weight_units(frames, (t * LATENT_PATCH[0], s * LATENT_PATCH[1], s * LATENT_PATCH[2]))
        assert torch.equal(units[pack.seg == k], want), sid
        fractional += int(((want > 0) & (want < WEIGHT_ONE)).sum())
        assert float(counts.sample_tokens[0][k]) == int(want.sum()) / WEIGHT_ONE
        control = patchify(vae.encode(clip.control), LATENT_PATCH)[0]
        torch.testing.assert_close(pack.tokens["control"][pack.seg == k], control, rtol=0, atol=1e-6)
    assert fractional > 0  # the soft mask's band (and the codec's edges) gives fractions


def test_the_shards_carry_what_the_cache_holds(companion_cache, companion_shards):
    """Latent shards written with --masks --control hold the same mask sums and control latents."""
    from dit_train.data_pipelines.latent_cache import LatentCacheDataset
    from dit_train.data_pipelines.shards_source import shard_index, shard_reader
    from dit_train.data_pipelines.shard_datasets import ShardLatentDataset

    cache = LatentCacheDataset(companion_cache, LATENT_PATCH)
    cfg = latent_cfg(["data=shards", f"data.url={companion_shards}"]).data
    shards = ShardLatentDataset(shard_index(cfg), shard_reader(cfg), LATENT_PATCH)
    assert [r["source"] for r in shards.rows] == [r["source"] for r in cache.rows]
    for i in range(len(cache)):
        a, b = cache[i], shards[i]
        assert torch.equal(a.mask.sums, b.mask.sums) and a.mask.pixels == b.mask.pixels == 4 * 8 * 8
        assert torch.equal(a.control, b.control) and a.control.shape == a.pixels.shape


@pytest.mark.parametrize("flag, key", [("--masks", "data.masks=true"), ("--control", "cond.control=true")])
def test_a_cache_without_them_is_refused_before_the_run_naming_the_flag(flag, key, cache):
    """The session's plain cache (no --masks / --control) with the key on: one line before step 0
    that names the key and the tool's flag to cache again with."""
    from dit_train.config.errors import ConfigError
    from dit_train.tasks import check_data

    with pytest.raises(ConfigError) as err:
        check_data(latent_cfg(["data=latent_cache", f"data.root={cache}", key]))
    msg = str(err.value)
    assert "\n" not in msg and key in msg and f"tools.cache_latents {flag}" in msg, msg


def test_pixel_shards_carry_masks_boxes_and_control_videos(companion_folder, tmp_path):
    """tools.make_shards of a folder (and of a manifest with mask_boxes) writes each clip's mask
    and control files beside it: packs off the shards equal the folder's, weights and control
    tokens bit for bit; a set made without them refuses data.masks=true before the run."""
    import json
    import shutil

    from dit_train.config.errors import ConfigError
    from dit_train.tasks import check_data
    from dit_train.tools.make_shards import main

    manifest = tmp_path / "boxes.jsonl"  # the same clips, the first two with boxes instead of their mask videos
    manifest.write_text("".join(json.dumps({"path": str(companion_folder / f"c{i}.mp4"), "caption": "x",
                                            "control": str(companion_folder / f"c{i}.control.mp4"),
                                            **({"mask_boxes": [[0, 0, 12, 32, 0.5], [4, 8, 20, 24]]} if i < 2 else
                                               {"mask": str(companion_folder / f"c{i}.mask.mp4")})}) + "\n"
                            for i in range(4)))
    for name, root in (("folder", companion_folder), ("manifest", manifest)):
        out = tmp_path / name
        assert main(["--out", str(out), "--no-progress", "--workers", "1", "--samples-per-shard", "3", "data=video_folder",
                     f"data.root={root}", f"data.cache_dir={tmp_path / 'c'}"]) == 0
        base = [*TINY_MODEL, "data.resolution_buckets=null", "data.max_frames=8", "train.global_batch=4",
                "data.masks=true", "cond.control=true"]
        want = task_of(compose_config([*base, "data=video_folder", f"data.root={root}"], cache_dir=str(tmp_path / "c")))
        got = task_of(compose_config([*base, "data=shards", f"data.url={out}"], cache_dir=str(tmp_path / "c")))
        reader, reads = got.dataset.reader, []
        read = reader.read
        reader.read = lambda *a: reads.append(a) or read(*a)
        a, b = want.build([0, 1, 2, 3], 0), got.build([0, 1, 2, 3], 0)
        assert len(reads) == 4, name  # one range read a sample: its clip, mask and control are members of it
        assert torch.equal(a.weight_units(), b.weight_units()) and torch.equal(a.tokens["control"], b.tokens["control"])
        units = b.weight_units()
        assert ((units > 0) & (units < WEIGHT_ONE)).any(), name  # fractional: the soft masks, the 0.5 box
    plain = tmp_path / "plain_clips"  # the clips without their mask / control files
    plain.mkdir()
    for p in companion_folder.glob("c?.mp4"):
        shutil.copy(p, plain / p.name)
    assert main(["--out", str(tmp_path / "plain"), "--no-progress", "--workers", "1", "data=video_folder",
                 f"data.root={plain}", f"data.cache_dir={tmp_path / 'c'}"]) == 0
    cfg = compose_config([*TINY_MODEL, "data=shards", f"data.url={tmp_path / 'plain'}", "data.masks=true",
                          "data.resolution_buckets=null", "train.global_batch=2"], cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="data.masks=true but no clip of the data has a mask"):
        check_data(cfg)


def test_i2v_tensors_go_into_latent_shards(models, source, clip_dir, i2v_cache, tmp_path):
    """--i2v first_frame --shards: each sample carries the cache folder's condition latents and
    CLIP tokens, and model=wan_i2v_tiny trains off the shards (the config is not refused)."""
    from dit_train.data_pipelines.latent_cache import LatentCacheDataset
    from dit_train.engine.checks import check_config
    from dit_train.tasks import check_data
    from dit_train.tools.cache_latents import main
    from tests.conftest import CLIP_DIM, cache_args

    out = tmp_path / "i2v_shards"
    assert main(cache_args(models, source, out, tmp_path / "probe", "--i2v", "first_frame", "--image-encoder",
                           str(clip_dir), "--shards")) == 0
    cfg = latent_cfg(["model=wan_i2v_tiny", "data=shards", f"data.url={out}", f"model.image_dim={CLIP_DIM}",
                      "cond.kind=first_frame", "cond.feed=concat"])
    check_config(cfg)
    check_data(cfg)
    shards, folder = task_of(cfg).dataset, LatentCacheDataset(i2v_cache, LATENT_PATCH)
    assert [r["source"] for r in shards.rows] == [r["source"] for r in folder.rows]
    for i in range(len(folder)):
        assert torch.equal(shards[i].cond_latents, folder[i].cond_latents)
        assert torch.equal(shards[i].image_emb, folder[i].image_emb)


def test_sample_control_on_a_latent_run_goes_through_the_cache_vae(companion_cache, companion_folder, models):
    """tools.sample --control on a latent run: the file encoded by the cache's VAE at the latent
    grid asked for equals the control latents the cache holds for the clip it came from."""
    from dit_train.data_pipelines.latent_cache import LatentCacheDataset, VaeCodec
    from dit_train.sampling.conditioned import control_from_file

    ds = LatentCacheDataset(companion_cache, (1, 1, 1))
    i = next(k for k, r in enumerate(ds.rows) if r["source"].endswith("c0.mp4"))
    want = ds[i].control
    got = control_from_file(str(companion_folder / "c0.control.mp4"), tuple(want.shape), VaeCodec(str(models / "vae")))
    assert want.shape == (Z_DIM, 3, 4, 4)  # 9 frames of 32 x 32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_latent_mask_cut_to_whole_blocks_weighs_the_kept_tokens_as_the_whole_mask_does():
    """A block-causal run trims a cached clip to whole blocks and cuts its mask with it
    (tasks/video.py); the cut LatentMask gives the kept tokens the whole mask's weights."""
    import torch

    from dit_train.data_pipelines.companions import LatentMask

    sums = torch.randint(0, 255 * 8, (5, 4, 4), generator=torch.Generator().manual_seed(0))
    whole, patch = LatentMask(sums, 8), (1, 2, 2)
    cut = whole[:4]  # seen failing with the __getitem__ removed: TypeError, not subscriptable
    assert cut.shape == (4, 4, 4)
    per_frame = (4 // 2) * (4 // 2)
    assert torch.equal(cut.token_units(patch), whole.token_units(patch)[: 4 * per_frame])
