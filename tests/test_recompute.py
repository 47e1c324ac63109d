"""models/recompute.py: linear layers that recompute their elementwise prologue (norm, adaLN
modulate, GELU, gated residual) in backward give the composite modules' values and gradients
bit for bit, and save less."""
from __future__ import annotations

import pytest
import torch

from dit_train.models import build_model, init_weights, model_config
from dit_train.models.recompute import composite_ops
from dit_train.perf.memory import example_inputs, saved_activation_bytes


def _cfgs():
    return [model_config("dit", dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4, text_dim=16),
            model_config("dit", dim=32, depth=2, heads=2, patch_size=[1, 2, 2], in_channels=4),
            model_config("lm", dim=32, depth=2, heads=2)]


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
    without checkpointing (the composite block is not), equal under full checkpointing."""
    pytest.importorskip("diffusers")
    from dit_train.tools.bench_activations import accounting_rows

    shape = dict(name="tiny", dim=64, heads=2, ffn=160, text_dim=32, text_len=8, scale="-")
    rows = accounting_rows([shape], (2, 8, 8), ["fp32"], ["none", "full"])
    got = {(r["ac"], r["model"]): r["vs_wan"] for r in rows}
    assert got[("none", "ours")] < 0.7 and got[("none", "ours (composite)")] > 0.9, got
    assert got[("full", "ours")] == 1.0, got
