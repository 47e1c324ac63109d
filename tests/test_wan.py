"""diffusers' WanTransformer3DModel through our packed path (model.name=wan).

1. The packed adapter equals diffusers' own forward run clip by clip (forward and weight
   gradients), for clips of different sizes, with caption masking or Wan's zero padding.
2. Diffusers folders: a folder of another size or family is refused before the run; the LoRA
   run's file loads in diffusers (load, train, export: tests/test_diffusers_families.py).
3. Layout invariance: 1 process vs cp_ulysses=2 vs dp_shard=2 (meta-device build, pretrained
   weights loaded per shard) after 2 SGD steps, sample_mean.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from dit_train.models import WanConfig, model_config
from dit_train.models import build_model
from dit_train.models.diffusers_family import read_pretrained, to_diffusers
from dit_train.tasks.video import patchify, unpatchify
from dit_train.engine.layout_equivalence import relative_difference, run_layouts
from dit_train.kernels import VarlenLayout
from tests.conftest import REPO, TINY, compose_config
from tests.families import (family_run_cfg, PATCH, pretrained_folder, random_model, SHAPES,
                            assert_matches_diffusers_per_clip)



def tiny_wan_cfg(**kw) -> WanConfig:
    base = dict(dim=32, heads=2, depth=2, ffn_dim=64, freq_dim=32, text_dim=32, text_len=6,
                in_channels=4, patch_size=list(PATCH), init="normal")
    return model_config("wan", **(base | kw))


def pack(clips: list[torch.Tensor], pad: int = 0):
    """Our packed inputs for `clips` ([C, F, H, W] each), plus `pad` padding tokens at the end."""
    toks, pos, seg = [], [], []
    for i, x in enumerate(clips):
        tk, grid = patchify(x, PATCH)
        toks.append(tk), pos.append(grid), seg.append(torch.full((tk.shape[0],), i))
    toks.append(torch.zeros(pad, toks[0].shape[1])), pos.append(torch.zeros(pad, 3, dtype=torch.long))
    seg.append(torch.full((pad,), -1))
    seg = torch.cat(seg)
    order = torch.cat([torch.arange(len(s)) for s in torch.split(seg, [t.shape[0] for t in toks])])
    return torch.cat(toks), torch.cat(pos), seg, VarlenLayout.build(seg, order, causal=False)


@pytest.mark.parametrize("padded", [False, True], ids=["masked_context", "wan_padded_context"])
def test_packed_forward_and_grads_match_diffusers_per_clip(padded):
    cfg = tiny_wan_cfg(attend_padded_context=padded)
    ours = random_model(cfg)
    ref = to_diffusers(ours.state_dict(), cfg)  # diffusers' own module, same weights
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    t = torch.tensor([0.3, 0.85])
    context, context_len = torch.randn(2, 5, 32, generator=g), torch.tensor([3, 5])
    x, pos, seg, meta = pack(clips, pad=3)
    out = ours(x, pos, seg, t, meta, context, context_len)

    def theirs(i, clip, grid):
        # diffusers' pipeline convention: timestep = 1000·t; captions zero-padded to text_len (Wan)
        # or just the valid tokens
        ctx = context[i:i + 1, :context_len[i]]
        if padded:
            ctx = torch.nn.functional.pad(ctx, (0, 0, 0, cfg.text_len - ctx.shape[1]))
        return ref(clip[None], t[i:i + 1] * 1000, ctx).sample[0]

    assert_matches_diffusers_per_clip(ours, ref, out, clips, theirs, 4, g)


def test_context_none_is_one_zero_token_and_rope_uses_positions():
    """Fallback without captions; a clip's output depends on its (t, h, w) positions only
    through RoPE (shuffled positions change it)."""
    cfg = tiny_wan_cfg(attend_padded_context=False)
    ours = random_model(cfg)
    g = torch.Generator().manual_seed(3)
    clips = [torch.randn(4, *s, generator=g) for s in SHAPES]
    x, pos, seg, meta = pack(clips)
    t = torch.tensor([0.5, 0.2])
    a = ours(x, pos, seg, t, meta)
    b = ours(x, pos, seg, t, meta, torch.zeros(2, 1, 32), torch.ones(2, dtype=torch.long))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = ours(x, pos.flip(0), seg, t, meta)
    assert (a - c).abs().max() > 1e-3


def test_pretrained_shape_mismatch_names_the_keys(tmp_path):
    cfg = tiny_wan_cfg()
    to_diffusers(random_model(cfg).state_dict(), cfg).save_pretrained(str(tmp_path / "wan"))
    with pytest.raises(ValueError, match=r"num_layers=2 \(model.depth gives 3\)"):
        read_pretrained(str(tmp_path / "wan"), tiny_wan_cfg(depth=3))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_pretrained(str(tmp_path), cfg)


def test_a_folder_of_another_size_or_family_is_refused_before_any_worker_starts(tmp_path):
    """check_config reads the folder's config.json (no weights, no worker): one line naming what differs."""
    from dit_train.config.errors import ConfigError
    from dit_train.engine.checks import check_config

    run = compose_config(["model=wan_tiny", "model.text_len=16"])
    bigger = replace(run.model, depth=run.model.depth + 1)
    to_diffusers(build_model(bigger).state_dict(), bigger).save_pretrained(str(tmp_path / "wan" / "transformer"))
    ltx = model_config("ltx", dim=32, heads=2, depth=1, text_dim=24, in_channels=4, patch_size=list(PATCH))
    to_diffusers(build_model(ltx).state_dict(), ltx).save_pretrained(str(tmp_path / "ltx"))
    for folder, want in (("wan", fr"num_layers={bigger.depth} \(model.depth gives {run.model.depth}\)"),
                         ("ltx", "holds a LTXVideoTransformer3DModel, not a WanTransformer3DModel")):
        run.model.pretrained = str(tmp_path / folder)
        with pytest.raises(ConfigError, match=want) as err:
            check_config(run)
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def wan_run_cfg(data_cache):
    return family_run_cfg(["model=wan_tiny", "model.text_len=16"], data_cache)


