"""LoRA adapters (peft) on our models and their diffusers export (dit_train.models.lora).

1. Tiny Wan: injection leaves the output bit-identical (B = 0) and only adapters trainable;
   after SGD steps the exported pytorch_lora_weights.safetensors, loaded by diffusers
   (`WanPipeline.load_lora_weights` onto a WanTransformer3DModel with the base weights), gives
   diffusers' own forward = our packed forward (alpha != r, so the scale is checked).
2. Merged weights (peft merge, original keys, no peft) give the adapted model's output.
3. Our DiT: trains on a fixed batch with its base frozen; merge and save/load round trips.
4. Adapter init is a function of (seed, name): not of torch's global RNG nor of the device the
   model was built on; with FSDP2 per block (1-rank gloo) the start and the steps match one
   process, and the full state dict exports.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dit_train.models import MODELS, model_config
from dit_train.models import build_model, init_weights
from dit_train.models.params import copy_full
from dit_train.models.lora import (
    LoraSettings,
    apply_lora,
    base_parameters,
    init_lora_weights_from_seed,
    is_lora_name,
    load_lora,
    lora_state_dict,
    merge_lora,
    plain_lora_name,
    save_lora,
    trainable_names,
)
from dit_train.models.lora import WEIGHT_NAME as WEIGHT
from dit_train.models.diffusers_family import to_diffusers
from dit_train.tasks.video import unpatchify
from tests.families import PATCH, SHAPES, random_model
from tests.test_wan import pack, tiny_wan_cfg

# alpha != rank: a lost or doubled alpha/r in the export changes the outputs
SETTINGS = LoraSettings(rank=4, alpha=8)
# fp32 round trip tolerance, relative to the largest output value (measured: ~6e-7)
RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def wan_inputs(cfg):
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(cfg.in_channels, *s, generator=g) for s in SHAPES]
    x, pos, seg, meta = pack(clips)
    args = (x, pos, seg, torch.tensor([0.3, 0.85]), meta, torch.randn(2, 5, cfg.text_dim, generator=g),
            torch.tensor([3, 5]))
    return clips, args, torch.randn(x.shape[0], x.shape[1], generator=g)


def sgd_steps(model: torch.nn.Module, args: tuple, target: torch.Tensor, steps: int, lr: float = 0.5) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = (model(*args) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def trained_wan():
    """(cfg, base state dict, LoRA model after 3 SGD steps, clips, packed args)."""
    cfg = tiny_wan_cfg(attend_padded_context=False)
    model = random_model(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    clips, args, target = wan_inputs(cfg)
    apply_lora(model, SETTINGS, "wan", seed=0)
    sgd_steps(model, args, target, 3)
    return cfg, base, model, clips, args


def test_wan_injection_is_identity_and_trains_only_adapters():
    cfg = tiny_wan_cfg(attend_padded_context=False)
    model = random_model(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    _, args, target = wan_inputs(cfg)
    with torch.no_grad():
        before = model(*args)
    apply_lora(model, SETTINGS, "wan", seed=0)
    with torch.no_grad():
        assert torch.equal(model(*args), before)  # B = 0: exactly the base model
    assert model.blocks[0].attn1.to_q.scaling == {"default": SETTINGS.alpha / SETTINGS.rank}

    # names: base weights map back to diffusers' keys, adapters to LoRA-file keys
    assert {k: torch.equal(p, base[k]) for k, p in base_parameters(model).items()} == {k: True for k in base}
    adapted = {f"blocks.{i}.{m}" for i in range(cfg.depth) for m in
               ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")}
    trainable = trainable_names(model)
    assert {plain_lora_name(n) for n in trainable} == {f"{m}.lora_{ab}.weight" for m in adapted for ab in "AB"}
    assert all(is_lora_name(n) == p.requires_grad for n, p in model.named_parameters())
    wrapped = "blocks.0._checkpoint_wrapped_module.attn1.to_q.base_layer.weight"
    assert plain_lora_name(wrapped) == "blocks.0.attn1.to_q.weight"

    sgd_steps(model, args, target, 2)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert all(torch.equal(p, base[k]) for k, p in base_parameters(model).items())  # base frozen
    lora_b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(p.abs().max() > 0 for p in lora_b)  # every adapter moved


@pytest.mark.parametrize("fold_scale", [False, True], ids=["alpha_in_metadata", "alpha_folded_into_B"])
def test_wan_export_loads_in_diffusers_with_the_same_output(trained_wan, tmp_path, fold_scale):
    from diffusers import WanPipeline
    from peft import get_peft_model_state_dict

    cfg, base, model, clips, args = trained_wan
    sd = lora_state_dict(model, "wan", fold_scale=fold_scale)
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in sd
    assert sd["transformer.blocks.0.ffn.net.0.proj.lora_B.weight"].shape == (cfg.ffn_dim, SETTINGS.rank)
    if not fold_scale:  # the same tensors under the same keys as peft's own selection
        peft_sd = get_peft_model_state_dict(model)
        assert sd.keys() == {f"transformer.{k}" for k in peft_sd}
        assert all(torch.equal(sd[f"transformer.{k}"], v) for k, v in peft_sd.items())

    save_lora(model, tmp_path, "wan", fold_scale=fold_scale)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None,
                       transformer=to_diffusers(base, cfg))
    pipe.load_lora_weights(str(tmp_path))
    with torch.no_grad():
        out = model(*args)
    x, pos, seg, t, meta, context, context_len = args
    off = 0
    for i, clip in enumerate(clips):
        grid = tuple(s // p for s, p in zip(clip.shape[1:], PATCH))
        n = grid[0] * grid[1] * grid[2]
        mine = unpatchify(out[off:off + n], grid, PATCH, cfg.in_channels)
        off += n
        with torch.no_grad():
            theirs = pipe.transformer(clip[None], t[i:i + 1] * 1000, context[i:i + 1, :context_len[i]]).sample[0]
        assert _rel(mine, theirs) <= RTOL, (i, _rel(mine, theirs))


def test_wan_merged_weights_equal_the_adapted_model(trained_wan):
    from peft.tuners.tuners_utils import BaseTunerLayer

    cfg, base, model, _, args = trained_wan
    merged = merge_lora(model)
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    assert any(isinstance(m, BaseTunerLayer) for m in model.modules())  # the input keeps its adapters
    sd = merged.state_dict()
    assert sd.keys() == base.keys()
    changed = {k for k in base if not torch.equal(sd[k], base[k])}
    assert changed == {k for k in base if any(f".{m}.weight" in f".{k}" for m in MODELS["wan"].lora_targets)}
    with torch.no_grad():
        adapted = model(*args)
        assert _rel(merged(*args), adapted) <= RTOL
        # the merged weights are a diffusers state dict (strict load)
        to_diffusers(sd, cfg)


def tiny_dit() -> torch.nn.Module:
    # init=normal: adaLN-zero gates would be 0, and LoRA on a never-trained adaLN-zero DiT gets no gradient
    cfg = model_config("dit", dim=32, depth=2, heads=2, mlp_ratio=2.0, patch_size=[1, 2, 2], in_channels=4,
                      text_dim=8, init="normal")
    model = build_model(cfg)
    init_weights(model, seed=1, scheme="normal")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights, as a trained model's: the adapters get real gradients
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def test_dit_lora_trains_with_frozen_base_and_merges(tmp_path):
    model = tiny_dit()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    x, pos, seg, meta = pack([torch.randn(4, 2, 4, 6, generator=g), torch.randn(4, 3, 2, 4, generator=g)])
    args = (x, pos, seg, torch.tensor([0.3, 0.7]), meta, torch.randn(2, 5, 8, generator=g), torch.tensor([5, 2]))
    target = torch.randn(x.shape, generator=g)
    apply_lora(model, SETTINGS, "dit", seed=0)
    expected = {f"blocks.{i}.{m}.lora_{ab}.weight" for i in range(2) for m in MODELS["dit"].lora_targets for ab in "AB"}
    assert {plain_lora_name(n) for n in trainable_names(model)} == expected

    losses = sgd_steps(model, args, target, 6, lr=0.03)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, base[k]) for k, p in base_parameters(model).items())
    with torch.no_grad():
        adapted = model(*args)
        assert _rel(merge_lora(model)(*args), adapted) <= RTOL
        # save/load into a freshly wrapped model on the same base
        save_lora(model, tmp_path, "dit")
        fresh = tiny_dit()
        apply_lora(fresh, SETTINGS, "dit", seed=9)
        load_lora(fresh, tmp_path / "pytorch_lora_weights.safetensors")
        assert torch.equal(fresh(*args), adapted)
        # a folded file (alpha = r in its header) loads into the alpha = 2r model just as well
        save_lora(model, tmp_path / "folded", "dit", fold_scale=True)
        load_lora(fresh, tmp_path / "folded" / "pytorch_lora_weights.safetensors")
        assert _rel(fresh(*args), adapted) <= RTOL
    with pytest.raises(ValueError, match="rank 4"):
        load_lora(apply_lora(tiny_dit(), LoraSettings(rank=2), "dit"), tmp_path / "pytorch_lora_weights.safetensors")
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(fresh, SETTINGS, "dit")


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {plain_lora_name(n): p.detach().clone() for n, p in model.named_parameters() if is_lora_name(n)}


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_seeded_adapter_init_ignores_global_rng_and_device(init):
    settings = LoraSettings(rank=4, alpha=8, init=init)
    cfg = tiny_wan_cfg()
    builds = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        builds.append(_adapters(apply_lora(build_model(cfg), settings, "wan", seed=5)))
    assert builds[0].keys() == builds[1].keys()
    assert all(torch.equal(builds[0][k], builds[1][k]) for k in builds[0])
    torch.manual_seed(1)
    key = "blocks.0.attn1.to_q.lora_A.weight"
    unseeded = _adapters(apply_lora(build_model(cfg), settings, "wan"))  # peft's draw: global RNG
    assert not torch.equal(unseeded[key], builds[0][key])
    other = _adapters(apply_lora(build_model(cfg), settings, "wan", seed=6))
    assert not torch.equal(other[key], builds[0][key])

    # peft's distribution: B = 0; A ~ U(±1/sqrt(in)) (default) or N(0, 1/r) (gaussian)
    a = torch.cat([v.flatten() for k, v in builds[0].items() if ".lora_A." in k])
    assert all(not v.any() for k, v in builds[0].items() if ".lora_B." in k)
    if init == "default":
        bound = cfg.dim ** -0.5  # all A here but ffn.net.2's have in = dim (tighter bound: still inside)
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * (cfg.ffn_dim ** -0.5)
    else:
        assert abs(float(a.std()) - 1 / settings.rank) < 0.02

    # a meta-device build, materialised later, gets the same bits
    with torch.device("meta"):
        model = apply_lora(build_model(cfg), settings, "wan")
    model.to_empty(device="cpu")
    init_lora_weights_from_seed(model, 5)
    meta_built = _adapters(model)
    assert all(torch.equal(meta_built[k], builds[0][k]) for k in builds[0])


def test_fsdp2_per_block_frozen_base_matches_one_process(tmp_path):
    """1-rank gloo FSDP2 (fully_shard per block + root, meta build, pretrained base loaded by
    original names, adapters seeded): same start and same weights after SGD steps as the plain
    model; frozen parameters get no gradient; the full state dict exports."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = tiny_wan_cfg(attend_padded_context=False)
    pretrained = random_model(cfg).state_dict()
    plain = apply_lora(random_model(cfg), SETTINGS, "wan", seed=3)
    _, args, target = wan_inputs(cfg)
    full_opts = StateDictOptions(full_state_dict=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = apply_lora(build_model(cfg), SETTINGS, "wan")
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            params = base_parameters(model)
            assert params.keys() == pretrained.keys()
            for k, p in params.items():
                copy_full(p, pretrained[k])
        init_lora_weights_from_seed(model, 3)
        assert type(model.blocks[0].attn1.to_q.lora_A.default.weight).__name__ == "DTensor"
        start = get_model_state_dict(model, options=full_opts)
        assert start.keys() == plain.state_dict().keys()
        assert all(torch.equal(start[k], v) for k, v in plain.state_dict().items())

        assert sgd_steps(model, args, target, 2) == pytest.approx(sgd_steps(plain, args, target, 2), rel=1e-6)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        full = get_model_state_dict(model, options=full_opts)
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-7)
        ours, ref = lora_state_dict(model, "wan", state_dict=full), lora_state_dict(plain, "wan")
        assert ours.keys() == ref.keys() and all(torch.allclose(ours[k], ref[k], rtol=1e-6, atol=1e-7) for k in ref)
        with pytest.raises(ValueError, match="full_state_dict=True"):
            lora_state_dict(model, "wan")  # sharded parameters
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- training runs (layouts)

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
LORA_LAYOUTS = ["dp_shard=2,cp_ulysses=2,grad_accum=2", "cp_ulysses=2,cp_ring=2,grad_accum=2",
                "dp_replicate=2,dp_shard=2,grad_accum=2", "cp_ring=2", "dp_shard=2,dp_mode=ddp"]


