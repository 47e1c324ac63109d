"""LTX-2's audio latents: a clip's sound as the tokens LTX-2's transformer takes (`AudioLatentCodec`).

waveform float32 [N] mono, 16 kHz (audio_io: PyAV resampled and downmixed)
  -> the audio VAE's channels: mono repeated to its `in_channels` (2 for LTX-2: the stereo input of
     a mono track, as diffusers' Echo `_normalize_waveform` does)
  -> log-mel [1, in_channels, T, mel_bins]: |STFT| (torch.stft) through a slaney mel filter bank
     (transformers' `mel_filter_bank`), log(max(·, 1e-5)); T = N // hop + 1
  -> `AutoencoderKLLTX2Audio.encode(...).latent_dist.mode()` [1, C, 1 + (T - 1) // 4, mel_bins / 4]
  -> LTX2Pipeline's `_pack_audio_latents` [n, C · mel_bins / 4] and `_normalize_audio_latents`
     (the inverse of what the pipeline applies before `audio_vae.decode`).

The mel settings. LTX2Pipeline itself only decodes (text-to-audio+video), so they are read off
diffusers' one encode path for this VAE, the Echo modular pipeline's `_encode_audio`
(diffusers/modular_pipelines/echo/encoders.py): torchaudio's MelSpectrogram with n_fft = win_length
= 1024, hop = the VAE config's `mel_hop_length`, f_min 0, f_max = sample_rate / 2, n_mels = the
config's `mel_bins`, a periodic Hann window, center=True with reflect padding, power 1, slaney mel
scale and norm, then log(clamp(·, 1e-5)); a waveform shorter than n_fft is zero-padded to n_fft.
torchaudio is not installed here, so the same transform is composed from torch.stft and
transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")` (torchaudio's MelSpectrogram is
exactly Spectrogram(power=1) then that filter bank); the numbers below are Echo's, the rest is
the VAE's config. FastVideo's and SimpleTuner's LTX-2 trainers use the same settings.

Alignment: a clip's audio latents cover exactly its kept frames' time span. The video VAE keeps
F' = 1 + t·k of the clip's F frames, so the sound is cut to the first round(span · F' / F)
samples of its span (span: the kept frames' samples at 16 kHz; a `short` track: what there is),
and of the VAE's 1 + (T - 1) // 4 latents the first round(samples / (hop · 4)) are kept:
LTX2Pipeline's `audio_num_frames` for that duration (25 a second for LTX-2), the VAE's last
causal latent (which reads past the end) trimmed. A span under one latent gives no audio latent.
"""
from __future__ import annotations

from typing import Callable

import torch

from dit_train.data_pipelines.audio_io import SAMPLE_RATE, resample
from dit_train.data_pipelines.latent_encoders import component_path

N_FFT = 1024  # diffusers' Echo `_encode_audio`: n_fft = win_length (module docstring)
MEL_FLOOR = 1e-5  # ... and log(clamp(mel, min=1e-5))


def _load(cls_name: str, path: str, dtype: torch.dtype, allow_pickle: bool, what: str):
    """diffusers' `cls_name` from a local folder, or one ValueError line naming it."""
    import diffusers  # deferred: diffusers takes ~2 s to import; only audio latents need it
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    cls = LTX2Vocoder if cls_name == "LTX2Vocoder" else getattr(diffusers, cls_name)
    try:
        return cls.from_pretrained(path, torch_dtype=dtype, use_safetensors=not allow_pickle).eval()
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"the {what} folder {path} cannot be loaded as a {cls_name} ({first})") from None