@pytest.fixture(scope="module")
def pretrained_dir(wan_run_cfg, tmp_path_factory):
    """A diffusers folder with random weights of wan_tiny's shape (nothing downloaded)."""
    return pretrained_folder(wan_run_cfg.model, tmp_path_factory.mktemp("wan_pretrained"))


def same_outputs(cfg, weights, wan) -> float:
    """Our packed model with `weights` vs diffusers' `wan` on one 2x16x24 pixel clip without a
    caption (Wan's zeros up to text_len): max |diff| / max."""
    ours = build_model(replace(cfg, lora=replace(cfg.lora, rank=0)))
    ours.load_state_dict(weights)
    clip = torch.randn(3, 2, 16, 24, generator=torch.Generator().manual_seed(5))
    tok, grid = patchify(clip, tuple(cfg.patch_size))
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    with torch.no_grad():
        mine = ours(tok, grid, seg, torch.tensor([0.4]), VarlenLayout.build(seg, torch.arange(len(seg)), False))
        theirs = wan(clip[None], torch.tensor([400.0]), torch.zeros(1, cfg.text_len, cfg.text_dim)).sample[0]
    theirs = patchify(theirs, tuple(cfg.patch_size))[0]
    return float((mine - theirs).abs().max() / theirs.abs().max())


@pytest.mark.slow
def test_layout_invariance_1_vs_ulysses2_vs_fsdp2_meta_pretrained(wan_run_cfg, pretrained_dir):
    """Same weights after 2 SGD steps (clipping on) for 1 process, Ulysses CP=2, FSDP2 dp_shard=2
    built on the meta device with the pretrained weights loaded per shard. Uneven clips, packs
    split inside clips by CP, captions (byte embeddings) with dropout."""
    cfg = replace(wan_run_cfg, model=replace(wan_run_cfg.model, pretrained=str(pretrained_dir)))
    start = read_pretrained(str(pretrained_dir), cfg.model)
    runs = run_layouts(cfg, ["1", "cp_ulysses=2", "dp_shard=2,meta_init=true"], ["sample_mean"])
    (oracle,) = runs.pop("1")
    assert all(torch.equal(oracle[f"__init__/{k}"], v) for k, v in start.items())
    for spec, (got,) in runs.items():
        assert all(torch.equal(got[f"__init__/{k}"], v) for k, v in start.items()), spec
        rel = relative_difference(oracle, got)
        assert rel <= 1e-4, f"{spec}: weights differ by {rel:.2e} of the update"
        norms_ref, norms = oracle["__grad_norms__"], got["__grad_norms__"]
        assert (norms - norms_ref).abs().max() <= 1e-5 * norms_ref.abs().max(), (spec, norms, norms_ref)


