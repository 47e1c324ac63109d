"""Measure the mistake that conditioned training avoids: context tokens counted in T_b.

Trains your conditioned config for --steps steps on one process twice — as dit_train trains it
(context tokens weigh 0 and stay out of T_b) and with every token of a sample, context included,
counted in T_b (the sample's weights then shrink by T_b / (T_b + C_b)) — and prints how far the
second run's weights end from the first, relative to the update (`max |w' − w| / max |w − w0|`,
the measure of `verify_layouts`, EMA weights included):

    python -m dit_train.tools.context_shift --steps 100 +experiment=shapes_i2v

Everything after `--` (or any bare key=value) is a Hydra override of the training config. The
wrong count replaces `PackedBatch.local_weights` (the per-sample Σ w that the metadata sync sums
into T_b) for the second run only; nothing else differs (docs/conditioning.md).
"""
from __future__ import annotations

import argparse
import sys
from unittest import mock

import torch

from dit_train.batch import WEIGHT_ONE, PackedBatch
from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.engine.layout_equivalence import relative_difference, train_weights
from dit_train.tasks import check_data, resolve_config
from dit_train.tools.args import POSITIVE_INT, ToolParser


def counting_context(self: PackedBatch) -> torch.Tensor:
    """[S] int64 every token of each sample as one unit of weight, context included: the T_b the
    contract forbids (a stand-in for `PackedBatch.local_weights`)."""
    keep = self.seg >= 0
    return torch.bincount(self.seg[keep], minlength=self.num_samples)[: self.num_samples] * WEIGHT_ONE


def context_shift(cfg) -> float:
    """Relative weight difference after cfg.train.steps between the run as trained and the run
    with context counted in T_b (one process each)."""
    right = train_weights([cfg])[0]
    with mock.patch.object(PackedBatch, "local_weights", counting_context):
        wrong = train_weights([cfg])[0]
    return relative_difference(right, wrong)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    ap = ToolParser(prog="python -m dit_train.tools.context_shift", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=POSITIVE_INT, default=100)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (key=value), also accepted after `--`")
    args = ap.parse_args(argv)
    cfg = compose([f"train.steps={args.steps}", "train.progress=false", *args.overrides, *overrides])
    if not cfg.cond.timestep_feed:
        print(f"error: cond.kind={cfg.cond.kind} cond.feed={cfg.cond.feed} has no context tokens to count: set "
              "cond.kind=first_frame|first_last|prefix with cond.feed=timestep (e.g. +experiment=shapes_i2v)",
              file=sys.stderr)
        return 2
    prepare_data(cfg.data, cfg.model)
    cfg = resolve_config(cfg, check_data(cfg))
    shift = context_shift(cfg)
    print(f"context counted in T_b: weights after {args.steps} steps differ by {shift:.3f} of the update "
          f"(max |w' - w| / max |w - w0|, cond.kind={cfg.cond.kind}, loss.reduction={cfg.loss.reduction})")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
