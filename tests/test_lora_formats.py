"""Wan LoRA files in ComfyUI's and kohya / musubi-tuner's layouts (dit_train/models/lora_formats.py,
`tools.export_weights --lora-format`), read back by an independent reader: diffusers' own Wan LoRA
loader (`WanLoraLoaderMixin.lora_state_dict`, whose converters implement both layouts' key and
alpha rules: `_convert_non_diffusers_wan_lora_to_diffusers`, `_convert_musubi_wan_lora_to_diffusers`).
Every module's weight delta it reads equals ours, alpha / r · B @ A (alpha != r, so a lost or
doubled alpha shows); the conversion back to our keys is the identity.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dit_train.models.lora import WEIGHT_NAME
from dit_train.models.lora_formats import convert, to_diffusers

ALPHA, RANK = 8.0, 4


def _deltas(sd: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """{module: scale · B @ A} of a diffusers-keyed LoRA state dict."""
    mods = {k.rsplit(".lora_A.", 1)[0] for k in sd if ".lora_A." in k}
    return {m: scale * sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double() for m in mods}


@pytest.fixture(scope="module")
def adapters() -> dict[str, torch.Tensor]:
    """A tiny Wan's trained adapters (rank 4, alpha 8: scale 2) as our diffusers file holds them."""
    from tests.test_lora import SETTINGS, random_model, sgd_steps, tiny_wan_cfg, wan_inputs
    from dit_train.models.lora import apply_lora, lora_state_dict

    assert (SETTINGS.rank, SETTINGS.alpha) == (RANK, ALPHA)
    cfg = tiny_wan_cfg(attend_padded_context=False)
    model = random_model(cfg)
    _, args, target = wan_inputs(cfg)
    apply_lora(model, SETTINGS, "wan", seed=0)
    sgd_steps(model, args, target, 3)
    return lora_state_dict(model, "wan")


@pytest.mark.parametrize("fmt,key", [("comfyui", "diffusion_model.blocks.0.self_attn.q.lora_A.weight"),
                                     ("kohya", "lora_unet_blocks_0_self_attn_q.lora_down.weight")])
def test_exported_format_reads_back_through_diffusers_with_the_same_deltas(adapters, fmt, key):
    from diffusers.loaders import WanLoraLoaderMixin

    converted = convert(adapters, ALPHA, fmt)
    assert key in converted
    alphas = [v for k, v in converted.items() if k.endswith(".alpha")]
    assert len(alphas) == len(adapters) // 2 and all(a.dim() == 0 and float(a) == ALPHA for a in alphas)
    read = WanLoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in converted.items()})
    read = read[0] if isinstance(read, tuple) else read
    want, got = _deltas(adapters, ALPHA / RANK), _deltas(read, 1.0)  # diffusers folds alpha / r into the weights
    assert want.keys() == got.keys()
    assert all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-12) for m in want)
    back, alpha = to_diffusers(converted)
    assert alpha == ALPHA and back.keys() == adapters.keys() and all(torch.equal(back[k], adapters[k]) for k in back)


def test_unmapped_modules_and_other_families_are_refused(adapters):
    with pytest.raises(ValueError, match="no ComfyUI / kohya name known for the Wan module 'blocks.0.norm2'"):
        convert({"transformer.blocks.0.norm2.lora_A.weight": torch.zeros(1)}, ALPHA, "kohya")


@pytest.fixture(scope="module")
def wan_lora_run(data_cache, tmp_path_factory) -> Path:
    """`+experiment=wan_lora` (tiny random base) for 2 steps, alpha != rank."""
    from tests.conftest import TINY, train_in_process

    run = tmp_path_factory.mktemp("wan_lora_formats") / "run"
    train_in_process(["+experiment=wan_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                      "train.steps=2", "train.sample_every=0", "model.lora.alpha=16", "optim.lr=0.05"], run,
                     cache_dir=data_cache)
    return run


@pytest.mark.slow
def test_export_weights_writes_each_format_beside_the_diffusers_file(wan_lora_run, capsys):
    from diffusers.loaders import WanLoraLoaderMixin

    from dit_train.tools import export_weights

    ours = load_file(wan_lora_run / "lora" / WEIGHT_NAME)
    rank = next(v.shape[0] for k, v in ours.items() if ".lora_A." in k)
    for fmt in ("comfyui", "kohya"):
        assert export_weights.main([str(wan_lora_run), "--lora-format", fmt]) == 0
        read = WanLoraLoaderMixin.lora_state_dict(load_file(wan_lora_run / "lora" / f"lora_{fmt}.safetensors"))
        read = read[0] if isinstance(read, tuple) else read
        want, got = _deltas(ours, 16.0 / rank), _deltas(read, 1.0)
        assert want.keys() == got.keys() and all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-12) for m in want)
        capsys.readouterr()
        assert export_weights.main([str(wan_lora_run), "--lora-format", fmt]) == 2  # exists: not replaced
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err, err
    assert export_weights.main([str(wan_lora_run), "--merge-lora", "--lora-format", "kohya", "--out", "x.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "full weights" in err, err


@pytest.mark.parametrize("fmt", ["diffusers", "comfyui", "kohya"])
def test_init_from_starts_the_adapters_from_a_file_of_each_format(fmt, tmp_path):
    """model.lora.init_from: a run's adapters start as the file's, whatever its layout and alpha
    (the file alpha 8, the run's 4: B is rescaled so each delta is the file's)."""
    from safetensors.torch import save_file

    from dit_train.engine.build import build_parallel_model
    from dit_train.engine.checks import check_config
    from dit_train.models.lora import save_lora
    from dit_train.parallel.mesh import init_parallel
    from tests.conftest import TINY, compose_config

    base = [*TINY, "model=wan_tiny", "model.lora.rank=4"]
    src_cfg = compose_config([*base, "model.lora.alpha=8"])
    src = build_parallel_model(src_cfg, init_parallel(src_cfg.parallel))
    with torch.no_grad():
        for n, p in src.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    path = save_lora(src, tmp_path / "src", "wan")
    if fmt != "diffusers":
        path = tmp_path / f"lora_{fmt}.safetensors"
        save_file(convert(load_file(tmp_path / "src" / WEIGHT_NAME), ALPHA, fmt), str(path))
    cfg = compose_config([*base, "model.lora.alpha=4", f"model.lora.init_from={path}"])
    check_config(cfg)
    got = build_parallel_model(cfg, init_parallel(cfg.parallel))
    plain = lambda m: {k.replace(".default", ""): v.detach() for k, v in m.named_parameters() if ".lora_" in k}
    want_d, got_d = _deltas(plain(src), ALPHA / RANK), _deltas(plain(got), 4.0 / RANK)
    assert want_d.keys() == got_d.keys() and all(torch.allclose(got_d[m], want_d[m], rtol=1e-6, atol=1e-7) for m in want_d)
    bad = compose_config([*base, f"model.lora.init_from={tmp_path / 'missing.safetensors'}"])
    with pytest.raises(Exception, match="model.lora.init_from=.* is not a file"):
        check_config(bad)
