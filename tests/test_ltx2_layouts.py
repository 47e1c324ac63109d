"""LTX-2 (model=ltx2_tiny: diffusers' LTX2VideoTransformer3DModel, video + audio) trains
layout-exact: dp_shard=2 × cp_ulysses=2 and dp_shard=2 × cp_ring=2 against one process, on the
embedded set with sound (uneven clips, a quarter without audio, a CP rank holding a clip's video
but none of its audio: tests/test_av_layouts.py shows the same planner's steps are not vacuous),
full training and LoRA on both streams (docs/audio-video.md)."""
from __future__ import annotations


import pytest
import torch

from tests.families import family_run_cfg, lora_run_cfg
from tests.layout_cases import Case, assert_exact, run_cases

# one block: the runs are Python-bound (a step costs its blocks' calls, not their width), and the two
# streams split over CP, their counts, the shards and the adapters need no second block
AV = ["model=ltx2_tiny", "data.audio=true", "model.audio_dim=32", "model.audio_heads=4", "train.micro_batch_tokens=600",
      "model.depth=1"]
LAYOUTS = {"ulysses": "dp_shard=2,cp_ulysses=2", "ring": "dp_shard=2,cp_ring=2"}


@pytest.fixture(scope="module")
def ltx2_cfg(data_cache):
    return family_run_cfg(AV, data_cache)  # TINY, data prepared; always clips: the global norm must be exact too


@pytest.fixture(scope="module")
def lora_cfg(ltx2_cfg, tmp_path_factory):
    """LoRA (rank 4, the family's default targets) on a random pretrained LTX-2 folder."""
    return lora_run_cfg(ltx2_cfg, tmp_path_factory.mktemp("ltx2_pretrained"))


@pytest.fixture(scope="module")
def layouts(ltx2_cfg, lora_cfg):
    cases = {name: Case(ltx2_cfg, spec) for name, spec in LAYOUTS.items()}
    return run_cases(cases | {"lora": Case(lora_cfg, LAYOUTS["ulysses"])})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ltx2_training_matches_one_process(name, layouts):
    assert_exact(*layouts[name], f"LTX-2 audio + video on {LAYOUTS[name]}")


@pytest.mark.slow
def test_ltx2_lora_on_both_streams_matches_one_process(layouts):
    """LoRA adapts both streams (video and audio attention, audio<->video, both feed-forwards),
    the base stays put, and the adapters on dp_shard=2 x cp_ulysses=2 equal one process's."""
    ref, got = layouts["lora"]
    adapted = {k.split(".lora_")[0] for k in ref if ".lora_" in k}
    for module in ("attn1.to_q", "audio_attn1.to_q", "audio_to_video_attn.to_k", "video_to_audio_attn.to_v",
                   "audio_attn2.to_out.0", "audio_ff.net.0.proj", "ff.net.2"):
        assert any(name.endswith(module) for name in adapted), module
    assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)
    assert_exact(ref, got, "LTX-2 LoRA on dp_shard=2,cp_ulysses=2")


def test_the_layout_case_is_not_vacuous(ltx2_cfg):
    """The steps trained hold clips with and without sound, and a pack whose CP split leaves a
    rank with video tokens of a clip but none of its audio (the two-stream DiT's check, on
    LTX-2's 640-sample audio tokens)."""
    from tests.test_av_layouts import test_the_layout_case_is_not_vacuous as check

    check(ltx2_cfg)
