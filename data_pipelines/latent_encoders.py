"""The encoders a latent cache is made with: a diffusers video VAE (`VaeCodec`: pixels <->
normalized latents) and a transformers caption encoder (`TextEncoder`), each from a local folder
(`component_path`: a component folder, or a whole pipeline folder holding it). The cache folder
itself (layout, writing, reading back) is latent_cache.py."""
from __future__ import annotations

from pathlib import Path

import torch


def component_path(path: str, sub: str) -> str:
    """`path`, or `path/sub` when `path` is a whole diffusers pipeline folder (vae/, text_encoder/, ...).
    A path that is not a local folder is a ValueError naming it (diffusers and transformers would
    take it for a hub id and fail on the network)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"{path}: no such folder (the {sub} must be a local diffusers / transformers folder or a "
                         f"pipeline folder holding {sub}/; hub ids are not downloaded)")
    return str(p / sub) if (p / sub / "config.json").is_file() or (p / sub / "tokenizer_config.json").is_file() else str(p)


class VaeCodec:
    """A diffusers video VAE from a local folder: pixels [3, F, H, W] in [-1, 1] <-> normalized
    latents [C, f, h, w], f = 1 + (F - 1) / t, h = H / s, w = W / s (t, s: its compression)."""

    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 tiling: bool = False, allow_pickle: bool = False):
        from diffusers import AutoModel  # deferred: diffusers takes ~2 s to import; only latent caches need a VAE

        self.path = component_path(path, "vae")
        self.device, self.dtype = torch.device(device), dtype
        # safetensors only unless asked: pickled weights (.bin) can run code when loaded
        try:
            self.vae = AutoModel.from_pretrained(self.path, torch_dtype=dtype, use_safetensors=not allow_pickle)
        except (OSError, ValueError) as err:  # no weights there, .bin only, a damaged file: one line naming it
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"the VAE folder {self.path} cannot be loaded ({first}); it must hold a diffusers VAE in "
                             f"safetensors (the one the latent cache was made with)") from None
        self.vae = self.vae.to(self.device).eval()
        if tiling and hasattr(self.vae, "enable_tiling"):
            self.vae.enable_tiling()
        cfg = self.vae.config
        self.latent_channels = int(cfg.get("z_dim") or cfg.get("latent_channels"))
        self.temporal = int(cfg.get("scale_factor_temporal") or getattr(self.vae, "temporal_compression_ratio", 1) or 1)
        self.spatial = int(getattr(self.vae, "spatial_compression_ratio", None) or cfg.get("scale_factor_spatial") or 8)
        if cfg.get("latents_mean") is not None and cfg.get("latents_std") is not None:
            mean, std = list(cfg["latents_mean"]), list(cfg["latents_std"])
        elif isinstance(getattr(self.vae, "latents_mean", None), torch.Tensor):
            # LTX-Video keeps its per-channel statistics as weights (buffers), and LTXPipeline
            # normalizes (z - mean) · scaling_factor / std: the same map with std / scaling_factor
            scale = float(cfg.get("scaling_factor") or 1.0)
            mean, std = self.vae.latents_mean.float().tolist(), (self.vae.latents_std.float() / scale).tolist()
        else:  # one scalar for all channels (CogVideoX, HunyuanVideo, ...)
            mean = [float(cfg.get("shift_factor") or 0.0)] * self.latent_channels
            std = [1.0 / float(cfg.get("scaling_factor") or 1.0)] * self.latent_channels
        self.latents_mean, self.latents_std = [float(m) for m in mean], [float(s) for s in std]
        if len(self.latents_mean) != self.latent_channels:
            raise ValueError(f"VAE {self.path}: latents_mean has {len(self.latents_mean)} entries for "
                             f"{self.latent_channels} latent channels")
        self._mean = torch.tensor(self.latents_mean).view(-1, 1, 1, 1)
        self._std = torch.tensor(self.latents_std).view(-1, 1, 1, 1)

    @property
    def class_name(self) -> str:
        return type(self.vae).__name__

    def usable_frames(self, frames: int) -> int:
        """The longest 1 + t·k prefix of `frames` (causal video VAEs encode frame 0 alone)."""
        return 1 + (frames - 1) // self.temporal * self.temporal if frames > 0 else 0

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return (self.latent_channels, 1 + (self.usable_frames(frames) - 1) // self.temporal,
                height // self.spatial, width // self.spatial)

    def pixel_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """[3, F, H, W] of the pixels whose latents have `latent_shape` [C, f, h, w]: F = 1 + t·(f − 1)
        (the inverse of latent_shape on usable frames)."""
        _, f, h, w = latent_shape
        return (3, 1 + self.temporal * (f - 1), h * self.spatial, w * self.spatial)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, F, H, W] in [-1, 1] (H, W multiples of s) -> normalized latents [C, f, h, w] float32
        (the posterior's mode: deterministic, as Wan's pipelines do). Frames past 1 + t·k are dropped."""
        c, f, h, w = pixels.shape
        if h % self.spatial or w % self.spatial:
            raise ValueError(f"frame size {h}x{w} is not a multiple of the VAE's spatial factor {self.spatial}")
        x = pixels[:, : self.usable_frames(f)].unsqueeze(0).to(self.device, self.dtype)
        dist = self.vae.encode(x).latent_dist
        z = dist.mode()[0].float().cpu()
        want = self.latent_shape(f, h, w)
        if tuple(z.shape) != want:
            raise RuntimeError(f"VAE {self.path} returned latents {tuple(z.shape)} for pixels {tuple(pixels.shape)}; "
                               f"expected {want} from its compression factors (t={self.temporal}, s={self.spatial})")
        return (z - self._mean) / self._std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [C, f, h, w] -> pixels [3, F, H, W] in [-1, 1], float32 on the CPU."""
        z = latents.float().cpu() * self._std + self._mean
        x = self.vae.decode(z.unsqueeze(0).to(self.device, self.dtype)).sample[0]
        return x.float().clamp(-1, 1).cpu()


class TextEncoder:
    """Captions -> embeddings [Lt, text_dim] float32 of the valid tokens (no padding), with a
    transformers tokenizer and encoder from local folders (T5 / UMT5 / mT5: encoder only).
    HunyuanVideo 1.5's MLLM (a Qwen2.5-VL text model) is read as its pipeline does: the prompt
    in its chat template, the third-to-last hidden layer, the template's tokens cropped
    (`HunyuanVideo15Pipeline._get_mllm_prompt_embeds` itself); max_length counts the caption's."""

    ENCODER_ONLY = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
    MLLM = ("qwen2_5_vl_text",)  # HunyuanVideo 1.5's text encoder

    def __init__(self, path: str, tokenizer: str = "", max_length: int = 512, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, allow_pickle: bool = False):
        import transformers  # deferred: optional (the text extra); only caption encoders need it

        self.path = component_path(path, "text_encoder")
        self.tokenizer_path = component_path(tokenizer or path, "tokenizer")
        self.max_length = max_length
        self.device = torch.device(device)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.tokenizer_path)
        config = transformers.AutoConfig.from_pretrained(self.path)
        cls = getattr(transformers, self.ENCODER_ONLY.get(config.model_type, "AutoModel"))
        model = cls.from_pretrained(self.path, torch_dtype=dtype, use_safetensors=not allow_pickle)
        if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
            model = model.get_encoder()
        self.model = model.to(self.device).eval()
        self.text_dim = int(getattr(config, "d_model", None) or config.hidden_size)
        self.mllm = config.model_type in self.MLLM

    @torch.no_grad()
    def encode(self, caption: str) -> torch.Tensor:
        if self.mllm:
            from diffusers import HunyuanVideo15Pipeline  # deferred: diffusers takes ~2 s to import

            emb, mask = HunyuanVideo15Pipeline._get_mllm_prompt_embeds(self.model, self.tokenizer, caption.strip(),
                                                                       self.device, tokenizer_max_length=self.max_length)
            return emb[0][mask[0].bool()].float().cpu().contiguous()
        enc = self.tokenizer([caption.strip()], max_length=self.max_length, truncation=True,
                             padding=False, return_attention_mask=True, return_tensors="pt")
        ids, mask = enc.input_ids.to(self.device), enc.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
        return hidden[mask[0].bool()].float().cpu().contiguous()
