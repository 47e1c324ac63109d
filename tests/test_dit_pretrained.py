"""model.pretrained for our DiT (dit_train/models/dit_pretrained.py): a run starts from a finished
run's weights (its EMA weights when present), checked against the model config before any
worker starts.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY, compose_config, refusal


def _run_folder(tiny_teacher, tmp_path, ema: bool):
    """A copy of the tiny trained run; with `ema`, a weights_ema.safetensors beside its weights
    (the training weights + 1: which file was read shows in the values)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    shutil.copy(tiny_teacher / "weights.safetensors", run / "weights.safetensors")
    if ema:
        save_file({k: v + 1 for k, v in load_file(tiny_teacher / "weights.safetensors").items()},
                  str(run / "weights_ema.safetensors"))
    return run


@pytest.mark.parametrize("lora", [False, True])
def test_pretrained_run_loads_equal_weights(tiny_teacher, tiny_cfg, tmp_path, lora):
    """Built from model.pretrained=RUN: every base weight equals the run's EMA file bit for bit
    (the training weights when there is no EMA file; a .safetensors path directly too); under
    LoRA the base sits under peft's base_layer names and the adapters start as usual."""
    from dit_train.engine.build import build_run
    from dit_train.engine.checks import check_config
    from dit_train.models.lora import plain_lora_name

    lora_args = ["model.lora.rank=4", "model.lora.alpha=8"] if lora else []
    for ema in (True, False):
        run = _run_folder(tiny_teacher, tmp_path / f"ema{ema}", ema)
        want = load_file(run / ("weights_ema.safetensors" if ema else "weights.safetensors"))
        for path in (run, run / "weights.safetensors") if not ema else (run,):
            cfg = compose_config([*TINY, *lora_args, f"model.pretrained={path}"], cache_dir=tiny_cfg.data.cache_dir)
            check_config(cfg)
            model = build_run(cfg).model
            got = {plain_lora_name(k): v for k, v in model.state_dict().items() if ".lora_" not in k}
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), (ema, path)
            assert lora == any(".lora_" in k for k in model.state_dict())


def test_pretrained_mismatch_refused_in_one_line(tiny_teacher, tmp_path):
    """Another width, a missing folder, a folder without weights, a file that is not
    safetensors: one line each from check_config, before any worker."""
    def refused(overrides: list[str]) -> str:
        return refusal([*TINY, *overrides])

    text = refused([f"model.pretrained={tiny_teacher}", "model.dim=64"])
    assert "does not fit the configured model" in text and "weights (" in text, text
    assert "does not fit" in refused([f"model.pretrained={tiny_teacher}", "model.depth=3"])
    assert "does not exist" in refused([f"model.pretrained={tmp_path / 'nowhere'}"])
    (tmp_path / "empty").mkdir()
    assert "holds no weights_ema.safetensors or weights.safetensors" in refused([f"model.pretrained={tmp_path / 'empty'}"])
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    assert "cannot read it as safetensors" in refused([f"model.pretrained={tmp_path / 'bad.safetensors'}"])
