"""Which way does one Flow-GRPO batch pull the model? (docs/video-rl.md, "Sanity check").

Usage: python benchmarks/grpo_sign_probe.py RUN [BATCHES]  (default 16; ~30 s a batch on one thread)

First the exact gradient of the held-out brightness (24 held-out captions, validation's 20-step
ODE sampler from fixed noise, differentiated through every step). Then BATCHES independent batches
like `tools.video_rl --recipe grpo --reward brightness`'s (4 reward captions x 4 clips, the 10-step
SDE, group advantages); for each, Flow-GRPO's ascent direction trained on every transition but the
last (flow_grpo_steps: what the tool trains) and on every transition (the code before), from the
same rollouts, against the exact gradient:
  cos     the cosine of the two directions in weight space (SGD's step);
  sign    sum_j gradB_j sign(g_j) / sum_j |gradB_j|: the brightness the first AdamW step (lr
          times the gradient's sign) buys, as a share of the most any step of that size could;
  offset  the ascent along the model's output offset (final.linear.bias summed: a brighter x0).
and, for scale, DiffusionNFT's (the tool's nft batch: the ODE sampler's clips of the same captions).
Darkness (advantages negated) flips every figure. Then the mean +- standard error over batches,
and the norm of each transition's part of the gradient (the last one's is the largest)."""
import math
import random
import sys
from pathlib import Path

import torch

from dit_train.checkpoint.export import run_weights
from dit_train.compose import load_config
from dit_train.data_pipelines.synthetic_video import EVAL_SIZE, caption_split
from dit_train.batch import video_forward
from dit_train.kernels import VarlenLayout
from dit_train.models.init import load_full_weights
from dit_train.objectives.flow_matching import velocity_from_output
from dit_train.posttrain import (TrainingSession, VideoDatum, diffusion_nft_loss, flow_grpo_loss, flow_grpo_steps,
                                 group_advantages, transitions)
from dit_train.posttrain.session import apply_overrides
from dit_train.sampling.sampler import VideoSampler
from dit_train.tasks.video import unpatchify
from dit_train.tools.video_rl_rewards import brightness_reward

run = sys.argv[1]
batches = int(sys.argv[2]) if len(sys.argv) > 2 else 16
cfg = apply_overrides(load_config(run), ["optim.name=sgd", "optim.lr=1e-30", "optim.max_grad_norm=0",
                                         "optim.warmup_steps=0", "optim.schedule=constant", "train.ema_decay=0"])
s = TrainingSession(cfg)
load_full_weights(s.model, run_weights(Path(run), None)[0])
params = [p for p in s.model.parameters() if p.requires_grad]
names = [n for n, p in s.model.named_parameters() if p.requires_grad]
at = names.index("final.linear.bias")
offset = slice(sum(p.numel() for p in params[:at]), sum(p.numel() for p in params[:at + 1]))
pool, heldout = caption_split()


def heldout_gradient() -> torch.Tensor:
    """d(mean held-out brightness)/d(weights) through validation's ODE sampler (fixed noise)."""
    caps = heldout[:24]
    requests, space = s._requests(caps, EVAL_SIZE, [90000 + i for i in range(len(caps))])
    task, t = s.task, s.cfg.train
    smp = VideoSampler(requests, task.inputs, space.null, s.ctx, 20, 1.0, t.seed, s.cfg.loss.timestep_shift,
                       s.cfg.loss.shift_reference_tokens)
    prediction, x0_min_t = task.inputs.prediction, task.inputs.x0_min_t
    xs, guided, ctxs = smp._start()
    assert not guided
    sig = smp.schedulers()[0].sigmas.tolist()
    ends = [0] + torch.tensor([math.prod(smp._grid(x.shape)) for x in xs]).cumsum(0).tolist()
    s.model.eval()
    for i in range(len(sig) - 1):
        b = smp._pack(xs, [sig[i]] * len(xs), ctxs, [None] * len(xs), [None] * len(xs))
        out = video_forward(s.model, b, VarlenLayout.build(b.seg, b.order, False)).float()
        v = velocity_from_output(out, b.tokens["x"], b.samples["t"][b.seg], prediction, x0_min_t)
        xs = [x + (sig[i + 1] - sig[i]) * unpatchify(v[ends[k]:ends[k + 1]], smp._grid(x.shape), smp.patch, x.shape[0])
              for k, x in enumerate(xs)]
    s.model.train()
    bright = sum((x.clamp(-1, 1).mean() + 1) / 2 for x in xs) / len(xs)
    print(f"held-out brightness (ODE, 24 captions): {float(bright.detach()):.4f}", flush=True)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(bright, params)])


gB = heldout_gradient()
rng = random.Random(4)
rows, norms = [], None
for b in range(batches):
    caps = [c for c in rng.sample(pool, 4) for _ in range(4)]
    ids = [80000 + 100 * b + i for i in range(16)]  # the SDE rollouts' and nft's ODE clips' starting noise
    rs = s.sample_videos(caps, EVAL_SIZE, noise_ids=ids, steps=10, sde=True, guidance_scale=1.0)
    adv = group_advantages(brightness_reward([r.clip for r in rs], caps), 4)
    parts = []
    for k in range(len(rs[0].log_probs)):  # one transition at a time: its part of the gradient
        s.forward_backward([t for r, a in zip(rs, adv) if a != 0 for t in transitions(r, a, [k])], flow_grpo_loss())
        parts.append(torch.cat([-p.grad.reshape(-1) for p in params]))
        s.optim_step("num_sequences")  # lr 1e-30: clears the gradient
    part_norms = torch.stack([p.norm() for p in parts])
    norms = part_norms if norms is None else norms + part_norms
    fixed = sum(parts[k] for k in flow_grpo_steps(rs[0]))
    clips = [r.clip.clamp(-1, 1) for r in s.sample_videos(caps, EVAL_SIZE, noise_ids=ids, steps=10, guidance_scale=1.0)]
    nft_adv = group_advantages(brightness_reward(clips, caps), 4)
    s.forward_backward([VideoDatum(pixels=c, caption=p, noise_key=i, advantages=a)
                        for i, (c, p, a) in enumerate(zip(clips, caps, nft_adv)) if a != 0], diffusion_nft_loss())
    nft = torch.cat([-p.grad.reshape(-1) for p in params])
    s.optim_step("num_loss_tokens")
    row = []
    for g in (fixed, sum(parts), nft):
        row += [float(g @ gB / (g.norm() * gB.norm())), float((gB * torch.sign(g)).sum() / gB.abs().sum()),
                float(g[offset].sum() / len(parts) / len(rs))]
    rows.append(row)
    print(f"batch {b}: grpo without the last transition cos {row[0]:+.4f} sign {row[1]:+.4f} offset {row[2]:+.4f} | "
          f"every transition cos {row[3]:+.4f} sign {row[4]:+.4f} offset {row[5]:+.4f} | nft cos {row[6]:+.4f} "
          f"sign {row[7]:+.4f}", flush=True)
R = torch.tensor(rows)
mean, se = R.mean(0), R.std(0) / len(rows) ** 0.5
for j, name in enumerate(("cos", "sign", "offset")):
    cells = [f"{what} {mean[i + j]:+.4f} +- {se[i + j]:.4f} ({int((R[:, i + j] > 0).sum())}/{len(rows)} > 0)"
             for i, what in ((0, "grpo without the last"), (3, "every transition"), (6, "nft"))]
    print(f"{name:6s}: " + ";  ".join(cells))
print("mean norm of each transition's part:", " ".join(f"{x:.3f}" for x in (norms / batches).tolist()))
