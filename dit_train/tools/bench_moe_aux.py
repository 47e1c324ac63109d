"""Does `model.moe.aux_loss_coef` mean the same on every layout? Ours vs the usual recipes.

    python -m dit_train.tools.bench_moe_aux [overrides ...] [--layouts "1;grad_accum=4;dp=2,grad_accum=2;dp=4"]

One process plays every data-parallel rank and micro-batch of each layout (the real step plan,
packs, model and routing, the same weights), and takes the gradient of the balance loss with
respect to the router weights three ways:

  ours       Σ over all micro-batches and ranks of Σ_t w_t·a_t, w_t the reduction's global
             token weights (dit_train/loss/moe.py); ranks' gradients summed
  per-micro  the common recipe: per micro-batch the mean over its samples of the sample's
             balance term, divided by grad_accum like the main loss; DP ranks' gradients averaged
  no-scaler  the same without the 1/grad_accum ("forgetting the aux scaler")

and prints, per layout, ‖g‖ / ‖g(1 process)‖ and ‖g − g(1 process)‖ / ‖g(1 process)‖. Context
parallelism is not played here (it needs ranks); tests/test_moe.py proves ours under CP.
"""
from __future__ import annotations

import argparse
import sys

import torch

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.data_pipelines.packing import plan_step
from dit_train.engine.build import build_run
from dit_train.kernels import VarlenLayout
from dit_train.loss.moe import local_expert_counts, router_token_losses
from dit_train.models.moe import moe_layers

LAYOUTS = "1;grad_accum=4;dp=2,grad_accum=2;dp=4;micro_batch_tokens=512"
RECIPES = ("ours", "per-micro", "no-scaler")


def parse(spec: str) -> dict[str, int]:
    out = {"dp": 1, "grad_accum": 1, "micro_batch_tokens": 0}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "1":
            continue
        key, _, value = item.partition("=")
        if key not in out:
            raise SystemExit(f"unknown layout key {key!r} in {spec!r}; use dp, grad_accum, micro_batch_tokens")
        out[key] = int(value)
    return out


def router_gradients(run, layout: dict[str, int], step: int) -> dict[str, torch.Tensor]:
    """{recipe: flat gradient of the balance term w.r.t. every router weight} for one step."""
    t = run.cfg.train
    budget = layout["micro_batch_tokens"] or t.micro_batch_tokens
    lengths = dict(enumerate(run.task.lengths()))
    plan = plan_step(step, lengths, t.global_batch, layout["dp"], layout["grad_accum"], budget, t.seed)
    layers = moe_layers(run.model)
    routers = [layer.router.weight for layer in layers]
    grads = {r: torch.zeros(sum(p.numel() for p in routers), dtype=torch.float64) for r in RECIPES}
    num_samples = len(plan.sample_ids)
    for rank_packs in plan.micro_batches:
        for ids in rank_packs:
            if not ids:
                continue
            pack = run.task.build(ids, step)
            run.task.per_token_loss(run.model, pack, VarlenLayout.build(pack.seg, pack.mask_order, pack.causal))
            routings = [layer.routing for layer in layers]
            T = pack.local_counts()  # whole samples: no CP here
            counts = local_expert_counts(routings, pack.seg, pack.valid, pack.num_samples, layers[0].num_experts)
            a, _ = router_token_losses(routings, counts, T, pack.seg, layers[0].top_k)
            per_sample = torch.where(pack.valid, 1.0 / T[pack.seg.clamp(min=0)].float().clamp(min=1), 0.0)
            terms = {
                "ours": (a * per_sample).sum() / num_samples,  # sample_mean: 1/(B_global·T_b)
                "per-micro": (a * per_sample).sum() / pack.num_samples / layout["grad_accum"] / layout["dp"],
                "no-scaler": (a * per_sample).sum() / pack.num_samples / layout["dp"],
            }
            for recipe, loss in terms.items():
                g = torch.autograd.grad(loss, routers, retain_graph=True)
                grads[recipe] += torch.cat([x.reshape(-1) for x in g]).double()
            for layer in layers:
                layer.routing = None
    return grads


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=LAYOUTS, help="';'-separated, each 'dp=..,grad_accum=..,micro_batch_tokens=..'")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    args = ap.parse_args(argv)

    cfg = compose(["model.moe.num_experts=4", *args.overrides])
    if cfg.model.moe.num_experts == 0:
        raise SystemExit("model.moe.num_experts=0: nothing to measure")
    prepare_data(cfg.data, cfg.model)
    run = build_run(cfg)
    specs = [s.strip() for s in args.layouts.split(";") if s.strip()]
    results = {spec: router_gradients(run, parse(spec), args.step) for spec in specs}
    ref = results[specs[0]]
    print(f"balance-loss gradient on the router weights, step {args.step}, global batch {cfg.train.global_batch}; "
          f"relative to the first layout ({specs[0]})")
    print("| layout | " + " | ".join(f"{r} ‖g‖ ratio | {r} rel. diff" for r in RECIPES) + " |")
    print("|---|" + "---|---|" * len(RECIPES))
    for spec, got in results.items():
        cells = []
        for r in RECIPES:
            base = ref[r].norm()
            cells += [f"{float(got[r].norm() / base):.3f}", f"{float((got[r] - ref[r]).norm() / base):.1e}"]
        print(f"| {spec} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
