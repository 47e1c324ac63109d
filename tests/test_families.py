"""What every model family's tiny preset must do, one test per feature parametrized over the
families (docs/models.md's table of families × features names, per cell, the test proving it):

1. Exact resume: AdamW with a cosine schedule and EMA, checkpointed after step 0 of 2 and
   resumed: the weights and EMA weights of the uninterrupted run (optimizer moments, step
   counters, the LR schedule, the EMA's update count and the data position all come back);
   then tools.sample samples from the resumed run.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CLIP_DIM, TEXT_DIM, TINY, TINY_MODEL, Z_DIM, train_in_process

# AdamW (its moments and bias correction are state a resume must restore; SGD's is none),
# warm-up and cosine (the schedule's position), EMA (its update count sets its decay)
ADAM = ["optim=adamw", "optim.lr=3e-3", "optim.warmup_steps=2", "optim.schedule=cosine", "train.ema_decay=0.9", "train.steps=2",
        "train.global_batch=2"]  # 2 steps of 2 clips: each step on other clips (the data position comes back too)
TINY_ADAM = [o for o in TINY if not o.startswith("optim")] + ADAM

# each family's tiny preset on the embedded pixel clips, at TINY's dim 32 / 4 heads (after TINY: they win)
FAMILIES = {
    "wan": ["model=wan_tiny", "model.text_len=16"],
    # Wan 2.2 TI2V: the first frame clean at timestep 0 on half the samples (per-token timesteps)
    "wan22_ti2v": ["model=wan22_ti2v_tiny", "model.text_len=16", "cond.kind=first_frame", "cond.feed=timestep",
                   "cond.prob=0.5"],
    "ltx": ["model=ltx_tiny", "model.text_len=16"],
    # head dim 8; a sample's pack length counts its 32 caption slots. Its image embedder (the
    # image-to-video branch, not run) never has a gradient, so no optimizer state: a resume
    # once failed on that (tests/test_checkpoint.py::test_parameters_without_gradients_...)
    "hunyuan15": ["model=hunyuan15_tiny", "model.rope_axes=[2,2,4]", "model.text_len=32", "train.micro_batch_tokens=448"],
    # block-causal (K = 4) with diffusion forcing and clean history blocks (their RNG comes back
    # too); tools.sample streams its 4 frames (one block) with the KV cache
    "skyreels_v2": ["model=skyreels_v2_tiny", "model.text_len=16", "loss.frame_noise=block", "loss.history_prob=0.5"],
}
# (Wan 2.2 A14B resumes in tests/test_wan22_runs.py, both experts with LoRA; our DiT in tests/test_checkpoint.py)


def family_run(family: str, request) -> tuple[list[str], str | None, list[str]]:
    """(overrides, data cache dir, extra tools.sample args) of `family`'s resume run. Wan 2.1 I2V
    trains on the tiny I2V latent cache (mask, condition latents, CLIP tokens per clip) and
    samples from its held-out clips' first frames (its CLIP branch needs an image)."""
    if family == "wan_i2v":
        cache = request.getfixturevalue("i2v_cache")
        return ([*(o for o in TINY_MODEL if not o.startswith(("optim", "model.heads", "model.patch_size"))), *ADAM,
                 "model=wan_i2v_tiny", "data=latent_cache", f"data.root={cache}", f"model.in_channels={Z_DIM}",
                 f"model.text_dim={TEXT_DIM}", f"model.image_dim={CLIP_DIM}", "cond.kind=first_frame",
                 "cond.feed=concat", "cond.prob=0.5", "train.micro_batch_tokens=0"],
                None, ["--data-captions", "1"])
    if family == "wan_vace":  # Wan VACE on the --control latent cache: its context from each clip's control video
        cache = request.getfixturevalue("companion_cache")
        return ([*(o for o in TINY_MODEL if not o.startswith(("optim", "model.heads", "model.patch_size"))), *ADAM,
                 "model=wan_vace_tiny", "model.heads=2", "model.patch_size=[1,2,2]", "data=latent_cache",
                 f"data.root={cache}", f"model.in_channels={Z_DIM}", f"model.text_dim={TEXT_DIM}",
                 "model.vace_mask_channels=64", "cond.control=true", "train.micro_batch_tokens=0"],
                None, ["--data-captions", "1"])
    return ([*TINY_ADAM, *FAMILIES[family]], request.getfixturevalue("data_cache"),
            ["--prompt", "a red square", "--frames", "4", "--height", "32", "--width", "32"])


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("family", [*FAMILIES, "wan_i2v", "wan_vace"])
def test_each_family_resumes_exactly_and_samples(family, request, tmp_path, capsys):
    from dit_train.tools import sample

    overrides, cache, sample_args = family_run(family, request)
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*overrides, "train.ckpt_every=1"], full, cache_dir=cache)
    capsys.readouterr()
    train_in_process([*overrides, f"train.resume={full / 'checkpoints' / 'step_00000000'}"], part, cache_dir=cache)
    assert "resumed from" in capsys.readouterr().out
    for name in ("weights.safetensors", "weights_ema.safetensors"):
        # CPU kernels with 2 threads are not bitwise deterministic run to run, so 1e-6
        assert _max_diff(load_file(full / name), load_file(part / name)) < 1e-6, name

    out = tmp_path / "gen"
    assert sample.main([str(part), *sample_args, "--steps", "2", "--out", str(out)]) == 0
    (x, *_) = load_file(out / "samples.safetensors").values()
    assert bool(torch.isfinite(x).all())
