"""Activation accounting, side by side: bytes one transformer block keeps for backward, per
token, for our packed DiT and for diffusers' WanTransformer3DModel at equal shapes, fp32 and
bf16 autocast, without and with activation checkpointing (full, selective); then what one
block of each saves, tensor by tensor.

    python -m dit_train.tools.bench_activations [--shapes wan_1_3b,wan_14b] [--frames 8 --height 16 --width 16]
        [--list] [--cost] [--quick] [--out FILE]

Equal shapes (each preset is a Wan config with width and FFN divided by the same factor and
the head width kept at 128): the same width d, heads, FFN width (our MLP hidden = Wan's
ffn_dim), caption cross-attention in both (caption width and length equal), patch (1, 2, 2),
16 latent channels, one clip of frames x height x width latents (Wan runs it as a batch of
one; ours as a pack of one sample). Our DiT's adaLN is per block, Wan's a shared table: their
parameter counts differ, their activation shapes do not.

Measurement (dit_train/perf/saved.py, CPU): storages a forward creates that are still alive
when it returns (what backward will read), at depth 2 minus depth 1 — one block, whatever lies
outside cancels — per token. Sees tensors saved by autograd, the inputs a checkpoint keeps and
the matmul outputs a selective-checkpoint policy caches. Autocast's bf16 weight copies are
per parameter and reported apart. CUDA autocast keeps LayerNorm outputs in fp32 where CPU
autocast does not: the bf16 rows are CPU-autocast figures. `ours (prologues off)` is our block
with `model.recompute_prologues=false` (models/recompute.py): the norms, modulate, GELU and
gated residual saved instead of recomputed in backward.

`--cost`: the compute price of each policy, of activation offload and of each
model.recompute_prologues setting, measured in one interleaved run of real training steps
(see `cost_rows`).
"""
from __future__ import annotations

import argparse

import torch

from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
from dit_train.engine.build import build_run
from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, init_weights, model_config, model_spec
from dit_train.perf.bench import format_table, interleaved_wall_and_cpu, median, write_json
from dit_train.perf.saved import bytes_per_token_per_block, saved_tensor_table
from dit_train.tasks.video import patchify

C = 16
PATCH = (1, 2, 2)
# (dim, heads, ffn_dim, text_dim) of diffusers' Wan2.1 T2V configs, scaled by `factor` (head width 128 kept)
PRESETS = {
    "wan_1_3b": dict(dim=1536, heads=12, ffn=8960, factor=4),
    "wan_14b": dict(dim=5120, heads=40, ffn=13824, factor=8),
}


def shape_of(preset: str, text_len: int) -> dict:
    p = PRESETS[preset]
    f = p["factor"]
    return dict(name=preset, dim=p["dim"] // f, heads=p["heads"] // f, ffn=p["ffn"] // f, text_dim=256,
                text_len=text_len, scale=f"1/{f}")


def ours_cfg(s: dict, depth: int, prologues: bool = True):
    cfg = model_config("dit", dim=s["dim"], depth=depth, heads=s["heads"], mlp_ratio=(s["ffn"] + 0.5) / s["dim"],
                       patch_size=list(PATCH), in_channels=C, text_dim=s["text_dim"], text_len=s["text_len"], init="normal",
                       recompute_prologues=prologues)
    assert model_spec(cfg).hidden(cfg) == s["ffn"]
    return cfg


def ours_model(s: dict, depth: int, prologues: bool = True):
    m = build_model(ours_cfg(s, depth, prologues), "sdpa")
    init_weights(m, 0, "normal")
    return m


def wan_model(s: dict, depth: int):
    from diffusers import WanTransformer3DModel  # deferred: diffusers takes ~2 s to import; only the Wan rows need it

    torch.manual_seed(0)
    return WanTransformer3DModel(num_attention_heads=s["heads"], attention_head_dim=s["dim"] // s["heads"], in_channels=C,
                                 out_channels=C, text_dim=s["text_dim"], freq_dim=256, ffn_dim=s["ffn"], num_layers=depth,
                                 cross_attn_norm=True, eps=1e-6)


