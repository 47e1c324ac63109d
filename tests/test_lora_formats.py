"""LoRA files in ComfyUI's and kohya / musubi-tuner's layouts (dit_train/models/lora_formats.py,
`tools.export_weights --lora-format`, `model.lora.init_from`), for every family with a key map,
read back by a reader that is not ours:

- Wan, SkyReels-V2: diffusers' own loaders (`WanLoraLoaderMixin` / `SkyReelsV2LoraLoaderMixin
  .lora_state_dict`, whose converters implement both layouts' key and alpha rules); Wan VACE's
  vace_blocks through the same Wan reader (a VACE block is a Wan block: its keys renamed to blocks);
- LTX-Video, LTX-2, ComfyUI's layout: diffusers' `LTXVideoLoraLoaderMixin` / `LTX2LoraLoaderMixin`;
  their kohya layout: ComfyUI's key rule (comfy/lora.py `model_lora_keys_unet`: `lora_unet_<model key,
  . -> _>` for each weight of its model, whose block names are the diffusers model's: `_comfy_read`)
  over the real diffusers model's module names;
- HunyuanVideo 1.5, both layouts: ComfyUI's key rule over the original checkpoint's names as
  diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py gives them (`_HV15`, transcribed here,
  apart from the key map in models/hunyuan15.py): no maintained reader of such files exists.

Every module's weight delta read equals ours, alpha / r · B @ A (alpha != r, so a lost, doubled or
misplaced alpha shows); a file of each layout starts a model's adapters equal (init_from).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dit_train.models import build_model, init_weights, MODELS
from dit_train.models.lora import apply_lora, load_lora, lora_state_dict, settings_from, WEIGHT_NAME
from dit_train.models.lora_formats import convert, key_map
from tests.conftest import compose_config, TINY

ALPHA, RANK = 8.0, 4
FORMATS = ("comfyui", "kohya")
# the original checkpoint's double-block names per diffusers suffix (diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py, convert_hyvideo15_transformer_to_diffusers)
_HV15 = {"attn.to_q": "img_attn_q", "attn.to_k": "img_attn_k", "attn.to_v": "img_attn_v",
         "attn.to_out.0": "img_attn_proj", "attn.add_q_proj": "txt_attn_q", "attn.add_k_proj": "txt_attn_k",
         "attn.add_v_proj": "txt_attn_v", "attn.to_add_out": "txt_attn_proj", "ff.net.0.proj": "img_mlp.fc1",
         "ff.net.2": "img_mlp.fc2", "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2"}


def _deltas(sd: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """{module: scale · B @ A} of a diffusers-keyed LoRA state dict (`transformer.` dropped)."""
    mods = {k.rsplit(".lora_A.", 1)[0] for k in sd if ".lora_A." in k}
    return {m.removeprefix("transformer."): scale * sd[f"{m}.lora_B.weight"].double() @ sd[f"{m}.lora_A.weight"].double()
            for m in mods}


def _comfy_read(sd: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """ComfyUI's reading of a LoRA file for a model whose weights are `names` {its own module name:
    the diffusers name we compare under}: each module answers to diffusion_model.<name> and
    lora_unet_<name with . -> _>, up/down (lora_B/lora_A too) and alpha, delta = alpha / r · up @ down
    (1 · up @ down without alpha). Every key must be read (ComfyUI warns "lora key not loaded")."""
    out, read = {}, set()
    for own, ours in names.items():
        for base in (f"diffusion_model.{own}", "lora_unet_" + own.replace(".", "_")):
            for up, down in (("lora_up", "lora_down"), ("lora_B", "lora_A")):
                if f"{base}.{up}.weight" in sd:
                    u, d = sd[f"{base}.{up}.weight"].double(), sd[f"{base}.{down}.weight"].double()
                    alpha = sd.get(f"{base}.alpha")
                    out[ours] = (1.0 if alpha is None else alpha.item() / d.shape[0]) * u @ d
                    read |= {f"{base}.{up}.weight", f"{base}.{down}.weight", f"{base}.alpha"}
    assert not sd.keys() - read, f"keys not loaded: {sorted(sd.keys() - read)[:4]}"
    return out


def _diffusers_read(mixin: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import diffusers.loaders

    read = getattr(diffusers.loaders, mixin).lora_state_dict({k: v.clone() for k, v in sd.items()})
    read = read[0] if isinstance(read, tuple) else read
    assert not [k for k in read if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))], read.keys()
    return _deltas(read, 1.0)  # diffusers folds alpha / r into the weights


def _wan_vace_read(fmt: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' Wan reader on the shared blocks, and on vace_blocks renamed blocks (no reader takes them)."""
    vace = re.compile(r"^(diffusion_model\.|lora_unet_)vace_blocks")
    shared = _diffusers_read("WanLoraLoaderMixin", {k: v for k, v in sd.items() if not vace.match(k)})
    own = _diffusers_read("WanLoraLoaderMixin", {vace.sub(r"\1blocks", k): v for k, v in sd.items() if vace.match(k)})
    return shared | {f"vace_{m}": d for m, d in own.items()}


