"""Block swap (model.block_swap, dit_train/engine/block_swap.py) on the CPU, where the same code
runs as on CUDA (plain copies instead of a side stream):

1. Weights (adapters) and losses after 3 steps bit-equal to the run without swap, DiT and Wan,
   some and all blocks swapped, and over an int8 and an nf4 base; at most two swapped blocks
   resident at once; evicted parameters hold no values (0-element placeholders: a use the hooks
   did not announce fails), read from the modules themselves, inner tensors of a quantized
   weight included.
   Every model.base_quant on a stack of checkpointed quantized blocks (cheap, no run): output and
   input gradient bit-equal to no swap, at most two of four blocks holding values at once.
2. Refused before any worker starts, one line each: more blocks than the model has, no LoRA,
   no full activation checkpointing on the swapped blocks, several ranks, meta init.
"""
from __future__ import annotations

import pytest
import torch

from dit_train.config.errors import ConfigError
from dit_train.engine.block_swap import BlockSwap, held_bytes
from dit_train.models import quant
from tests.conftest import TINY, compose_config

BASE = [*TINY, "model.lora.rank=4", "model.lora.alpha=8", "model.activation_checkpointing=full", "train.steps=3"]
CASES = {"dit-1": ([], 1), "dit-all": ([], 2), "wan-all": (["model=wan_tiny"], 2),
         "dit-int8-1": (["model.base_quant=int8"], 1), "wan-nf4-all": (["model=wan_tiny", "model.base_quant=nf4"], 2)}
# a string condition: asked at a test's setup, not at collection (importing torchao costs ~2.5 CPU-s
# in every pytest process that collects this file)
NEEDS_TORCHAO = pytest.mark.skipif("not quant.available()", reason="torchao is not installed")


def _train(overrides: list[str], data_cache: str):
    from dit_train.data_pipelines import prepare_data
    from dit_train.engine.build import build_run
    from dit_train.engine.checks import check_config

    cfg = compose_config([*BASE, *overrides], cache_dir=data_cache)
    check_config(cfg)
    prepare_data(cfg.data, cfg.model)
    run = build_run(cfg)
    losses = [run.trainer.step(s).loss for s in range(cfg.train.steps)]
    trained = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    return losses, trained, run


@pytest.mark.parametrize("case", [pytest.param(c, marks=[NEEDS_TORCHAO] if "base_quant" in str(CASES[c][0]) else [])
                                  for c in sorted(CASES)])
def test_block_swap_is_bit_equal_to_no_swap(case, data_cache):
    extra, n = CASES[case]
    want_losses, want, _ = _train(extra, data_cache)
    losses, got, run = _train([*extra, f"model.block_swap={n}"], data_cache)
    assert losses == want_losses
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want), case
    swap = run.model.block_swap_state
    assert len(swap.blocks) == n and swap.resident_peak <= 2
    swap.release()
    # evicted: placeholders (a quantized weight's codes and scales too), values in host memory only
    assert all(held_bytes(m) == 0 for m in swap.modules)
    assert all(h.numel() > 0 for b in swap.blocks for h in b.host)


class _Checkpointed(torch.nn.Module):
    """A block as the models call it under full activation checkpointing (what block swap needs)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _quantized_stack(kind: str) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).requires_grad_(False)
              for _ in range(4)]
    quant.quantize_base(blocks, kind)
    return blocks


@NEEDS_TORCHAO
@pytest.mark.parametrize("kind", ["none", *quant.KINDS])
def test_block_swap_streams_every_base_quant(kind):
    """Four checkpointed blocks of quantized linears, all swapped: output and input gradient
    bit-equal to the same blocks without swap; at most two blocks hold values at any hook; none
    after release (the quantized weight's inner tensors moved, not only its wrapper)."""
    x = torch.randn(5, 64)

    def run(blocks):
        xi = x.clone().requires_grad_(True)
        h = xi
        for b in blocks:
            h = b(h)
        h.square().sum().backward()
        return h.detach(), xi.grad

    want = run([_Checkpointed(b) for b in _quantized_stack(kind)])
    blocks = _quantized_stack(kind)
    swap = BlockSwap(blocks, torch.device("cpu"))
    wrapped = [_Checkpointed(b) for b in blocks]
    swap.install(wrapped)
    assert all(held_bytes(b) == 0 for b in blocks)
    got = run(wrapped)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kind
    assert swap.resident_peak == 2
    swap.release()
    assert all(held_bytes(b) == 0 for b in blocks)


@pytest.mark.parametrize("overrides,message", [
    (["model.block_swap=3"], "model.block_swap=3 must be between 0 and model.depth=2"),
    (["model.lora.rank=0", "model.block_swap=1"], "with model.lora.rank=0 every weight trains"),
    (["model.activation_checkpointing=none", "model.block_swap=1"], "needs full activation checkpointing"),
    (["model.activation_checkpointing=full", "model.ac_every=2", "model.block_swap=2"], "needs full activation checkpointing"),
    (["parallel.dp_shard=2", "model.block_swap=1"], "is for one process"),
    (["parallel.meta_init=true", "model.block_swap=1"], "set parallel.meta_init=false"),
])
def test_bad_block_swap_is_refused_in_one_line(overrides, message):
    from dit_train.engine.checks import check_config

    with pytest.raises(ConfigError) as info:
        check_config(compose_config([*BASE, *overrides]))
    text = str(info.value)
    assert "\n" not in text and message in text, text


@pytest.mark.slow
@NEEDS_TORCHAO
def test_a_whole_run_with_int8_base_and_swap_writes_the_merged_full_precision_weights(data_cache, tmp_path):
    """The CLI's path end to end (sanity checks, EMA, checkpoint, final export) with an int8 base and
    a swapped block: weights.safetensors is the full-precision base plus the adapters, equal to
    what export_weights --merge-lora rebuilds from the checkpoint."""
    from safetensors.torch import load_file

    from dit_train.tools import export_weights
    from tests.conftest import train_in_process

    run = tmp_path / "run"
    train_in_process(["+experiment=wan_lora", *(o for o in TINY if not o.startswith("optim")), "model.text_len=16",
                      "train.steps=2", "train.sample_every=0", "train.ema_decay=0.9", "train.ckpt_every=2",
                      "model.base_quant=int8", "model.block_swap=1", "model.activation_checkpointing=full"], run,
                     cache_dir=data_cache)
    assert export_weights.main([str(run), "--merge-lora", "--out", str(tmp_path / "merged.safetensors")]) == 0
    a, b = load_file(tmp_path / "merged.safetensors"), load_file(run / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
