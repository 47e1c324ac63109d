"""Memory options change where tensors live or when they are computed, never the result:
activation checkpointing policies (none | full | selective, every k-th block), activation
offload to host memory, FSDP2 parameter/gradient/optimizer offload (parallel.cpu_offload),
the recomputed prologues (model.recompute_prologues)."""
from __future__ import annotations

import pytest
import torch

from dit_train.config.errors import ConfigError
from dit_train.engine.checks import check_config
from dit_train.engine.layout_equivalence import apply_layout, train_on_workers, train_weights


def _assert_same(ref: dict, got: dict, what: str) -> None:
    assert set(ref) == set(got), what
    for k, v in ref.items():
        assert torch.equal(v, got[k]), f"{what}: {k} differs by {(v - got[k]).abs().max():.3e}"


def _with(cfg, **keys):
    c = apply_layout(cfg, {})
    for k, v in keys.items():
        section, _, name = k.partition("__")
        setattr(getattr(c, section), name, v)
    return c


def test_checkpointing_and_activation_offload_are_bit_exact(tiny_cfg):
    """One process: every AC policy (on all blocks, or every second one), activation offload
    and the recomputed prologues give the same weights and gradient norms, bit for bit, as the
    plain run."""
    variants = {
        "full": dict(model__activation_checkpointing="full"),
        "selective every 2": dict(model__activation_checkpointing="selective", model__ac_every=2),
        "selective": dict(model__activation_checkpointing="selective"),
        "activation offload": dict(train__activation_offload=True),
        "full + offload": dict(model__activation_checkpointing="full", train__activation_offload=True),
        "recomputed prologues": dict(model__recompute_prologues=True),
        "recomputed prologues + selective": dict(model__recompute_prologues=True, model__activation_checkpointing="selective"),
    }
    cfgs = [_with(tiny_cfg)] + [_with(tiny_cfg, **v) for v in variants.values()]
    ref, *got = train_weights(cfgs)
    for name, res in zip(variants, got):
        _assert_same(ref, res, name)


def test_policies_keep_what_they_say(tiny_cfg):
    """none > selective > full in bytes kept for backward, and ac_every picks the blocks."""
    from dit_train.models import build_model, init_weights
    from dit_train.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks
    from dit_train.perf.memory import example_inputs
    from dit_train.perf.saved import retained_bytes

    assert checkpointed_blocks(6, 1) == list(range(6)) and checkpointed_blocks(6, 2) == [1, 3, 5]
    kept = {}
    for policy in ("none", "selective", "full"):
        model = build_model(tiny_cfg.model)
        init_weights(model, 0, "normal")
        apply_activation_checkpointing(model.blocks, policy, 1)
        args = example_inputs(tiny_cfg.model, 256)
        kept[policy] = retained_bytes(lambda: model(*args), list(model.parameters()))[0]["activations"]
    assert kept["none"] > kept["selective"] > kept["full"], kept
    model = build_model(tiny_cfg.model)
    apply_activation_checkpointing(model.blocks, "full", 2)
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.blocks]
    assert wrapped == [False, True], wrapped


def test_offload_copies_each_storage_once_and_restores_the_same_views():
    """Views of one storage share one host copy and come back with their own size, stride and
    offset (backward sees the layouts it would have seen: the summation order is unchanged);
    parameters are not copied."""
    from dit_train.engine.offload import offload_activations

    hooks = offload_activations(pin_memory=False)
    x = torch.randn(8, 6).t()  # non-contiguous
    a, b = hooks.pack_hook(x[1:4]), hooks.pack_hook(x[2:5])
    assert a[-1] is b[-1] and a[-1].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    ra, rb = hooks.unpack_hook(a), hooks.unpack_hook(b)
    for r, v in ((ra, x[1:4]), (rb, x[2:5])):
        assert torch.equal(r, v) and r.stride() == v.stride() and r.storage_offset() == v.storage_offset()
    assert ra.untyped_storage().data_ptr() == rb.untyped_storage().data_ptr()
    w = torch.nn.Parameter(torch.randn(3))
    assert hooks.pack_hook(w) is w


def test_cpu_offload_needs_sharded_fsdp2(tiny_cfg):
    with pytest.raises(ConfigError, match="parallel.cpu_offload=true needs FSDP2"):
        check_config(_with(tiny_cfg, parallel__cpu_offload=True, parallel__dp_shard=2, parallel__dp_mode="ddp"), 2)
    with pytest.raises(ConfigError, match="over >= 2 ranks"):
        check_config(_with(tiny_cfg, parallel__cpu_offload=True), 1)


@pytest.mark.slow
def test_fsdp2_cpu_offload_and_activation_options_match_the_plain_fsdp2_run(tiny_cfg):
    """Two gloo ranks: CPUOffloadPolicy (shards, gradients, optimizer state on the host) and
    selective AC with activation offload give the plain FSDP2 run's weights bit for bit."""
    plain = _with(tiny_cfg, parallel__dp_shard=2)
    plain.optim.max_grad_norm = 0.05  # the clipped global norm is reduced over offloaded shards
    variants = {
        "cpu_offload": dict(parallel__cpu_offload=True),
        "selective + activation offload": dict(model__activation_checkpointing="selective",
                                               train__activation_offload=True),
    }
    ref, *got = train_on_workers([plain] + [_with(plain, **v) for v in variants.values()])
    for name, res in zip(variants, got):
        _assert_same(ref, res, name)


def _offload_policies(cfg) -> list[str]:
    """Runs on every rank: the offload policy of each FSDP2 unit of the built model."""
    from torch.distributed.fsdp import FSDPModule

    from dit_train.engine.build import build_run

    run = build_run(cfg)
    return sorted({type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                   for m in run.model.modules() if isinstance(m, FSDPModule)})


@pytest.mark.slow
def test_cpu_offload_puts_every_fsdp2_unit_on_the_host(tiny_cfg):
    from dit_train.engine.launch import launch_local

    cfg = _with(tiny_cfg, parallel__dp_shard=2, parallel__cpu_offload=True)
    got = launch_local(_offload_policies, (cfg,), 2, cfg.launcher)
    assert got == {0: ["CPUOffloadPolicy"], 1: ["CPUOffloadPolicy"]}, got
