"""Masked loss (data.masks) and control videos (cond.control), issue 32's second half: a mask
becomes per-token weights (fractional, T_b = Σ w), a control video more input channels; both
read through their clip's frames, resize and crop, and exact on every layout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dit_train.batch import WEIGHT_ONE
from dit_train.data_pipelines.example_videos import ExampleClip, render, write_example_videos
from dit_train.data_pipelines.synthetic_video import write_mp4
from tests.conftest import TINY_MODEL, compose_config
from tests.layout_cases import Case, assert_exact, run_cases

# uneven clips (height, width, frames at 8 fps): 16 to 96 tokens at 2x8x8 patches; the last one's
# mask is all zero (its sample weighs nothing: T_b = 0, not counted in B_global)
SIZES = [(32, 32, 8), (32, 64, 6), (64, 32, 4), (48, 32, 8), (32, 32, 2), (64, 64, 4), (40, 32, 6), (32, 32, 4)]
ZERO_MASK = "clip_7"


def folder_clips() -> list[ExampleClip]:
    colors, shapes = ("red", "green", "blue", "yellow"), ("circle", "square")
    return [ExampleClip(f"clip_{i}.mp4", h, w, 8, f, colors[i % 4], shapes[i % 2], "navy", rightward=i % 3 != 0)
            for i, (h, w, f) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The clips with a soft mask (255 on the shape, 64 around it) and a control video beside each."""
    root = tmp_path_factory.mktemp("masked_videos")
    clips = folder_clips()
    write_example_videos(root, clips, masks=True, control=True)
    h, w, f = SIZES[-1]
    write_mp4(root / f"{ZERO_MASK}.mask.mp4", np.zeros((f, h, w, 3), np.uint8), fps=8)
    return root


def folder_cfg(root: Path, cache: str, overrides: list[str]):
    cfg = compose_config([*TINY_MODEL, "data=video_folder", f"data.root={root}", "data.resolution_buckets=null",
                          "data.num_workers=0", "data.max_frames=8", "model.text_len=16", *overrides], cache_dir=cache)
    cfg.optim.max_grad_norm = 0.05  # always clips: the global norm must be exact too
    return cfg


def task_of(cfg):
    from dit_train.tasks import build_task

    return build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed, cond=cfg.cond)


# fractional masks and control videos, alone and with each conditioning feed, on our DiT and on
# pixel-space Wan; each on a layout mixing DP, Ulysses or ring CP and accumulation
CASES = {
    "masks-dit": (["data.masks=true"], "dp_shard=2,cp_ring=2,grad_accum=2"),
    "masks-first_frame-wan": (["data.masks=true", "cond.kind=first_frame", "model=wan_tiny", "loss.reduction=token_mean"],
                              "dp_replicate=2,cp_ulysses=2"),
    "control-dit": (["cond.control=true"], "cp_ulysses=2,cp_ring=2,grad_accum=2"),
    "control-concat-masks-wan": (["cond.control=true", "cond.kind=first_last", "cond.feed=concat", "data.masks=true",
                                  "model=wan_tiny"], "dp_shard=2,cp_ring=2"),
}


@pytest.fixture(scope="module")
def layouts(folder, data_cache):
    """{case: (one-process result, layout result)}, every layout in one launch of 4 workers. One
    transformer block: the runs are Python-bound, and the masks' weights, the control channels and
    the CP splits need no second."""
    return run_cases({name: Case(folder_cfg(folder, data_cache, [*overrides, "model.depth=1"]), spec)
                      for name, (overrides, spec) in CASES.items()})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_masked_and_controlled_training_matches_one_process(case, layouts):
    assert_exact(*layouts[case], f"{case} on {CASES[case][1]}")


# -- masks become token weights -------------------------------------------------------------------

def test_soft_mask_video_gives_fractional_weights_and_T_b_is_their_sum(folder, data_cache):
    """Each token weighs the mean of its patch of the (decoded) mask: 1 inside the shape, ~1/4 on
    the band, fractions on edges; T_b is Σ w exactly and the all-zero mask's sample is out of B."""
    from dit_train.loss import sync_counts
    from dit_train.data_pipelines.companions import mask_weight_units

    task = task_of(folder_cfg(folder, data_cache, ["data.masks=true"]))
    ids = list(range(len(task.lengths())))
    pack = task.build(ids, 0)
    counts = sync_counts([pack], None, None)
    units = pack.weight_units()
    frac = (units > 0) & (units < WEIGHT_ONE)
    assert frac.sum() > 0 and (units == WEIGHT_ONE).sum() > 0  # fractional and whole tokens
    for k, sid in enumerate(ids):
        mask = task.dataset[sid].mask
        assert mask.shape == task.dataset[sid].pixels.shape[1:]
        assert torch.equal(units[pack.seg == k], mask_weight_units(mask, task.patch))
        assert float(counts.sample_tokens[0][k]) == int(units[pack.seg == k].sum()) / WEIGHT_ONE
    zero = [k for k, sid in enumerate(ids) if Path(task.dataset.entries[sid].path).stem == ZERO_MASK]
    assert zero and float(counts.sample_tokens[0][zero[0]]) == 0
    assert counts.num_samples == len(ids) - 1  # B_global counts samples with T_b > 0