@pytest.mark.slow
def test_lora_adapters_match_one_process_on_every_layout(data_cache, tiny_cfg):
    """FSDP2 / HSDP / DDP x Ulysses / ring / hybrid CP x grad_accum: the adapters (and their EMA)
    after 2 clipped steps equal one process; the frozen base moves nowhere."""
    from dit_train.engine.layout_equivalence import relative_difference, run_layouts
    from tests.conftest import TINY, compose_config

    cfg = compose_config([*TINY, *LORA, "optim.max_grad_norm=0.05", "train.ema_decay=0.9"], cache_dir=data_cache)
    runs = run_layouts(cfg, ["1", *LORA_LAYOUTS], ["sample_mean"])
    (ref,) = runs.pop("1")
    adapters = [k for k in ref if ".lora_" in k and not k.startswith("__")]
    assert adapters and all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref
                            if not k.startswith("__") and ".lora_" not in k)
    for spec, (got,) in runs.items():
        rel = relative_difference(ref, got)
        assert rel <= 1e-4, f"{spec}: adapters or their EMA differ by {rel:.2e} of the update"


@pytest.mark.slow
def test_lora_resume_onto_another_layout_is_exact(data_cache, tmp_path):
    """Checkpoints hold only the adapters (and their optimizer state); saved on dp_shard=2,
    resumed on cp_ulysses=2: the same merged weights and adapters as an uninterrupted run."""
    from safetensors.torch import load_file

    from tests.conftest import train_in_process

    from tests.conftest import TINY

    base = [*TINY, *LORA, "train.steps=4", "train.ema_decay=0.9", f"data.cache_dir={data_cache}"]
    ref, a, b = tmp_path / "ref", tmp_path / "a", tmp_path / "b"
    train_in_process(base, ref)
    train_in_process([*base, "parallel.dp_shard=2", "train.ckpt_every=2"], a)
    ck = a / "checkpoints" / "step_00000001"
    sizes = sum(f.stat().st_size for f in ck.glob("*.distcp"))
    assert sizes < 300_000  # adapters + their AdamW moments, not the 90k-parameter base
    train_in_process([*base, "parallel.cp_ulysses=2", f"train.resume={ck}"], b)
    for name in ("weights.safetensors", "weights_ema.safetensors", "lora/pytorch_lora_weights.safetensors"):
        w_ref, w = load_file(ref / name), load_file(b / name)
        assert max(float((w_ref[k] - w[k]).abs().max()) for k in w_ref) < 1e-6, name


