"""A small audio-visual sync encoder: a clip's pixels -> one logit a frame, "a sound event starts here".

Video-to-audio models take their synchronisation from a dedicated network (MMAudio: Synchformer
features, trained self-supervised on audio-visual sync, upsampled onto the audio latents), not
from the generator's own video tokens: through the sound's denoising error alone the generator
learns to see the event far too slowly (docs/audio-video.md measures it). This is its analogue
for the two-stream DiT (`model.sync_encoder`): three 3-D convolutions over the clip, pooled per
frame (max and mean over the picture), one linear logit per frame. `tools.train_sync` trains it on
the clips' own sound (the frames where it has a transient); the DiT reads its per-frame
probability through the audio tokens (tasks/av_sync.py). Frozen during the DiT's training.

Nothing here communicates.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS, META = "sync_encoder.safetensors", "sync_encoder.json"


class SyncEncoder(nn.Module):
    """forward(pixels [3, F, H, W] in [-1, 1]) -> [F] logits, one a frame (any F, H, W)."""

    def __init__(self, channels: int = 24):
        super().__init__()
        c = channels
        # the first layer sees one frame (edges, colours); the next two compare neighbouring
        # frames (a reversal of motion is a change over 3 frames); stride 2 in space only
        self.net = nn.Sequential(nn.Conv3d(3, c, (1, 3, 3), padding=(0, 1, 1)), nn.GELU(),
                                 nn.Conv3d(c, c, 3, padding=1, stride=(1, 2, 2)), nn.GELU(),
                                 nn.Conv3d(c, c, 3, padding=1), nn.GELU())
        # max over the picture finds a small event anywhere in it; the mean, the frame's overall change
        self.head = nn.Linear(2 * c, 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.net(pixels[None].to(self.head.weight.dtype))[0]  # [c, F, h, w]
        per_frame = torch.cat([h.amax((2, 3)), h.mean((2, 3))], 0).T  # [F, 2c]
        return self.head(per_frame)[:, 0]


def save(encoder: SyncEncoder, folder: str | Path, meta: dict) -> Path:
    """Write `folder`/sync_encoder.safetensors and sync_encoder.json (channels + `meta`)."""
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in encoder.state_dict().items()}, str(out / WEIGHTS))
    channels = encoder.head.in_features // 2
    (out / META).write_text(json.dumps({"channels": channels, **meta}, indent=1) + "\n")
    return out


def weights_path(path: str | Path) -> Path:
    """The weights file `model.sync_encoder=path` names: a folder tools.train_sync wrote, or its
    .safetensors file (FileNotFoundError saying what to run, else)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / WEIGHTS
    if not p.is_file():
        raise FileNotFoundError(f"{path} holds no {WEIGHTS}: train one with python -m dit_train.tools.train_sync "
                                f"<the run's overrides> --out {path}")
    return p


@lru_cache(maxsize=4)
def load(path: str) -> SyncEncoder:
    """The frozen encoder at `path` (weights_path), in eval mode, on the CPU; one per process."""
    p = weights_path(path)
    meta_file = p.parent / META
    channels = json.loads(meta_file.read_text()).get("channels", 24) if meta_file.is_file() else 24
    encoder = SyncEncoder(channels)
    encoder.load_state_dict(load_file(str(p)))
    encoder.requires_grad_(False)
    return encoder.eval()
