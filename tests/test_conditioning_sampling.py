"""Conditioned sampling (issue 32): given frames stay clean (timestep feed) or arrive as input
channels (concat feed); validation and tools.sample continue real first frames, on any layout."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY, compose_config

PATCH = (2, 8, 8)
SHAPE = (3, 6, 16, 16)  # 3 temporal patches of 4 tokens


class Recording(torch.nn.Module):
    """A 'model' that records its inputs and outputs a fixed wrong velocity."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, pos, seg, t, meta, context=None, context_len=None, clean=None):
        self.calls.append((x.clone(), None if clean is None else clean.clone()))
        return 0.5 * x[:, : 3 * math.prod(PATCH)]


def _sample(feed: str, given: bool = True):
    from dit_train.config import ParallelConfig
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import SampleRequest, VideoSampler
    from dit_train.tasks.video_inputs import VideoInputs

    frames = torch.rand(SHAPE, generator=torch.Generator().manual_seed(1)) * 2 - 1
    patches = torch.tensor([True, False, False])
    r = SampleRequest("c0", SHAPE, "", None, 0, given=frames if given else None, given_patches=patches if given else None)
    model = Recording()
    inputs = VideoInputs(PATCH, concat=feed == "concat", clean=feed == "timestep")
    out = VideoSampler([r], inputs, None, init_parallel(ParallelConfig(device="cpu")), 3, 1.0, 0).sample(model)
    return frames, out[0], model.calls


def test_timestep_feed_keeps_the_given_frames_clean_at_every_step():
    frames, out, calls = _sample("timestep")
    from dit_train.tasks.video import patchify

    given_tokens = patchify(frames, PATCH)[0][:4]
    for x, clean in calls:
        assert clean is not None and clean[:4].all() and not clean[4:].any()
        assert torch.equal(x[:4], given_tokens)  # x = the given frames at every model call
    assert torch.equal(out[:, :2], frames[:, :2]) and not torch.equal(out[:, 2:], frames[:, 2:])


def test_concat_feed_appends_mask_and_frames_and_generates_every_frame():
    frames, out, calls = _sample("concat")
    from dit_train.tasks.video import patchify

    per = math.prod(PATCH)
    mask = torch.zeros(1, *SHAPE[1:])
    mask[:, :2] = 1
    want = patchify(torch.cat([mask, frames * mask]), PATCH)[0]  # [mask | given frames, zeros elsewhere]
    for x, clean in calls:
        assert clean is None and x.shape[1] == 3 * per + 4 * per
        assert torch.equal(x[:, 3 * per:], want)
    assert not torch.equal(out[:, :2], frames[:, :2])  # the model outputs the given frames too
    _, _, plain = _sample("concat", given=False)  # a request without given frames: zeros, mask 0
    assert all(float(x[:, 3 * per:].abs().sum()) == 0 for x, _ in plain)


@pytest.fixture(scope="module")
def cond_run(tmp_path_factory, data_cache, tiny_cfg):
    """A tiny first_frame run, a quarter of its clips held out, validated at its end."""
    from dit_train.engine.worker import train

    cfg = compose_config([*TINY, "cond.kind=first_frame", "data.heldout_fraction=0.25", "train.ema_decay=0.5",
                          "train.sample_every=2", "train.num_samples=3", "train.sample_steps=3"], cache_dir=data_cache)
    cfg.run_dir = str(tmp_path_factory.mktemp("cond_run"))
    train(cfg)
    return cfg


def test_validation_continues_the_first_frames_of_held_out_clips(cond_run):
    from dit_train.tasks import build_task

    heldout = build_task(cond_run.mode, cond_run.data, cond_run.model, cond_run.loss, 0, split="heldout",
                         cond=cond_run.cond)
    step = f"{cond_run.run_dir}/samples/step_000002"
    got = load_file(f"{step}/samples.safetensors")
    captions = json.loads(open(f"{step}/captions.json").read())
    assert len(got) == 3
    for key, clip in got.items():
        real = heldout.dataset[int(key.split("_")[1])]
        assert captions[key] == real.caption
        torch.testing.assert_close(clip[:, :2], real.pixels[:, :2], rtol=0, atol=1e-6)  # the given patch, kept
    scores = json.loads(open(f"{step}/info.json").read())["scores"]
    assert scores["eval/num_given"] == 3 and "eval/kept_ok" in scores
    assert json.loads(open(f"{cond_run.run_dir}/samples/reference.json").read())["eval/kept_ok"] == 1.0


def test_data_captions_reproduce_the_conditioned_validation(cond_run, tmp_path):
    from dit_train.tools.sample import main

    assert main([cond_run.run_dir, "--data-captions", "3", "--out", str(tmp_path / "a")]) == 0
    want = load_file(f"{cond_run.run_dir}/samples/step_000002/samples.safetensors")
    got = load_file(str(tmp_path / "a" / "samples.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_conditioned_sampling_on_two_workers_matches_one_process(cond_run, tmp_path):
    from dit_train.tools.sample import main

    for name, extra in (("one", []), ("two", ["--layout", "cp_ulysses=2"])):
        assert main([cond_run.run_dir, "--data-captions", "3", "--steps", "2", "--out", str(tmp_path / name), *extra]) == 0
    one, two = load_file(str(tmp_path / "one" / "samples.safetensors")), load_file(str(tmp_path / "two" / "samples.safetensors"))
    for k in one:
        torch.testing.assert_close(one[k], two[k], atol=1e-4, rtol=1e-4)


def test_image_prompt_starts_from_the_image(cond_run, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    from dit_train.tools.sample import main

    img = np.zeros((32, 48, 3), np.uint8)
    img[:] = (20, 20, 70)
    img[8:20, 10:22] = (230, 40, 40)
    Image.fromarray(img).save(tmp_path / "first.png")
    prompt = "a red square moving down and right on a navy background"
    args = [cond_run.run_dir, "--prompt", prompt, "--frames", "6", "--height", "32", "--width", "48", "--steps", "2"]
    assert main([*args, "--image", str(tmp_path / "first.png"), "--out", str(tmp_path / "a")]) == 0
    clip = load_file(str(tmp_path / "a" / "samples.safetensors"))["prompt_0_0"]
    want = torch.from_numpy(img).permute(2, 0, 1).float() / 127.5 - 1
    for f in range(2):  # one temporal patch: the image twice
        torch.testing.assert_close(clip[:, f], want, rtol=0, atol=1e-6)
    # refused, one line each: no image for a run that always trained with one, a last image it
    # cannot use, a missing file
    assert main([*args]) == 2
    assert main([*args, "--image", str(tmp_path / "first.png"), "--last-image", str(tmp_path / "first.png")]) == 2
    assert main([*args, "--image", str(tmp_path / "nope.png")]) == 2
    assert main([*args, "--image", str(tmp_path)]) == 2  # a folder (it said "no such file")
    err = capsys.readouterr().err
    assert err.count("error:") == 4 and "give --image first.png" in err and "nope.png" in err
    assert "--last-image: this run trained cond.kind=first_frame (the first frame only); drop --last-image" in err
    assert f"{tmp_path} is a folder: give one image or video file" in err
