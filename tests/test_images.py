"""Image + video joint training, the data side: still images in folders and manifests, the
temporal-patch rule (an image is its one frame repeated pt times), the embedded set's images,
mixed packs, the latent cache, and (slow) one CP layout over a set with images."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dit_train.data_pipelines.shapes_metric import parse_caption, score_clip
from dit_train.data_pipelines.synthetic_video import _render_image, dataset_dir, ensure_synthetic_videos
from dit_train.data_pipelines.video_folder import index_path, index_video_folder
from dit_train.data_pipelines.video_io import VideoInfo, VideoReadError, probe, probe_image, read_frames
from dit_train.tasks.video import patchify
from tests.conftest import TINY, TINY_MODEL, compose_config

PATCH = (2, 8, 8)  # the default model.patch_size: pt = 2 > one frame


def make_media_folder(root: Path, src_cache: Path) -> Path:
    """2 captioned videos, 3 captioned images (RGB .png, greyscale .JPG, RGBA .webp whose left
    half is fully transparent) and a corrupt .png with a caption."""
    src = ensure_synthetic_videos(src_cache, 2, 99)
    rows = [json.loads(line) for line in (src / "manifest.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        shutil.copy(src / r["path"], root / f"video_{i}.mp4")
        (root / f"video_{i}.txt").write_text(r["caption"] + "\n")
    image, caption = _render_image(np.random.default_rng([5, 0]))
    Image.fromarray(image).save(root / "still.png")
    (root / "still.txt").write_text(caption)
    sub = root / "nested"
    sub.mkdir()
    grey = np.tile(np.linspace(0, 255, 40, dtype=np.uint8), (24, 1))  # [24, 40]: 3x5 patches
    Image.fromarray(grey, "L").save(sub / "grey.JPG", quality=95)
    (sub / "grey.txt").write_text("a grey ramp")
    rgba = np.zeros((16, 32, 4), np.uint8)
    rgba[:, :, :3] = (30, 200, 90)
    rgba[:, 16:, 3] = 255  # right half opaque green, left half transparent (black underneath)
    Image.fromarray(rgba, "RGBA").save(root / "rgba.webp", lossless=True)
    (root / "rgba.txt").write_text("a green half")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (root / "broken.txt").write_text("never read")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_media_folder(tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("src"))


def pixel_dataset(folder: Path, cache: Path, *overrides: str):
    from dit_train.data_pipelines import source_for

    cfg = compose_config(TINY_MODEL + ["data=video_folder", f"data.root={folder}", "data.num_workers=0", *overrides],
                         cache_dir=str(cache))
    return source_for(cfg.data, cfg.model).pixel_dataset(tuple(cfg.model.patch_size))


def names(entries) -> list[str]:
    return [Path(e.path).name for e in entries]


def test_folder_indexes_images_next_to_videos(folder, tmp_path, monkeypatch):
    import dit_train.data_pipelines.video_folder as vf

    index = index_video_folder(folder, tmp_path, progress=False)
    assert names(index.entries) == ["grey.JPG", "rgba.webp", "still.png", "video_0.mp4", "video_1.mp4"]
    info = {Path(e.path).name: e.info for e in index.entries}
    assert info["grey.JPG"] == VideoInfo(1, 24, 40, 0.0)
    assert (info["still.png"].frames, info["rgba.webp"].height) == (1, 16)
    assert info["video_0.mp4"].frames > 1
    captions = {Path(e.path).name: e.caption for e in index.entries}
    assert captions["grey.JPG"] == "a grey ramp" and parse_caption(captions["still.png"]) is not None
    # the corrupt image is skipped, named, and kept in the probe index like a corrupt video
    assert [Path(p).name for p, _ in index.skipped] == ["broken.png"]
    assert index.skipped[0][1].startswith("cannot open image") and "broken.png" in index.skipped[0][1]
    rows = {Path(r["path"]).name: r for r in map(json.loads, index_path(tmp_path, folder).read_text().splitlines())}
    assert set(rows) == {"grey.JPG", "rgba.webp", "still.png", "video_0.mp4", "video_1.mp4", "broken.png"}
    assert "error" in rows["broken.png"] and rows["still.png"]["frames"] == 1
    calls = []
    monkeypatch.setattr(vf, "probe", lambda p: calls.append(p) or probe(p))
    assert index_video_folder(folder, tmp_path, progress=False).entries == index.entries and calls == []


def test_image_probe_reads_no_pixels(folder, monkeypatch):
    """Probing an image costs its header (and PNG checksums), never a decode."""
    from PIL import ImageFile

    def no_decode(self):
        raise AssertionError("probe decoded pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    for name in ("still.png", "nested/grey.JPG", "rgba.webp"):
        assert probe_image(str(folder / name)).frames == 1
    with pytest.raises(VideoReadError, match="broken.png"):
        probe_image(str(folder / "broken.png"))


def test_images_are_pt_frames_and_token_counts_are_exact(folder, tmp_path, monkeypatch):
    import dit_train.data_pipelines.video_dataset as vd

    # frame rules that would cut a video, and must not touch an image
    ds = pixel_dataset(folder, tmp_path, "data.max_frames=4", "data.frame_stride=2", "data.fps=4.0",
                       "data.resolution_buckets=null")  # native sizes: the crop to the patch is what is checked
    monkeypatch.setattr(vd, "read_frames", lambda *a: pytest.fail("lengths() decoded a file"))
    lengths = ds.lengths()  # from the probe index only
    monkeypatch.undo()
    assert names(ds.entries) == ["grey.JPG", "rgba.webp", "still.png", "video_0.mp4", "video_1.mp4"]
    for i, e in enumerate(ds.entries):
        x = ds[i].pixels
        tokens, grid = patchify(x, PATCH)
        assert tokens.shape[0] == lengths[i] == x.shape[1] // 2 * (x.shape[2] // 8) * (x.shape[3] // 8)
        if e.info.frames == 1:
            assert x.shape == (3, 2, e.info.height // 8 * 8, e.info.width // 8 * 8)
            assert torch.equal(x[:, 0], x[:, 1]) and (grid[:, 0] == 0).all()  # one temporal slab
        else:
            assert x.shape[1] == 4  # max_frames applies to videos
    grey, rgba = ds[0].pixels, ds[1].pixels
    assert grey.shape == (3, 2, 24, 40) and torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    assert grey[0, 0, :, 0].max() < -0.9 and grey[0, 0, :, -1].min() > 0.9  # a ramp, not clipped to white
    white, green = rgba[:, 0, :, :16], rgba[:, 0, :, 16:]
    assert (white == 1.0).all()  # transparency composited onto white
    want = torch.tensor([30, 200, 90]).view(3, 1, 1) / 127.5 - 1
    assert torch.allclose(green, want.expand_as(green), atol=1e-6)


def test_image_modes_become_rgb(tmp_path):
    """Palette, 16-bit greyscale, CMYK and EXIF-rotated images read as upright 8-bit RGB."""
    ramp = np.tile(np.arange(0, 256, 32, dtype=np.uint8), (8, 1))  # [8, 8], 0..224 across
    Image.fromarray(np.stack([ramp] * 3, -1)).convert("P", palette=Image.Palette.ADAPTIVE).save(tmp_path / "p.png")
    Image.fromarray(ramp.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    Image.fromarray(np.stack([ramp] * 3, -1)).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=100)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: stored 8x16 reads as 16x8
    Image.fromarray(np.zeros((8, 16, 3), np.uint8)).save(tmp_path / "turned.jpg", exif=exif)
    for name, tol in (("p.png", 0), ("g16.png", 0), ("cmyk.jpg", 3)):
        info = probe(str(tmp_path / name))
        x = read_frames(str(tmp_path / name), [0], info)
        assert x.shape == (1, 8, 8, 3) and x.dtype == torch.uint8, name
        assert (x[0].int() - torch.from_numpy(ramp).int()[..., None]).abs().max() <= tol, name
    info = probe(str(tmp_path / "turned.jpg"))
    assert (info.height, info.width) == (16, 8)
    assert read_frames(str(tmp_path / "turned.jpg"), [0, 0], info).shape == (2, 16, 8, 3)


def test_resolution_buckets_apply_to_images(folder, tmp_path):
    ds = pixel_dataset(folder, tmp_path, "data.resolution_buckets=[[32,32],[32,64]]")
    for i in range(len(ds)):
        x = ds[i].pixels
        assert tuple(x.shape[2:]) in ((32, 32), (32, 64)) and ds.num_tokens(i) == patchify(x, PATCH)[0].shape[0]
    # grey 24x40 and rgba 16x32 go to the wide bucket, resized (not cropped: the ramp spans it)
    assert ds[0].pixels.shape == ds[1].pixels.shape == (3, 2, 32, 64)
    assert ds[0].pixels[0, 0, :, 0].max() < -0.8 and ds[0].pixels[0, 0, :, -1].min() > 0.8


def test_mixed_manifest(folder, tmp_path):
    """Manifests mixing videos and images. With size columns (manifest_entries, the embedded
    set's reader) an image's `frames` is ignored (it has one) and its declared size wins, as for
    videos; rows without them are probed. Through data=video_folder (.jsonl, .csv) every file is
    probed. The corrupt image is skipped and named."""
    from dit_train.data_pipelines.video_dataset import VideoClipDataset, manifest_entries

    rows = [{"path": "video_1.mp4", "caption": "v"},
            {"path": str(folder / "still.png"), "caption": "s", "frames": 7, "height": 32, "width": 48},
            {"path": "nested/grey.JPG", "caption": "g"},
            {"path": "broken.png", "caption": "b"}]
    manifest = folder / "mixed.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    entries, bad = manifest_entries(manifest)
    assert [(Path(e.path).name, e.info.frames) for e in entries][1:] == [("still.png", 1), ("grey.JPG", 1)]
    assert entries[0].info.frames > 1 and (entries[1].info.height, entries[1].info.width) == (32, 48)
    assert [Path(p).name for p, _ in bad] == ["broken.png"]
    ds = VideoClipDataset(entries, patch=PATCH)
    still = ds[1].pixels  # the declared 32x48, whatever the file holds
    assert still.shape == (3, 2, 32, 48) and ds.num_tokens(1) == patchify(still, PATCH)[0].shape[0]
    ds = pixel_dataset(manifest, tmp_path)
    assert [ds[i].caption for i in range(len(ds))] == ["g", "s", "v"]  # the folder source sorts by path
    assert ds.entries[1].info == probe(str(folder / "still.png"))  # probed, not declared
    assert [Path(p).name for p, _ in ds.skipped] == ["broken.png"]
    csv_manifest = folder / "mixed.csv"
    csv_manifest.write_text("path,caption\nvideo_0.mp4,v\nstill.png,s\nbroken.png,b\n")
    ds = pixel_dataset(csv_manifest, tmp_path)
    assert names(ds.entries) == ["still.png", "video_0.mp4"] and [Path(p).name for p, _ in ds.skipped] == ["broken.png"]


def test_embedded_set_images(tmp_path):
    plain = ensure_synthetic_videos(tmp_path, 3, 1234)
    mixed = ensure_synthetic_videos(tmp_path, 3, 1234, num_images=4)
    assert plain.name == "synthetic_video_v2_n3_seed1234" and mixed.name == "synthetic_video_v2_n3_seed1234_img4"
    assert dataset_dir(tmp_path, 3, 1234, 4) == mixed
    rows = [json.loads(line) for line in (mixed / "manifest.jsonl").read_text().splitlines()]
    # the clips are the set without images, listed first (their sample ids do not move)
    assert (plain / "manifest.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows[:3]]
    images = rows[3:]
    assert [r["path"] for r in images] == [f"image_{i:04d}.png" for i in range(4)]
    for r in images:
        cap = parse_caption(r["caption"])
        assert cap is not None and not cap.has_motion
        assert r["caption"] == f"a {cap.color} {cap.shape} on a {cap.background} background"
        info = probe(str(mixed / r["path"]))
        assert (1, info.height, info.width) == (r["frames"], r["height"], r["width"])
        frames = read_frames(str(mixed / r["path"]), [0], info)  # uint8 [1, H, W, 3], lossless
        assert score_clip(frames, r["caption"])["all_ok"] == 1.0, r
    again = ensure_synthetic_videos(tmp_path / "again", 3, 1234, num_images=4)
    for r in images:
        assert np.array_equal(np.asarray(Image.open(mixed / r["path"])), np.asarray(Image.open(again / r["path"])))
    with pytest.raises(ValueError, match="num_images"):
        ensure_synthetic_videos(tmp_path, 3, 1234, num_images=-1)


def test_config_num_images(tmp_path):
    from dit_train.data_pipelines import open_dataset, prepare_data

    cfg = compose_config(TINY + ["data.num_images=4"], cache_dir=str(tmp_path))
    prepare_data(cfg.data, cfg.model)
    ds = open_dataset(cfg.data, cfg.model)
    assert len(ds) == 20 and [Path(e.path).suffix for e in ds.entries[16:]] == [".png"] * 4
    assert compose_config(TINY, cache_dir=str(tmp_path)).data.num_images == 0  # default: clips only


def test_pack_holds_an_image_and_a_video(folder, tmp_path):
    from dit_train.tasks import build_task

    cfg = compose_config(TINY_MODEL + ["data=video_folder", f"data.root={folder}", "data.num_workers=0",
                                       "data.max_frames=6"], cache_dir=str(tmp_path))
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    ds = task.dataset
    ids = [2, 3, 1]  # still.png, video_0.mp4, rgba.webp
    batch = task.build(ids, step=0)
    counts = torch.bincount(batch.seg).tolist()
    assert counts == [ds.num_tokens(i) for i in ids] == [task.lengths()[i] for i in ids]
    assert batch.sample_ids.tolist() == ids and batch.tokens["x"].shape == (sum(counts), 3 * 2 * 8 * 8)
    t = batch.pos[:, 0]
    assert (t[batch.seg == 0] == 0).all() and (t[batch.seg == 2] == 0).all()  # images: one temporal slab
    assert t[batch.seg == 1].max() == ds[3].pixels.shape[1] // 2 - 1 > 0


def test_truncated_jpeg_is_dropped_when_read(tmp_path):
    """A JPEG cut short passes the header probe; decoding it fails, and the task drops it and
    counts it like an undecodable video."""
    from dit_train.tasks import build_task

    root = tmp_path / "media"
    root.mkdir()
    for name in ("whole", "cut"):
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), np.uint8)).save(root / f"{name}.jpg")
    data = (root / "cut.jpg").read_bytes()
    (root / "cut.jpg").write_bytes(data[: len(data) * 3 // 4])  # past the header, into the pixels
    cfg = compose_config(TINY_MODEL + ["data=video_folder", f"data.root={root}", "data.num_workers=0"],
                         cache_dir=str(tmp_path / "cache"))
    task = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed)
    assert names(task.dataset.entries) == ["cut.jpg", "whole.jpg"]
    with pytest.raises(VideoReadError, match="cut.jpg"):
        task.dataset[0]
    batch = task.build([0, 1], step=0)
    assert batch.sample_ids.tolist() == [1] and task.failed == {0}


def test_latent_cache_encodes_an_image(folder, tmp_path):
    """An image goes through the video VAE as one frame: Wan's causal VAE encodes frame 0
    alone, so 1 frame -> 1 latent frame; trained with temporal patch 1."""
    from diffusers import AutoencoderKLWan

    from dit_train.data_pipelines import latent_cache as lc
    from dit_train.tools.cache_latents import main

    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                     ).save_pretrained(tmp_path / "vae")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(folder / "still.png", src / "still.png")
    shutil.copy(folder / "video_0.mp4", src / "video_0.mp4")  # a clip beside it: the same tool run
    out = tmp_path / "latents"
    assert main(["--vae", str(tmp_path / "vae"), "--out", str(out), "--no-progress", "data=video_folder",
                 f"data.root={src}", f"data.cache_dir={tmp_path / 'probe'}", "data.max_frames=5",
                 "data.resolution_buckets=null"]) == 0  # native sizes (the default is Wan's 480p)
    rows = {Path(r["source"]).name: r for r in map(json.loads, (out / lc.MANIFEST).read_text().splitlines())}
    h, w = Image.open(src / "still.png").size[::-1]
    assert rows["still.png"]["latent_shape"] == [4, 1, h // 8, w // 8]
    frames = min(probe(str(src / "video_0.mp4")).frames, 5)
    assert rows["video_0.mp4"]["latent_shape"][1] == 1 + (frames - 1) // 4
    ds = lc.LatentCacheDataset(out, patch=(1, 2, 2))
    want = [f * (h // 2) * (w // 2) for _, f, h, w in (r["latent_shape"] for r in rows.values())]
    assert sorted(ds.lengths()) == sorted(want)


@pytest.mark.slow
def test_images_next_to_videos_under_cp(data_cache):
    """Images and clips in one pack, trained on 1 process and on 2 Ulysses CP ranks: same weights."""
    from dit_train.data_pipelines.packing import plan_step
    from dit_train.tasks import build_task
    from dit_train.data_pipelines import prepare_data
    from dit_train.engine.layout_equivalence import relative_difference, run_layouts

    # train.seed=1: both steps pack images with clips (seed 0 draws the images only at step 2)
    cfg = compose_config(TINY + ["data.num_images=4", "train.seed=1"], cache_dir=data_cache)
    prepare_data(cfg.data, cfg.model)
    lengths = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).lengths()
    t = cfg.train
    packs = [p for s in range(t.steps) for p in plan_step(s, lengths, t.global_batch, 1, t.grad_accum,
                                                          t.micro_batch_tokens, t.seed).micro_batches[0]]
    assert any(min(p) < 16 <= max(p) for p in packs), packs  # ids >= 16 are the images
    got = run_layouts(cfg, ["1", "cp_ulysses=2"], ["sample_mean"])
    rel = relative_difference(got["1"][0], got["cp_ulysses=2"][0])
    assert rel <= 1e-4, f"CP weights differ by {rel:.2e} of the update"