def box_manifest(root: Path, rows: list[dict]) -> Path:
    """A manifest of one 44x32 clip of 4 frames per row (cropped to 40x32 at 2x8x8 patches: 2
    rows off the top), with the row's columns ({"mask_boxes": ...})."""
    clip = ExampleClip("boxed.mp4", 44, 32, 8, 4, "red", "circle", "navy")
    for k in range(len(rows)):
        write_mp4(root / f"boxed_{k}.mp4", render(clip), fps=8)
    (root / "m.jsonl").write_text("".join(json.dumps({"path": f"boxed_{k}.mp4", "caption": "x", **r}) + "\n"
                                          for k, r in enumerate(rows)))
    return root / "m.jsonl"


def test_boxes_become_weights_in_the_cropped_frame(tmp_path, data_cache):
    """mask_boxes in the clip's native pixels, drawn and cropped like the clip: a box over the
    left half (rows 2..34 native = the crop's first 4 token rows) weighs 1, a box of weight 0.5
    half a token (128/255: 8-bit exact units), per-frame boxes only their frames, a box covering a
    quarter of a token a quarter."""
    rows = [{"mask_boxes": [[0, 2, 16, 34]]},
            {"mask_boxes": [[16, 2, 32, 10, 0.5]]},
            {"mask_boxes": [[[0, 2, 8, 10]], [[0, 2, 8, 10]], [], []]},
            {"mask_boxes": json.dumps([[0, 2, 4, 6]])}]  # a CSV cell holds JSON text: the same
    manifest = box_manifest(tmp_path, rows)
    task = task_of(folder_cfg(manifest, data_cache, ["data.masks=true"]))
    f, h, w = 2, 5, 4  # token grid of the 4x40x32 crop
    expect = [torch.zeros(f, h, w, dtype=torch.int64) for _ in rows]
    expect[0][:, :4, :2] = WEIGHT_ONE
    expect[1][:, 0, 2:] = 128 * 257
    expect[2][0, 0, 0] = WEIGHT_ONE
    expect[3][:, 0, 0] = (2 * (16 * 2 * 255 * 257) + 128) // 256  # 2 frames x 4x4 of 2x8x8 pixels, rounded
    pack = task.build(list(range(len(rows))), 0)
    for k in range(len(rows)):
        assert torch.equal(pack.weight_units()[pack.seg == k], expect[k].reshape(-1)), k


# -- control videos -----------------------------------------------------------------------------

def test_control_is_aligned_and_appended_after_the_concat_channels(tmp_path, data_cache):
    """A control video equal to its clip decodes to the clip's own pixels (same frames, resize and
    crop); one at half the size (same aspect) is resized to match; the model's input is
    [noisy | mask | conditioning | control] per token."""
    from dit_train.batch import input_tokens
    from dit_train.tasks.video import patchify

    clips = [ExampleClip("a.mp4", 44, 64, 8, 4, "red", "circle", "navy"),
             ExampleClip("b.mp4", 64, 64, 8, 6, "green", "square", "gray")]
    write_example_videos(tmp_path, clips)
    shutil.copy(tmp_path / "a.mp4", tmp_path / "a.control.mp4")
    write_mp4(tmp_path / "b.control.mp4", render(ExampleClip("x", 32, 32, 8, 6, "green", "square", "gray")), fps=8)
    cfg = folder_cfg(tmp_path, data_cache, ["cond.control=true", "cond.kind=first_frame", "cond.feed=concat"])
    assert cfg.model.cond_channels == 3 + 1 + 3
    task = task_of(cfg)
    a, b = task.dataset[0], task.dataset[1]
    assert torch.equal(a.control, a.pixels)
    assert b.control.shape == b.pixels.shape and (b.control - b.pixels).abs().mean() < 0.1
    pack = task.build([0, 1], 0)
    tokens = input_tokens(pack)
    P = 3 * 2 * 8 * 8
    assert tokens.shape[1] == P + 4 * 2 * 8 * 8 + P
    torch.testing.assert_close(tokens[:, :P], pack.tokens["x"], rtol=0, atol=0)
    torch.testing.assert_close(tokens[:, -P:], torch.cat([patchify(a.control, task.patch)[0],
                                                          patchify(b.control, task.patch)[0]]), rtol=0, atol=0)


