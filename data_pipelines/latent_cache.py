"""VAE latent cache: clips encoded once with a diffusers video VAE (and captions with a
transformers text encoder), then trained on instead of pixels (`data=latent_cache`).

Layout of a cache folder:

    meta.json                   VAE / text encoder paths, latent channels, compression factors,
                                per-channel latents mean/std, text_dim, settings fingerprint
    null_text_emb.safetensors   `text_emb` [Lt0, text_dim] of the empty caption (caption dropout, CFG)
    samples/<key>.safetensors   `latents` [C, f, h, w] float32 normalized, `text_emb` [Lt, text_dim]
                                float32 (valid tokens only); key = hash of the source path. With
                                --masks `mask_sums` [f, h, w] int32 (the clip's mask summed per
                                latent voxel: companions.latent_mask_sums), with --control
                                `control_latents` [C, f, h, w] (its control video encoded like the
                                clip) and `control_inactive_latents` (an all-zero video of its size
                                encoded: Wan VACE's inactive video), with --i2v Wan 2.1 I2V's tensors (i2v_cache.py),
                                with --audio-vae `audio_latents` [n, token_dim] float32: LTX-2's normalized
                                audio tokens of the clip's kept frames' span (audio_latents.py; absent
                                for a clip without usable sound)
    manifest.jsonl              {file, caption, source, latent_shape, text_len[, audio_len]} per encoded
                                clip, in source order (sample id = line number)
    report.json                 counts: encoded, reused, unreadable (path, why), with --audio-vae
                                audio / no_audio clips and the sound reader's outcomes, ...

Latents are normalized like the Wan pipelines do: (z - latents_mean) / latents_std per channel,
from the VAE's config (LTX-Video's VAE: from its latents_mean / latents_std buffers and
scaling_factor, as LTXPipeline does; VAEs with a single `scaling_factor`/`shift_factor` use those instead).
Each sample file is written to a temporary name and renamed, so an interrupted run leaves only
complete files and a rerun skips them (resumable).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from dit_train.atomic import save_file_atomic, write_atomic
from dit_train.data_pipelines.audio_latents import AudioLatentCodec, kept_span
from dit_train.data_pipelines.companions import KEYS, LatentMask, latent_mask_sums
from dit_train.data_pipelines.latent_encoders import TextEncoder, VaeCodec
from dit_train.data_pipelines.records import in_heldout, member_name, parsed_once
from dit_train.data_pipelines.video_dataset import VideoSample
from dit_train.data_pipelines.video_io import VideoReadError

log = logging.getLogger(__name__)

META, MANIFEST, REPORT, NULL_TEXT, SAMPLES = "meta.json", "manifest.jsonl", "report.json", "null_text_emb.safetensors", "samples"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- the cache folder ------------------------------------------------------------------------


def sample_key(source: str) -> str:
    """File name of a clip's latents: stable under added/removed clips (ids shift, keys do not)."""
    return hashlib.sha1(source.encode()).hexdigest()[:20]