def _module_names(cfg) -> list[str]:
    """The linear layers of the real diffusers model of `cfg`'s family (their names, not our map's)."""
    module = MODELS[cfg.name].diffusers.module(cfg)
    return [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]


def _hv15_original(name: str) -> str | None:
    m = re.match(r"^transformer_blocks\.(\d+)\.(.+)$", name)
    return f"double_blocks.{m.group(1)}.{_HV15[m.group(2)]}" if m and m.group(2) in _HV15 else None


def _read(family: str, fmt: str, sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The independent reading of `sd` (module docstring): {diffusers module: delta}."""
    if family in ("wan", "skyreels_v2"):
        return _diffusers_read("SkyReelsV2LoraLoaderMixin" if family == "skyreels_v2" else "WanLoraLoaderMixin", sd)
    if family == "wan_vace":
        return _wan_vace_read(fmt, sd)
    if family in ("ltx", "ltx2") and fmt == "comfyui":
        return _diffusers_read({"ltx": "LTXVideoLoraLoaderMixin", "ltx2": "LTX2LoraLoaderMixin"}[family], sd)
    if family in ("ltx", "ltx2"):  # ComfyUI's LTXVModel / LTXAVModel blocks: the diffusers names
        return _comfy_read(sd, {n: n for n in _module_names(cfg)})
    return _comfy_read(sd, {_hv15_original(n): n for n in _module_names(cfg) if _hv15_original(n)})


FAMILIES = ["wan", "wan_vace", "skyreels_v2", "ltx", "ltx2", "hunyuan15"]


# beyond each tiny preset: what its checks require (a VACE context needs cond.control; RoPE axes
# that fit hunyuan15's head dim 8 at TINY's 4 heads)
_EXTRA = {"wan_vace": ["cond.control=true"], "hunyuan15": ["model.rope_axes=[2,2,4]"]}


def _family_cfg(family: str, alpha: float):
    return compose_config([*TINY, f"model={family}_tiny", *_EXTRA.get(family, []), f"model.lora.rank={RANK}",
                           f"model.lora.alpha={alpha}"])


def _adapted(family: str, alpha: float, seed: int) -> torch.nn.Module:
    """The tiny model of `family` with LoRA (rank 4, `alpha`) on its default targets, every B random."""
    cfg = _family_cfg(family, alpha)
    model = build_model(cfg.model)
    init_weights(model, 0, "normal")
    apply_lora(model, settings_from(RANK, alpha, 0.0, [], "default"), family, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def adapters() -> dict[str, dict[str, torch.Tensor]]:
    """{family: its tiny model's adapters (rank 4, alpha 8: scale 2) as our diffusers file holds them}."""
    return {f: lora_state_dict(_adapted(f, ALPHA, seed=1), f) for f in FAMILIES}


@pytest.fixture(scope="module")
def fresh() -> dict[str, torch.nn.Module]:
    """{family: its tiny model with other adapters (alpha 4, other B)}, built on first use."""
    class Lazy(dict):
        def __missing__(self, family):
            self[family] = _adapted(family, 4.0, seed=2)
            return self[family]
    return Lazy()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_exported_format_reads_back_through_an_independent_reader_with_the_same_deltas(adapters, family, fmt):
    ours = adapters[family]
    converted = convert(ours, ALPHA, fmt, key_map(MODELS[family]))
    got, want = _read(family, fmt, converted, _family_cfg(family, ALPHA).model), _deltas(ours, ALPHA / RANK)
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())[:4]
    assert all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-12) for m in want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_a_file_of_each_format_starts_the_adapters_equal(adapters, fresh, family, fmt, tmp_path):
    """The file alpha 8, the model's 4: B is rescaled so each module's delta is the file's."""
    path = tmp_path / f"lora_{fmt}.safetensors"
    save_file(convert(adapters[family], ALPHA, fmt, key_map(MODELS[family])), str(path))
    model = fresh[family]  # the file sets every adapter: one model serves both layouts
    load_lora(model, path, family)
    got = _deltas(lora_state_dict(model, family), 4.0 / RANK)
    want = _deltas(adapters[family], ALPHA / RANK)
    assert want.keys() == got.keys() and all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-7) for m in want)