def inputs(s: dict, clip: tuple[int, int, int], seed: int = 0) -> dict:
    """One latent clip [C, F, H, W] and its caption, in both models' formats."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(C, *clip, generator=g)
    ctx = torch.randn(1, s["text_len"], s["text_dim"], generator=g)
    t = torch.rand(1, generator=g)
    tok, grid = patchify(lat, PATCH)
    seg = torch.zeros(tok.shape[0], dtype=torch.long)
    order = torch.arange(tok.shape[0])
    ours = (tok, grid, seg, t, VarlenLayout.build(seg, order, False), ctx, torch.tensor([s["text_len"]]))
    wan = dict(hidden_states=lat[None], timestep=t * 1000, encoder_hidden_states=ctx, return_dict=False)
    return {"ours": ours, "wan": wan, "tokens": tok.shape[0]}


def accounting_rows(shapes: list[dict], clip: tuple[int, int, int], precisions: list[str], policies: list[str]) -> list[dict]:
    rows = []
    for s in shapes:
        x = inputs(s, clip)
        n = x["tokens"]
        models = {  # name -> (build(depth), forward(model), measured under checkpointing too)
            "ours (prologues on)": (lambda depth: ours_model(s, depth), lambda m: m(*x["ours"]), True),
            "ours (prologues off)": (lambda depth: ours_model(s, depth, False), lambda m: m(*x["ours"]), False),
            "wan (diffusers)": (lambda depth: wan_model(s, depth), lambda m: m(**x["wan"])[0], True),
        }
        for precision in precisions:
            for policy in policies:
                got = {name: bytes_per_token_per_block(build, fwd, n, precision, policy)
                       for name, (build, fwd, with_ac) in models.items() if with_ac or policy == "none"}
                wan = got["wan (diffusers)"]["bytes_per_token"]
                for name, r in got.items():
                    b = r["bytes_per_token"]
                    rows.append({"shape": s["name"], "d": s["dim"], "heads": s["heads"], "ffn": s["ffn"], "tokens": n,
                                 "precision": precision, "ac": policy, "model": name, "bytes_per_token_block": b,
                                 "d_elems_fp32": b / (4 * s["dim"]), "vs_wan": b / wan})
    return rows


def block_tables(s: dict, clip: tuple[int, int, int]) -> dict[str, list[dict]]:
    """Every tensor one block saves (fp32): ours (both model.recompute_prologues settings) and
    Wan's, by the op that saved it."""
    x = inputs(s, clip)
    out = {}
    ours = lambda m: m(*x["ours"])  # noqa: E731
    for name, build, call in (("ours (prologues on)", lambda s, d: ours_model(s, d, True), ours),
                              ("ours (prologues off)", lambda s, d: ours_model(s, d, False), ours),
                              ("wan", wan_model, lambda m: m(**x["wan"])[0])):
        model = build(s, 1)
        cap = {}

        def grab(mod, args, kwargs):
            cap["args"], cap["kwargs"] = args, kwargs

        h = model.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        with torch.no_grad():
            call(model)
        h.remove()
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in cap["args"])
        y = model.blocks[0](*args, **cap["kwargs"])
        rows = saved_tensor_table(y, exclude=list(model.blocks[0].parameters()))
        out[name] = [r.row(x["tokens"], s["dim"]) for r in rows]
    return out


COST_VARIANTS = {  # name -> config overrides of the timed step
    "none": [],
    "prologues on": ["model.recompute_prologues=true"],
    "prologues off": ["model.recompute_prologues=false"],
    "selective": ["model.activation_checkpointing=selective"],
    "selective every 2": ["model.activation_checkpointing=selective", "model.ac_every=2"],
    "full": ["model.activation_checkpointing=full"],
    "activation offload": ["train.activation_offload=true"],
}