class AudioLatentCodec:
    """LTX-2's audio VAE (+ its vocoder, for decoding) from local folders: waveform [N] at 16 kHz
    <-> normalized audio tokens [n, token_dim], token_dim = latent_channels · mel_bins / 4.

    path: an AutoencoderKLLTX2Audio folder, or a pipeline folder holding audio_vae/; vocoder: an
    LTX2Vocoder folder or a pipeline folder holding vocoder/ ("" = `path`'s pipeline vocoder/ when
    there is one; without a vocoder `decode` refuses)."""

    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 vocoder: str = "", allow_pickle: bool = False):
        from transformers.audio_utils import mel_filter_bank  # deferred: optional (the text extra)

        self.path = component_path(path, "audio_vae")
        self.device, self.dtype, self.allow_pickle = torch.device(device), dtype, allow_pickle
        self.vae = _load("AutoencoderKLLTX2Audio", self.path, dtype, allow_pickle, "audio VAE").to(self.device)
        cfg = self.vae.config
        self.rate, self.hop, self.mel_bins = int(cfg.sample_rate), int(cfg.mel_hop_length), int(cfg.mel_bins)
        self.channels, self.latent_channels = int(cfg.in_channels), int(cfg.latent_channels)
        self.latent_mel = self.mel_bins // self.vae.mel_compression_ratio
        self.token_dim = self.latent_channels * self.latent_mel
        self.per_token = self.hop * self.vae.temporal_compression_ratio  # waveform samples a latent (640)
        if self.rate != SAMPLE_RATE:
            raise ValueError(f"the audio VAE {self.path} takes {self.rate} Hz audio; clips' sound is read at "
                             f"{SAMPLE_RATE} Hz (LTX-2's rate): resampling to another rate is not built")
        if self.vae.latents_mean.numel() != self.token_dim:
            raise ValueError(f"the audio VAE {self.path} has {self.vae.latents_mean.numel()} latents_mean values for "
                             f"{self.token_dim} token features (latent_channels x mel_bins / 4): LTX2Pipeline could not "
                             "normalise its latents")
        fb = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=self.mel_bins, min_frequency=0.0,
                             max_frequency=self.rate / 2.0, sampling_rate=self.rate, norm="slaney", mel_scale="slaney")
        self.filters = torch.from_numpy(fb.T.copy()).float()  # [mel_bins, N_FFT // 2 + 1]
        if not vocoder:
            p = path.rstrip("/")
            vocoder = p if component_path(p, "vocoder") != p else ""
        self.vocoder_path = component_path(vocoder, "vocoder") if vocoder else ""
        self._vocoder = None

    def meta(self) -> dict:
        """What a cache records (meta.json `audio`; its fingerprint's settings)."""
        return {"audio_vae": self.path, "vocoder": self.vocoder_path, "token_dim": self.token_dim,
                "latent_channels": self.latent_channels, "latent_mel_bins": self.latent_mel,
                "samples_per_token": self.per_token, "sample_rate": self.rate}

    def tokens_for(self, samples: int) -> int:
        """Audio tokens of `samples` waveform samples: LTX2Pipeline's round(duration · rate / hop / 4)."""
        return int(round(samples / self.per_token))

    def mel(self, wave: torch.Tensor) -> torch.Tensor:
        """float32 [N] -> log-mel [1, in_channels, N' // hop + 1, mel_bins] (N' = max(N, N_FFT))."""
        x = wave.float().reshape(1, -1)
        if x.shape[1] < N_FFT:  # as Echo's _encode_audio: a short span is zero-padded to one window
            x = torch.nn.functional.pad(x, (0, N_FFT - x.shape[1]))
        spec = torch.stft(x, N_FFT, self.hop, N_FFT, torch.hann_window(N_FFT), center=True, pad_mode="reflect",
                          return_complex=True).abs()  # [1, N_FFT // 2 + 1, T]
        mel = torch.log(torch.clamp(self.filters @ spec, min=MEL_FLOOR))  # [1, mel_bins, T]
        return mel.transpose(1, 2).unsqueeze(0).expand(1, self.channels, -1, -1)

    @torch.no_grad()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """float32 [N] mono at 16 kHz -> normalized tokens [round(N / per_token), token_dim] float32
        ([0, token_dim] for a span under half a latent)."""
        from diffusers import LTX2Pipeline  # deferred: diffusers takes ~2 s to import

        n = self.tokens_for(wave.numel())
        if n == 0:
            return torch.zeros(0, self.token_dim)
        z = self.vae.encode(self.mel(wave).to(self.device, self.dtype)).latent_dist.mode().float()  # [1, C, L, M']
        if z.shape[2] < n:
            raise RuntimeError(f"the audio VAE {self.path} gave {z.shape[2]} latents for {wave.numel()} samples; "
                               f"expected at least {n} (one per {self.per_token} samples)")
        tokens = LTX2Pipeline._pack_audio_latents(z[:, :, :n])  # [1, n, C · M']
        mean, std = self.vae.latents_mean.float(), self.vae.latents_std.float()
        return LTX2Pipeline._normalize_audio_latents(tokens, mean, std)[0].cpu().contiguous()

    @property
    def vocoder(self):
        if self._vocoder is None:
            if not self.vocoder_path:
                raise ValueError(f"no vocoder for the audio VAE {self.path}: give the pipeline folder (vocoder/ beside "
                                 "audio_vae/) or a vocoder folder, to turn audio latents into sound")
            self._vocoder = _load("LTX2Vocoder", self.vocoder_path, self.dtype, self.allow_pickle, "vocoder").to(self.device)
        return self._vocoder

    @property
    def output_rate(self) -> int:
        """The vocoder's waveform rate (LTX-2's: 24 kHz)."""
        return int(self.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normalized tokens [n, token_dim] -> float32 [M] mono waveform at `output_rate` (the
        vocoder's channels averaged), as LTX2Pipeline decodes: un-normalise, unpack, the audio
        VAE's decoder, the vocoder."""
        from diffusers import LTX2Pipeline  # deferred: diffusers takes ~2 s to import

        mean, std = self.vae.latents_mean.float(), self.vae.latents_std.float()
        z = LTX2Pipeline._denormalize_audio_latents(tokens.float()[None].cpu(), mean.cpu(), std.cpu())
        z = LTX2Pipeline._unpack_audio_latents(z, tokens.shape[0], num_mel_bins=self.latent_mel)  # [1, C, n, M']
        mel = self.vae.decode(z.to(self.device, self.dtype), return_dict=False)[0]
        return self.vocoder(mel)[0].float().mean(0).cpu()


def kept_span(samples: int, span: int, frames: int, usable: int) -> int:
    """Waveform samples of a clip's sound that its cached video frames cover: of `frames` frames
    (their span: `span` samples at 16 kHz) the video VAE keeps the first `usable`; a short track
    (`samples` < span) keeps what it has."""
    return min(samples, int(round(span * usable / frames))) if frames > 0 else 0


class LatentSound:
    """Sampling sound on a run of cached audio latents (DataSource.sound): how many audio tokens a
    clip gets and how they become a waveform.

    codec: the cache's AudioLatentCodec; pixel_frames: latent shape (C, f, h, w) -> the frames its
    video decodes to (VaeCodec.pixel_shape); fps: the clips' frame rate (model.fps: LTX2Pipeline's
    frame_rate)."""

    def __init__(self, codec: AudioLatentCodec, pixel_frames: Callable[[tuple], int], fps: float):
        self.codec, self.pixel_frames, self.fps = codec, pixel_frames, float(fps)

    def tokens(self, shape: tuple[int, ...]) -> int:
        """Audio tokens of a clip of latent `shape`: LTX2Pipeline's round(frames / frame_rate · 25)."""
        return self.codec.tokens_for(int(round(self.pixel_frames(shape) / self.fps * SAMPLE_RATE)))

    def waveform(self, tokens: torch.Tensor) -> torch.Tensor:
        """Generated tokens [n, token_dim] -> float32 [N] mono at 16 kHz (audio VAE + vocoder, then
        PyAV's resampler from the vocoder's rate), what the mp4s' AAC tracks carry."""
        wave = self.codec.decode(tokens).numpy()
        return torch.from_numpy(resample(wave, self.codec.output_rate, SAMPLE_RATE))