def fingerprint(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file_atomic({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(text))


def read_cache_info(root: str | os.PathLike) -> dict:
    p = Path(root).expanduser() / META
    if not p.is_file():
        raise ValueError(f"{p} not found: data.root must be a folder written by tools/cache_latents.py")
    return json.loads(p.read_text())


def check_or_write_meta(out: Path, meta: dict, write: bool) -> None:
    """Refuse to mix latents made with other settings into `out`; rank 0 writes meta.json."""
    p = out / META
    if p.is_file():
        old = json.loads(p.read_text())
        if old.get("fingerprint") != meta["fingerprint"]:
            diff = sorted(k for k in set(old.get("settings", {})) | set(meta["settings"])
                          if old.get("settings", {}).get(k) != meta["settings"].get(k))
            raise ValueError(f"{out} holds latents made with other settings (differ: {', '.join(diff)}); "
                             f"pick another output folder or delete it")
    if write:
        _write_text_atomic(p, json.dumps(meta, indent=2))


def build_meta(vae: VaeCodec, text: TextEncoder | None, settings: dict, audio: AudioLatentCodec | None = None) -> dict:
    return {
        "format": 1, "settings": settings, "fingerprint": fingerprint(settings),
        "vae": vae.path, "vae_class": vae.class_name, "latent_channels": vae.latent_channels,
        "scale_factor_temporal": vae.temporal, "scale_factor_spatial": vae.spatial,
        "latents_mean": vae.latents_mean, "latents_std": vae.latents_std,
        "text_encoder": text.path if text else "", "tokenizer": text.tokenizer_path if text else "",
        "text_dim": text.text_dim if text else 0, "max_text_len": text.max_length if text else 0,
        "null_text_emb": NULL_TEXT if text else "",
        "audio": audio.meta() if audio else None,
    }


def write_null_text(out: Path, text: TextEncoder) -> None:
    _save_atomic(out / NULL_TEXT, {"text_emb": text.encode("")}, {"caption": ""})


class CompanionEncoder:
    """What a clip's mask and control video become in a cache (`tools.cache_latents --masks
    --control`, the `kinds` "mask" / "control"): `mask_sums` [f, h, w] int32, the 8-bit mask
    summed in weight units over each latent voxel's pixels (companions.latent_mask_sums: the
    training reader's token weights are then the pixel mask's patch means, exactly), and
    `control_latents` [C, f, h, w], the control video encoded by the clip's VAE, with
    `control_inactive_latents` [C, f, h, w], the encoding of an all-zero video of its size: Wan
    VACE's "inactive" video of a control without mask (models/wan_vace.py; encoded once per size)."""

    def __init__(self, vae: VaeCodec, kinds: tuple[str, ...]):
        self.vae, self.kinds = vae, tuple(k for k in ("mask", "control") if k in kinds)
        self._zero_latents: dict[tuple[int, ...], torch.Tensor] = {}

    def zero_latents(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The VAE's encoding of an all-zero (mid-grey) video [3, F, H, W] of `shape`, once per shape."""
        if shape not in self._zero_latents:
            self._zero_latents[shape] = self.vae.encode(torch.zeros(shape))
        return self._zero_latents[shape]

    def tensors(self, sample: VideoSample) -> dict[str, torch.Tensor]:
        out = {}
        if "mask" in self.kinds:  # int32 holds t·s·s·65535 for any VAE (Wan: 4·8·8·65535 < 2^24)
            mask = sample.mask[: self.vae.usable_frames(sample.mask.shape[0])]
            out["mask_sums"] = latent_mask_sums(mask, self.vae.temporal, self.vae.spatial).to(torch.int32)
        if "control" in self.kinds:
            out["control_latents"] = self.vae.encode(sample.control)
            out["control_inactive_latents"] = self.zero_latents(tuple(sample.control.shape))
        return out


def clip_tensors(sample: VideoSample, caption: str, vae: VaeCodec, text: TextEncoder | None, i2v: Any = None,
                 companions: CompanionEncoder | None = None, audio: AudioLatentCodec | None = None,
                 audio_span: int = 0) -> dict[str, torch.Tensor]:
    """Everything a cache stores of one clip (the sample file's tensors; the layout above).
    audio_span: 16 kHz samples of the time span of the clip's frames (with `audio`)."""
    tensors = {"latents": vae.encode(sample.pixels)}
    if audio is not None and sample.audio is not None:  # the sound of the frames the video VAE keeps
        frames = sample.pixels.shape[1]
        keep = kept_span(sample.audio.numel(), audio_span, frames, vae.usable_frames(frames))
        z = audio.encode(sample.audio[:keep])
        if z.shape[0]:
            tensors["audio_latents"] = z
    if text is not None:
        tensors["text_emb"] = text.encode(caption)
    if i2v is not None:
        tensors |= i2v.tensors(sample.pixels)
    if companions is not None:
        tensors |= companions.tensors(sample)
    return tensors


def encode_shard(dataset: Any, out: Path, vae: VaeCodec, text: TextEncoder | None, rank: int = 0,
                 world: int = 1, progress: bool = True, i2v: Any = None, companions: CompanionEncoder | None = None,
                 audio: AudioLatentCodec | None = None) -> dict:
    """Encode the clips i ≡ rank (mod world) of `dataset` (VideoClipDataset: `entries`,
    `__getitem__` -> VideoSample with pixels [3, F, H, W], H/W multiples of the VAE's factor)
    into `out/samples/`, skipping those already there; with `i2v` (i2v_cache.I2VEncoder) also
    each clip's Wan 2.1 I2V tensors, with `companions` its mask and control latents, with `audio`
    its audio latents (a clip without usable sound stays video-only). Returns this rank's counts."""
    mine = list(range(rank, len(dataset), world))
    report = {"encoded": 0, "reused": 0, "unreadable": []}
    bar = tqdm(mine, desc=f"caching latents (rank {rank}/{world})", unit="clip", position=rank, disable=not progress)
    for i in bar:
        entry = dataset.entries[i]
        path = out / SAMPLES / f"{sample_key(entry.path)}.safetensors"
        if path.is_file():
            report["reused"] += 1
            continue
        try:
            sample = dataset[i]
        except VideoReadError as err:
            report["unreadable"].append([entry.path, str(err)])
            continue
        span = dataset.span_samples(i) if audio is not None else 0
        _save_atomic(path, clip_tensors(sample, entry.caption, vae, text, i2v, companions, audio, span),
                     {"caption": entry.caption, "source": entry.path})
        report["encoded"] += 1
    bar.close()
    report["audio_outcomes"] = dict(getattr(dataset, "audio_outcomes", {}))
    return report


def write_manifest(out: Path, dataset: Any, reports: list[dict]) -> dict:
    """After every rank finished: manifest.jsonl of the clips that have latents (source order)
    and report.json (counts over all ranks + clips the source itself skipped)."""
    lines = []
    for entry in dataset.entries:
        name = f"{SAMPLES}/{sample_key(entry.path)}.safetensors"
        if not (out / name).is_file():
            continue
        with safe_open(str(out / name), "pt") as f:
            shape = list(f.get_slice("latents").get_shape())
            text_len = f.get_slice("text_emb").get_shape()[0] if "text_emb" in f.keys() else 0
            audio_len = f.get_slice("audio_latents").get_shape()[0] if "audio_latents" in f.keys() else 0
        row = {"file": name, "caption": entry.caption, "source": entry.path, "latent_shape": shape,
               "text_len": int(text_len)}
        lines.append(json.dumps(row | ({"audio_len": int(audio_len)} if audio_len else {})))
    _write_text_atomic(out / MANIFEST, "".join(line + "\n" for line in lines))
    report = {
        "samples": len(lines),
        "encoded": sum(r["encoded"] for r in reports), "reused": sum(r["reused"] for r in reports),
        "unreadable": [u for r in reports for u in r["unreadable"]],
        "skipped_by_source": [list(s) for s in getattr(dataset, "skipped", [])],
    } | audio_report(lines, reports)
    _write_text_atomic(out / REPORT, json.dumps(report, indent=2))
    return report


def audio_report(rows: list[str], reports: list[dict]) -> dict:
    """The report's sound counts, when the clips were read with sound (--audio-vae): clips with
    audio latents, clips without (no track, silent, corrupt, under one latent: video-only), and
    the sound reader's outcomes over the clips encoded now (audio_io's table)."""
    outcomes: dict[str, int] = {}
    for r in reports:
        for k, v in (r.get("audio_outcomes") or {}).items():
            outcomes[k] = outcomes.get(k, 0) + v
    audio = sum('"audio_len"' in row for row in rows)
    if not outcomes and not audio:
        return {}
    return {"audio": audio, "no_audio": len(rows) - audio, "audio_outcomes": outcomes}


# -- reading it back -------------------------------------------------------------------------


def _manifest_rows(manifest: Path) -> list[dict]:
    """A manifest's rows (shared: read only), each row's file checked to be the cache's before any is opened."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    return [row for row in rows if member_name(row.get("file"), str(manifest))]  # (it raises for any other file)


class LatentCacheDataset:
    """Cached latents as VideoSample (pixels = normalized latents [C, f, h, w] cropped to
    multiples of `patch`, text_emb [Lt, text_dim] or None); token counts from the manifest.
    split: "" every sample, "train" / "heldout" one side of the `heldout_fraction` split (by a
    hash of each clip's source file name). Latent shards (shard_datasets.py) read the same rows
    from their index and the same tensors out of a tar."""

    def __init__(self, root: str | os.PathLike, patch: tuple[int, int, int], split: str = "",
                 heldout_fraction: float = 0.0):
        self.root = Path(root).expanduser()
        meta = read_cache_info(self.root)
        manifest = self.root / MANIFEST
        if not manifest.is_file():
            raise ValueError(f"{manifest} not found: the cache tool did not finish; run it again (it resumes)")
        rows = parsed_once(manifest, _manifest_rows)  # once per process while unchanged: every dataset build asks
        if meta.get("null_text_emb"):
            member_name(meta["null_text_emb"], str(self.root / META))
            check_tensor_file(self.root / meta["null_text_emb"], "text_emb")
        self.keep_rows(meta, rows, patch, split, heldout_fraction, f"the latent cache {self.root}")

    def keep_rows(self, meta: dict, rows: list[dict], patch: tuple[int, int, int], split: str,
                  heldout_fraction: float, where: str) -> None:
        """Keep the rows ({source, caption, latent_shape, ...}, in sample order) of `split` whose
        latent grid holds at least one patch; `where` names the data in errors."""
        self.meta = meta
        self.patch = tuple(patch)
        self.latent_channels = int(meta["latent_channels"])
        self.text_dim = int(meta.get("text_dim", 0))
        self.rows: list[dict] = []
        self.skipped: list[tuple[str, str]] = []
        pt, ph, pw = self.patch
        for row in rows:
            if split and in_heldout(Path(row["source"]).name, heldout_fraction) != (split == "heldout"):
                continue
            _, f, h, w = row["latent_shape"]
            if f < pt or h < ph or w < pw:
                self.skipped.append((row.get("file") or row["source"],
                                     f"latent grid {f}x{h}x{w} is smaller than one patch {self.patch}"))
            else:
                self.rows.append(row)
        if self.skipped:
            log.warning("skipped %d cached clip(s) smaller than one patch, e.g. %s", len(self.skipped), self.skipped[0][0])
        if not self.rows:
            raise ValueError(f"{where} has no usable sample "
                             f"({len(self.skipped)} smaller than model.patch_size={list(self.patch)}; the patch applies "
                             f"to the latent grid: use a small one such as model.patch_size=[1,2,2])")

    def __len__(self) -> int:
        return len(self.rows)

    def num_tokens(self, i: int) -> int:
        _, f, h, w = self.rows[i]["latent_shape"]
        pt, ph, pw = self.patch
        return (f // pt) * (h // ph) * (w // pw)

    def lengths(self) -> list[int]:
        return [self.num_tokens(i) for i in range(len(self))]

    def captions(self) -> list[str]:
        """Each sample's caption, in sample order (the resume check's content fingerprint)."""
        return [row["caption"] for row in self.rows]

    def audio_token_count(self, i: int) -> int:
        """Audio tokens of sample i (its cached audio latents; 0 without), from the manifest."""
        return int(self.rows[i].get("audio_len", 0))

    def frames(self, i: int) -> int:
        """Latent frames sample i is trained with (cropped to a multiple of the temporal patch, as read)."""
        f = self.rows[i]["latent_shape"][1]
        return f - f % self.patch[0]

    def tensors(self, row: dict) -> dict[str, torch.Tensor]:
        """The sample's stored tensors (`latents`, optional `text_emb`); VideoReadError when they
        cannot be read (skipped and counted by the task)."""
        try:
            return load_file(str(self.root / row["file"]))
        except Exception as err:  # missing or truncated file
            raise VideoReadError(f"cannot read cached latents {self.root / row['file']}: {err}") from err

    def __getitem__(self, i: int) -> VideoSample:
        row = self.rows[i]
        t = self.tensors(row)
        z = t["latents"].float()
        _, f, h, w = z.shape
        pt, ph, pw = self.patch
        z = z[:, : f - f % pt, : h - h % ph, : w - w % pw].contiguous()
        emb = t.get("text_emb")
        sample = VideoSample(z, row["caption"], emb.float() if emb is not None else None)
        if "cond_latents" in t:  # Wan 2.1 I2V (i2v_cache.py): cropped like the latents
            sample.cond_latents = t["cond_latents"].float()[:, : z.shape[1], : z.shape[2], : z.shape[3]].contiguous()
        if "image_emb" in t:
            sample.image_emb = t["image_emb"].float()
        crop = (slice(None, z.shape[1]), slice(None, z.shape[2]), slice(None, z.shape[3]))
        if "mask_sums" in t:  # data.masks (CompanionEncoder): each voxel a sum over t·s·s pixels
            pixels = int(self.meta["scale_factor_temporal"]) * int(self.meta["scale_factor_spatial"]) ** 2
            sample.mask = LatentMask(t["mask_sums"][crop].to(torch.int64).contiguous(), pixels)
        if "control_latents" in t:  # cond.control: the control video's latents, cropped like the clip's
            sample.control = t["control_latents"].float()[(slice(None), *crop)].contiguous()
        if "control_inactive_latents" in t:  # Wan VACE's inactive video of a control without mask
            sample.control_inactive = t["control_inactive_latents"].float()[(slice(None), *crop)].contiguous()
        if "audio_latents" in t:  # --audio-vae: LTX-2's audio tokens [n, token_dim] (the frames' whole span)
            sample.audio_latents = t["audio_latents"].float()
        return sample

    def null_text_emb(self) -> torch.Tensor:
        """[Lt0, text_dim]: the empty caption's embedding (caption dropout, classifier-free guidance)."""
        if not self.meta.get("null_text_emb"):
            raise ValueError(f"the latent cache {self.root} has no text embeddings (cached without --text-encoder)")
        return load_file(str(self.root / self.meta["null_text_emb"]))["text_emb"].float()


def check_tensor_file(path: Path, key: str) -> None:
    """Refuse (ValueError naming the file) a safetensors file that does not open or lacks `key`:
    read at every caption dropout, a damaged one was a traceback mid-run. Reads the header only."""
    try:
        with safe_open(str(path), "pt") as f:
            if key not in f.keys():
                raise ValueError(f"holds no {key!r}")
    except Exception as err:  # safetensors' own error types for a truncated or foreign file
        raise ValueError(f"{path} is damaged ({str(err).splitlines()[0] if str(err) else type(err).__name__}); run "
                         f"tools.cache_latents into this cache again (it rewrites it)") from None


def load_decoder(root: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cache's VAE decoder: normalized latents [C, f, h, w] -> pixels [3, F, H, W] in [-1, 1]
    (F = 1 + t·(f - 1), H = s·h, W = s·w), for validation videos."""
    meta = read_cache_info(root)
    return VaeCodec(meta["vae"], device, dtype).decode


@dataclass
class CacheSettings:
    """What decides the content of a cache (its fingerprint): change one, use a new folder."""

    vae: str
    text_encoder: str
    tokenizer: str
    max_text_len: int
    dtype: str
    source: dict
    i2v: dict = None  # i2v_cache.I2VEncoder.meta(); None = no I2V tensors (and out of the fingerprint)
    companions: list = None  # CompanionEncoder.kinds ("mask", "control"); None = none (and out of the fingerprint)
    audio: dict = None  # AudioLatentCodec.meta(); None = no audio latents (and out of the fingerprint)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("i2v", "companions", "audio") or v}


def uncached_companions(meta: dict, wanted: tuple[str, ...], where: str) -> list[str]:
    """One line per companion kind the run needs (data.masks: "mask", cond.control: "control")
    that the cache or latent shards `where` (meta.json: settings.companions) were written without."""
    have = (meta.get("settings") or {}).get("companions") or []
    flags = {"mask": "--masks", "control": "--control"}
    return [f"{KEYS[k]}=true but {where} was cached without {'masks' if k == 'mask' else 'control videos'}: cache it "
            f"again with python -m dit_train.tools.cache_latents {flags[k]} (into a new --out), or set {KEYS[k]}=false"
            for k in wanted if k not in have]