def test_unmapped_modules_our_own_models_and_foreign_keys_are_refused_in_one_line(adapters, tmp_path):
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config
    from dit_train.models.lora_formats import to_diffusers

    with pytest.raises(ValueError, match=r"no ComfyUI / kohya name known for the LTX-Video module 'proj_in' \(ComfyUI "
                                         r"names proj_in and time_embed patchify_proj"):
        convert({"transformer.proj_in.lora_A.weight": torch.zeros(1)}, ALPHA, "kohya", key_map(MODELS["ltx"]))
    for name in ("dit", "lm"):  # no ComfyUI / kohya loader exists for them: diffusers' format is the way
        with pytest.raises(ValueError, match=rf"model={name} is dit_train's own model: no ComfyUI or kohya .*"
                                             rf"\(--lora-format diffusers\)"):
            key_map(MODELS[name])
    wan = key_map(MODELS["wan"])
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in adapters["wan"]}
    extra = convert(adapters["wan"], ALPHA, "comfyui", wan) | {"diffusion_model.blocks.0.norm2.lora_A.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"^diffusion_model.blocks.0.norm2.lora_A.weight: not a LoRA down / up weight "
                                         r"or alpha of a Wan module this run adapts"):
        to_diffusers(extra, wan, modules)
    # a ComfyUI file as model.lora.init_from of our DiT: one line before any worker starts
    path = tmp_path / "lora_comfyui.safetensors"
    save_file(convert(adapters["wan"], ALPHA, "comfyui", wan), str(path))
    with pytest.raises(ConfigError) as err:
        check_config(compose_config([*TINY, "model=dit_tiny", "model.lora.rank=4", f"model.lora.init_from={path}"]))
    assert [p for p in err.value.problems if "init_from" in p] == [
        f"model.lora.init_from={path} is a ComfyUI / kohya LoRA, but {_first_line(key_map, MODELS['dit'])}"]