def test_wan_lora_run_loads_in_diffusers_with_matching_outputs(data_cache, pretrained_dir, tmp_path):
    """+experiment=wan_lora from a pretrained folder: the run writes diffusers' LoRA file; diffusers'
    own WanTransformer3DModel with the pretrained weights + load_lora_adapter gives the outputs of
    our packed model with the run's (merged) weights.safetensors: relative error <= 1e-5."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from dit_train.__main__ import run_from_config

    lora_tiny = [o for o in TINY if not o.startswith("optim")]
    cfg = compose_config(["+experiment=wan_lora", *lora_tiny, "model.text_len=16", "train.steps=3", "train.sample_every=0",
                          "model.lora.rank=4", "model.lora.alpha=8", f"model.pretrained={pretrained_dir}"],
                         cache_dir=data_cache)
    cfg.run_dir = str(tmp_path / "run")
    run_from_config(cfg)
    run = tmp_path / "run"
    adapters = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    assert adapters and all(k.startswith("transformer.blocks.") and ".lora_" in k for k in adapters)
    merged = load_file(str(run / "weights.safetensors"))
    start = read_pretrained(str(pretrained_dir), cfg.model)
    assert merged.keys() == start.keys()
    changed = {k for k in start if not torch.equal(merged[k], start[k])}
    assert changed and all(".to_" in k or ".ffn." in k for k in changed)  # only adapted layers moved

    wan = WanTransformer3DModel.from_pretrained(str(pretrained_dir))
    wan.load_lora_adapter(str(run / "lora"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    cfg.model.lora.rank = 0
    ours = build_model(cfg.model)
    ours.load_state_dict(merged)
    g = torch.Generator().manual_seed(5)
    clip = torch.randn(3, 2, 16, 24, generator=g)
    ctx = torch.randn(1, cfg.model.text_len, cfg.model.text_dim, generator=g)
    tok, grid = patchify(clip, tuple(cfg.model.patch_size))
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    with torch.no_grad():
        mine = ours(tok, grid, seg, torch.tensor([0.4]), VarlenLayout.build(seg, torch.arange(len(seg)), False),
                    ctx, torch.tensor([cfg.model.text_len]))
        theirs = wan(clip[None], torch.tensor([400.0]), ctx).sample[0]
    mine = unpatchify(mine, (1, 2, 3), tuple(cfg.model.patch_size), 3)
    assert float((mine - theirs).abs().max() / theirs.abs().max()) <= 1e-5


def _count_reads(cfg):
    """Build the run with pretrained weights; how often this rank read the folder, and the
    full weights it ended with (rank 0)."""
    from dit_train.checkpoint import full_state_dict
    from dit_train.engine.build import build_run
    from dit_train.models.diffusers_family import DiffusersFamily

    reads = {"n": 0}
    original = DiffusersFamily.read  # what every family's ModelSpec.pretrained calls

    def counting(self, *a, **kw):
        reads["n"] += 1
        return original(self, *a, **kw)

    DiffusersFamily.read = counting
    try:
        run = build_run(cfg)
    finally:
        DiffusersFamily.read = original  # the worker may serve later jobs (tests/pool.py)
    return {"reads": reads["n"], "weights": full_state_dict(run.model)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp_shard=2", "dp_shard=2,dp_mode=ddp"])
def test_pretrained_weights_are_read_once_and_broadcast(wan_run_cfg, pretrained_dir, layout):
    from dit_train.engine.launch import launch_local
    from dit_train.engine.layout_equivalence import apply_layout, parse_layout

    cfg = apply_layout(replace(wan_run_cfg, model=replace(wan_run_cfg.model, pretrained=str(pretrained_dir))),
                       parse_layout(layout))
    got = launch_local(_count_reads, (cfg,), 2, cfg.launcher)
    assert [got[r]["reads"] for r in sorted(got)] == [1, 0]  # rank 0 read the safetensors, rank 1 did not
    start = read_pretrained(str(pretrained_dir), cfg.model)
    assert all(torch.equal(got[0]["weights"][k], v) for k, v in start.items())
