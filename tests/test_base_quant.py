"""A quantized frozen base under LoRA (model.base_quant, dit_train/models/quant.py).

1. On our DiT and on Wan (tiny, one process): int8, fp8 and nf4 bases train the adapters, and the
   loss and the adapter gradients stay within a measured bound of the full-precision base
   (the numbers are in docs/one-gpu.md; bounds ~3x the measured error).
2. Layout-exact: dp_shard=2 x cp_ulysses=2 (FSDP2 leaves the quantized weights unsharded)
   equals the one-process oracle on uneven clips, for each model and quantization.
3. Refused before any worker starts, one line each: base_quant without LoRA; nf4 on a layer
   whose size is not a multiple of its 64-value blocks; torchao missing; a quantization torchao
   cannot run on the device.
"""
from __future__ import annotations

import pytest
import torch

from dit_train.models import quant
from tests.conftest import TINY, compose_config, refusal
from tests.layout_cases import Case, assert_exact, run_cases

# a string: asked at each test's setup, not at collection (torchao's import, ~2.5 CPU-s, only where a test needs it)
pytestmark = pytest.mark.skipif("not quant.available()", reason="torchao is not installed (pip install 'dit_train[quant]')")

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
MODELS = {"dit": [], "wan": ["model=wan_tiny"]}
# measured on this CPU (docs/one-gpu.md#measured): largest loss relative error over 3 steps, adapter
# gradient relative error (L2) at step 0; the bounds leave ~3x room
BOUNDS = {"int8": (5e-6, 5e-3), "fp8": (1e-5, 2e-2), "fp8_scaled": (6e-5, 3e-2), "nf4": (3e-5, 7e-2)}
# fp8_scaled's 64-input groups need 64-wide inputs: the tiny models (dim 32) run it at dim 64
WIDER = {("dit", "fp8_scaled"): ["model.dim=64"], ("wan", "fp8_scaled"): ["model.dim=64"]}


def _cfg(model: str, kind: str, data_cache: str, like: str | None = None):
    """The tiny `model` with model.base_quant=`kind`, in the widths `like`'s (default: kind's) needs."""
    return compose_config([*TINY, *MODELS[model], *WIDER.get((model, like or kind), []), *LORA,
                           f"model.base_quant={kind}", "train.steps=3"], cache_dir=data_cache)


def measure(cfg) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: the losses of cfg.train.steps steps, the adapter gradients of step 0 (taken
    just before the optimizer uses them), and the adapters before and after."""
    from dit_train.data_pipelines import prepare_data
    from dit_train.engine.build import build_run

    prepare_data(cfg.data, cfg.model)
    run = build_run(cfg)
    adapters = {n: p for n, p in run.model.named_parameters() if ".lora_" in n}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    grads: dict[str, torch.Tensor] = {}

    def keep(*_):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in adapters.items()})

    run.optimizer.register_step_pre_hook(keep)
    losses = [run.trainer.step(s).loss for s in range(cfg.train.steps)]
    return losses, grads, before, {n: p.detach().clone() for n, p in adapters.items()}


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([d[k].reshape(-1) for k in sorted(d)])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_quantized_base_trains_adapters_close_to_the_full_base(model, data_cache, capsys):
    """The base's frozen block linears hold torchao tensors; only adapters train and they move;
    loss and adapter gradients within BOUNDS of the full-precision base's."""
    refs = {}
    for kind, (loss_bound, grad_bound) in BOUNDS.items():
        widths = tuple(WIDER.get((model, kind), []))
        if widths not in refs:  # the full-precision base in the same widths
            refs[widths] = measure(_cfg(model, "none", data_cache, like=kind))[:2]
        ref_losses, ref_grads = refs[widths]
        cfg = _cfg(model, kind, data_cache)
        losses, grads, before, after = measure(cfg)
        assert all(not torch.equal(before[n], after[n]) for n in after if ".lora_B." in n), "adapters did not move"
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        grad_err = float((_flat(grads) - _flat(ref_grads)).norm() / _flat(ref_grads).norm())
        with capsys.disabled():
            print(f"\n{model} base_quant={kind}: loss rel err {loss_err:.2e}, adapter grad rel err {grad_err:.2e}")
        # the gradient error > 0 shows the quantized base is in use; the loss error may be 0: Wan's
        # int8 error (~8e-8) is at float32's resolution of the reported loss and read 0.0 in one run
        assert 0 <= loss_err <= loss_bound and 0 < grad_err <= grad_bound, (model, kind, loss_err, grad_err)


