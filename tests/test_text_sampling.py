"""Caption cross-attention, caption dropout and validation sampling."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import dataclasses

from dit_train.config import LossConfig
from dit_train.models import model_config
from dit_train.models import build_model, init_weights
from dit_train.tasks.captions import ByteCaptionEncoder, drop_caption, pad_contexts
from dit_train.tasks.video import VideoTask, patchify
from dit_train.kernels import VarlenLayout
from tests.conftest import TINY, train_in_process


def _text_dit():
    cfg = model_config("dit", dim=32, depth=2, heads=4, patch_size=[1, 4, 4], init="normal", text_dim=8, text_len=16)
    model = build_model(cfg)
    init_weights(model, seed=0, scheme="normal")
    return model


def _clips():
    g = torch.Generator().manual_seed(0)
    grids = [(2, 2, 3), (1, 3, 3)]
    xs = [torch.randn(f * h * w, 48, generator=g) for f, h, w in grids]
    pos = [torch.stack(torch.meshgrid(*(torch.arange(n) for n in gr), indexing="ij"), -1).reshape(-1, 3) for gr in grids]
    return xs, pos


def _run(model, xs, pos, ctxs, idx):
    x, p = torch.cat([xs[i] for i in idx]), torch.cat([pos[i] for i in idx])
    seg = torch.cat([torch.full((xs[i].shape[0],), k) for k, i in enumerate(idx)])
    order = torch.cat([torch.arange(xs[i].shape[0]) for i in idx])
    context, length = pad_contexts([ctxs[i] for i in idx], 8)
    t = torch.tensor([0.3, 0.7])[idx]
    return model(x, p, seg, t, VarlenLayout.build(seg, order, False), context=context, context_len=length)


def test_captions_condition_only_their_own_clip():
    model = _text_dit()
    xs, pos = _clips()
    enc = ByteCaptionEncoder(8, 16)
    ctxs = [enc("a red circle"), enc("a blue square moving left")]
    packed = _run(model, xs, pos, ctxs, [0, 1])
    n0 = xs[0].shape[0]
    alone = _run(model, xs, pos, ctxs, [1])
    torch.testing.assert_close(packed[n0:], alone, atol=1e-5, rtol=1e-5)
    other = _run(model, xs, pos, [enc("a green star"), ctxs[1]], [0, 1])
    assert (other[:n0] - packed[:n0]).abs().max() > 1e-5  # clip 0 reads its caption (noise is ~1e-7)
    torch.testing.assert_close(other[n0:], packed[n0:], atol=1e-7, rtol=1e-6)  # clip 1 does not see it


def test_caption_dropout_is_a_pure_function_of_seed_sample_and_step(tiny_cfg):
    from dit_train.data_pipelines import open_dataset

    drops = [drop_caption(0, sid, step, 0.3) for sid in range(50) for step in range(20)]
    assert 0.25 < sum(drops) / len(drops) < 0.35
    assert drops == [drop_caption(0, sid, step, 0.3) for sid in range(50) for step in range(20)]
    assert not any(drop_caption(0, sid, 0, 0.0) for sid in range(50))

    model_cfg = dataclasses.replace(tiny_cfg.model, text_dim=8)
    task = VideoTask(open_dataset(tiny_cfg.data, model_cfg), model_cfg, LossConfig(), seed=0, caption_dropout=0.5)
    step = 3
    together = task.build([0, 1, 2, 3, 4, 5], step)
    for k, sid in enumerate([0, 1, 2, 3, 4, 5]):
        alone = task.build([sid], step)
        n = int(alone.samples["context_len"][0])
        assert int(together.samples["context_len"][k]) == n
        torch.testing.assert_close(together.samples["context"][k, :n], alone.samples["context"][0, :n])
        expected = task.null_caption() if drop_caption(0, sid, step, 0.5) else task.caption_embedding(task.dataset[sid])
        torch.testing.assert_close(alone.samples["context"][0, :n], expected)


class _OracleVelocity(torch.nn.Module):
    """Returns the exact rectified-flow velocity towards known clean tokens: v = (x_t − x0)/t."""

    def __init__(self, x0_tokens):
        super().__init__()
        self.x0 = x0_tokens

    def forward(self, x, pos, seg, t, meta, **_):
        return (x - self.x0) / t[seg][:, None]


def test_sampler_integrates_the_flow_from_noise_to_data(tiny_cfg):
    """With a perfect velocity the Euler sampler lands on the data: checks the time direction,
    the scheduler's sigmas and the pack/unpack bookkeeping."""
    from dit_train.tasks import build_task
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling import VideoSampler, dataset_requests

    task = build_task("video", tiny_cfg.data, tiny_cfg.model, tiny_cfg.loss, 0)
    requests = dataset_requests(task, 2)
    # the oracle below outputs the velocity itself (the tiny DiT's own prediction is x0)
    inputs = dataclasses.replace(task.inputs, prediction="velocity")
    sampler = VideoSampler(requests, inputs, task.null_caption(), init_parallel(tiny_cfg.parallel),
                           steps=6, guidance_scale=1.0, seed=0)
    data = [task.dataset[r.noise_id].pixels for r in requests]
    model = _OracleVelocity(torch.cat([patchify(x, task.patch)[0] for x in data]))
    out = sampler.sample(model)
    for got, want in zip(out, data):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_validation_videos_are_written_and_layout_invariant(tmp_path, data_cache):
    from dit_train.data_pipelines.video_io import probe

    # in this process and on the suite's workers: the CLI's own path to run_from_config is
    # covered by test_cli; a fresh `python -m dit_train` per layout cost most of this test
    one, two = tmp_path / "one", tmp_path / "two"
    base = [*TINY, "train.steps=2", "train.sample_every=2", "train.sample_steps=3", "train.num_samples=2",
            "train.guidance_scale=3.0", "train.stochastic_sampling=true"]
    for run_dir, layout in ((one, []), (two, ["parallel.cp_ulysses=2"])):
        train_in_process([*base, *layout], run_dir, cache_dir=data_cache)
    d1, d2 = one / "samples" / "step_000002", two / "samples" / "step_000002"
    assert (d1 / "grid.png").exists() and len(list(d1.glob("*.mp4"))) == 2
    a, b = load_file(d1 / "samples.safetensors"), load_file(d2 / "samples.safetensors")
    assert a.keys() == b.keys() and len(a) == 2
    captions = json.loads((d1 / "captions.json").read_text())
    assert captions.keys() == a.keys() and all(c.startswith("a ") for c in captions.values())
    # the embedded world is scored on every validation: eval/ figures in metrics.jsonl
    last = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["eval/num_clips"] == 2 and 0 <= last["eval/palette_share"] <= 1
    ref = json.loads((one / "samples" / "reference.json").read_text())  # the real clips, scored once
    assert ref["eval/all_ok"] == 1.0 and ref["eval/palette_share"] > 0.9
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-4)
        assert probe(str(d1 / f"{k}.mp4")).frames == a[k].shape[1]  # decord, or PyAV where decord has no wheel


