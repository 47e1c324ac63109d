"""What diffusers' Wan 2.1 I2V layout needs beside a clip's latents, cached once per clip
(`tools.cache_latents --i2v first_frame|first_last [--image-encoder FOLDER]`).

`WanImageToVideoPipeline` (without `expand_timesteps`) builds, for an image and a clip of N frames:

    cond_latents  the VAE encoding of [image, zeros × (N - 1)] as ONE clip (FLF2V: [first,
                  zeros × (N - 2), last]), normalized like the latents. Wan's VAE is causal:
                  the zeros' latents depend on the image before them, so this is not the
                  clip's first latent frame followed by zeros, and is stored per clip.
    image_emb     the CLIP vision encoder's penultimate hidden states of the image
                  [257, 1280] (FLF2V: both images', [2 × 257, 1280], first then last).

The mask channels follow from the kind alone (tasks/conditioning.py, `i2v_mask`). Nothing here
communicates.
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from dit_train.data_pipelines.latent_encoders import VaeCodec, component_path

I2V_KINDS = ("first_frame", "first_last")


def condition_clip(pixels: torch.Tensor, kind: str, usable: int) -> torch.Tensor:
    """[3, usable, H, W]: the first `usable` frames of `pixels` [3, F, H, W] with every frame but
    the first (first_last: and the last) zeroed, as WanImageToVideoPipeline.prepare_latents."""
    clip = torch.zeros_like(pixels[:, :usable])
    clip[:, 0] = pixels[:, 0]
    if kind == "first_last":
        clip[:, usable - 1] = pixels[:, usable - 1]
    return clip


def to_uint8_image(frame: torch.Tensor):
    """A [3, H, W] frame in [-1, 1] as the PIL image a pipeline user would pass."""
    return Image.fromarray(((frame.float() + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())


def processor_folder(root: Path, encoder: Path) -> str:
    """Where the CLIP image processor of `root` is: a pipeline's image_processor/, the encoder
    folder's sibling image_processor/, or the encoder folder itself."""
    for p in (root / "image_processor", encoder.parent / "image_processor"):
        if (p / "preprocessor_config.json").is_file():
            return str(p)
    return str(encoder)


class ImageEncoder:
    """transformers' CLIPVisionModel + CLIPImageProcessor from a local folder (or a Wan I2V
    pipeline folder's image_encoder/ and image_processor/): images -> the penultimate hidden
    states [tokens, width] float32, as WanImageToVideoPipeline.encode_image."""

    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 allow_pickle: bool = False, processor: str = ""):
        from transformers import CLIPImageProcessor, CLIPVisionModel  # deferred: only I2V caches need CLIP

        self.path = component_path(path, "image_encoder")
        self.processor_path = processor or processor_folder(Path(path).expanduser(), Path(self.path))
        self.processor = CLIPImageProcessor.from_pretrained(self.processor_path)
        self.model = CLIPVisionModel.from_pretrained(self.path, torch_dtype=dtype, use_safetensors=not allow_pickle)
        self.model = self.model.to(device).eval()
        self.device, self.dtype = torch.device(device), dtype
        self.width = int(self.model.config.hidden_size)

    @torch.no_grad()
    def encode(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """[n · tokens, width]: the images ([3, H, W] in [-1, 1]) encoded, concatenated in order."""
        inputs = self.processor(images=[to_uint8_image(f) for f in frames], return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.dtype)
        hidden = self.model(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]
        return hidden.float().cpu().flatten(0, 1)


class I2VEncoder:
    """The I2V tensors of one clip: `cond_latents` [C, f, h, w] and, with an image encoder,
    `image_emb` [n · tokens, width] (n = 1, or 2 for first_last)."""

    def __init__(self, vae: VaeCodec, kind: str, image_encoder: ImageEncoder | None):
        if kind not in I2V_KINDS:
            raise ValueError(f"--i2v {kind}: must be one of {', '.join(I2V_KINDS)}")
        self.vae, self.kind, self.image_encoder = vae, kind, image_encoder

    def meta(self) -> dict:
        """What meta.json records of the I2V tensors (the dataset checks it against cond.kind)."""
        enc = self.image_encoder
        return {"kind": self.kind, "image_encoder": enc.path if enc else "", "image_processor": enc.processor_path if enc else "",
                "image_dim": enc.width if enc else 0}

    def tensors(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        usable = self.vae.usable_frames(pixels.shape[1])
        out = {"cond_latents": self.vae.encode(condition_clip(pixels, self.kind, usable))}
        if self.image_encoder is not None:
            frames = [pixels[:, 0]] + ([pixels[:, usable - 1]] if self.kind == "first_last" else [])
            out["image_emb"] = self.image_encoder.encode(frames)
        return out
