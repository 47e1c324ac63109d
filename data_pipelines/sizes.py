"""Clip sizes: which resolution bucket a clip goes to, resizing it there, and the sizes that
would fit a token budget (what a "sample too long" error suggests).

A bucket is a (height, width) in pixels. A clip goes to the bucket with the closest aspect
ratio (ties: the larger area), is resized so that it just covers the bucket (aspect kept) and
centre-cropped to it; without buckets it keeps its native size, cropped to a multiple of the
patch. Tokens of a clip = slabs · (h / ph) · (w / pw), where slabs = kept frames / pt.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Size = tuple[int, int]


def target_size(h: int, w: int, patch_hw: tuple[int, int], buckets: list[Size]) -> Size:
    """The (height, width) a clip of native size (h, w) is trained at."""
    if buckets:
        # closest aspect ratio, ties to the larger area
        return min(buckets, key=lambda b: (abs(b[0] / b[1] - h / w), -b[0] * b[1]))
    return h - h % patch_hw[0], w - w % patch_hw[1]


def resize_crop(x: torch.Tensor, h: int, w: int, resize: bool) -> torch.Tensor:
    """[C, F, H, W] -> [C, F, h, w]: optionally scale so the frame just covers (h, w), then
    centre-crop. Without `resize` (no buckets) the crop only trims the patch remainder."""
    _, _, H, W = x.shape
    if resize and (H, W) != (h, w):
        scale = max(h / H, w / W)
        nh, nw = max(h, round(H * scale)), max(w, round(W * scale))
        x = F.interpolate(x.transpose(0, 1), size=(nh, nw), mode="bilinear", antialias=True,
                          align_corners=False).transpose(0, 1)
        H, W = nh, nw
    top, left = (H - h) // 2, (W - w) // 2
    return x[:, :, top:top + h, left:left + w].contiguous()


def slab_tokens(size: Size, patch_hw: tuple[int, int]) -> int:
    """Tokens of one temporal patch of a clip trained at `size`."""
    return (size[0] // patch_hw[0]) * (size[1] // patch_hw[1])


def fitting_max_frames(slabs: list[int], slab_sizes: list[int], pt: int, budget: int) -> int:
    """The largest data.max_frames (a multiple of pt) with which every sample has at most
    `budget` tokens, its sizes unchanged; 0 when no sample is over, or when even one temporal
    patch of a sample is.

    slabs[i], slab_sizes[i]: temporal patches and tokens per temporal patch of sample i now."""
    over = [per for n, per in zip(slabs, slab_sizes) if n * per > budget]
    if not over:
        return 0
    return pt * (budget // max(over))


def fitting_buckets(natives: list[Size], slabs: list[int], patch_hw: tuple[int, int], budget: int,
                    start: list[Size]) -> list[Size] | None:
    """`start` scaled down (each side a multiple of the patch) until every sample, with its
    temporal patches `slabs[i]` and native size `natives[i]`, has at most `budget` tokens; the
    largest such scale, or None when even one patch per side does not fit."""
    ph, pw = patch_hw
    for k in range(64):
        f = 0.93 ** k
        scaled = sorted({(max(ph, int(h * f) // ph * ph), max(pw, int(w * f) // pw * pw)) for h, w in start})
        if all(n * slab_tokens(target_size(h, w, patch_hw, scaled), patch_hw) <= budget
               for (h, w), n in zip(natives, slabs)):
            return scaled
        if all(b == (ph, pw) for b in scaled):
            return None
    return None