# --------------------------------------------------------------------------- export of a Wan LoRA run

DOCS = Path(__file__).resolve().parents[1] / "docs" / "wan.md"


@pytest.fixture(scope="module")
def wan_lora_run(data_cache, tmp_path_factory) -> Path:
    """The README's `+experiment=wan_lora` (random tiny base, EMA), 2 steps, with a checkpoint."""
    from tests.conftest import TINY, train_in_process

    run = tmp_path_factory.mktemp("wan_lora") / "run"
    train_in_process(["+experiment=wan_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                      "train.steps=2", "train.sample_every=0", "train.ema_decay=0.9", "train.ckpt_every=2",
                      "optim.lr=0.05"], run,  # adapters that move: a lost one changes the outputs
                     cache_dir=data_cache)
    return run


def _without_checkpoints(run: Path, dest: Path) -> Path:
    """The run as the README's command leaves it (train.ckpt_every=0): lora/, weights*.safetensors."""
    import shutil

    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("checkpoints"))
    return dest


def _doc_blocks(lang: str) -> list[str]:
    import re

    return re.findall(rf"^( *)```{lang}\n(.*?)^\1```", DOCS.read_text(), flags=re.S | re.M)


def test_wan_lora_docs_snippet_runs_as_written(wan_lora_run, tmp_path, monkeypatch):
    """docs/wan.md's export commands and Python block, as written, in a folder holding the run
    as `outputs/wan_lora`: the base (--base) + the adapters in diffusers give the outputs of the
    run's merged weights (a wrong base or a lost adapter would not)."""
    import shlex
    import textwrap

    from diffusers import WanTransformer3DModel

    from dit_train.tools import export_weights

    _without_checkpoints(wan_lora_run, tmp_path / "outputs" / "wan_lora")
    monkeypatch.chdir(tmp_path)
    commands = [line.strip() for indent, block in _doc_blocks("bash") for line in block.splitlines()
                if line.strip().startswith("python -m dit_train.tools.export_weights outputs/wan_lora ")]
    assert commands, "docs/wan.md lost its base export command"
    for line in commands:
        assert export_weights.main(shlex.split(line)[3:]) == 0, line
    (snippet,) = [textwrap.dedent(block) for indent, block in _doc_blocks("python")
                  if "load_lora_adapter" in block]
    scope: dict = {}
    exec(compile(snippet, str(DOCS), "exec"), scope)  # noqa: S102 - the documented snippet itself

    assert export_weights.main(["outputs/wan_lora", "--merge-lora", "--diffusers", "merged"]) == 0
    merged = WanTransformer3DModel.from_pretrained("merged")
    g = torch.Generator().manual_seed(5)
    clip, ctx = torch.randn(1, 3, 2, 16, 24, generator=g), torch.randn(1, 16, 32, generator=g)
    with torch.no_grad():
        want = merged(clip, torch.tensor([400.0]), ctx).sample
        base = WanTransformer3DModel.from_pretrained("outputs/wan_lora_base")
        assert _rel(base(clip, torch.tensor([400.0]), ctx).sample, want) > 100 * RTOL  # the adapters matter
        for adapted in (scope["transformer"], scope["pipe"].transformer):
            assert _rel(adapted(clip, torch.tensor([400.0]), ctx).sample, want) <= RTOL


