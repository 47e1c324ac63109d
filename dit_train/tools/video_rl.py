"""Post-train a trained video run with rewards: DiffusionNFT, Flow-GRPO or Diffusion-DPO through
the session API (docs/video-rl.md).

    python -m dit_train.tools.video_rl RUN --recipe nft --steps 40 --out DIR
    python -m dit_train.tools.video_rl RUN --recipe grpo --steps 20 --out DIR parallel.dp_shard=2
    python -m dit_train.tools.video_rl RUN --recipe dpo --reward my_rewards:score --out DIR

RUN: a training run's folder (config.yaml and weights: the EMA weights when it has them, which
are what its validation scored). Each step samples --captions captions × --group clips from the
reward captions (every caption of the shapes world but the 48 held-out ones; --rollout-captions
heldout: the 48 held-out compositions themselves, which no clip shows — taught by the reward
alone, evaluated on other noise), scores them with the reward, and takes one optimizer step on them:
  nft:  validation's ODE sampler (with guidance); group-normalized advantages; diffusion_nft_loss,
        normalized by num_loss_tokens;
  grpo: Flow-GRPO's SDE sampler without guidance; the transitions of every clip but its last
        (flow_grpo_steps, as Flow-GRPO trains); flow_grpo_loss (+ KL to the initial weights with
        --kl), normalized by num_sequences (transitions);
  dpo:  the best and the worst clip of each group as (chosen, rejected) when their rewards
        differ; the initial weights' errors as the reference; normalized by num_sequences (pairs);
  raft: reward-filtered flow matching (rejection sampling): validation's ODE sampler (with
        guidance); the clips whose reward is >= --keep-min (default 5.5: exactly the all_ok clips
        under the shapes reward) join a buffer, and --updates optimizer steps a step train
        sft_loss(agg="sequence") on --raft-batch clips drawn from it, normalized by
        num_sequences (the mean over clips of their token means). No negative push: nothing
        is trained away from, so the model cannot collapse by avoiding failures.
        --raft-select best keeps only each caption's best clip (if >= --keep-min);
        --raft-min-buffer N waits for N accepted clips before the first optimizer step;
  sft:  the baseline, not a recipe: no rollouts, no reward; --updates optimizer steps a step of
        sft_loss(agg="sequence") on --raft-batch clips of the run's own training data.
--rollout-guidance sets the ODE rollouts' guidance (default: train.guidance_scale, as evaluated);
--max-cpu-s stops once the process has used that many CPU seconds (start-up included), then
evaluates. --old-decay D (nft): DiffusionNFT's old policy, an EMA of the weights that samples the
rollouts and gives the loss its v_old (its proximal term; 0 = on-policy).
The reward: the exact shapes metric, a smooth sum of its per-clip figures (palette_share +
background_ok + color_ok + shape_ok + single_shape + motion_ok + all_ok; --reward shapes, the
default), --reward shapes_graded (the same with shape_ok graded by the blob's fill), --reward shape
(that graded figure alone), --reward brightness (the mean brightness of the clip, 0 .. 1: the
sanity check every recipe must raise fast), or --reward module:function taking (clips [3, F, H, W] in [-1, 1],
captions) and returning one finite float per clip. Every --eval-every steps (and at 0 and the end) the 48 held-out captions are sampled
like validation samples and scored: DIR/heldout.jsonl, DIR/heldout_step_XXXX.png.
--out is a new or empty folder, never RUN nor a folder holding it: one that is not empty is
refused unless --overwrite (its contents move to DIR/overwritten_<time>/) or --resume. Ctrl-C or
SIGTERM stops after the step's update (a second one at once) and keeps the steps done: weights,
config, DIR/video_rl.json and a checkpoint (also at the end and every --ckpt-every steps; runs of
several processes keep only those); --resume continues from it, with the same flags, to the same
weights as a run never stopped (video_rl_state.py).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from PIL import Image

from dit_train.compose import load_config
from dit_train.config.errors import CheckpointError, ConfigError
from dit_train.data_pipelines import prepare_data
from dit_train.data_pipelines.shapes_metric import score_clips
from dit_train.data_pipelines.synthetic_video import EVAL_SIZE, caption_split
from dit_train.engine.launch import check_interrupted, interrupt_on_signals, interruption, launch, signals_deferred
from dit_train.models.init import load_full_weights
from dit_train.posttrain import TrainingSession
from dit_train.posttrain.rollouts import broadcast_from_rank0
from dit_train.posttrain.session import apply_overrides
from dit_train.sampling import frame_grid
from dit_train.checkpoint.export import run_weights
from dit_train.tools.video_rl_recipes import RECIPES, RaftBuffer, StepInputs, accepted, data_clips  # noqa: F401 (accepted: API)
from dit_train.tools.video_rl_rewards import checked_rewards, load_reward, shapes_reward, with_timeout  # noqa: F401 (shapes_reward: API)
from dit_train.tools.video_rl_state import (PROGRESS, Progress, check_out, check_source_weights, keep_data_record,
                                            read_progress, restore_state, save_state, source_weights, trajectory, write_progress)

def evaluate(session, captions: list[str], out_dir: Path, step: int, reward: Callable | None = None) -> dict[str, float]:
    """The held-out figures: one clip per caption, validation's sampler, the exact metric (rank 0
    writes), and `reward`'s mean on the same clips ("reward_heldout": the reward on fixed prompts and
    noise, so its curve shows the policy, not which captions a step happened to draw)."""
    rollouts = session.sample_videos(captions, EVAL_SIZE, noise_ids=range(10 ** 6, 10 ** 6 + len(captions)))
    clips = [r.clip.clamp(-1, 1) for r in rollouts]
    scores = {k.removeprefix("eval/"): v for k, v in score_clips(clips, captions).items()}
    if reward is not None:
        scores["reward_heldout"] = sum(reward(clips, captions)) / len(clips)
    if session.ctx.is_main:
        grid = frame_grid([((c + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy() for c in clips[:16]],
                          captions[:16])
        Image.fromarray(grid).save(out_dir / f"heldout_step_{step:04d}.png")
    return scores


def logged_steps(log: Path) -> set[int]:
    """The steps heldout.jsonl has figures for."""
    if not log.is_file():
        return set()
    return {json.loads(line)["step"] for line in log.read_text().splitlines() if line.strip()}


def train(cfg, run: str, recipe: str, steps: int, out: str, reward: str, captions: int, group: int,
          eval_every: int, sample_steps: int, kl: float, max_minutes: float = 0.0, initial_eval: bool = True,
          keep_min: float = 5.5, updates: int = 1, raft_batch: int = 8, select: str = "all", min_buffer: int = 1,
          rollout_guidance: float | None = None, max_cpu_s: float = 0.0, ckpt_every: int = 0,
          resume: dict | None = None, settings: dict | None = None, reward_timeout_s: float = 0.0,
          rollout_captions: str = "reward") -> None:
    """The post-training loop (every rank). resume: the loop state `check_out` read from --out's
    checkpoint (--resume); settings: what each checkpoint records of the flags (video_rl_state)."""
    how = RECIPES[recipe]
    session = TrainingSession(cfg)
    weights, which = run_weights(Path(run), None)
    load_full_weights(session.model, weights)
    if session.run.ema is not None:  # the old policy (--old-decay) starts at the loaded weights
        session.run.ema.missing_from_checkpoint()
    reference = None
    if how.reference or kl:
        reference = TrainingSession(cfg, ctx=session.ctx)  # the initial weights, frozen
        load_full_weights(reference.model, weights)
    main = session.ctx.is_main
    say = (lambda s: print(s, flush=True)) if main else (lambda s: None)
    fn, name = load_reward(reward or "shapes"), reward or "shapes"
    fn = with_timeout(fn, reward_timeout_s, f"--reward {name}")
    pool, heldout = caption_split()
    if rollout_captions == "heldout":  # the evaluation's captions, on the rollouts' own noise ids
        pool = list(heldout)
    out_dir = Path(out)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "heldout.jsonl"
    say(f"{recipe}: from {run} ({which}); {captions} captions x {group} clips a step from the {rollout_captions} "
        f"captions ({len(pool)}), reward {name}")
    rng = random.Random(0)  # the same on every rank
    buffer = RaftBuffer()
    data = data_clips(session.cfg) if not how.rollouts else None
    start = restore_state(session, resume, rng, buffer, data) if resume else 0
    if resume:
        say(f"resumed from {resume['checkpoint']}: {start} of {steps} steps done")
    t0, cpu0 = time.time(), time.process_time()

    # --old-decay: the old policy is the session's EMA of the weights (DiffusionNFT's): it samples
    # the rollouts, gives the update its v_old, and is what --out's weights_ema.safetensors holds
    # (what tools.sample / tools.evaluate read first), so the held-out figures are its too
    keeps_old = how.old_policy and session.run.ema is not None
    old_policy = session.run.ema.swapped_in if keeps_old else contextlib.nullcontext

    def record(step: int, extra: dict) -> None:
        with old_policy():
            scores = evaluate(session, heldout, out_dir, step, functools.partial(checked_rewards, fn, name))
        row = {"step": step, "wall_s": round(time.time() - t0, 1), "cpu_s_rank0": round(time.process_time() - cpu0, 1),
               "cpu_s_process": round(time.process_time(), 1),
               **{k: round(v, 4) for k, v in scores.items()}, **extra}
        say(f"step {step}: held-out all_ok={scores['all_ok']:.3f} color_ok={scores['color_ok']:.3f} "
            f"shape_ok={scores['shape_ok']:.3f} motion_ok={scores.get('motion_ok', float('nan')):.3f} "
            f"background_ok={scores['background_ok']:.3f} reward={scores['reward_heldout']:.3f} "
            f"({row['wall_s']} s, {row['cpu_s_process']} CPU s)")
        if main:
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def keep(snap: Progress, status: str, **extra) -> None:
        """Save the state at `snap` (every rank) and say where it is in video_rl.json."""
        ckpt = save_state(session, out_dir, snap, {**(settings or {}), "source": str(Path(run).resolve())})
        if main:
            write_progress(out_dir, {"status": status, "step": snap.step, "steps": steps, "source": str(run),
                                     "recipe": recipe, "checkpoint": str(ckpt), **extra})

    # the state a stop keeps: the last step boundary (a step cut short is taken again on --resume)
    snap, updating = Progress.capture(start, session, rng, buffer, data), False
    try:
        # held-out figures of the starting point (again on --resume if a stop came before they were
        # written); rank 0's file decides for every rank (the evaluation holds collectives)
        if eval_every and (initial_eval if start == 0 else start % eval_every == 0 and broadcast_from_rank0(
                start not in logged_steps(log), session.ctx.world_group, main)):
            record(start, {})
        sde = how.sde
        for step in range(start, steps):
            check_interrupted()  # a signal whose exception a finalizer swallowed stops here, between steps
            rollouts, rewards = None, [0.0]
            if how.rollouts:
                caps = [c for c in rng.sample(pool, captions) for _ in range(group)]
                ids = [step * 10 ** 4 + i for i in range(len(caps))]
                with old_policy():
                    rollouts = session.sample_videos(caps, EVAL_SIZE, noise_ids=ids, steps=sample_steps, sde=sde,
                                                     guidance_scale=1.0 if sde else rollout_guidance)
                rewards = checked_rewards(fn, name, [r.clip.clamp(-1, 1) for r in rollouts], caps)
            updating = True
            with signals_deferred():  # an update is never cut in half: a Ctrl-C / SIGTERM in it stops after it
                stats, n, extra_raft = how.update(StepInputs(session, reference, rollouts, rewards, group, step, kl, buffer,
                                                             data, keep_min, select, updates, min_buffer, raft_batch))
                snap, updating = Progress.capture(step + 1, session, rng, buffer, data), False
            extra = {"reward": round(sum(rewards) / len(rewards), 4), "datums": n,
                     "grad_norm": round(stats.get("grad_norm", 0.0), 4), **extra_raft}
            say(f"step {step + 1}/{steps}: reward {extra['reward']:.3f}, {n} datums, {time.process_time():.0f} CPU s, "
                f"loss {stats.get('loss', 0.0):.4f}, grad_norm {extra['grad_norm']:.3f}"
                + (f", accepted {extra_raft['accepted']} (buffer {extra_raft['buffer']})" if extra_raft else ""))
            # every rank decides on rank 0's clock (the same decision everywhere: the loop holds collectives)
            late = broadcast_from_rank0((bool(max_minutes) and time.time() - t0 > 60 * max_minutes)
                                        or (bool(max_cpu_s) and time.process_time() > max_cpu_s),
                                        session.ctx.world_group, main)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps or late):
                record(step + 1, extra)
            if late:
                say(f"stopping after step {step + 1}: --max-minutes {max_minutes} / --max-cpu-s {max_cpu_s} reached")
                break
            if ckpt_every and (step + 1) % ckpt_every == 0 and step + 1 < steps:
                keep(snap, "running")
    except (Exception, KeyboardInterrupt) as err:
        # one process keeps what it did (several would need every rank at one point: they keep their
        # newest --ckpt-every checkpoint); not a step's update cut in half by a second signal
        if session.ctx.world_group is None and not updating and snap.step > start:
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            how = interruption(err)[0] if isinstance(err, KeyboardInterrupt) else f"{type(err).__name__}: {err}"
            try:
                keep(snap, status, stopped=how)
            except Exception as failed:  # noqa: BLE001 - the first error is the one to report
                say(f"could not save the progress after step {snap.step}: {failed}")
        raise
    keep(snap, "completed" if snap.step >= steps else "stopped", **({} if snap.step >= steps else {
        "stopped": f"--max-minutes {max_minutes} / --max-cpu-s {max_cpu_s}"}))
    say(f"wrote {out_dir / 'weights.safetensors'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a trained run's folder (config.yaml + weights)")
    ap.add_argument("--recipe", choices=tuple(RECIPES), default="nft",
                    help="sft: the baseline, plain flow matching on the run's own clips (no reward)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True, help="write weights.safetensors, heldout.jsonl and grids here (a new or "
                                                 "empty folder, never the run itself)")
    ap.add_argument("--overwrite", action="store_true",
                    help="--out is not empty: start over (what it holds moves to --out/overwritten_<time>/)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the stopped run in --out from its checkpoint (the same flags; --steps may grow)")
    ap.add_argument("--ckpt-every", type=int, default=0,
                    help="also checkpoint every this many steps (default 0: when stopped and at the end; "
                         "runs of several processes keep only these when stopped)")
    ap.add_argument("--reward", default="",
                    help="shapes (the default: the exact metric), shapes_graded (its shape figure graded by the blob's "
                         "fill), shape (that graded figure alone), brightness (the sanity check) or module:function "
                         "(clips, captions) -> floats")
    ap.add_argument("--reward-timeout", type=float, default=600.0, metavar="S",
                    help="seconds a reward call may take before the run stops with an error (0 = no limit)")
    ap.add_argument("--captions", type=int, default=4, help="captions per step")
    ap.add_argument("--rollout-captions", choices=("reward", "heldout"), default="reward",
                    help="reward: every caption but the 48 held-out ones (the default); heldout: the 48 held-out "
                         "compositions, which no training clip shows (taught by the reward alone)")
    ap.add_argument("--group", type=int, default=4, help="clips per caption (the advantage's group)")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out figures every this many steps (0 = never)")
    ap.add_argument("--sample-steps", type=int, default=10, help="sampler steps of the rollouts")
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop stepping after this wall time (0 = never)")
    ap.add_argument("--skip-initial-eval", action="store_true", help="no held-out figures at step 0")
    ap.add_argument("--kl", type=float, default=0.0, help="grpo: KL coefficient to the initial weights")
    ap.add_argument("--old-decay", type=float, default=0.0,
                    help="nft: the old policy is an EMA of the weights with this decay (train.ema_decay): it samples "
                         "the rollouts and its velocity is v_old, whose proximal term keeps the update from drifting; "
                         "0 = on-policy (v_old = the current weights, no proximal term)")
    ap.add_argument("--keep-min", type=float, default=5.5,
                    help="raft: keep clips with a reward >= this (5.5: the all_ok clips under the shapes reward)")
    ap.add_argument("--updates", type=int, default=1, help="raft: optimizer steps a step, on clips drawn from the buffer")
    ap.add_argument("--raft-batch", type=int, default=8, help="raft / sft: clips an optimizer step")
    ap.add_argument("--raft-select", choices=("all", "best"), default="all",
                    help="raft: keep every clip >= --keep-min (all), or each caption's best clip if >= --keep-min (best)")
    ap.add_argument("--raft-min-buffer", type=int, default=1,
                    help="raft: no optimizer step until the buffer holds this many accepted clips")
    ap.add_argument("--rollout-guidance", type=float, default=None,
                    help="nft / dpo / raft: the rollouts' guidance scale (default train.guidance_scale, as evaluated)")
    ap.add_argument("--max-cpu-s", type=float, default=0.0,
                    help="stop stepping once this process has used this many CPU seconds, start-up included (0 = never)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.dp_shard=2 optim.lr=1e-4")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    started, lock = False, None
    try:
        run = Path(args.run)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"{run}: no config.yaml there (expected a training run's folder)")
        for flag, value in (("--steps", args.steps), ("--captions", args.captions), ("--sample-steps", args.sample_steps),
                            ("--updates", args.updates), ("--raft-batch", args.raft_batch),
                            ("--raft-min-buffer", args.raft_min_buffer)):
            if value < 1:
                raise ConfigError(f"{flag}={value} must be >= 1")
        if args.ckpt_every < 0:
            raise ConfigError(f"--ckpt-every={args.ckpt_every} must be >= 0 (0 = when stopped and at the end)")
        if args.group < 2:
            raise ConfigError(f"--group={args.group} must be >= 2 (advantages compare the clips of a caption)")
        held_out = len(caption_split()[1])
        if args.rollout_captions == "heldout" and args.captions > held_out:
            raise ConfigError(f"--captions={args.captions} with --rollout-captions heldout: there are "
                              f"{held_out} held-out captions; give --captions <= that")
        if not 0.0 <= args.old_decay < 1.0:
            raise ConfigError(f"--old-decay={args.old_decay} must be in [0, 1) (0 = on-policy)")
        if args.old_decay and not RECIPES[args.recipe].old_policy:
            raise ConfigError(f"--old-decay is DiffusionNFT's old policy: --recipe nft only (not {args.recipe})")
        if args.reward:
            load_reward(args.reward)  # refused before anything is built
        # AdamW whatever the run trained with (a from-scratch run's Muon is for pre-training; the
        # recipes' learning rates are AdamW's): optim.name=muon after the flags chooses it again
        base = [f"train.ema_decay={args.old_decay:g}", "train.progress=false", "optim.name=adamw", "optim.lr=1e-4",
                "optim.warmup_steps=0",
                f"train.steps={args.steps}", "optim.schedule=constant"]
        cfg = apply_overrides(load_config(run / "config.yaml"), [*base, *args.overrides])
        if cfg.mode != "video":
            raise ConfigError(f"{run}: a mode={cfg.mode} run; video_rl post-trains video generators")
        if getattr(cfg.model, "audio_patch", 0):  # rollouts with sound, rewards and updates without: not built
            raise ConfigError(f"{run}: a run with an audio stream (model.audio_patch={cfg.model.audio_patch}); video_rl "
                              f"post-trains video-only runs (rewarding sound is not built yet: docs/audio-video.md)")
        prepare_data(cfg.data, cfg.model)
        out = Path(args.out)
        saved, lock = check_out(run, out, args)  # refusals, --out's lock, then --overwrite moves things aside
        weights = source_weights(run)  # what it starts from, kept in its checkpoints: --resume onto other weights refused
        check_source_weights(saved, weights, run, out)
        if saved is not None and saved["step"] >= args.steps:
            print(f"{out} already took {saved['step']} steps (--steps {args.steps}): nothing to do; give a larger "
                  f"--steps to go on")
            return 0
        keep_data_record(run, out)
        started = True  # from here on a failure may leave progress in --out: the error line says so
        launch(cfg, functools.partial(train, run=str(run), recipe=args.recipe, steps=args.steps, out=args.out,
                                      reward=args.reward, captions=args.captions, group=args.group,
                                      eval_every=args.eval_every, sample_steps=args.sample_steps, kl=args.kl,
                                      max_minutes=args.max_minutes, initial_eval=not args.skip_initial_eval,
                                      keep_min=args.keep_min, updates=args.updates, raft_batch=args.raft_batch,
                                      select=args.raft_select, min_buffer=args.raft_min_buffer,
                                      rollout_guidance=args.rollout_guidance, max_cpu_s=args.max_cpu_s,
                                      ckpt_every=args.ckpt_every, resume=saved,
                                      settings={**trajectory(args), "source_weights": weights},
                                      reward_timeout_s=args.reward_timeout,
                                      rollout_captions=args.rollout_captions))
    except KeyboardInterrupt as err:  # Ctrl-C / SIGTERM (interrupt_on_signals): what was kept, how to go on
        how, code = interruption(err)
        print(f"error: video_rl was {how}{kept(Path(args.out), 'interrupted') if started else ''}", file=sys.stderr)
        return code
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}{kept(Path(args.out), 'failed') if started else ''}", file=sys.stderr)
        return 2
    finally:
        if lock is not None:  # --out is free for the next process (a --resume)
            lock.close()
    return 0


def kept(out: Path, status: str) -> str:
    """The end of a stopped run's error line: what --out keeps and how to go on (the record a
    one-process run wrote when stopped, or the newest --ckpt-every save of several processes,
    whose record is marked `status` here)."""
    record = read_progress(out)
    if not record or not record.get("step") or record.get("status") == "completed":
        return ""
    if record.get("status") == "running":
        write_progress(out, {**record, "status": status})
    return (f"; {out} keeps {record['step']} of {record['steps']} steps (weights.safetensors, {PROGRESS}, "
            f"its checkpoint): continue with the same command and --resume")


if __name__ == "__main__":
    interrupt_on_signals()  # Ctrl-C / SIGTERM stop the loop like the trainer's: kept progress, one line, 130 / 143
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
