"""Train the sync encoder a two-stream DiT reads its frame events from (`model.sync_encoder`).

    python -m dit_train.tools.train_sync +experiment=shapes_av --out outputs/sync_encoder     # ~3 CPU-minutes
    python -m dit_train +experiment=shapes_v2a                    # video-to-audio reading outputs/sync_encoder

The overrides are a training run's: the encoder learns from that run's clips. Self-supervised, as
Synchformer-style sync features are: the label of a frame is whether the clip's *own sound* has a
transient there (`click_frames`: energy above 2.5 kHz in the frame's span of samples), never
the picture's ground truth, so any data with sound trains it. Clips without sound (or that
cannot be read) are skipped and counted. One process, no collective.

Half of the clips drawn are perturbed frame by frame (`perturbed`): the DiT's generated pictures
carry such noise, and an encoder that never saw it flagged a third of their frames. On the
embedded world it also scores the encoder where the DiT will need it: on clips of the 48
compositions the training data never shows (the data source's `sync_events`), against the frames
where their shape touches a wall — per-frame AUC, the share of bounce frames it flags (p > 0.5)
and of other frames it flags. The figures go to the folder's
sync_encoder.json beside the weights (models/sync_encoder.py).
"""
from __future__ import annotations

import random
import time
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from dit_train.compose import compose
from dit_train.data_pipelines import open_dataset, prepare_data, source_for
from dit_train.data_pipelines.shapes_sound_metric import click_frames
from dit_train.data_pipelines.video_io import VideoReadError
from dit_train.engine.checks import Range
from dit_train.models.sync_encoder import SyncEncoder, save
from dit_train.tools.args import POSITIVE_FLOAT, POSITIVE_INT, ToolParser, ranged
from dit_train.tools.probe_sync import auc


