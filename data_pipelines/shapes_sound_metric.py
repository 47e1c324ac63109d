"""The exact metric's sound half: does a clip's sound state the caption's colour, and does it
click when the shape bounces? (The world's sound: data_pipelines/synthetic_video.py.)

    sound_color_ok  the strongest tone between 150 and 1500 Hz is, on a log scale, within two
                    semitones (half the PITCHES spacing) of the caption colour's pitch, and no
                    other colour's pitch is nearer
    sound_sync_ok   every bounce of the shape (frames where it touches a wall, found on the
                    clip's own pixels by `bounce_frames`, or the renderer's list) has a click
                    within one frame, and every click a bounce within one frame; a clip whose
                    shape never bounces passes when it never clicks
    sound_all_ok    both

A click is a frame whose energy above CLICK_BAND_HZ (where no tone lies) is at least CLICK_MIN
(a rendered click: ~2.9, tone leakage: < 1e-3, in Σ x² over the frame's samples).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dit_train.data_pipelines.audio_io import read_audio
from dit_train.data_pipelines.shapes_metric import (
    PALETTE_NAMES,
    _blobs,
    palette_labels,
    parse_caption,
    to_rgb,
)
from dit_train.data_pipelines.synthetic_video import PITCHES, SAMPLE_RATE, SAMPLES_PER_FRAME, caption_split, render_long_clip
from dit_train.data_pipelines.video_io import probe, read_frames, to_model_range

TONE_BAND_HZ = (150.0, 1500.0)
PITCH_TOL_SEMITONES = 2.0
CLICK_BAND_HZ = 2500.0
CLICK_MIN = 0.3
SYNC_FRAMES = 1
STEP_PX = 0.1  # gap changes under this are measurement noise (soft coverage of H.264 edges)
TOUCH_PX = 1.0  # a blob this close to an edge touches it (rendered at the wall: gaps of -0.5..0.5 after H.264)
SOUND_FIGURES = ("sound_color_ok", "sound_sync_ok", "sound_all_ok")


def pitch_of(wave: np.ndarray, rate: int = SAMPLE_RATE) -> float:
    """Hz of the strongest component of float [N] `wave` within TONE_BAND_HZ (Hann window)."""
    x = np.asarray(wave, np.float64)
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    hz = np.fft.rfftfreq(len(x), 1.0 / rate)
    band = (hz >= TONE_BAND_HZ[0]) & (hz <= TONE_BAND_HZ[1])
    return float(hz[band][spec[band].argmax()]) if band.any() else 0.0


def color_of_pitch(hz: float) -> str | None:
    """The colour whose pitch is nearest `hz` on a log scale, None beyond PITCH_TOL_SEMITONES."""
    if hz <= 0:
        return None
    dist = {c: abs(12 * np.log2(hz / p)) for c, p in PITCHES.items()}
    best = min(dist, key=dist.get)
    return best if dist[best] <= PITCH_TOL_SEMITONES else None


def click_frames(wave: np.ndarray, rate: int = SAMPLE_RATE, per_frame: int = SAMPLES_PER_FRAME) -> list[int]:
    """Frames of float [N] `wave` (per_frame samples each) whose energy above CLICK_BAND_HZ is at
    least CLICK_MIN."""
    x = np.asarray(wave, np.float64)
    out = []
    for f in range(len(x) // per_frame):
        seg = x[f * per_frame:(f + 1) * per_frame]
        spec = np.fft.rfft(seg)
        hz = np.fft.rfftfreq(len(seg), 1.0 / rate)
        energy = 2 * float((np.abs(spec[hz >= CLICK_BAND_HZ]) ** 2).sum()) / len(seg)  # Parseval: Σ x² of the band
        if energy >= CLICK_MIN:
            out.append(f)
    return out


def bounce_frames(clip: torch.Tensor | np.ndarray) -> list[int]:
    """Frames where the shape of a clip (uint8 [F, H, W, 3] or float [3, F, H, W]) touches a
    wall, from its pixels: the blob's gap to an edge drops to at most TOUCH_PX (by more than
    STEP_PX from the frame before) and does not drop further after. A shape drawn in whole
    pixels may rest several frames at the wall (a slow one: ~0.4 px a frame); the middle frame of
    the rest counts, where the renderer reflects it. A touch at the last frame counts too (the
    renderer clicks there; no reversal shows it)."""
    rgb = to_rgb(clip)
    F, H, W, _ = rgb.shape
    labels = palette_labels(rgb)
    counts = np.bincount(labels[labels >= 0], minlength=len(PALETTE_NAMES))
    bg = int(counts.argmax())
    shape = int(np.where(np.arange(8) == bg, -1, counts[:8]).argmax())
    b = _blobs(rgb, labels, bg, shape)
    c, h = b.center, b.half  # [F, 2] (x, y), nan without blob
    gaps = np.stack([c[:, 0] - h[:, 0], W - c[:, 0] - h[:, 0], c[:, 1] - h[:, 1], H - c[:, 1] - h[:, 1]], 1)  # [F, 4]
    out = set()
    for side in range(4):
        g = gaps[:, side]
        for f in range(1, F):
            if not (g[f] <= TOUCH_PX and g[f - 1] > g[f] + STEP_PX):  # nan compares False
                continue
            end = f
            while end + 1 < F and abs(g[end + 1] - g[f]) <= STEP_PX:
                end += 1
            if end + 1 < F and g[end + 1] < g[f] - STEP_PX:
                continue  # still approaching: not at the wall yet
            out.add(f + (end - f + 1) // 2)
    return sorted(out)


def _matched(a: list[int], b: list[int]) -> bool:
    return all(any(abs(x - y) <= SYNC_FRAMES for y in b) for x in a)


def score_sound(wave: np.ndarray, caption: str, bounces: list[int], rate: int = SAMPLE_RATE) -> dict[str, float]:
    """The SOUND_FIGURES of one clip's float [N] mono `wave` against its caption and the frames
    where its shape bounces."""
    return _score_sound(wave, caption, bounces, rate)[0]


def _score_sound(wave: np.ndarray, caption: str, bounces: list[int], rate: int) -> tuple[dict[str, float], list[int]]:
    """score_sound's figures and the frames where `wave` clicks."""
    cap = parse_caption(caption)
    if cap is None:
        raise ValueError(f"not a caption of the shapes world: {caption!r}")
    color = color_of_pitch(pitch_of(wave, rate))
    clicks = click_frames(wave, rate, rate * SAMPLES_PER_FRAME // SAMPLE_RATE)
    out = {"sound_color_ok": float(color == cap.color),
           "sound_sync_ok": float(_matched(bounces, clicks) and _matched(clicks, bounces))}
    out["sound_all_ok"] = float(out["sound_color_ok"] and out["sound_sync_ok"])
    return out, clicks


def score_sounds(waves: list[np.ndarray], captions: list[str], bounces: list[list[int]]) -> dict[str, float]:
    """Means of `score_sound`, keys prefixed eval/ (eval/sound_num_clips: how many), and
    sound_sync_bounced: sound_sync_ok over the clips whose pixels show a bounce
    (eval/sound_bounced_clips of them) — a sound that never clicks passes sync on every clip
    without one, so pictures that never bounce would make silence look synchronised;
    eval/sound_clicking_clips: how many clips' sounds click at all (0 with sync_ok > 0: the
    sync is silence, not clicks put in the wrong frames)."""
    scored = [_score_sound(w, c, b, SAMPLE_RATE) for w, c, b in zip(waves, captions, bounces)]
    scores = [figures for figures, _ in scored]
    out = {f"eval/{k}": float(np.mean([s[k] for s in scores])) if scores else 0.0 for k in SOUND_FIGURES}
    bounced = [s["sound_sync_ok"] for s, b in zip(scores, bounces) if b]
    out["eval/sound_sync_bounced"] = float(np.mean(bounced)) if bounced else 0.0
    out["eval/sound_bounced_clips"] = float(len(bounced))
    out["eval/sound_clicking_clips"] = float(sum(bool(clicks) for _, clicks in scored))
    out["eval/sound_num_clips"] = float(len(scores))
    return out


def reference_sound_scores(manifest_dir: str | Path, from_pixels: bool = True) -> dict[str, float]:
    """score_sounds over the clips with sound of a set written with audio (its manifest.jsonl):
    the figures a perfect generator would reach. from_pixels: bounces found on the decoded
    clip (`bounce_frames`, what a generated clip is scored with); else the renderer's list."""
    root = Path(manifest_dir)
    waves, captions, bounces = [], [], []
    for line in (root / "manifest.jsonl").read_text().splitlines():
        item = json.loads(line) if line.strip() else {}
        if not item.get("audio"):
            continue
        seconds = item["frames"] / item["fps"]
        sound = read_audio(root / item["audio"], SAMPLE_RATE, 0.0, seconds, seconds)
        if sound.samples is None:
            continue
        if from_pixels:
            info = probe(str(root / item["path"]))
            bounces.append(bounce_frames(read_frames(str(root / item["path"]), list(range(info.frames)), info)))
        else:
            bounces.append(item["bounces"])
        waves.append(sound.samples)
        captions.append(item["caption"])
    return score_sounds(waves, captions, bounces)


def heldout_event_clips(per_caption: int = 4, frames: int = 8, size: int = 32) -> list:
    """`per_caption` clips of each of the 48 held-out compositions (synthetic_video.caption_split),
    drawn as the set's clips are (render_long_clip, as tools.evaluate --heldout draws them): (pixels [3, F, H, W] in [-1, 1], [F] float 1
    on the frames where the shape touches a wall, `bounce_frames` of the pixels: where the world
    clicks)."""
    _, held = caption_split()
    out = []
    for j, caption in enumerate(held * per_caption):
        rgb = render_long_clip(caption, frames, size, size, index=j)  # uint8 [F, H, W, 3]
        pixels = to_model_range(torch.from_numpy(np.ascontiguousarray(rgb)))
        label = torch.zeros(frames)
        label[bounce_frames(pixels)] = 1.0
        out.append((pixels, label))
    return out
