"""The layout tests' one fixture and one comparison (tests/test_layouts.py, test_moe.py,
test_conditioning.py, test_masks_control.py): a case is a config, a layout and a reduction; its
one-process oracle and its layout run are trained in one launch per world size for all the
cases of a file (spawning costs more than these tiny runs), cases of the same config and
reduction sharing one oracle run; `assert_exact` is the comparison every case passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dit_train.engine.layout_equivalence import apply_layout, parse_layout, relative_difference, train_on_workers

TOL = 1e-4  # weights (and EMA weights): max |Δ| relative to the largest update of the oracle
NORMS_TOL = 1e-5  # per-step gradient norms (before clipping), relative to the largest


@dataclass(frozen=True)
class Case:
    """`cfg` on one process (the oracle) and on `layout` ('dp_shard=2,cp_ring=2', …), with
    `reduction` (None: the config's). `change`: applied to the layout run's config only (a
    setting that must not change the result, e.g. full activation checkpointing)."""

    cfg: Any
    layout: str
    reduction: str | None = None
    change: Callable[[Any], None] | None = None

    def oracle_cfg(self) -> Any:
        return apply_layout(self.cfg, {}, self.reduction)

    def layout_cfg(self) -> Any:
        cfg = apply_layout(self.cfg, parse_layout(self.layout), self.reduction)
        if self.change is not None:
            self.change(cfg)
        return cfg


Result = dict[str, torch.Tensor]


def run_cases(cases: dict[str, Case]) -> dict[str, tuple[Result, Result]]:
    """{name: (oracle result, layout result)} for every case: train_weights' results (weights,
    initial weights, EMA weights, gradient norms), one launch per world size."""
    jobs, oracle_of, layout_of = [], {}, {}
    for name, case in cases.items():
        key = (id(case.cfg), case.reduction)
        if key not in oracle_of:
            oracle_of[key] = len(jobs)
            jobs.append(case.oracle_cfg())
    for name, case in cases.items():
        layout_of[name] = len(jobs)
        jobs.append(case.layout_cfg())
    results = train_on_workers(jobs)
    return {name: (results[oracle_of[(id(c.cfg), c.reduction)]], results[layout_of[name]]) for name, c in cases.items()}


def assert_exact(oracle: Result, got: Result, label: str, tol: float = TOL, norms: bool = True) -> None:
    """The layout run equals the oracle: weights and EMA weights within `tol` of the update
    (relative_difference), and, with `norms`, the gradient norm of every step within NORMS_TOL."""
    rel = relative_difference(oracle, got)
    assert rel <= tol, f"{label}: weights differ by {rel:.2e} of the update"
    if norms:
        want, have = oracle["__grad_norms__"], got["__grad_norms__"]
        assert (have - want).abs().max() <= NORMS_TOL * want.abs().max(), (label, have, want)


def assert_distill_adapters_match(one: dict, got: dict, label: str) -> None:
    """A LoRA distillation run (DMD2, Self-Forcing) against its one-process run: the student's
    (`.default.`) and the critic's (`.critic.`) adapters each moved and each within TOL."""
    assert got.keys() == one.keys() and any(".lora_A.critic." in k for k in one)
    for who in ("student", "critic"):
        adapter = ".default." if who == "student" else ".critic."
        mine = {k: v for k, v in one.items() if k.startswith(who) and adapter in k}
        assert mine and max(float(v.abs().max()) for k, v in mine.items() if ".lora_B." in k) > 0  # it trained
        rel = max(float((one[k] - got[k]).abs().max()) for k in mine) / max(float(v.abs().max()) for v in mine.values())
        assert rel <= TOL, f"{label} LoRA {who}: the {adapter} adapter differs from the one-process run by {rel:.2e}"