def labelled_clips(dataset: Any, limit: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    """Up to `limit` (pixels [3, F, H, W], label [F] float 0/1) of the dataset's clips with sound,
    in id order: label 1 on the frames where the clip's own sound has a transient. Also returns
    how many clips had no sound and how many could not be read (skipped)."""
    out, silent, unreadable = [], 0, 0
    for i in range(len(dataset)):
        if len(out) >= limit:
            break
        try:
            item = dataset[i]
        except VideoReadError:
            unreadable += 1
            continue
        audio = getattr(item, "audio", None)
        if audio is None or audio.numel() == 0:
            silent += 1
            continue
        frames = item.pixels.shape[1]
        per_frame = max(1, audio.numel() // frames)  # samples of one frame's span
        label = torch.zeros(frames)
        hits = [f for f in click_frames(audio.float().numpy(), per_frame=per_frame) if f < frames]
        label[hits] = 1.0
        out.append((item.pixels.float(), label))
    return out, silent, unreadable


@torch.no_grad()
def score(encoder: SyncEncoder, clips: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Per-frame AUC, and the shares of positive / negative frames with p > 0.5, over `clips`."""
    logits = torch.cat([encoder(x) for x, _ in clips])
    labels = torch.cat([y for _, y in clips])
    flagged = logits > 0
    return {"auc": auc(logits.numpy(), labels.numpy()), "hit": float(flagged[labels > 0].float().mean()),
            "false": float(flagged[labels <= 0].float().mean())}


def perturbed(pixels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """pixels [3, F, H, W] with what differs from frame to frame in *generated* clips and is no
    event: each frame its own Gaussian noise (std up to 0.2) and its own speckles (up to 3 % of the
    pixels at random values). Without it the encoder flagged 32 % of the frames without a bounce in
    clips the DiT generated (5 % in rendered ones): it had learnt that a change between frames is
    an event; with it, 2 % (docs/audio-video.md)."""
    F = pixels.shape[1]
    std = 0.2 * torch.rand(1, F, 1, 1, generator=gen)
    rate = 0.03 * torch.rand(1, F, 1, 1, generator=gen)
    noisy = pixels + std * torch.randn(pixels.shape, generator=gen)
    speckle = torch.rand((1, *pixels.shape[1:]), generator=gen) < rate
    return torch.where(speckle, 2 * torch.rand(pixels.shape, generator=gen) - 1, noisy).clamp(-1, 1)


def train(clips: list[tuple[torch.Tensor, torch.Tensor]], steps: int, batch: int, lr: float, channels: int,
          seed: int, progress: bool = True, augment: float = 0.5) -> SyncEncoder:
    """The encoder after `steps` AdamW steps of `batch` clips drawn at random (seeded): binary
    cross-entropy per frame, positives weighted by the negatives-to-positives ratio (clicks are rare);
    a share `augment` of the drawn clips `perturbed`, their labels kept."""
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    encoder = SyncEncoder(channels)
    opt = torch.optim.AdamW(encoder.parameters(), lr)
    labels = torch.cat([y for _, y in clips])
    pos_weight = ((labels <= 0).sum() / labels.sum().clamp(min=1)).clamp(1, 100)
    bar = tqdm(range(steps), desc="sync encoder", unit="step", disable=not progress)
    for _ in bar:
        drawn = rng.sample(clips, min(batch, len(clips)))
        drawn = [(perturbed(x, gen) if rng.random() < augment else x, y) for x, y in drawn]
        loss = sum(nn.functional.binary_cross_entropy_with_logits(encoder(x), y, pos_weight=pos_weight)
                   for x, y in drawn) / len(drawn)
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return encoder.eval()


def main(argv: list[str] | None = None) -> int:
    p = ToolParser(prog="python -m dit_train.tools.train_sync", description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="the training run's overrides (its data)")
    p.add_argument("--out", required=True, help="folder for sync_encoder.safetensors and sync_encoder.json")
    p.add_argument("--steps", type=POSITIVE_INT, default=600)
    p.add_argument("--clips", type=POSITIVE_INT, default=1500, help="training clips with sound, read in id order")
    p.add_argument("--batch", type=POSITIVE_INT, default=8)
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=2e-3)
    p.add_argument("--channels", type=POSITIVE_INT, default=24)
    p.add_argument("--augment", type=ranged(float, Range(0, 1)), default=0.5,
                   help="share of the clips drawn with per-frame noise and speckles")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        cfg = compose(args.overrides)
    except Exception as err:  # noqa: BLE001 - a bad override: one line
        p.error(f"the overrides do not compose: {err}")
    if not getattr(cfg.data, "audio", False):
        p.error(f"data={cfg.data.name} has no sound (data.audio=false): the encoder learns from the clips' own "
                "sound; add data.audio=true or +experiment=shapes_av")
    start = time.process_time()
    prepare_data(cfg.data, cfg.model)
    clips, silent, unreadable = labelled_clips(open_dataset(cfg.data, cfg.model), args.clips)
    positives = int(sum(y.sum() for _, y in clips))
    print(f"{len(clips)} clips with sound ({silent} without, {unreadable} unreadable: skipped), "
          f"{positives} of {sum(len(y) for _, y in clips)} frames with a transient")
    if not clips or not positives:
        p.error("no clip with a transient in its sound: nothing to learn the frame events from")
    encoder = train(clips, args.steps, args.batch, args.lr, args.channels, args.seed, augment=args.augment)
    meta: dict[str, Any] = {"steps": args.steps, "clips": len(clips), "augment": args.augment, "overrides": args.overrides,
                            "train": score(encoder, clips[:200])}
    events = source_for(cfg.data, cfg.model).sync_events()  # the embedded world: its held-out compositions
    if events:
        meta["heldout"] = score(encoder, events)
    meta["cpu_s"] = round(time.process_time() - start, 1)
    folder = save(encoder, args.out, meta)
    for split in ("train", "heldout"):
        if split in meta:
            s = meta[split]
            print(f"{split}: per-frame AUC {s['auc']:.3f}, event frames flagged {s['hit']:.2f}, others {s['false']:.3f}")
    print(f"sync encoder: {folder} ({meta['cpu_s']:.0f} CPU-s); train with model.sync_encoder={folder}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