def cost_rows(reps: int, quick: bool) -> list[dict]:
    """Step cost of each AC policy, of activation offload and of each model.recompute_prologues
    setting ("none" is the configured default): real optimizer steps (forward,
    backward, AdamW) of one process on the embedded clips, every variant built once and timed
    round-robin (perf/bench.interleaved_wall_and_cpu), CPU seconds of this process (far less
    sensitive to other processes on a shared machine than wall time; one intra-op thread, since
    spinning OpenMP threads on a busy machine bill CPU time they do not compute with). On a CPU run the offload
    copy stays in host memory: the row is the price of the hooks and copies, not of PCIe."""
    base = ["model.dim=256", "model.depth=4", "model.heads=2", "parallel.threads_per_worker=1", "optim=adamw", "train.steps=1000",
            "train.global_batch=2", "train.micro_batch_tokens=0", "train.progress=false", "train.sample_every=0",
            "data.num_clips=8", "data.max_frames=" + ("4" if quick else "8")]
    runs, step = {}, {}
    for name, extra in COST_VARIANTS.items():
        cfg = compose(base + extra)
        prepare_data(cfg.data, cfg.model)
        runs[name] = build_run(cfg)
        step[name] = 0

    def one(name):
        def run():
            runs[name].trainer.step(step[name])
            step[name] += 1
        return run

    wall, cpu = interleaved_wall_and_cpu({k: one(k) for k in runs}, reps=reps, warmup=1)
    ref_c, ref_w = median(cpu["none"]), median(wall["none"])
    return [{"variant": k, "cpu_s_per_step": median(cpu[k]), "cpu_vs_none": median(cpu[k]) / ref_c,
             "wall_s_per_step": median(wall[k]), "wall_vs_none": median(wall[k]) / ref_w} for k in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dit_train.tools.bench_activations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="wan_1_3b,wan_14b", help=f"comma list of {', '.join(PRESETS)}")
    ap.add_argument("--frames", type=int, default=8, help="latent frames of the clip")
    ap.add_argument("--height", type=int, default=16, help="latent height")
    ap.add_argument("--width", type=int, default=16, help="latent width")
    ap.add_argument("--text-len", type=int, default=32, help="caption tokens (both models)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--policies", default="none,full,selective")
    ap.add_argument("--list", action="store_true", help="print every tensor one block saves (fp32, first shape)")
    ap.add_argument("--cost", action="store_true", help="also measure the step cost of each AC policy and offload")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of the --cost steps")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.quick:
        a.frames, a.height, a.width, a.text_len, a.reps = 2, 8, 8, 8, 2
    shapes = [shape_of(p, a.text_len) for p in a.shapes.split(",")]
    clip = (a.frames, a.height, a.width)
    rows = accounting_rows(shapes, clip, a.precisions.split(","), a.policies.split(","))
    print(f"bytes kept for backward per token per block (CPU; one clip of {clip} latents; captions of {a.text_len} tokens)")
    print(format_table(rows))
    none = [r for r in rows if r["ac"] == "none" and r["model"].startswith("ours")]
    for r in none:
        print(f"{r['shape']} {r['precision']}: {r['model']} / Wan = {r['vs_wan']:.3f} "
              f"(target <= 0.6: {'met' if r['vs_wan'] <= 0.6 else 'NOT met'})")
    payload = {"args": vars(a), "shapes": shapes, "rows": rows}
    if a.list:
        tables = block_tables(shapes[0], clip)
        for name, t in tables.items():
            print(f"\nsaved by one {name} block (fp32, {shapes[0]['name']} shape):")
            print(format_table(t))
        payload["saved_tensors"] = tables
    if a.cost:
        cost = cost_rows(a.reps, a.quick)
        print("\nstep cost of activation checkpointing and offload (one interleaved run):")
        print(format_table(cost))
        payload["cost"] = cost
    p = write_json(a.out, "activations", payload)
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
