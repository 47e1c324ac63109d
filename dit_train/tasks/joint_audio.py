"""Audio tokens as a second stream of the pack, for the two-stream DiT (model.audio_patch > 0).

Each clip's sound (VideoSample.audio, 16 kHz mono, data.audio) is cut into tokens of
`audio_patch` waveform samples (each token those samples, or their log-magnitude STFT frames:
model.audio_features) and noised with the clip's own t (its own noise stream). Right
after each clip's video tokens come its n_k audio tokens, with the clip's seg, in-clip order
after its video and `stream` 1 (PackedBatch.stream): the clip's attention run is then the joint
audio↔video one, whatever the backend, and CP (Ulysses, ring) splits it like any run — a CP rank
may hold only a clip's video, or only its audio. Audio tokens are supervised (weight 1): they
count in T_{b,audio}, and the metadata sync counts each stream apart (loss/counts.py). Their
RoPE position is (the time of their first sample in temporal patches, fractional, 0, 0): aligned
in time with the video, and each token of a temporal patch at its own time (the same position
for all of them would make them interchangeable to attention: a click could not be placed in
one). A clip without sound has no audio token and is not in B_audio.

Nothing here communicates.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dit_train.batch import STREAMS, WEIGHT_ONE, PackedBatch
from dit_train.data_pipelines.audio_features import encode, token_width
from dit_train.data_pipelines.audio_io import SAMPLE_RATE
from dit_train.rng import sample_generator


def audio_tokens(wave: torch.Tensor | None, audio_patch: int, features: str = "wave") -> torch.Tensor:
    """float32 [N] waveform -> [N // audio_patch, W] tokens (the tail under one token dropped): W =
    audio_patch samples, or their log-magnitude STFT frames (model.audio_features=spectrogram,
    data_pipelines/audio_features.py); no sound -> [0, W]."""
    if wave is None:
        return torch.zeros(0, token_width(audio_patch, features))
    return encode(wave, audio_patch, features)


def audio_positions(n: int, audio_patch: int, fps: float, pt: int, index: bool = False) -> torch.Tensor:
    """RoPE positions of a clip's n audio tokens: float32 [n, 3] (time of the token's first sample
    in temporal patches of `pt` frames at `fps` kept frames a second, 0, 0) — a video token of
    temporal patch p sits at p, so 500-sample tokens at 8 fps with pt = 2 sit at 0, 1/8, 2/8, ...
    and the 8 tokens of a patch are told apart (they shared floor(·) = p before: attention could
    not place a click in one of them) — or with `index` int64 (j, 0, 0) for its j-th token (LTX-2
    places audio tokens by their own time: ModelSpec.audio_positions)."""
    if index:
        return torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)], 1)
    time = torch.arange(n, dtype=torch.float64) * (audio_patch * fps / SAMPLE_RATE / pt)
    return torch.stack([time, torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)], 1).float()


def given_stream(seed: int, sample_id: int, step: int, which: int, prob: float) -> int:
    """The stream given clean to a clip with sound at `step` (`which`: cond.given_stream's index in
    STREAMS, 0 video, 1 audio; -1 none), or -1: a draw of the "conditioning" stream of (seed, id,
    step) below `prob` (the frame conditioning that also draws there is refused with an audio stream)."""
    if which < 0 or prob <= 0:
        return -1
    hit = bool(torch.rand((), generator=sample_generator(seed, sample_id, step, "conditioning")) < prob)
    return which if hit else -1


def join_audio_tokens(batch: PackedBatch, x: list[torch.Tensor], target: list[torch.Tensor] | None,
                      pos: list[torch.Tensor], weight: list[torch.Tensor] | None = None,
                      clean: list[torch.Tensor] | None = None, sync: list[torch.Tensor] | None = None) -> PackedBatch:
    """`batch` (clips contiguous and in seg order, no padding, as pack_clips builds it) with clip
    k's audio tokens after its video tokens: x[k], target[k] [n_k, P], pos[k] [n_k, 3]. Token
    fields x and target become [L + Σ n_k, max(D, P)] (zeros pad the narrower stream); stream
    is 0 on video, 1 on audio; pos is float32 when pos[k] is (fractional times). target None: a sampler's pack (no target field). weight [n_k]
    int64 (units of 1/WEIGHT_ONE; default whole tokens) and clean [n_k] bool (tokens given at
    timestep 0; default none) of the audio tokens join the video's when either side has them;
    sync [n_k] float32 (model.sync_encoder, tasks/av_sync.py) becomes tokens["sync"], 0 on video."""
    S = batch.num_samples
    counts = torch.tensor([t.shape[0] for t in x], dtype=torch.long)
    clip_len = torch.bincount(batch.seg, minlength=S)[:S] if batch.num_tokens else torch.zeros(S, dtype=torch.long)
    seg_a = torch.repeat_interleave(torch.arange(S), counts)
    j = torch.arange(seg_a.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    seg = torch.cat([batch.seg, seg_a])
    where = torch.argsort(seg, stable=True)  # each clip's video tokens, then its audio tokens
    P = x[0].shape[1] if x else 0
    width = max(batch.tokens["x"].shape[1], P)

    def field(video: torch.Tensor, audio: list[torch.Tensor]) -> torch.Tensor:
        a = torch.cat(audio) if audio else video.new_zeros(0, P)
        pad = lambda y: torch.nn.functional.pad(y.to(video.dtype), (0, width - y.shape[1]))  # noqa: E731
        return torch.cat([pad(video), pad(a)])[where]

    tokens = {"x": field(batch.tokens["x"], x)}
    if target is not None:
        tokens["target"] = field(batch.tokens["target"], target)
    A = seg_a.numel()
    if clean is not None or "clean" in batch.tokens:
        video = batch.tokens.get("clean", torch.zeros(batch.num_tokens, dtype=torch.bool))
        tokens["clean"] = torch.cat([video, torch.cat(clean) if clean else torch.zeros(A, dtype=torch.bool)])[where]
    if sync is not None:
        tokens["sync"] = torch.cat([torch.zeros(batch.num_tokens), torch.cat(sync).float() if sync else torch.zeros(A)])[where]
    stream = torch.cat([torch.zeros(batch.num_tokens, dtype=torch.long), torch.ones(A, dtype=torch.long)])
    pos_a = torch.cat(pos) if pos else batch.pos.new_zeros(0, 3)
    # fractional audio times make the pack's pos float32: the video's integer positions are exact
    # in it, and RoPE reads pos.float() anyway (the video's rotations are unchanged)
    dtype = torch.promote_types(batch.pos.dtype, pos_a.dtype)
    pos_all = torch.cat([batch.pos.to(dtype), pos_a.to(dtype)])
    out = replace(batch, seg=seg[where], pos=pos_all[where],
                  order=torch.cat([batch.order, clip_len[seg_a] + j])[where],
                  valid=torch.cat([batch.valid, torch.ones(A, dtype=torch.bool)])[where],
                  tokens=tokens, stream=stream[where], weight=None)
    if weight is None and batch.weight is None:
        return out
    w_a = torch.cat(weight) if weight else torch.full((A,), WEIGHT_ONE, dtype=torch.int64)
    return out.with_weight(torch.cat([batch.weight_units(), w_a])[where])
