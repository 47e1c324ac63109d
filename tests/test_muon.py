"""optim.name=muon: which parameters Muon trains, that a sharded update equals one process's,
and that a resumed run continues the same trajectory.

Why not the layout tests' whole-run comparison: Newton–Schulz lifts every singular direction of
the momentum to the same size, including the gradient's rounding-level ones, so two layouts whose
gradients differ in the last bit (another summation order) move apart by far more than 1e-4 of
the update — with DDP as well as FSDP2 (measured: 0.28 after 3 steps). What the optimizer itself
must guarantee is that the *same* gradient gives the same update on any sharding; the gradients'
own exactness is what tests/test_layouts.py proves (through SGD and AdamW).
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from dit_train.checkpoint.export import full_state_dict
from dit_train.config.choices import OptimName
from dit_train.engine.build import build_run
from dit_train.engine.launch import launch_local
from dit_train.engine.layout_equivalence import apply_layout, parse_layout
from dit_train.models.registry import blocks_of
from dit_train.optim.muon import MuonAdamW
from tests.conftest import TINY, compose_config, train_in_process

MUON_TINY = [o for o in TINY if not o.startswith("optim")] + ["optim.name=muon", "optim.lr=3e-3",
                                                              "optim.warmup_steps=2", "optim.schedule=cosine"]


def _gradient(name: str, shape: torch.Size) -> torch.Tensor:
    """A fixed gradient per parameter name (the same on every rank and layout)."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def muon_steps(cfg, steps: int = 2) -> dict[str, torch.Tensor]:
    """Build cfg's run, give every parameter the same full gradient `steps` times, step the
    optimizer; the full weights (on every rank)."""
    # deferred: DTensor's import (~0.7 CPU-s, sympy) cost every pytest process that collects this file
    from torch.distributed.tensor import DTensor, distribute_tensor

    run = build_run(cfg)
    assert isinstance(run.optimizer, MuonAdamW)
    for _ in range(steps):
        for name, p in run.model.named_parameters():
            g = _gradient(name, p.shape)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g
        run.optimizer.step()
    return full_state_dict(run.model)


def test_muon_trains_the_blocks_matrices_and_adamw_the_rest(tiny_cfg):
    cfg = apply_layout(tiny_cfg, {})
    cfg.optim.name = OptimName.muon
    run = build_run(cfg)
    kinds = {id(p): g["kind"] for g in run.optimizer.param_groups for p in g["params"]}
    block = {id(p) for p in blocks_of(run.model).parameters() if p.ndim == 2}
    for name, p in run.model.named_parameters():
        assert kinds[id(p)] == ("muon" if id(p) in block else "adamw"), name
    assert "muon" in kinds.values() and "adamw" in kinds.values()


@pytest.mark.parametrize("family", ["ltx_tiny", "hunyuan15_tiny", "ltx2_tiny"])
def test_muon_takes_each_familys_own_blocks(tiny_cfg, family):
    """Muon, the from-scratch default, read `model.blocks`: a family keeping diffusers'
    `transformer_blocks` (LTX, HunyuanVideo 1.5, LTX-2) stopped `python -m dit_train model=ltx_tiny`
    with an AttributeError before step 0. Its matrices are the spec's blocks'."""
    from dit_train.models import model_spec
    from tests.families import family_run_cfg

    extra = {"ltx2_tiny": ["data.audio=true"], "hunyuan15_tiny": ["model.rope_axes=[2,2,4]"]}.get(family, [])
    cfg = apply_layout(family_run_cfg([f"model={family}", "model.text_len=16", *extra, "optim.name=muon"],
                                      tiny_cfg.data.cache_dir), {})
    run = build_run(cfg)
    kinds = {id(p): g["kind"] for g in run.optimizer.param_groups for p in g["params"]}
    block = {id(p) for p in model_spec(cfg.model).blocks(run.model).parameters() if p.ndim == 2}
    assert block and all(kinds[id(p)] == ("muon" if id(p) in block else "adamw") for p in run.model.parameters())


def test_sharded_muon_update_equals_one_process(tiny_cfg):
    """FSDP2 shards each matrix over 2 ranks: the gathered, orthogonalised update must be the one
    process's bit for bit (momentum from two steps included)."""
    cfg = apply_layout(tiny_cfg, {})
    cfg.optim.name = OptimName.muon
    oracle = muon_steps(cfg)
    sharded = launch_local(muon_steps, (apply_layout(cfg, parse_layout("dp_shard=2")),), 2, cfg.launcher)[0]
    init = full_state_dict(build_run(cfg).model)
    moved = [k for k in oracle if not torch.equal(oracle[k], init[k])]
    assert len(moved) == len(oracle), "every parameter had a gradient and must have moved"
    for k in oracle:
        assert torch.equal(oracle[k], sharded[k]), f"{k}: {(oracle[k] - sharded[k]).abs().max():.2e}"


def test_muon_resumes_on_the_same_trajectory(tmp_path, data_cache):
    base = [*MUON_TINY, "train.steps=5", f"data.cache_dir={data_cache}"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=2", "train.keep_last=5"], full)
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000001'}"], part)
    assert [json.loads(x)["step"] for x in (part / "metrics.jsonl").read_text().splitlines()] == [2, 3, 4]
    a, b = load_file(full / "weights.safetensors"), load_file(part / "weights.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_one_sided_muon_adamw_steps_and_reloads():
    """A run whose trained parameters are all Muon's (or all AdamW's, e.g. LoRA adapters outside
    the blocks) gets an optimizer of that side alone; it steps, and its state dict reloads."""
    for muon_side in (True, False):
        w = torch.nn.Parameter(torch.randn(4, 3))
        opt = MuonAdamW([w] if muon_side else [], [] if muon_side else [w], lr=1e-2, weight_decay=0.0,
                        momentum=0.95, betas=(0.9, 0.999), eps=1e-8)
        assert [g["kind"] for g in opt.param_groups] == ["muon" if muon_side else "adamw"]
        before = w.detach().clone()
        w.grad = torch.ones_like(w)
        opt.step()
        assert not torch.equal(w, before)
        again = MuonAdamW([w] if muon_side else [], [] if muon_side else [w], lr=1e-2, weight_decay=0.0,
                          momentum=0.95, betas=(0.9, 0.999), eps=1e-8)
        again.load_state_dict(opt.state_dict())
        assert list(again.inner.values())[0].state is again.state and len(again.state) == 1
