"""The pretrained -> train -> export round trip of every diffusers family, one test parametrized
over FAMILIES (a new family joins by adding its tiny preset here: docs/models.md#add-a-family).

model.pretrained = a pipeline folder holding transformer/ (random weights of the tiny preset's
shape, nothing downloaded); one step with a checkpoint and validation videos (the sampler runs the
family with CFG); the weights start from the folder and move; `export_weights --diffusers` from
the run and from its weights file loads back with `from_pretrained`: the same weights, and the
same outputs as our packed model; tools.sample samples from the run with the family's shift (a
joint-text family gets its captions as text slots on every call, the CFG negative's too).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import pytest
import torch

from dit_train.models import build_model, model_spec
from dit_train.models.diffusers_family import family_of, read_pretrained
from tests import test_hunyuan15, test_ltx, test_ltx2, test_minimax_h3, test_skyreels_v2, test_wan
from tests.families import family_run_cfg, pretrained_folder


@dataclass(frozen=True)
class Family:
    overrides: tuple[str, ...]  # its tiny preset first, after TINY (tests/families.family_run_cfg)
    same_outputs: Callable  # (model cfg, weights, diffusers model) -> max |ours - theirs| / max |theirs|
    shift: float  # tools.sample --shift (the family's scheduler shift)
    frames: int = 2  # tools.sample --frames (a block-causal family: whole causal blocks)


FAMILIES = {
    "wan": Family(("model=wan_tiny", "model.text_len=16"), test_wan.same_outputs, 3.0),
    "ltx": Family(("model=ltx_tiny", "model.text_len=16"), test_ltx.same_outputs, 3.0),
    # head dim 8; a sample's pack length counts its 32 caption slots
    "hunyuan15": Family(("model=hunyuan15_tiny", "model.rope_axes=[2,2,4]", "model.text_len=32"),
                        test_hunyuan15.same_outputs, 5.0),
    # block-causal (K = 4) with diffusion forcing and clean history blocks; samples streamed
    "skyreels_v2": Family(("model=skyreels_v2_tiny", "model.text_len=16", "loss.frame_noise=block",
                           "loss.history_prob=0.5"), test_skyreels_v2.same_outputs, 3.0, frames=4),
    # both streams train on the embedded world's sound; outputs compared on a clip with sound
    "ltx2": Family(("model=ltx2_tiny", "model.text_len=16", "data.audio=true"), test_ltx2.same_outputs, 3.0),
    # caption, audio and video tokens in one sequence; outputs compared on a clip with sound and caption
    "minimax_h3": Family(("model=minimax_h3_tiny", "model.text_len=16", "data.audio=true"),
                         test_minimax_h3.same_outputs, 3.0),
}
# registered diffusers families whose round trip needs more than a tiny preset, and where it is
ELSEWHERE = {"wan_vace": "tests/test_wan_vace.py (needs a control video: pretrained -> LoRA run -> merged export)"}


def test_every_registered_diffusers_family_has_its_round_trip():
    """A family registered with a DiffusersFamily is in FAMILIES (or ELSEWHERE, saying where):
    a new family cannot land without the pretrained -> train -> export test."""
    from dit_train.models import MODELS

    assert set(FAMILIES) | set(ELSEWHERE) == {n for n in MODELS.names() if MODELS[n].diffusers is not None}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, data_cache, tmp_path_factory):
    """(its Family, its tiny run's config, a pipeline folder of its shape holding transformer/)."""
    fam = FAMILIES[request.param]
    cfg = family_run_cfg(list(fam.overrides), data_cache)
    return fam, cfg, pretrained_folder(cfg.model, tmp_path_factory.mktemp(f"{request.param}_pretrained")).parent


def test_train_from_pretrained_export_and_sample(family, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from dit_train.engine.worker import train as run
    from dit_train.tools import export_weights, sample

    fam, base, pipeline = family
    cfg = replace(base, model=replace(base.model, pretrained=str(pipeline)),
                  train=replace(base.train, steps=1, ckpt_every=1, sample_every=1, sample_steps=2, num_samples=2,
                                guidance_scale=2.0),
                  run_dir=str(tmp_path / "run"))
    run(cfg)
    assert (tmp_path / "run" / "samples" / "step_000001" / "sample_1.mp4").exists()
    start = read_pretrained(str(pipeline / "transformer"), cfg.model)
    trained = load_file(str(tmp_path / "run" / "weights.safetensors"))
    assert trained.keys() == start.keys()
    assert max(float((trained[k] - start[k]).abs().max()) for k in start) > 0  # it trained from there

    cls = family_of(cfg.model).model_class()
    assert export_weights.main([str(tmp_path / "run"), "--diffusers", str(tmp_path / "from_ckpt")]) == 0
    assert export_weights.main([str(tmp_path / "run" / "weights.safetensors"), "--diffusers",
                                str(tmp_path / "from_w")]) == 0
    for folder in ("from_ckpt", "from_w"):
        theirs = cls.from_pretrained(str(tmp_path / folder))
        assert all(torch.equal(theirs.state_dict()[k], trained[k]) for k in trained), folder
    assert fam.same_outputs(cfg.model, trained, theirs) <= 1e-5

    calls = []  # a joint-text family: every sampler call hands the model its captions as text slots
    if model_spec(cfg.model).joint_text:
        packed = type(build_model(cfg.model))
        forward = packed.forward
        monkeypatch.setattr(packed, "forward", lambda self, *a, text=None, **kw: calls.append(
            text is not None and bool((text > 0).any())) or forward(self, *a, text=text, **kw))
    gen = tmp_path / "gen"
    assert sample.main([str(tmp_path / "run"), "--prompt", "a red square", "--frames", str(fam.frames), "--height", "16",
                        "--width", "24", "--steps", "2", "--shift", str(fam.shift), "--out", str(gen)]) == 0
    (x,) = load_file(gen / "samples.safetensors").values()
    assert x.shape == (3, fam.frames, 16, 24) and bool(torch.isfinite(x).all())
    assert not model_spec(cfg.model).joint_text or (len(calls) == 2 and all(calls))
