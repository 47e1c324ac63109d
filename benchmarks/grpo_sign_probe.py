"""Does one Flow-GRPO step move the brightness of samples toward the reward? (docs/video-rl.md,
"Sanity check"). Usage: python benchmarks/grpo_sign_probe.py RUN FLIP LR  -- FLIP 1 rewards
brightness, -1 darkness (the advantages negated); SGD at LR, three steps on 16 rollouts (2
captions x 8), each followed by the mean brightness of 16 fixed-noise ODE and SDE samples."""
import sys
from pathlib import Path

from dit_train.compose import load_config
from dit_train.posttrain import TrainingSession, transitions, flow_grpo_loss, group_advantages
from dit_train.posttrain.session import apply_overrides
from dit_train.models.init import load_full_weights
from dit_train.checkpoint.export import run_weights
from dit_train.tools.video_rl_rewards import brightness_reward

run = sys.argv[1]; flip = float(sys.argv[2]); lr = sys.argv[3]
cfg = apply_overrides(load_config(run), ["optim.name=sgd", f"optim.lr={lr}", "optim.max_grad_norm=0",
      "optim.warmup_steps=0", "optim.schedule=constant", "train.ema_decay=0"])
s = TrainingSession(cfg)
load_full_weights(s.model, run_weights(Path(run), None)[0])
caps = ["a red circle moving up and left on a gray background"] * 8 + ["a blue square moving down and right on a navy background"] * 8
ids = list(range(16))
def bright(rs):
    return brightness_reward([r.clip for r in rs], [r.caption for r in rs])

for it in range(3):
    rs = s.sample_videos(caps, (8, 32, 32), noise_ids=[100 * it + i for i in ids], steps=10, sde=True, guidance_scale=1.0)
    rew = bright(rs)
    adv = [flip * a for a in group_advantages(rew, 8)]
    batch = [t for r, a in zip(rs, adv) for t in transitions(r, a)]
    s.forward_backward(batch, flow_grpo_loss())
    st = s.optim_step("num_sequences")
    ode = bright(s.sample_videos(caps, (8, 32, 32), noise_ids=[1000 + i for i in ids], steps=20))
    sde = bright(s.sample_videos(caps, (8, 32, 32), noise_ids=[1000 + i for i in ids], steps=10, sde=True, guidance_scale=1.0))
    print(f"flip {flip} it {it}: rollout {sum(rew)/16:.4f}  ode-eval {sum(ode)/16:.4f}  sde-eval {sum(sde)/16:.4f} gn {st['grad_norm']:.3f}", flush=True)
