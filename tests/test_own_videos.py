"""A new user's clips (issue 29): real files of different sizes and frame rates train with the
README's own-video command as written; sizes go to the model's default buckets, the token
budget follows the data, frames are sampled without repeats, and the errors that remain name
keys and values that work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dit_train.data_pipelines.example_videos import ExampleClip, write_example_videos
from dit_train.data_pipelines.video_dataset import ClipEntry, VideoClipDataset
from dit_train.data_pipelines.video_io import VideoInfo
from tests.conftest import compose_config, train_in_process

# the clips (height x width): a 144x176 phone clip at 30 fps, a 272x640 and a 720x1280
# clip at 25 fps; the 720p one has 6 frames (2 at 8 fps: cheap to write and decode, and shorter
# than data.max_frames)
CLIPS = (
    ExampleClip("qcif.mp4", 144, 176, 30, 90, "red", "circle", "navy"),
    ExampleClip("wide.mp4", 272, 640, 25, 50, "yellow", "square", "gray", rightward=False),
    ExampleClip("hd.mp4", 720, 1280, 25, 6, "green", "circle", "black"),
)
README = ["data=video_folder", "data.max_frames=16", "data.fps=8"]  # the README's own-video command
TINY_BUCKETS = [[48, 80], [64, 64], [80, 48]]  # dit_tiny's model.default_buckets


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    write_example_videos(root, CLIPS)
    return root


def checked(overrides: list[str], cache: Path):
    """The run's config after the data check (train.micro_batch_tokens=0 resolved, as a run does)."""
    from dit_train.tasks import check_data, resolve_config
    from dit_train.data_pipelines import prepare_data

    cfg = compose_config(overrides, cache_dir=str(cache))
    prepare_data(cfg.data, cfg.model)
    return resolve_config(cfg, check_data(cfg))


@pytest.mark.slow
def test_readme_command_trains_on_clips_of_mixed_sizes_and_rates(videos, tmp_path, capsys):
    """Only data.root and a global batch that fits 3 clips (steps and sampler steps kept small):
    each clip trains at the bucket of its aspect ratio, the budget comes from the data, and
    validation samples at those sizes and says so."""
    run_dir = tmp_path / "run"
    train_in_process(README + [f"data.root={videos}", "train.global_batch=3", "train.steps=2",
                               "train.sample_steps=2", "train.progress=false"], run_dir, cache_dir=str(tmp_path / "cache"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # hd: 2 frames at 48x80 = 240 tokens; qcif: 16 at 64x64 = 2048; wide: 16 at 48x80 = 1920 (2x4x4 patches)
    assert [(r["samples"], r["tokens"], r["micro_batches"]) for r in rows] == [(3, 4208, 2)] * 2
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["resolution_buckets"] == TINY_BUCKETS and saved["train"]["micro_batch_tokens"] == 4096
    clips = load_file(str(run_dir / "samples" / "step_000002" / "samples.safetensors"))
    assert sorted(tuple(x.shape) for x in clips.values()) == [(3, 2, 48, 80), (3, 16, 48, 80), (3, 16, 64, 64)]
    out = capsys.readouterr().out
    assert "validation samples 3 training clip(s)" in out and "(frames x height x width): " in out
    assert all(size in out for size in ("2x48x80", "16x64x64", "16x48x80"))


def test_native_sizes_only_when_asked(videos, tmp_path):
    """data.resolution_buckets=null keeps native sizes; the budget still follows the data."""
    cfg = checked(README + [f"data.root={videos}", "train.global_batch=3", "data.resolution_buckets=null"], tmp_path)
    assert cfg.data.resolution_buckets is None
    assert cfg.train.micro_batch_tokens == 16 // 2 * (272 // 4) * (640 // 4)  # the longest: the wide clip


def test_errors_name_keys_and_values_that_fit(videos, tmp_path):
    """Each refusal names a value; with that value the same data passes the check."""
    from dit_train.config.errors import ConfigError

    base = README + [f"data.root={videos}"]
    with pytest.raises(ConfigError, match=r"set train.global_batch=3 \(the largest that fits\)"):
        checked(base, tmp_path)
    fixed = [*base, "train.global_batch=3", "train.micro_batch_tokens=4096"]
    # native sizes: no max_frames fits (one temporal patch of the 720p clip is 57600 tokens); the model's buckets do
    with pytest.raises(ConfigError, match=r"wide.mp4: 16 frames at 272x640\) .* 'data.resolution_buckets="
                                          r"\[\[48,80\],\[64,64\],\[80,48\]\]'$") as err:
        checked([*fixed, "data.resolution_buckets=null"], tmp_path)
    assert "data.max_frames" not in str(err.value)
    # the third round: buckets of the user's own that are just over the budget
    with pytest.raises(ConfigError, match=r"4608 tokens \(.*qcif.mp4: 16 frames at 96x96 \(native 144x176\)\) .* "
                                          r"'data.resolution_buckets=\[\[88,88\]\]' or data.max_frames=14$"):
        checked([*fixed, "data.resolution_buckets=[[96,96]]"], tmp_path)
    for works in ("data.resolution_buckets=[[88,88]]", "data.max_frames=14"):
        checked([*fixed, works], tmp_path)


def test_frames_are_sampled_without_repeats():
    """Mixed rates resample to data.fps; a clip slower than data.fps keeps its own rate (no
    frame twice, its written fps is its own); a short clip is a short sample. No decoding."""
    from dit_train.data_pipelines.video_source import PixelVideoSource

    entries = [ClipEntry("a30.mp4", "", VideoInfo(90, 144, 176, 30.0)), ClipEntry("b25.mp4", "", VideoInfo(50, 272, 640, 25.0)),
               ClipEntry("c25.mp4", "", VideoInfo(6, 720, 1280, 25.0))]
    at8 = VideoClipDataset(entries, patch=(2, 4, 4), max_frames=16, fps=8.0, buckets=[(48, 80)])
    assert [at8.frames(i) for i in range(3)] == [16, 16, 2]
    assert at8._indices(entries[0])[:4] == [0, 4, 8, 11] and at8._indices(entries[1])[:4] == [0, 3, 6, 9]
    at60 = VideoClipDataset(entries, patch=(2, 4, 4), max_frames=16, fps=60.0)
    for e in entries:
        idx = at60._indices(e)
        assert idx == sorted(set(idx)) == list(range(len(idx)))  # every frame once, in order
    assert [at60.frames(i) for i in range(3)] == [16, 16, 6]
    cfg = compose_config(["data=video_folder", "data.root=x", "data.fps=60"])
    source = PixelVideoSource(cfg.data, cfg.model)
    assert [source.fps(at60, i) for i in range(3)] == [30.0, 25.0, 25.0]


def test_default_buckets_suit_the_model():
    """video_folder's buckets come from the model preset; the embedded set stays native; the
    latent cache tool defaults to Wan's 480p (a latent cache is for a latent model)."""
    from dit_train.tools.cache_latents import compose_data

    wan_480p = [[480, 832], [624, 624], [832, 480]]
    for model, want in (("dit_tiny", TINY_BUCKETS), ("wan_tiny", TINY_BUCKETS), ("wan_1_3b", wan_480p),
                        ("wan_14b", wan_480p), ("dit_small", wan_480p)):
        assert compose_config([f"model={model}", "data=video_folder", "data.root=x"]).data.resolution_buckets == want
    assert compose_config([]).data.resolution_buckets == []
    assert compose_data(["data=video_folder", "data.root=x"]).resolution_buckets == wan_480p
    assert compose_data(["model=dit_tiny", "data=video_folder", "data.root=x"]).resolution_buckets == TINY_BUCKETS
