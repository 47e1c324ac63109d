"""The embedded dataset: small mp4 clips of moving coloured shapes, generated on first use,
and optionally still PNG images of the same world (image + video joint training).

Clips differ in duration and resolution on purpose: the loss weighting only matters when
samples differ in token count. Everything is a pure function of (gen_seed, clip index) and
(gen_seed, image index), so every machine writes the same pixels. Images are drawn from their
own random stream: adding images changes no clip, and image k is not a frame of clip k. The
set is written into a temporary directory and renamed into place, so concurrent writers
(several ranks, several jobs) never see half a set.

The world's sound (`data.audio=true`, docs/audio-video.md): what a metric can check from a
waveform. Each clip with sound plays a steady tone whose pitch encodes the shape's colour
(PITCHES: eight notes a major third apart, 220-1109 Hz), and a click (a 4 kHz burst of a few
milliseconds) at the start of every frame where the shape touches a wall (a bounce: the
renderer reflects its velocity there). Sound is rendered at SAMPLE_RATE, LTX-2's audio VAE
rate: 16000 / FPS = 2000 samples per frame exactly, so any kept range of frames has its sound
cut at whole samples. About one clip in four is a silent film (no audio track, to exercise
B_audio): a pure function of (gen_seed, clip index), like the pixels.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import tempfile
import wave
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from dit_train.data_pipelines.audio_io import SAMPLE_RATE

# Default sizes and frame range (inclusive) of a clip; `data.widths`, `data.heights` and
# `data.frames` choose others. Widths are multiples of 32: decord 0.6 returns garbled frames for
# some other widths (see data_pipelines/video_io.py); heights are free.
WIDTHS = (32, 64, 96)
HEIGHTS = (32, 48, 64)
FRAMES = (4, 24)
FPS = 8
COLORS = {
    "red": (230, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230), "yellow": (240, 220, 40),
    "white": (245, 245, 245), "purple": (150, 60, 200), "orange": (250, 140, 30), "cyan": (40, 210, 220),
}
BACKGROUNDS = {"black": (10, 10, 10), "gray": (110, 110, 110), "navy": (20, 20, 70), "olive": (80, 90, 30)}
SHAPES = ("circle", "square")
DIRECTIONS = (("up", "down"), ("left", "right"))  # the caption's vertical and horizontal words
HELDOUT = 48  # compositions kept out of the clips (data.heldout_compositions) and scored by tools.evaluate --heldout
EVAL_SIZE = (8, 32, 32)  # frames, height, width at which the tools sample the world's captions (a training size)
IMAGE_STREAM = 0x1A6E  # seeds image k as [gen_seed, IMAGE_STREAM, k], apart from the clips' [gen_seed, k]
LONG_STREAM = 0x10C6  # seeds long clip k as [gen_seed, LONG_STREAM, k], apart from the set's clips
# the world's sound (module docstring)
SAMPLES_PER_FRAME = SAMPLE_RATE // FPS
assert SAMPLES_PER_FRAME * FPS == SAMPLE_RATE, "the sound must cut at whole samples per frame"
# colour -> tone (Hz): 220 Hz times 2^(4k/12), a major third apart, so that a pitch estimate off
# by up to a semitone still names the right colour
PITCHES = {name: 220.0 * 2.0 ** (4 * k / 12) for k, name in enumerate(COLORS)}
TONE_AMPLITUDE = 0.25
CLICK_HZ = 4000.0  # far above every tone: a high band holds the clicks only
CLICK_AMPLITUDE = 0.6
CLICK_DECAY_S = 0.002
CLICK_OFFSET = 16  # samples after the frame's start: the click lies inside its frame
SOUND_STREAM = 0x50D  # seeds the silent-film draw as [gen_seed, SOUND_STREAM, i], apart from the pixels' [gen_seed, i]
SILENT_SHARE = 0.25


def has_sound(gen_seed: int, index: int) -> bool:
    """Whether clip `index` of the set has an audio track (about 1 - SILENT_SHARE of the clips)."""
    return bool(np.random.default_rng([gen_seed, SOUND_STREAM, index]).random() >= SILENT_SHARE)


def render_sound(color: str, bounces: list[int], frames: int) -> np.ndarray:
    """float32 [frames · SAMPLES_PER_FRAME] mono waveform in [-1, 1]: the colour's tone plus a
    click at the start of every frame in `bounces`."""
    n = frames * SAMPLES_PER_FRAME
    t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
    out = TONE_AMPLITUDE * np.sin(2 * np.pi * PITCHES[color] * t)
    burst = int(6 * CLICK_DECAY_S * SAMPLE_RATE)
    tb = np.arange(burst) / SAMPLE_RATE
    click = CLICK_AMPLITUDE * np.exp(-tb / CLICK_DECAY_S) * np.sin(2 * np.pi * CLICK_HZ * tb)
    for f in bounces:
        start = f * SAMPLES_PER_FRAME + CLICK_OFFSET
        stop = min(start + burst, n)
        if start < n:
            out[start:stop] += click[: stop - start]
    return np.clip(out, -1.0, 1.0).astype(np.float32)


def write_wav(path: Path, samples: np.ndarray, rate: int = SAMPLE_RATE) -> None:
    """float [N] (mono) or [N, C] in [-1, 1] as 16-bit PCM WAV (the stdlib's writer)."""
    x = np.asarray(samples, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    pcm = np.round(np.clip(x, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def compositions() -> list[tuple[str, ...]]:
    """Every (colour, shape, vertical, horizontal, background) of the shapes world: 8 x 2 x 2 x 2 x 4 = 256."""
    return list(itertools.product(COLORS, SHAPES, *DIRECTIONS, BACKGROUNDS))


def world_captions() -> list[str]:
    """Every caption of the shapes world, in compositions()' order."""
    return [caption_of(*t) for t in compositions()]


def caption_of(color: str, shape: str, vert: str, horiz: str, background: str) -> str:
    return f"a {color} {shape} moving {vert} and {horiz} on a {background} background"


def caption_split(seed: int = 0) -> tuple[list[str], list[str]]:
    """(training compositions, the HELDOUT evaluation compositions): a fixed shuffle of the
    world's captions. The same split for every gen_seed, so every run (and video RL's reward
    captions) is scored on the same 48 compositions."""
    caps = world_captions()
    random.Random(seed).shuffle(caps)
    return caps[HELDOUT:], caps[:HELDOUT]


def training_compositions() -> list[tuple[str, ...]]:
    """The 208 (colour, shape, vertical, horizontal, background) tuples clips may show, in the
    world's order (clip i shows the (i mod 208)-th of a per-gen_seed shuffle: every composition
    gets num_clips / 208 clips, +-1)."""
    train = set(caption_split()[0])
    return [t for t in compositions() if caption_of(*t) in train]


def composition_of(caption: str) -> tuple[str, ...]:
    """The (colour, shape, vertical, horizontal, background) a clip caption states; ValueError
    for a caption that is not one of the world's clips (a still image's has no direction)."""
    found = dict(zip(world_captions(), compositions())).get(caption.strip())
    if found is None:
        raise ValueError(f"not a clip caption of the shapes world: {caption!r}")
    return found


def render_long_clip(caption: str, frames: int, height: int = 32, width: int = 32, index: int = 0,
                     gen_seed: int = 0) -> np.ndarray:
    """uint8 [frames, height, width, 3]: clip `index` of `caption`'s composition, `frames` long,
    drawn as the set's clips are (sizes, speed, start; the shape bouncing off the walls), so a
    long clip is what a long generation of that caption should look like: the reference of
    tools.evaluate's drift measurement. A pure function of its arguments; the set's own clips
    are untouched (their own seeds)."""
    if frames < 1 or height < 8 or width < 8:
        raise ValueError(f"a long clip needs frames >= 1 and height, width >= 8 (got {frames} x {height} x {width})")
    rng = np.random.default_rng([gen_seed, LONG_STREAM, index])
    clip, _ = _render(rng, (width,), (height,), (frames, frames), composition_of(caption))
    return clip


def _render(rng: np.random.Generator, widths: Sequence[int] = WIDTHS, heights: Sequence[int] = HEIGHTS,
            frames: Sequence[int] = FRAMES, composition: tuple[str, ...] | None = None,
            bounces: list[int] | None = None) -> tuple[np.ndarray, str]:
    """One clip as uint8 [F, H, W, 3] and its caption; W, H drawn from `widths`, `heights`,
    F from frames[0]..frames[1] (inclusive); the colour, shape, direction and background drawn,
    or those of `composition` (colour, shape, vertical, horizontal, background). `bounces`, when
    given, receives the frames where the shape touches a wall (its velocity reflected there:
    the clicks of the world's sound, data_pipelines/synthetic_video.py); the draws are the same
    either way."""
    W, H = int(rng.choice(list(widths))), int(rng.choice(list(heights)))
    F = int(rng.integers(frames[0], frames[1] + 1))
    if composition is None:
        bg_name = str(rng.choice(list(BACKGROUNDS)))
        color_name = str(rng.choice(list(COLORS)))
        shape = str(rng.choice(SHAPES))
    else:
        color_name, shape, _, _, bg_name = composition
    r = float(rng.uniform(0.12, 0.25)) * min(H, W)
    x, y = float(rng.uniform(r, W - r)), float(rng.uniform(r, H - r))
    speed = float(rng.uniform(1.0, 3.0))
    angle = float(rng.uniform(0, 2 * np.pi))
    vx, vy = speed * np.cos(angle), speed * np.sin(angle)
    if composition is not None:  # the same angle distribution, folded into the composition's quadrant
        vx = abs(vx) if composition[3] == "right" else -abs(vx)
        vy = abs(vy) if composition[2] == "down" else -abs(vy)
    # the caption states the direction of the motion at the start: cutting a clip to its first
    # data.max_frames frames (what training sees) keeps it true; bounces may reverse it later
    horiz = "right" if vx > 0 else "left"
    vert = "down" if vy > 0 else "up"
    frames = np.empty((F, H, W, 3), np.uint8)
    for f in range(F):
        frames[f] = _draw(H, W, bg_name, color_name, shape, x, y, r)
        x, y = x + vx, y + vy
        hit = not (r <= x <= W - r and r <= y <= H - r)
        if not r <= x <= W - r:  # bounce off the walls
            vx, x = -vx, float(np.clip(x, r, W - r))
        if not r <= y <= H - r:
            vy, y = -vy, float(np.clip(y, r, H - r))
        if hit and bounces is not None and f + 1 < F:  # frame f + 1 shows the shape at the wall
            bounces.append(f + 1)
    caption = f"a {color_name} {shape} moving {vert} and {horiz} on a {bg_name} background"
    return frames, caption


def _draw(H: int, W: int, bg_name: str, color_name: str, shape: str, x: float, y: float, r: float) -> np.ndarray:
    """One uint8 [H, W, 3] frame: the shape of half-size r centred at (x, y) on the background."""
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    img = np.empty((H, W, 3), np.uint8)
    img[:] = BACKGROUNDS[bg_name]
    if shape == "circle":
        inside = (xx - x) ** 2 + (yy - y) ** 2 <= r * r
    else:
        inside = (np.abs(xx - x) <= r) & (np.abs(yy - y) <= r)
    img[inside] = COLORS[color_name]
    return img


def _render_image(rng: np.random.Generator, widths: Sequence[int] = WIDTHS,
                  heights: Sequence[int] = HEIGHTS) -> tuple[np.ndarray, str]:
    """One still image as uint8 [H, W, 3] and its caption: a clip's first frame drawn the same
    way (sizes, palette, shape sizes and placement), with no motion, so no direction words."""
    W, H = int(rng.choice(list(widths))), int(rng.choice(list(heights)))
    bg_name = str(rng.choice(list(BACKGROUNDS)))
    color_name = str(rng.choice(list(COLORS)))
    shape = str(rng.choice(SHAPES))
    r = float(rng.uniform(0.12, 0.25)) * min(H, W)
    x, y = float(rng.uniform(r, W - r)), float(rng.uniform(r, H - r))
    return _draw(H, W, bg_name, color_name, shape, x, y, r), f"a {color_name} {shape} on a {bg_name} background"


def write_png(path: Path, image: np.ndarray) -> None:
    """uint8 [H, W, 3] as a lossless PNG (the decoded pixels are exactly the rendered ones)."""
    Image.fromarray(image, "RGB").save(path, format="PNG")


def write_mp4(path: Path, frames: np.ndarray, fps: int = FPS, sound: np.ndarray | None = None,
              rate: int = 16000, threads: int = 0) -> None:
    """Encode uint8 [F, H, W, 3] as H.264 mp4 (PyAV / libx264, near-lossless); with `sound`
    (float [N] mono in [-1, 1] at `rate` Hz) also an AAC audio track of it (PyAV's encoder, in
    frames of 1024 samples; values outside [-1, 1] are clipped). `threads`: libx264's encoder
    threads (0 = its own choice, 1.5 per core)."""
    import av  # deferred: PyAV loads FFmpeg (~1 s); only writing mp4s needs it

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12", "preset": "veryfast", **({"threads": str(threads)} if threads else {})}
        audio = container.add_stream("aac", rate=rate, layout="mono") if sound is not None else None
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio is None:
            return
        wave = np.clip(np.asarray(sound, dtype=np.float32).reshape(1, -1), -1.0, 1.0)
        for i in range(0, wave.shape[1], 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, i:i + 1024]), format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = rate, i
            for packet in audio.encode(chunk):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)


def _write_sound(folder: Path, index: int, gen_seed: int, caption: str, bounces: list[int], frames: int) -> dict:
    """Clip `index`'s sound as clip_XXXX.wav in `folder` when it has any: {"audio": name}, else {}."""
    if not has_sound(gen_seed, index):
        return {}
    name = f"clip_{index:04d}.wav"
    color = caption.split()[1]  # "a <colour> <shape> moving ..."
    write_wav(folder / name, render_sound(color, bounces, frames))
    return {"audio": name}


def _sizes(widths: Sequence[int], heights: Sequence[int], frames: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    w, h, f = tuple(int(x) for x in widths), tuple(int(x) for x in heights), tuple(int(x) for x in frames)
    if not w or not h or any(x % 32 or x <= 0 for x in w):
        raise ValueError(f"synthetic video widths {list(w)} must be positive multiples of 32 (decord), heights {list(h)} non-empty")
    if any(x < 8 for x in h):
        raise ValueError(f"synthetic video heights {list(h)} must be >= 8")
    if len(f) != 2 or not 1 <= f[0] <= f[1]:
        raise ValueError(f"synthetic video frames {list(f)} must be [min, max] with 1 <= min <= max")
    return w, h, f


def dataset_dir(cache_dir: str | os.PathLike, num_clips: int, gen_seed: int, num_images: int = 0,
                widths: Sequence[int] = WIDTHS, heights: Sequence[int] = HEIGHTS, frames: Sequence[int] = FRAMES,
                heldout_compositions: bool = False, audio: bool = False) -> Path:
    """Where a set lives. Sizes other than the defaults get their own name (`_w.._h.._f..`), and
    so does a set with images (`_img<k>`), without the held-out compositions (`_ho48`) or with
    sound (`_audio`): a set written without them (same seed, older code) must never be taken
    for one that has them."""
    w, h, f = _sizes(widths, heights, frames)
    # v2: captions state the starting direction (v1: the direction at the end of the clip)
    name = f"synthetic_video_v2_n{num_clips}_seed{gen_seed}"
    if (w, h, f) != (WIDTHS, HEIGHTS, FRAMES):
        name += "_w" + "-".join(map(str, w)) + "_h" + "-".join(map(str, h)) + "_f" + "-".join(map(str, f))
    if num_images:
        name += f"_img{num_images}"
    if heldout_compositions:
        name += f"_ho{HELDOUT}"
    if audio:
        name += "_audio"
    return Path(cache_dir).expanduser() / name


def ensure_synthetic_videos(cache_dir: str | os.PathLike, num_clips: int, gen_seed: int, num_images: int = 0,
                            widths: Sequence[int] = WIDTHS, heights: Sequence[int] = HEIGHTS,
                            frames: Sequence[int] = FRAMES, heldout_compositions: bool = False,
                            audio: bool = False) -> Path:
    """Write the set if it is not there yet; return its directory (holding manifest.jsonl).

    manifest.jsonl lists the clips (clip_XXXX.mp4) first, then the images (image_XXXX.png,
    frames=1, no fps), so sample ids of clips do not depend on num_images. Images take the
    clips' sizes (`widths`, `heights`). `heldout_compositions`: the clips cover the 208 training
    compositions in turn (caption_split), none of the 48 held-out ones; otherwise each clip
    draws its own (all 256 possible). `audio`: each clip's row also lists its bounce frames
    (`bounces`), and the clips with sound (has_sound) get clip_XXXX.wav (tone
    of the colour, clicks at the bounces), named in the row's `audio` column; the pixels are
    the same as without.
    """
    if num_images < 0 or num_clips < 0:
        raise ValueError(f"data.num_clips={num_clips} and data.num_images={num_images} must be >= 0")
    out = dataset_dir(cache_dir, num_clips, gen_seed, num_images, widths, heights, frames, heldout_compositions, audio)
    if (out / "manifest.jsonl").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        lines = []
        compositions = training_compositions() if heldout_compositions else None
        if compositions:
            random.Random(gen_seed).shuffle(compositions)
        for i in range(num_clips):
            chosen = compositions[i % len(compositions)] if compositions else None
            bounces: list[int] = []
            clip, caption = _render(np.random.default_rng([gen_seed, i]), widths, heights, frames, chosen, bounces)
            name = f"clip_{i:04d}.mp4"
            # one encoder thread: the clips are a few 32-px frames, where x264's threads (3 on 2
            # cores) cost more to start and join than they encode (the quickstart's 2080 clips
            # 9.2-11.5 -> 5.7-6.0 CPU-s), and the files are byte for byte the threaded encoder's
            write_mp4(tmp / name, clip, threads=1)
            row = {"path": name, "caption": caption, "frames": int(clip.shape[0]),
                   "height": int(clip.shape[1]), "width": int(clip.shape[2]), "fps": FPS}
            if audio:
                row.update(bounces=bounces, **_write_sound(tmp, i, gen_seed, caption, bounces, int(clip.shape[0])))
            lines.append(json.dumps(row))
        for i in range(num_images):
            image, caption = _render_image(np.random.default_rng([gen_seed, IMAGE_STREAM, i]), widths, heights)
            name = f"image_{i:04d}.png"
            write_png(tmp / name, image)
            lines.append(json.dumps({"path": name, "caption": caption, "frames": 1,
                                     "height": int(image.shape[0]), "width": int(image.shape[1])}))
        (tmp / "manifest.jsonl").write_text("\n".join(lines) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "manifest.jsonl").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