@pytest.mark.parametrize("kind", ["int8", "fp8_scaled", "nf4"])
def test_only_frozen_block_linears_are_quantized(kind):
    """The frozen nn.Linear layers of the blocks are quantized; adapters, norms, embeddings and
    what lies outside the blocks keep their dtype."""
    from dit_train.engine.build import build_parallel_model
    from dit_train.models import model_spec
    from dit_train.parallel.mesh import init_parallel

    cfg = compose_config([*TINY, *WIDER.get(("dit", kind), []), *LORA, f"model.base_quant={kind}"])
    model = build_parallel_model(cfg, init_parallel(cfg.parallel))
    names = quant.quantized_names(model)
    blocks = {f"blocks.{i}." for i in range(len(model_spec(cfg.model).blocks(model)))}
    assert names and all(any(n.startswith(b) for b in blocks) and n.endswith(".weight") for n in names), names
    assert not any(".lora_" in n or "norm" in n for n in names), names
    assert all(p.dtype == torch.float32 and not quant.is_quantized(p)
               for n, p in model.named_parameters() if n not in set(names))
    if kind == "fp8_scaled":  # one scale per 64 inputs of each row (fp8: one per row)
        weights = [p for p in model.parameters() if quant.is_quantized(p)]
        assert all(tuple(w.scale.shape) == (w.shape[0], w.shape[1] // quant.FP8_GROUP) for w in weights)


@pytest.fixture(scope="module")
def quantized_layouts(data_cache):
    """{(model, kind): (one-process result, dp_shard=2 x cp_ulysses=2 result)}: every model and
    quantization in one launch of 4 workers. 2 steps (the bounds above measure 3): the second
    step's exactness is what the layout must keep (synced counts, clipping, the quantized base
    unsharded under FSDP2 after an optimizer step); a third adds nothing a layout could break."""
    from dit_train.data_pipelines import prepare_data

    cases = {}
    for m in MODELS:
        for kind in BOUNDS:
            cfg = _cfg(m, kind, data_cache)
            cfg.train.steps = 2
            # one block: the runs are Python-bound (a step costs its blocks' calls, not their width);
            # each quantized linear kind is in every block, the counts and shards need no second one
            cfg.model.depth = 1
            prepare_data(cfg.data, cfg.model)
            cases[(m, kind)] = Case(cfg, "dp_shard=2,cp_ulysses=2")
    return run_cases(cases)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BOUNDS))
def test_quantized_base_is_layout_exact(kind, quantized_layouts):
    """dp_shard=2 x cp_ulysses=2 on uneven clips equals one process, each quantization, DiT and Wan."""
    for m in MODELS:
        oracle, got = quantized_layouts[(m, kind)]
        assert_exact(oracle, got, f"{m}-{kind}")


def test_bad_base_quant_is_refused_before_any_worker(monkeypatch):
    """One line each, from check_config: no LoRA; torchao missing; torchao cannot run it here."""
    def refused(overrides: list[str]) -> str:
        return refusal([*TINY, *overrides])

    assert "full training of a quantized base is not supported" in refused(["model.base_quant=int8"])
    # nf4 blocks of 64 values: a 36-wide DiT's qkv weight (108 x 36 = 3888 values) does not split
    assert ("blocks.0.attn.qkv.base_layer (108x36 = 3888 values) is not a multiple of 64"
            in refused([*LORA, "model.base_quant=nf4", "model.dim=36", "model.heads=2"]))
    # fp8_scaled groups of 64 inputs: the tiny DiT's 32-wide layers
    assert ("blocks.0.attn.qkv.base_layer (96x32) has 32 inputs, not a multiple of 64"
            in refused([*LORA, "model.base_quant=fp8_scaled"]))

    def no_torchao():
        raise ImportError("No module named 'torchao'")

    monkeypatch.setattr(quant, "torchao", no_torchao)
    assert "needs torchao" in refused([*LORA, "model.base_quant=fp8"])
    monkeypatch.undo()

    def unsupported(blocks, kind):
        raise NotImplementedError(f"no {kind} kernel for this device")

    monkeypatch.setattr(quant, "quantize_base", unsupported)
    assert "torchao cannot run a fp8 linear on cpu here (no fp8 kernel" in refused([*LORA, "model.base_quant=fp8"])


@pytest.mark.slow
def test_a_whole_nf4_run_writes_the_merged_full_precision_weights(data_cache, tmp_path):
    """The CLI's path end to end (sanity checks, EMA, checkpoint, final export) over an nf4 base:
    it finishes, and weights.safetensors equals what export_weights --merge-lora rebuilds from
    the checkpoint (the full-precision base plus the adapters)."""
    from safetensors.torch import load_file

    from dit_train.tools import export_weights
    from tests.conftest import train_in_process

    run = tmp_path / "run"
    train_in_process([*TINY, *LORA, "model.base_quant=nf4", "train.steps=2", "train.ema_decay=0.9",
                      "train.ckpt_every=2"], run, cache_dir=data_cache)
    assert export_weights.main([str(run), "--merge-lora", "--out", str(tmp_path / "merged.safetensors")]) == 0
    a, b = load_file(tmp_path / "merged.safetensors"), load_file(run / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