def test_lora_export_of_a_run_without_checkpoints_and_its_errors(wan_lora_run, tmp_path, capsys):
    from safetensors.torch import load_file

    from dit_train.tools import export_weights

    run = _without_checkpoints(wan_lora_run, tmp_path / "run")
    for flags, src in (([], "lora"), (["--ema"], "lora_ema")):
        assert export_weights.main([str(run), *flags, "--diffusers", str(tmp_path / src)]) == 0
        assert (tmp_path / src / WEIGHT).read_bytes() == (run / src / WEIGHT).read_bytes()
    assert export_weights.main([str(run), "--merge-lora", "--out", str(tmp_path / "m.safetensors")]) == 0
    a, b = load_file(tmp_path / "m.safetensors"), load_file(run / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    (run / "lora_ema" / WEIGHT).unlink()
    for args, says in (([str(tmp_path / "empty")], "pass a checkpoint dir, a run dir, or a run's weights.safetensors "
                                                   "with --diffusers DIR"),
                       ([str(run), "--ema", "--diffusers", str(tmp_path / "x")], "(the run has no EMA weights): drop --ema"),
                       ([str(run), "--out", "a", "--diffusers", "b"], "give --out or --diffusers DIR, not both")):
        assert export_weights.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err and "train." not in err, err


def test_lora_export_from_a_checkpoint_writes_into_the_diffusers_dir(wan_lora_run, tmp_path):
    from safetensors.torch import load_file

    from dit_train.tools import export_weights

    ckpt = wan_lora_run / "checkpoints" / "step_00000001"
    assert export_weights.main([str(wan_lora_run), "--diffusers", str(tmp_path / "adapters")]) == 0
    assert not (ckpt / "lora").exists()  # not somewhere else
    a, b = load_file(tmp_path / "adapters" / WEIGHT), load_file(wan_lora_run / "lora" / WEIGHT)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the last checkpoint = the run's end