def test_caption_words_give_every_byte_of_a_word_the_same_word_vector():
    plain, words = ByteCaptionEncoder(8, 64), ByteCaptionEncoder(8, 64, words=True)
    cap = "a green circle on a gray background"
    extra = words(cap) - plain(cap)
    assert torch.equal(words(""), plain(""))  # the null caption is unchanged (dropout, CFG)
    spans, start = [], 0
    for w in cap.split(" "):
        spans.append((start, start + len(w)))
        start += len(w) + 1
    for s, e in spans:
        assert torch.allclose(extra[s:e], extra[s:s + 1].expand(e - s, -1))
    assert extra[spans[1][0]].ne(extra[spans[5][0]]).any()  # "green" and "gray" differ
    torch.testing.assert_close(extra[spans[0][0]], extra[spans[4][0]])  # both "a" (up to the rounding of out - plain)
    assert extra[spans[0][1]].abs().max() == 0  # spaces carry no word
    assert torch.equal(words(cap), ByteCaptionEncoder(8, 64, words=True)(cap))  # deterministic


def test_x0_prediction_gives_the_velocity_target():
    from dit_train.objectives.flow_matching import velocity_from_output

    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
    t = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
    xt = (1 - t[:, None]) * x0 + t[:, None] * eps
    torch.testing.assert_close(velocity_from_output(x0, xt, t, "x0", 0.05), eps - x0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(velocity_from_output(eps - x0, xt, t, "velocity"), eps - x0)
    v = velocity_from_output(x0[:1], xt[:1], 0.01, "x0", 0.05)  # t below the clamp: divided by 0.05
    torch.testing.assert_close(v, (xt[:1] - x0[:1]) / 0.05)
