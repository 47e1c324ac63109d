"""optim.name=adamw8bit: AdamW with torchao's 8-bit moments (dit_train/optim/low_bit.py).

1. The LoRA adapters' moments are torchao 8-bit states, ~2 B per parameter against AdamW's 8
   (numbers printed, in docs/one-gpu.md).
2. Exact resume: a LoRA run stopped at a checkpoint and resumed ends bit-equal to the
   uninterrupted run (DCP writes and reads the quantized states as they are).
3. Refused before any worker starts, one line each: more than one process (FSDP2 would
   quantize per shard; DDP is not tested), torchao missing.
"""
from __future__ import annotations

import sys

import pytest
import torch

from dit_train.models import quant
from dit_train.optim import low_bit
from tests.conftest import TINY, compose_config, refusal

# a string: asked at each test's setup, not at collection (torchao's import, ~2.5 CPU-s, only where a test needs it)
pytestmark = pytest.mark.skipif("not quant.available()", reason="torchao is not installed (pip install 'dit_train[quant]')")

# TINY with AdamW8bit; dim 128 and rank 128 so the adapters' moments (16384 values each) pass
# torchao's 4096-value threshold (smaller tensors keep fp32 moments and would test nothing). One
# target, attn.proj, at rank = dim: lora_A and lora_B are both [128, 128], one shape, and torchao's
# update is torch.compile'd once per shape — rank 32 gave [32, 128] and [128, 32], two compiles
# (the file 43.2 -> 36.1 CPU-s with an empty inductor cache); the default targets' 6 shapes cost more
BASE = [o for o in TINY if not o.startswith("optim")] + [
    "optim=adamw8bit", "optim.lr=1e-2", "optim.warmup_steps=0", "model.dim=128",
    "model.lora.rank=128", "model.lora.alpha=128", "model.lora.targets=[attn.proj]"]


def _build(overrides: list[str], data_cache: str):
    from dit_train.data_pipelines import prepare_data
    from dit_train.engine.build import build_run

    cfg = compose_config(overrides, cache_dir=data_cache)
    prepare_data(cfg.data, cfg.model)
    return build_run(cfg)


def test_adamw8bit_states_are_8bit(data_cache, capsys):
    """After two steps the adapters' large moments are torchao 8-bit states; the state bytes per
    trainable parameter against AdamW's on the same run."""
    from torchao.optim.subclass_8bit import OptimState8bit

    per_param = {}
    for name in ("adamw", "adamw8bit"):
        run = _build([*BASE, "train.steps=2", f"optim.name={name}"], data_cache)
        for s in range(2):
            run.trainer.step(s)
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        per_param[name] = low_bit.state_bytes(run.optimizer) / trainable
        states = [v for st in run.optimizer.state.values() for k, v in st.items() if k.startswith("exp_avg")]
        if name == "adamw8bit":
            quantized = [v for v in states if isinstance(v, OptimState8bit)]
            assert quantized and sum(v.numel() for v in quantized) > 0.9 * sum(v.numel() for v in states)
    with capsys.disabled():
        print(f"\noptimizer state bytes per trainable parameter: adamw {per_param['adamw']:.3f}, "
              f"adamw8bit {per_param['adamw8bit']:.3f}")
    assert per_param["adamw"] == pytest.approx(8.0, abs=0.05)
    assert per_param["adamw8bit"] < 2.5


def test_adamw8bit_resume_is_bit_exact(data_cache, tmp_path):
    """Stopped at the checkpoint of step 2 and resumed to step 4: adapters and merged weights
    bit-equal to the uninterrupted 4-step run (the run that wrote the checkpoint and went on, as
    test_self_forcing's resumes compare: a third run without checkpoints would add a run, not a check)."""
    from safetensors.torch import load_file

    from tests.conftest import train_in_process

    base = [*BASE, "train.steps=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    train_in_process([*base, "train.ckpt_every=2"], a, cache_dir=data_cache)
    ck = a / "checkpoints" / "step_00000001"
    assert ck.is_dir(), sorted(p.name for p in (a / "checkpoints").iterdir())
    train_in_process([*base, f"train.resume={ck}"], b, cache_dir=data_cache)
    for name in ("weights.safetensors", "lora/pytorch_lora_weights.safetensors"):
        w_ref, w = load_file(a / name), load_file(b / name)
        assert w_ref.keys() == w.keys()
        diff = [k for k in w_ref if not torch.equal(w_ref[k], w[k])]
        assert not diff, (name, diff[:5])


def test_adamw8bit_refusals_before_any_worker(monkeypatch):
    """One line each, from check_config: several ranks (FSDP2 or DDP); torchao missing."""
    from dit_train.engine.checks import check_config

    def refused(overrides: list[str]) -> str:
        return refusal([*BASE, *overrides])

    assert "optim.name=adamw8bit runs on one process" in refused(["parallel.dp_shard=2"])
    assert "optim.name=adamw8bit runs on one process" in refused(["parallel.dp_shard=2", "parallel.dp_mode=ddp"])
    check_config(compose_config(BASE))  # one process runs

    low_bit.probe.cache_clear()
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if torchao were missing
    try:
        assert "optim.name=adamw8bit needs torchao" in refused([])
    finally:
        low_bit.probe.cache_clear()