def _first_line(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as err:
        assert "\n" not in str(err)
        return str(err)
    raise AssertionError(f"{fn.__name__} did not refuse")


@pytest.fixture(scope="module")
def wan_lora_run(data_cache, tmp_path_factory) -> Path:
    """`+experiment=wan_lora` (tiny random base) for 2 steps, alpha != rank."""
    from tests.conftest import train_in_process

    run = tmp_path_factory.mktemp("wan_lora_formats") / "run"
    train_in_process(["+experiment=wan_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                      "train.steps=2", "train.sample_every=0", "model.lora.alpha=16", "optim.lr=0.05"], run,
                     cache_dir=data_cache)
    return run


@pytest.mark.slow
def test_export_weights_writes_each_format_beside_the_diffusers_file(wan_lora_run, capsys):
    from dit_train.tools import export_weights

    ours = load_file(wan_lora_run / "lora" / WEIGHT_NAME)
    rank = next(v.shape[0] for k, v in ours.items() if ".lora_A." in k)
    for fmt in FORMATS:
        assert export_weights.main([str(wan_lora_run), "--lora-format", fmt]) == 0
        got = _diffusers_read("WanLoraLoaderMixin", load_file(wan_lora_run / "lora" / f"lora_{fmt}.safetensors"))
        want = _deltas(ours, 16.0 / rank)
        assert want.keys() == got.keys() and all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-12) for m in want)
        capsys.readouterr()
        assert export_weights.main([str(wan_lora_run), "--lora-format", fmt]) == 2  # exists: not replaced
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err, err
    assert export_weights.main([str(wan_lora_run), "--merge-lora", "--lora-format", "kohya", "--out", "x.safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "full weights" in err, err


@pytest.mark.parametrize("fmt", ["diffusers", "comfyui", "kohya"])
def test_init_from_through_the_build_starts_the_adapters_from_a_file_of_each_format(fmt, tmp_path):
    """model.lora.init_from in build_parallel_model: the run's adapters start as the file's (file
    alpha 8, the run's 4: B is rescaled so each delta is the file's)."""
    from dit_train.engine.build import build_parallel_model
    from dit_train.engine.checks import check_config
    from dit_train.parallel.mesh import init_parallel

    path, want = _source_file(fmt, tmp_path)
    cfg = compose_config([*_WAN, "model.lora.alpha=4", f"model.lora.init_from={path}"])
    check_config(cfg)
    got = _deltas(_plain(build_parallel_model(cfg, init_parallel(cfg.parallel)).named_parameters()), 4.0 / RANK)
    assert want.keys() == got.keys() and all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-7) for m in want)
    bad = compose_config([*_WAN, f"model.lora.init_from={tmp_path / 'missing.safetensors'}"])
    with pytest.raises(Exception, match="model.lora.init_from=.* is not a file"):
        check_config(bad)


_WAN = [*TINY, "model=wan_tiny", "model.lora.rank=4"]


def _plain(named) -> dict[str, torch.Tensor]:
    """LoRA tensors of named parameters / a state dict, under diffusers' keys (full tensors)."""
    return {"transformer." + k.replace(".default", ""): v.detach() for k, v in named if ".lora_" in k}


def _source_file(fmt: str, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Wan LoRA file (alpha 8, B random) in layout `fmt`, and its deltas."""
    from dit_train.engine.build import build_parallel_model
    from dit_train.models.lora import save_lora
    from dit_train.parallel.mesh import init_parallel

    src_cfg = compose_config([*_WAN, "model.lora.alpha=8"])
    src = build_parallel_model(src_cfg, init_parallel(src_cfg.parallel))
    with torch.no_grad():
        for n, p in src.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    path = save_lora(src, tmp_path / "src", "wan")
    if fmt != "diffusers":
        path = tmp_path / f"lora_{fmt}.safetensors"
        save_file(convert(load_file(tmp_path / "src" / WEIGHT_NAME), ALPHA, fmt, key_map(MODELS["wan"])), str(path))
    return path, _deltas(_plain(src.named_parameters()), ALPHA / RANK)


def _build_worker(cfg) -> dict[str, torch.Tensor]:
    """build_parallel_model on this rank; the full LoRA tensors gathered on rank 0 ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

    from dit_train.engine.build import build_parallel_model
    from dit_train.parallel.mesh import init_parallel

    model = build_parallel_model(cfg, init_parallel(cfg.parallel))
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in sd.items() if ".lora_" in k}


@pytest.mark.slow  # two gloo workers: ~20 s on a quiet core pair, most of it starting the pool
def test_init_from_lands_in_the_shards_of_a_meta_init_build(tmp_path):
    """parallel.meta_init=true, dp_shard=2: the model is built on the meta device, sharded,
    materialized and initialised before the file is read (engine/build.py), so the file lands in
    real shards, not in meta tensors that the initialisation would then overwrite: the gathered
    adapters start as the file's (a ComfyUI file, alpha 8, into a run with alpha 4)."""
    from dit_train.engine.launch import launch_local

    path, want = _source_file("comfyui", tmp_path)
    cfg = compose_config([*_WAN, "model.lora.alpha=4", f"model.lora.init_from={path}", "parallel.dp_shard=2",
                          "parallel.meta_init=true"])
    got = _deltas(_plain(launch_local(_build_worker, (cfg,), 2, cfg.launcher)[0].items()), 4.0 / RANK)
    assert want.keys() == got.keys() and all(torch.allclose(got[m], want[m], rtol=1e-6, atol=1e-7) for m in want)
