"""LoRA on a text-to-video Wan checkpoint widened into conditioning (issue 32): the patch
embedding's zero-initialised new channels (cond.feed=concat, cond.control) train beside the
adapters, as peft's `modules_to_save` (models/lora.py, LoraSettings.train_also), so the model
learns to read them; the rest of the base stays frozen; exact on a dp x CP layout; exported."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.models.registry import widens_pretrained
from tests.conftest import TINY, compose_config
from tests.families import random_model

WIDEN = ["cond.kind=first_frame", "cond.feed=concat", "cond.prob=0.5"]


def widen_cfg(data_cache, pretrained, extra=()):
    cfg = compose_config(["model=wan_tiny", *TINY, "model.text_len=16", *WIDEN, "model.lora.rank=4", "model.lora.alpha=8",
                          f"model.pretrained={pretrained}", "loss.reduction=sample_mean", *extra], cache_dir=data_cache)
    cfg.optim.max_grad_norm = 0.05
    return cfg


@pytest.fixture(scope="module")
def t2v_folder(data_cache, tiny_cfg, tmp_path_factory):
    """A text-to-video diffusers folder of wan_tiny's shape (3 input channels), random weights (tiny_cfg:
    the embedded clips written)."""
    t2v = compose_config(["model=wan_tiny", *TINY, "model.text_len=16"], cache_dir=data_cache).model
    path = tmp_path_factory.mktemp("t2v") / "transformer"
    to_diffusers(random_model(t2v, seed=3).state_dict(), t2v).save_pretrained(str(path))
    return path


def test_lora_trains_the_widened_patch_embedding_and_exports_it(data_cache, t2v_folder, tmp_path):
    from dit_train.__main__ import run_from_config
    from dit_train.checkpoint.export import checkpoint_model
    from dit_train.engine.checks import check_config

    cfg = widen_cfg(data_cache, t2v_folder, ["train.ckpt_every=2"])
    check_config(cfg)  # accepted: LoRA reads the new channels through the trained patch embedding
    assert widens_pretrained(cfg.model)
    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    start = read_pretrained(str(t2v_folder), cfg.model)  # widened: channels 3.. zero
    assert start["patch_embedding.weight"][:, 3:].abs().max() == 0
    merged = load_file(str(tmp_path / "run" / "weights.safetensors"))
    assert merged["patch_embedding.weight"][:, 3:].abs().max() > 0  # the model learnt to read the first frame
    moved = {k for k in start if not torch.equal(merged[k], start[k])}
    assert moved and all(k.startswith("patch_embedding.") or ".to_" in k or ".ffn." in k for k in moved)
    trained = load_file(str(tmp_path / "run" / "lora" / "trained_modules.safetensors"))
    assert trained.keys() == {"patch_embedding.weight", "patch_embedding.bias"}
    assert torch.equal(trained["patch_embedding.weight"], merged["patch_embedding.weight"])
    _, model = checkpoint_model(tmp_path / "run" / "checkpoints" / "step_00000001")  # an export from the checkpoint keeps it
    assert torch.equal(model.patch_embedding.weight.detach(), merged["patch_embedding.weight"])
    # so does an export of the files a run without checkpoints wrote (it copied only the adapters)
    import shutil

    from dit_train.tools import export_weights

    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "run", plain, ignore=shutil.ignore_patterns("checkpoints"))
    assert export_weights.main([str(plain), "--diffusers", str(tmp_path / "D")]) == 0
    for name in ("pytorch_lora_weights.safetensors", "trained_modules.safetensors"):
        assert (tmp_path / "D" / name).read_bytes() == (plain / "lora" / name).read_bytes(), name


@pytest.mark.slow
def test_widened_lora_training_matches_one_process(data_cache, t2v_folder):
    cfg = widen_cfg(data_cache, t2v_folder)
    oracle, got = train_on_workers([cfg, apply_layout(cfg, parse_layout("dp_shard=2,cp_ulysses=2"))])
    assert not torch.equal(oracle["patch_embedding.weight"], oracle["__init__/patch_embedding.weight"])
    assert relative_difference(oracle, got) <= 1e-4
