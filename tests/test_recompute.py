"""models/recompute.py: linear layers that recompute their elementwise prologue (norm, adaLN
modulate, GELU, gated residual) in backward give the composite modules' values and gradients
bit for bit, and save less."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dit_train.models import build_model, init_weights, model_config
from dit_train.models.recompute import composite_ops, set_recompute_prologues
from dit_train.parallel.checkpointing import apply_activation_checkpointing
from dit_train.perf.memory import example_inputs, saved_activation_bytes


def _cfgs():
    on = dict(recompute_prologues=True)
    return [model_config("dit", dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4, text_dim=16, **on),
            model_config("dit", dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4, **on),
            model_config("lm", dim=32, depth=2, heads=2, **on)]


def _run(cfg, dtype, composite: bool, autocast: bool = False):
    model = build_model(cfg).to(dtype)
    init_weights(model, 0, "normal")
    args = tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in example_inputs(cfg, 48))
    ctx = composite_ops() if composite else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        saved, out = saved_activation_bytes(lambda: model(*args), exclude=list(model.parameters()))
        out.float().square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", _cfgs(), ids=["dit_text", "dit", "lm"])
def test_recomputed_prologues_are_bit_exact(cfg, dtype):
    out, grads, saved = _run(cfg, dtype, composite=False)
    ref_out, ref_grads, ref_saved = _run(cfg, dtype, composite=True)
    assert torch.equal(out, ref_out)
    for name, g in grads.items():
        assert g is not None and torch.equal(g, ref_grads[name]), name
    assert saved < ref_saved  # the point of it: normalised inputs, GELU outputs, residuals not kept


def test_recomputed_prologues_under_bf16_autocast():
    cfg = _cfgs()[0]
    out, grads, saved = _run(cfg, torch.float32, composite=False, autocast=True)
    ref_out, ref_grads, ref_saved = _run(cfg, torch.float32, composite=True, autocast=True)
    assert torch.equal(out, ref_out)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert saved < ref_saved


def test_bench_activations_ours_keep_less_than_wan_at_equal_shapes():
    """The benchmark's accounting at a tiny equal shape: ours well below diffusers' Wan block
    without checkpointing (with model.recompute_prologues=false it is not), equal under full checkpointing."""
    pytest.importorskip("diffusers")
    from dit_train.tools.bench_activations import accounting_rows

    shape = dict(name="tiny", dim=64, heads=2, ffn=160, text_dim=32, text_len=8, scale="-")
    rows = accounting_rows([shape], (2, 8, 8), ["fp32"], ["none", "full"])
    got = {(r["ac"], r["model"]): r["vs_wan"] for r in rows}
    assert got[("none", "ours (prologues on)")] < 0.7 and got[("none", "ours (prologues off)")] > 0.9, got
    assert got[("full", "ours (prologues on)")] == 1.0, got


def _step(model, args):
    """Forward, saved bytes, backward: (output, grads by name, bytes saved for backward)."""
    model.zero_grad(set_to_none=True)
    saved, out = saved_activation_bytes(lambda: model(*args), exclude=list(model.parameters()))
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("cfg", _cfgs(), ids=["dit_text", "dit", "lm"])
def test_recompute_prologues_switch_gives_the_same_gradients(cfg):
    """model.recompute_prologues: one model, both settings, the same inputs -> the same output
    and gradients bit for bit; off keeps more for backward (what the memory model counts)."""
    model = build_model(replace(cfg, recompute_prologues=False))  # built through the config key
    init_weights(model, 0, "normal")
    assert not any(getattr(m, "recompute_prologues", False) for m in model.modules())
    args = example_inputs(cfg, 48)
    out_off, grads_off, saved_off = _step(model, args)
    out_on, grads_on, saved_on = _step(set_recompute_prologues(model, True), args)
    assert torch.equal(out_on, out_off)
    for name, g in grads_on.items():
        assert torch.equal(g, grads_off[name]), name
    assert saved_off > saved_on
    with composite_ops():  # the reference wins over a module's switch
        assert _step(model, args)[2] == saved_off


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_prologues_off_under_activation_checkpointing(policy):
    """Checkpointing re-runs a block's forward in backward: the block's switch makes the same
    choice there (else the re-run saves other tensors than the forward and torch refuses)."""
    cfg = _cfgs()[0]
    model = build_model(cfg)
    init_weights(model, 0, "normal")
    args = example_inputs(cfg, 48)
    ref = _step(set_recompute_prologues(model, False), args)
    apply_activation_checkpointing(model.blocks, policy)
    for on in (False, True):
        out, grads, _ = _step(set_recompute_prologues(model, on), args)
        assert torch.equal(out, ref[0])
        for name, g in grads.items():
            assert torch.equal(g, ref[1][name.replace("._checkpoint_wrapped_module", "")]), name
