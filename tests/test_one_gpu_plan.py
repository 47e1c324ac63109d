"""The one-GPU LoRA planner (dit_train/planning/one_gpu.py, `tools.plan --frames` with model.lora):
cheapest option first as memory shrinks; the swap's copy seconds; the base term against the bytes
of a really quantized model; the CLI prints every term and the choice."""
from __future__ import annotations

import pytest
import torch

from dit_train.models import quant
from dit_train.perf.memory import GIB, model_shape
from dit_train.planning import one_gpu
from dit_train.planning.planner import adapter_parameters
from tests.conftest import compose_config

KW = dict(precision="bf16", optimizer="adamw", ema=False, backend="flash", reserve=0.0, h2d_bytes_per_s=20 * GIB,
          flops_per_s=80e12)


def _plan(cfg, tokens: int, gib: float):
    s = model_shape(cfg.model)
    return one_gpu.choose(one_gpu.options(s, adapter_parameters(cfg.model), tokens, capacity=gib * GIB, **KW))


def test_choice_gets_cheaper_options_first_as_memory_shrinks():
    cfg = compose_config(["model=wan_1_3b", "model.lora.rank=16"])
    s = model_shape(cfg.model)
    opts = one_gpu.options(s, adapter_parameters(cfg.model), 4000, capacity=float("inf"), **KW)
    need = {(o.activation_offload, o.block_swap, o.base_quant, o.checkpointing): o.total for o in opts}
    seen = []
    for key in [(False, 0, "none", "none"), (False, 0, "none", "full"), (False, 0, "int8", "full"),
                (False, 4, "int8", "full")]:
        got = _plan(cfg, 4000, need[key] / GIB + 1e-6)
        seen.append((got.activation_offload, got.block_swap, got.base_quant, got.checkpointing))
    assert seen[0] == (False, 0, "none", "none") and seen[1] == (False, 0, "none", "full")
    assert seen[2][2] == "int8" and seen[3][1] > 0, seen
    swap = next(o for o in opts if o.block_swap == 4 and o.base_quant == "int8" and not o.activation_offload)
    assert swap.swap_copy_s == pytest.approx(2 * 4 * s.params_block * 1.0 / (20 * GIB))
    assert swap.host == pytest.approx(4 * s.params_block)
    assert _plan(cfg, 4000, 0.01) is None


@pytest.mark.skipif(not quant.available(), reason="torchao is not installed")
def test_base_term_matches_a_quantized_model():
    from dit_train.models import build_model, model_spec
    from dit_train.models.lora import apply_lora, lora_settings

    for q in ("none", "int8", "nf4"):
        cfg = compose_config(["model=dit_small", "model.lora.rank=16", f"model.base_quant={q}"])
        model = build_model(cfg.model)
        apply_lora(model, lora_settings(cfg.model), model_spec(cfg.model).name)
        quant.quantize_base(model_spec(cfg.model).blocks(model), q)

        def nbytes(p):
            if quant.is_quantized(p):
                names, _ = p.__tensor_flatten__()
                return sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in names)
            return p.numel() * p.element_size()

        frozen = sum(nbytes(p) for p in model.parameters() if not p.requires_grad)
        s = model_shape(cfg.model)
        est = one_gpu.estimate(s, 0, 64, base_quant=q, block_swap=0, checkpointing="full", capacity=GIB,
                               **{**KW, "precision": "fp32"}).terms["base"]
        assert abs(est - frozen) / frozen < 0.05, (q, est, frozen)


def test_plan_cli_prints_terms_and_choice(capsys):
    from dit_train.tools import plan

    rc = plan.main(["model=wan_1_3b", "model.lora.rank=16", "train.precision=bf16", "--gpu-mem-gib", "24",
                    "--frames", "33", "--height", "480", "--width", "832"])
    out = capsys.readouterr().out
    assert rc == 0 and "estimate of the choice (GiB): base " in out and "choice: model.base_quant=" in out, out


def test_adapter_term_counts_8bit_optimizer_states():
    """optim=adamw8bit: the adapters' term counts 2.03 B of optimizer state per parameter (the
    bytes tests/test_low_bit_optim.py measures) instead of AdamW's 8."""
    cfg = compose_config(["model=wan_1_3b", "model.lora.rank=32"])
    s, n = model_shape(cfg.model), adapter_parameters(cfg.model)

    def adapters(optimizer: str) -> float:
        return one_gpu.estimate(s, n, 64, base_quant="none", block_swap=0, checkpointing="full", capacity=GIB,
                                **{**KW, "optimizer": optimizer}).terms["adapters"]

    assert adapters("adamw") == pytest.approx(n * 16.0)
    assert adapters("adamw8bit") == pytest.approx(n * (8.0 + 2.0 + 8.0 / 256))