def test_input_width_follows_control():
    assert compose_config(["cond.control=true"]).model.cond_channels == 3
    from dit_train.models.wan import wan_config

    wan = compose_config(["model=wan_tiny", "cond.control=true", "cond.kind=first_frame", "cond.feed=concat"])
    assert (wan_config(wan.model)["in_channels"], wan_config(wan.model)["out_channels"]) == (3 + 4 + 3, 3)


def test_a_text_to_video_wan_checkpoint_widens_into_control(tmp_path):
    """model.pretrained from a T2V folder with cond.control=true: the patch embedding gets C
    zero-initialised control channels (the concat feed's widening, reused), so training starts
    from the T2V model's outputs whatever the control video."""
    from dit_train.kernels import VarlenLayout
    from dit_train.models import build_model, model_config
    from dit_train.models.init import load_full_weights
    from dit_train.models.diffusers_family import read_pretrained, to_diffusers

    base = dict(dim=32, heads=2, depth=1, ffn_dim=64, freq_dim=32, text_dim=32, text_len=6, in_channels=3,
                patch_size=[1, 2, 2], init="normal")
    t2v_cfg = model_config("wan", **base)
    t2v = build_model(t2v_cfg)
    to_diffusers(t2v.state_dict(), t2v_cfg).save_pretrained(str(tmp_path / "wan"))
    cfg = compose_config(["model=wan_tiny", "cond.control=true"])
    ctrl_cfg = model_config("wan", **base, cond_channels=cfg.model.cond_channels)
    state = read_pretrained(str(tmp_path / "wan"), ctrl_cfg)
    assert state["patch_embedding.weight"].shape[1] == 6 and float(state["patch_embedding.weight"][:, 3:].abs().sum()) == 0
    ctrl = build_model(ctrl_cfg)
    load_full_weights(ctrl, state)
    x, control = torch.randn(8, 3 * 4), torch.randn(8, 3 * 4)
    seg, pos = torch.zeros(8, dtype=torch.long), torch.stack([torch.zeros(8), torch.arange(8) // 4, torch.arange(8) % 4], 1).long()
    meta = VarlenLayout.build(seg, torch.arange(8), False)
    with torch.no_grad():
        torch.testing.assert_close(ctrl(torch.cat([x, control], 1), pos, seg, torch.tensor([0.3]), meta),
                                   t2v(x, pos, seg, torch.tensor([0.3]), meta), rtol=1e-5, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------------

def test_bad_companions_are_skipped_and_counted_per_clip(tmp_path, data_cache, caplog):
    """A mask of another length, a control of another aspect, a missing mask, a box weight outside
    [0, 1]: each clip is dropped with its reason (counted like an unreadable video); a mask of
    the clip's aspect at another size is resized and kept."""
    names = ["ok", "short_mask", "wide_control", "no_mask", "bad_box", "small_mask"]
    clips = [ExampleClip(f"{n}.mp4", 32, 32, 8, 4, "red", "circle", "navy") for n in names]
    write_example_videos(tmp_path, clips, masks=True, control=True)
    frames = render(clips[0])
    write_mp4(tmp_path / "short_mask.mask.mp4", frames[:2], fps=8)
    write_mp4(tmp_path / "wide_control.control.mp4", np.concatenate([frames, frames], axis=2), fps=8)
    (tmp_path / "no_mask.mask.mp4").unlink()
    write_mp4(tmp_path / "small_mask.mask.mp4", frames[:, ::2, ::2].copy(), fps=8)
    rows = [{"path": f"{n}.mp4", "caption": "", "control": f"{n}.control.mp4"}
            | ({"mask_boxes": [[0, 0, 8, 8, 1.5]]} if n == "bad_box" else
               {} if n == "no_mask" else {"mask": f"{n}.mask.mp4"}) for n in names]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = task_of(folder_cfg(manifest, data_cache, ["data.masks=true", "cond.control=true"]))
    order = [Path(e.path).stem for e in task.dataset.entries]
    pack = task.build(list(range(len(order))), 0)
    assert sorted(order[i] for i in pack.sample_ids.tolist()) == ["ok", "small_mask"]
    why = {order[i]: r for i, r in task.failure_reasons.items()}
    assert "has 2 frame(s), its clip" in why["short_mask"] and "short_mask.mask.mp4" in why["short_mask"]
    assert "another aspect ratio" in why["wide_control"]
    assert "has no mask (data.masks=true): put no_mask.mask.mp4 beside it" in why["no_mask"]
    assert "weight 1.5 is outside [0, 1]" in why["bad_box"]


@pytest.mark.parametrize("overrides,needle", [
    (["data.masks=true"], "data.masks=true but no clip of the data has a mask"),  # the shapes world writes none
    (["cond.control=true", "cond.kind=first_frame"], "cond.control=true but no clip of the data has a control"),
])
def test_keys_on_without_any_file_are_refused_before_the_run(overrides, needle, data_cache, tiny_cfg):
    from dit_train.config.errors import ConfigError
    from dit_train.tasks import check_data
    from tests.conftest import TINY

    with pytest.raises(ConfigError, match=needle):
        check_data(compose_config([*TINY, *overrides], cache_dir=data_cache))


@pytest.mark.parametrize("overrides,needle", [
    (["mode=llm", "data.masks=true"], r"data.masks=true need video clips; mode=llm has none"),
    # Wan trains its widened patch embedding beside the adapters (tests/test_widen_lora.py); LTX does not
    (["model=ltx_tiny", "model.pretrained=/models/ltx", "model.lora.rank=4", "cond.control=true"],
     r"model.lora.rank=4 freezes the patch embedding, and the \d+ input channels"),
])
def test_config_level_mistakes_are_refused_before_the_run(overrides, needle):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError, match=needle):
        check_config(compose_config(overrides))


def test_companion_files_are_not_clips_of_their_own(folder):
    from dit_train.data_pipelines.video_folder import list_clips

    paths = [Path(p).name for p, _ in list_clips(folder)]
    assert paths == [f"clip_{i}.mp4" for i in range(len(SIZES))]


# -- the commands as a user runs them -------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_run(folder, data_cache, tmp_path_factory) -> Path:
    """`python -m dit_train data=video_folder data.root=<folder> data.masks=true cond.control=true`
    for 2 steps, validated at its end (sampled with the clips' own control videos): the CLI's path
    (compose, check, prepare the data, train) in this process — a fresh Python cost ~5 CPU-s more
    and proved nothing of masks or control (the CLI itself: tests/test_cli.py)."""
    from tests.conftest import train_in_process

    out = tmp_path_factory.mktemp("cli") / "run"
    train_in_process(["data=video_folder", f"data.root={folder}", "data.masks=true", "cond.control=true",
                      "data.resolution_buckets=null", "data.max_frames=8", "train.global_batch=4", "train.steps=2",
                      "train.sample_every=2", "train.num_samples=2", "train.sample_steps=2", "train.progress=false",
                      "model.dim=32", "model.depth=1"], out, cache_dir=data_cache)
    return out


@pytest.mark.slow
def test_masks_and_control_train_from_the_command_line(cli_run):
    rows = [json.loads(line) for line in (cli_run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    # T_b are sums of fractional weights: the step's N is not a whole number of tokens
    assert any(r["tokens"] != int(r["tokens"]) for r in rows)
    assert len(list((cli_run / "samples" / "step_000002").glob("*.mp4"))) == 2


@pytest.mark.slow
def test_sample_tool_takes_a_control_video(cli_run, folder, tmp_path, capsys):
    from dit_train.tools.sample import main

    args = [str(cli_run), "--prompt", "a red circle moving right on a navy background", "--frames", "4",
            "--height", "32", "--width", "32", "--steps", "2"]
    assert main([*args, "--control", str(folder / "clip_0.control.mp4"), "--out", str(tmp_path / "a")]) == 0
    assert len(list((tmp_path / "a").glob("*.mp4"))) == 1
    capsys.readouterr()
    assert main(args) == 2
    assert "error: this run trained with a control video (cond.control=true): give --control" in capsys.readouterr().err
    assert main([*args, "--control", str(tmp_path / "nope.mp4")]) == 2
    assert "nope.mp4: no such file" in capsys.readouterr().err
    assert main([*args, "--frames", "16", "--control", str(folder / "clip_0.control.mp4")]) == 2
    assert "--control with --frames=16 needs at least that many" in capsys.readouterr().err
    # the run's validation clips, each with its own control video
    assert main([str(cli_run), "--data-captions", "2", "--steps", "2", "--out", str(tmp_path / "b")]) == 0
    assert len(list((tmp_path / "b").glob("*.mp4"))) == 2
    assert main([str(cli_run), "--data-captions", "2", "--control", str(folder / "clip_0.control.mp4")]) == 2
    assert "--control goes with --prompt" in capsys.readouterr().err


def test_control_flag_on_a_run_without_control_is_refused(capsys):
    import argparse

    from dit_train.tools.sample import read_control

    args = argparse.Namespace(control="ctrl.mp4", data_captions=0, prompt=["x"])
    with pytest.raises(ValueError, match=r"--control: this run trained without a control video"):
        read_control(args, compose_config([]))
