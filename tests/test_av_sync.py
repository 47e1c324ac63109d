"""The two-stream DiT's sync encoder (model.sync_encoder, docs/audio-video.md): a frame's event
probability from a clean picture lands on the audio token holding the frame's instant, only for
clips whose picture is given; the sampler reads it from a given video, and makes a joint
request's sound again from the pictures it sampled; tools.train_sync learns the encoder from the
clips' own sound. (Layout-exact training with it: tests/test_av_layouts.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from dit_train.models.sync_encoder import SyncEncoder, load, save
from dit_train.tasks.av_sync import clip_sync, sync_tokens
from tests.families import family_run_cfg, random_model

AV = ["data.audio=true", "model.audio_patch=500", "model.prediction=velocity", "train.micro_batch_tokens=600"]
PROMPTS = ["a red circle moving up and left on a navy background", "a yellow square moving down and right on a black background"]


def random_encoder(folder) -> str:
    """A random encoder whose probabilities spread over (0, 1) (a scaled head), saved in `folder`."""
    torch.manual_seed(0)
    enc = SyncEncoder(8)
    with torch.no_grad():
        enc.head.weight.mul_(30)
    return str(save(enc, folder, {"note": "random, for tests"}))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return random_encoder(tmp_path_factory.mktemp("sync"))


@pytest.fixture(scope="module")
def v2a_cfg(data_cache, encoder):
    return family_run_cfg([*AV, "cond.given_stream=video", "cond.given_stream_prob=0.5",
                           f"model.sync_encoder={encoder}"], data_cache)


def test_a_frames_probability_goes_to_the_token_holding_its_instant():
    probs = torch.tensor([0.1, 0.9, 0.3, 0.7])
    # 8 fps, 500-sample tokens: 2000 samples a frame, frame f starts at token 4f
    want = torch.zeros(14)
    want[[0, 4, 8, 12]] = probs
    assert torch.equal(sync_tokens(probs, 14, 500, 8.0), want)
    # 3 fps: frames start at samples 0, 5333.3, 10666.7, 16000 -> tokens 0, 10, 21, 32 (past n = 30: dropped)
    want = torch.zeros(30)
    want[[0, 10, 21]] = probs[:3]
    assert torch.equal(sync_tokens(probs, 30, 500, 3.0), want)
    # one token holding every frame's instant: the most likely event
    assert torch.equal(sync_tokens(probs, 2, 16000, 8.0), torch.tensor([0.9, 0.0]))


def test_only_clips_given_their_picture_carry_its_sync_feature(v2a_cfg):
    """Video-to-audio clips (cond.given_stream=video, half of them): their audio tokens carry the
    encoder's probabilities of their clean frames; joint clips and video tokens carry zeros."""
    from dit_train.tasks import build_task

    c = v2a_cfg
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed, cond=c.cond)
    batch = task.build(list(range(12)), 0)
    sync, audio = batch.tokens["sync"], batch.stream == 1
    assert not bool(sync[~audio].any())
    given = joint = 0
    for k, sid in enumerate(batch.sample_ids.tolist()):
        item, mine = task.dataset[sid], (batch.seg == k) & audio
        if item.audio is None:
            continue
        if bool(batch.tokens["clean"][(batch.seg == k) & ~audio].all()):  # its picture given clean
            given += 1
            n = int(mine.sum())
            want = clip_sync(c.model.sync_encoder, item.pixels, n, c.model.audio_patch, item.pixels.shape[1] * 16000 / item.audio.numel())
            assert torch.equal(sync[mine], want) and bool((want > 0).any())
        else:
            joint += 1
            assert not bool(sync[mine].any())
    assert given and joint, (given, joint)


def test_a_sync_model_makes_a_joint_requests_sound_again_from_its_pictures(v2a_cfg):
    """Joint requests (neither stream given): the sampler returns the pictures of the joint pass
    and the sound a video-to-audio request of the same noise makes from those pictures — whose
    packs carry the pictures' sync feature, where the joint pass's carried zeros."""
    from dit_train.data_pipelines.synthetic_video import caption_split  # noqa: F401  (the world's captions)
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import VideoSampler
    from dit_train.sampling.prompts import prompt_requests, prompt_space
    from dit_train.tasks.video_inputs import video_inputs

    c = v2a_cfg
    model = random_model(c.model).eval()
    assert model.sync_embedder is not None
    space, inputs, ctx = prompt_space(c), video_inputs(c.model, c.cond), init_parallel(c.parallel)
    seen, segs = [], []

    class Recording(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args, **kw):
            seen.append(kw["sync"].clone())
            segs.append(args[2].clone())
            return self.inner(*args, **kw)

    def sample(rs):
        s = VideoSampler(rs, inputs, space.null, ctx, 2, 2.0, 0)
        return s.sample(Recording()), s.sounds

    joint = prompt_requests(space, PROMPTS, 1, 8, 32, 32)
    clips, sounds = sample(joint)
    assert len(seen) == 4 and not seen[0].any() and seen[2].any()  # 2 joint steps (zeros), then 2 from the pictures
    # guidance 2: the uncaptioned copies (clips 2, 3 of each pack) read no frame events either
    assert not seen[2][segs[2] >= len(joint)].any() and seen[2][segs[2] < len(joint)].any()
    given = prompt_requests(space, PROMPTS, 1, 8, 32, 32)
    for r, x in zip(given, clips):
        r.given_video = x.clamp(-1, 1)
    _, v2a = sample(given)
    for a, b in zip(sounds, v2a):
        assert torch.equal(a, b)
    seen.clear()
    model.sync_embedder = None  # the same weights blind to the pictures' events: another sound
    _, blind = sample(given)
    assert any(not torch.equal(a, b) for a, b in zip(blind, v2a))


def test_train_sync_learns_from_the_clips_own_sound_and_writes_a_loadable_encoder(data_cache, tmp_path, capsys):
    from dit_train.tools.train_sync import main

    out = tmp_path / "enc"
    data = [f"data.cache_dir={data_cache}", "data.audio=true", "data.num_clips=16", "data.max_frames=8"]
    assert main([*data, "--out", str(out), "--steps", "3", "--clips", "6", "--channels", "4"]) == 0
    meta = json.loads((out / "sync_encoder.json").read_text())
    assert meta["clips"] == 6 and meta["steps"] == 3 and meta["channels"] == 4
    assert 0 <= meta["heldout"]["auc"] <= 1 and "cpu_s" in meta  # the embedded world: scored on held-out compositions
    enc = load(str(out))
    assert enc(torch.zeros(3, 5, 16, 16)).shape == (5,)
    assert "train with model.sync_encoder=" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main([f"data.cache_dir={data_cache}", "--out", str(tmp_path / "no")])
    assert exit_.value.code == 2 and "has no sound (data.audio=false)" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["model.sync_encoder=/no/such/folder"], "holds no sync_encoder.safetensors: train one with python -m dit_train.tools.train_sync"),
    (["cond.given_stream=none"], "reads the clean picture of video-to-audio clips: train with cond.given_stream=video"),
])
def test_a_sync_encoder_that_cannot_work_is_refused_before_any_worker(encoder, extra, needle):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from tests.conftest import compose_config

    base = [*AV, "cond.given_stream=video", f"model.sync_encoder={encoder}"]
    assert check_config(compose_config(base)) is None
    with pytest.raises(ConfigError, match=needle):
        check_config(compose_config([*base, *extra]))
    with pytest.raises(ConfigError, match="needs the two-stream DiT"):
        check_config(compose_config([f"model.sync_encoder={encoder}"]))
