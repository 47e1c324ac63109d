"""Video diffusion task: clips -> noisy packed patches -> per-token flow-matching loss."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from einops import rearrange
from torch import nn

from dit_train.data_pipelines.audio_io import SAMPLE_RATE
from dit_train.data_pipelines.companions import token_mask_units
from dit_train.data_pipelines.video_io import VideoReadError
from dit_train.batch import STREAMS, WEIGHT_ONE, PackedBatch, video_forward
from dit_train.config import LossConfig, ModelConfig
from dit_train.objectives.diffusion_forcing import history_weights, noisy_blocks
from dit_train.objectives.flow_matching import loss_weight, noisy_sample, per_token_mse, sample_shift, velocity_from_output
from dit_train.tasks.causal import kept_frames, trim_report
from dit_train.tasks.captions import ByteCaptionEncoder, drop_caption, pad_contexts
from dit_train.config.cond import cond_active
from dit_train.tasks.conditioning import (Conditioner, i2v_data_errors, masked, too_short, unconditionable_error, vace_context,
                                         vace_data_check)
from dit_train.rng import sample_generator
from dit_train.tasks.av_sync import clip_sync
from dit_train.tasks.joint_audio import audio_positions, audio_tokens, given_stream, join_audio_tokens
from dit_train.tasks.joint_text import join_text_tokens
from dit_train.tasks.video_inputs import video_inputs


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, F, H, W] -> tokens [T, C·pt·ph·pw] and their (t, h, w) grid positions [T, 3]."""
    pt, ph, pw = patch
    C, F, H, W = x.shape
    f, h, w = F // pt, H // ph, W // pw
    x = x[:, : f * pt, : h * ph, : w * pw]
    tokens = rearrange(x, "c (f pt) (h ph) (w pw) -> (f h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)
    grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
    return tokens, grid.reshape(-1, 3)


def num_patches(shape: tuple[int, ...] | torch.Size, patch: tuple[int, int, int]) -> int:
    """Tokens of a [C, F, H, W] clip once patchified (each side cut down to the patch)."""
    _, F, H, W = shape
    pt, ph, pw = patch
    return (F // pt) * (H // ph) * (W // pw)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int], channels: int) -> torch.Tensor:
    """Inverse of patchify: tokens [f·h·w, C·pt·ph·pw] -> [C, f·pt, h·ph, w·pw]."""
    f, h, w = grid
    pt, ph, pw = patch
    return rearrange(tokens, "(f h w) (c pt ph pw) -> c (f pt) (h ph) (w pw)", f=f, h=h, w=w, c=channels, pt=pt, ph=ph, pw=pw)


def pack_clips(clips: dict[str, list[torch.Tensor]], patch: tuple[int, int, int], patch_dim: int | dict[str, int],
               samples: dict[str, torch.Tensor], sample_ids: torch.Tensor,
               per_token: dict[str, list[torch.Tensor]] | None = None,
               weights: list[torch.Tensor] | None = None, causal_block: int = 0) -> PackedBatch:
    """Clips -> one bidirectional pack: tokens of clip k have seg k, in-clip order and (t, h, w)
    positions. `clips` maps a token field ("x", "target", ...) to one [C, F, H, W] tensor per
    clip (same clip sizes in every field; channels may differ); each field becomes
    tokens[field] [L, C·pt·ph·pw] (patch_dim: that width, or {field: width}). `per_token` adds
    fields given per token already ([T_k, ...] per clip, patchify's order); `weights` ([T_k]
    int64 per clip, units of 1/WEIGHT_ONE) sets the pack's loss weights (default: every token 1).
    causal_block > 0 (temporal patches per causal block, model.causal_block_frames / patch_size[0])
    makes the pack block-causal: each token's `block` is its temporal patch index // causal_block,
    so it sees its own block and the earlier ones of its clip (a clip's last block may be shorter).
    No clips -> an empty pack with the same fields."""
    per_token = per_token or {}
    first = next(iter(clips.values()))
    if not first:
        empty = torch.zeros(0, dtype=torch.long)
        dims = patch_dim if isinstance(patch_dim, dict) else {name: patch_dim for name in clips}
        tokens = {name: torch.zeros(0, dims[name]) for name in clips}
        tokens |= {name: torch.zeros(0, dtype=torch.bool) for name in per_token}
        batch = PackedBatch(seg=empty, pos=torch.zeros(0, 3, dtype=torch.long), order=empty,
                            valid=torch.zeros(0, dtype=torch.bool), tokens=tokens, samples=samples,
                            sample_ids=sample_ids, causal=causal_block > 0, block=empty if causal_block > 0 else None)
        return batch.with_weight(torch.zeros(0, dtype=torch.int64)) if weights is not None else batch
    tokens = {name: [] for name in clips}
    pos, seg, order = [], [], []
    for k in range(len(first)):
        for name, xs in clips.items():
            tok, grid = patchify(xs[k], patch)
            tokens[name].append(tok)
        n = tok.shape[0]
        pos.append(grid)
        seg.append(torch.full((n,), k, dtype=torch.long))
        order.append(torch.arange(n))
    seg_t = torch.cat(seg)
    fields = {name: torch.cat(t) for name, t in tokens.items()} | {name: torch.cat(v) for name, v in per_token.items()}
    pos_t = torch.cat(pos)
    # the grid's t is the temporal patch index: equal keys within a block (attention.VarlenLayout)
    block = pos_t[:, 0] // causal_block if causal_block > 0 else None
    batch = PackedBatch(seg=seg_t, pos=pos_t, order=torch.cat(order), valid=torch.ones_like(seg_t, dtype=torch.bool),
                        tokens=fields, samples=samples, sample_ids=sample_ids, causal=causal_block > 0, block=block)
    return batch.with_weight(torch.cat(weights)) if weights is not None else batch


log = logging.getLogger(__name__)

MASK_PROBE = 256  # samples data.masks reads at most before step 0 to find one whose mask weighs something


class VideoTask:
    """Builds packs of noisy video patches and scores the DiT's velocity prediction.

    dataset: indexable by sample id, returning an object with `.pixels` [C, F, H, W] (pixels
    in [-1, 1] or VAE latents), `.caption` and optionally `.text_emb` [Lt, text_dim] (cached
    text-encoder output). With model.text_dim > 0 every pack carries per-sample captions:
    samples["context"] [S, Lc, text_dim] and samples["context_len"] [S]. With `cond` (a
    CondConfig whose kind is not none) packs also carry loss weights (0 on context tokens) and
    tokens["clean"] [L] bool (timestep feed) or tokens["cond"] [L, (C+1)·patch] (concat feed):
    see tasks/conditioning.py. With `masks` (data.masks) each clip's loss weights are multiplied
    by its mask (`sample.mask`, token means; T_b = Σ of the weights); with cond.control packs
    carry tokens["control"] [L, C'·patch], the clip's control video (C' = C; Wan VACE: its context
    [inactive C | reactive C | mask], control_input), appended to the input.
    """

    causal = False
    cp_layout = "contiguous"

    def __init__(self, dataset: Any, model_cfg: ModelConfig, loss_cfg: LossConfig, seed: int,
                 caption_dropout: float = 0.0, cond: Any = None, masks: bool = False):
        self.dataset = dataset
        self.inputs = inputs = video_inputs(model_cfg, cond)  # what the model receives, read once
        self.text_dim, self.text_len = inputs.text_dim, inputs.text_len
        self.caption_dropout = caption_dropout
        self._bytes = ByteCaptionEncoder(self.text_dim, self.text_len, words=inputs.caption_words) if self.text_dim else None
        self.patch, self.patch_dim = inputs.patch, inputs.patch_dim
        self.loss_cfg = loss_cfg
        self.prediction, self.x0_min_t = inputs.prediction, inputs.x0_min_t  # what the model outputs
        self.seed = seed
        self.conditioner = Conditioner(cond, self.patch, seed, inputs.mask_channels) if cond_active(cond) else None
        if inputs.i2v_mask:  # the data must hold the I2V tensors
            errors = i2v_data_errors(getattr(dataset, "meta", {}), cond, model_cfg, f"data.root={getattr(dataset, 'root', '')}")
            if errors:
                raise ValueError("; ".join(errors))
        self.masks = masks  # loss weights times each clip's mask (data.masks)
        self.control = inputs.control  # the control video as more input channels
        if self.control and inputs.vace_mask and getattr(dataset, "meta", None) is not None:
            vace_data_check(dataset, inputs.vace_mask)  # Wan VACE: the control is its context
        # a model with joint text-video attention gets each clip's caption tokens as slots of the
        # pack (weight 0, outside T_b: tasks/joint_text.py)
        self.joint_text = inputs.joint_text
        # block-causal attention (model.causal_block_frames, DiT only): temporal patches per block;
        # packs then split zigzag under CP so that no ring rank holds only early blocks
        self.causal_block = inputs.causal_block
        if self.causal_block:
            self.cp_layout = "zigzag"
        # the two-stream DiT (model.audio_patch > 0): each clip's sound joins its sequence as a
        # second stream (tasks/joint_audio.py), and the metadata sync counts per stream
        self.audio_patch = getattr(model_cfg, "audio_patch", 0)
        self.streams = 2 if self.audio_patch else 1
        if self.audio_patch and not inputs.audio_index and (getattr(dataset, "meta", None) or {}).get("audio"):
            raise ValueError(f"model={model_cfg.name}: the data's audio latents (LTX-2's audio VAE) train LTX-2's audio "
                             "stream (model=ltx2 ...); the two-stream DiT reads waveforms (data.audio=true on clips)")
        # cross-stream conditioning (cond.given_stream): one stream of a clip with sound given clean
        # at timestep 0 with weight 0, so it is out of T_{b,s} and the clip out of that B_s
        self.cross_stream = bool(self.audio_patch and cond is not None and cond.cross_stream)
        self.given_index = STREAMS.index(str(cond.given_stream)) if self.cross_stream else -1  # 0 video, 1 audio
        self.given_prob = cond.given_stream_prob if self.cross_stream else 0.0
        # data frames per causal block (0 = bidirectional): clips train with whole blocks (tasks/causal.py)
        self.block_frames = self.causal_block * self.patch[0]
        # diffusion forcing: each block its own t (objectives/diffusion_forcing.py)
        self.block_noise = str(loss_cfg.frame_noise) == "block"
        self._sync_cache: dict[int, torch.Tensor] = {}  # sample id -> its audio tokens' sync feature
        self.failed: set[int] = set()  # samples whose file could not be decoded (skipped, counted)
        self.failure_reasons: dict[int, str] = {}  # ... and why (the first few name them in errors)

    def lengths(self) -> list[int]:
        """Tokens of each sample in a pack (what the step plan fills micro-batches with): its
        clip's, plus up to text_len caption slots for a joint-attention model (tasks/joint_text.py)."""
        lengths = self.dataset.lengths()
        frames = getattr(self.dataset, "frames", None)
        if self.block_frames and frames is not None:  # trimmed to whole causal blocks (tokens ∝ temporal patches)
            pt = self.patch[0]
            counts = [frames(i) for i in range(len(lengths))]
            lengths = [n // (f // pt) * (kept_frames(f, self.block_frames) // pt) if f >= pt else n
                       for n, f in zip(lengths, counts)]
        if self.audio_patch:  # its audio tokens: the manifest's audio column, or a cache's audio_len (no decoding)
            cached = getattr(self.dataset, "audio_token_count", None)
            count = cached or (lambda i: self.dataset.audio_samples(i) // self.audio_patch)
            lengths = [n + count(i) for i, n in enumerate(lengths)]
        return [n + self.text_len for n in lengths] if self.joint_text else lengths

    def check_samples(self, is_still: Callable[[int], bool]) -> None:
        """Before step 0 (tasks.check_data): ValueError when no sample can be trained as the run
        asks, a warning with the count when only some cannot. Conditioning: a sample too short to
        leave a frame to generate after its context trains unconditioned (`is_still(i)`: whether
        sample i is a still image, for the message)."""
        frames = getattr(self.dataset, "frames", None)  # datasets of clips say it without decoding
        counts = [frames(i) for i in range(len(self.dataset))] if frames is not None else None
        if self.block_frames and counts is not None:  # skip-and-count: the frames trimmed to whole blocks
            report = trim_report(counts, self.block_frames)
            if report:
                log.warning(report)
        if self.conditioner is not None and self.conditioner.cond.prob > 0 and counts is not None:
            cond, pt = self.conditioner.cond, self.patch[0]
            short = too_short(cond, pt, counts)
            if len(short) == len(counts):
                raise ValueError(unconditionable_error(cond, pt, counts, sum(map(is_still, short))))
            if short:
                log.warning("%d of the %d samples have at most %d frames: too short for %s (no frame left to "
                            "generate); they train unconditioned", len(short), len(counts),
                            max(counts[i] for i in short), cond.context_key)
        if self.masks:
            self._check_masks()

    def _check_masks(self) -> None:
        """data.masks: ValueError when every sample's mask is zero everywhere (T_b = 0 for all: each
        step would train on nothing and the run report completed). Samples are read until one
        weighs something (the first, on healthy data), at most MASK_PROBE of them spread over the
        data: beyond that a set whose samples read all weigh nothing is warned about, not refused."""
        n = len(self.dataset)
        ids = sorted({k * n // MASK_PROBE for k in range(MASK_PROBE)}) if n > MASK_PROBE else range(n)
        read = 0
        for i in ids:
            try:
                mask = self.dataset[i].mask
            except VideoReadError:  # counted when a step reads it (data.max_dropped_fraction)
                continue
            if bool(token_mask_units(mask, self.patch).any()):
                return
            read += 1
        what = ("the masks (clip.mask.mp4 beside each clip, or the manifest's mask / mask_boxes columns: white = "
                "weight 1, black = 0)")
        if read == n:
            raise ValueError(f"data.masks=true: the masks of all {n} samples are zero everywhere, so no token would "
                             f"carry loss (T_b = 0) and every step would train on nothing; check {what}, or set "
                             f"data.masks=false")
        if read:
            log.warning("data.masks=true: the masks of the %d samples read before step 0 (spread over %d) are zero "
                        "everywhere: most steps would train on nothing; check %s", read, n, what)

    def control_input(self, item: Any) -> torch.Tensor:
        """A clip's control input [C', F, H, W]: its control video, or Wan VACE's context built
        from it ([inactive | reactive | mask], tasks/conditioning.vace_context)."""
        if not self.inputs.vace_mask:
            return item.control
        return vace_context(item.control, getattr(item, "control_inactive", None), self.inputs.vace_mask)

    def null_caption(self) -> torch.Tensor:
        """[Lt, text_dim] embedding of the empty caption (dropout, and the CFG negative)."""
        null = getattr(self.dataset, "null_text_emb", None)
        return null()[: self.text_len].float() if null is not None else self._bytes("")

    def caption_embedding(self, sample: Any) -> torch.Tensor:
        """[Lt, text_dim] of one sample: cached encoder output when the data has it."""
        emb = getattr(sample, "text_emb", None)
        return emb[: self.text_len].float() if emb is not None else self._bytes(sample.caption)

    def prefetch(self, sample_ids: list[int]) -> None:
        """Ids that the next `build` calls will read: decoded ahead in background workers when
        the dataset has them (data.num_workers > 0); a no-op otherwise."""
        ahead = getattr(self.dataset, "prefetch", None)
        if ahead is not None:
            ahead(sample_ids)

    def build(self, sample_ids: list[int], step: int) -> PackedBatch:
        """The full (un-split) pack of `sample_ids` at `step`, on the CPU."""
        xs, targets, ts, ctx = [], [], [], []
        conds, weights, clean, controls, images = [], [], [], [], []
        kept, block_ts = [], []
        sound = ([], [], [], [], [], [])  # sound: audio x, target, positions, weights, clean flags, sync per kept clip
        lc = self.loss_cfg
        for sid in sample_ids:
            try:
                item = self.dataset[sid]
                x0 = item.pixels
            except VideoReadError as err:
                # skip and count: the same file fails whatever the layout, so dropping it keeps
                # every rank consistent (its tokens are simply absent from the metadata sync)
                if sid not in self.failed:
                    log.warning("dropping sample %d: %s", sid, err)
                    self.failure_reasons[sid] = str(err)
                self.failed.add(sid)
                continue
            kept.append(sid)
            frames = kept_frames(x0.shape[1], self.block_frames)  # whole causal blocks (tasks/causal.py)
            x0 = x0[:, :frames]
            # the shift of this sample follows from its own size (never the pack's): exact
            shift = sample_shift(lc.timestep_shift, lc.shift_reference_tokens, num_patches(x0.shape, self.patch))
            if self.block_noise:  # diffusion forcing: a t per block, history blocks clean and weightless
                xt, v, t_blocks, history = noisy_blocks(x0, self.seed, sid, step, lc, shift, self.block_frames)
                block_ts.append(t_blocks)
                t = float(t_blocks.max())  # the clip's samples["t"]: its noisiest block
                patches = frames // self.patch[0]  # temporal patches; tokens = patches × slab
                weight = history_weights(patches, num_patches(x0.shape, self.patch) // patches, self.causal_block,
                                         history, WEIGHT_ONE)
            else:
                xt, v, t = noisy_sample(x0, self.seed, sid, step, lc, shift, self.inputs.t_range)
                weight = torch.full((num_patches(x0.shape, self.patch),), WEIGHT_ONE, dtype=torch.int64)
            if self.conditioner is not None:  # context frames of the clip itself (tasks/conditioning.py)
                inputs = self.conditioner.inputs(x0, xt, sid, step, getattr(item, "cond_latents", None))
                xt, weight = inputs.x, inputs.weight
                if self.inputs.image_dim:  # an unconditioned sample (cond.prob < 1) sees zero image tokens, as its zero mask
                    images.append(item.image_emb if inputs.cond[: self.inputs.mask_channels].any() else item.image_emb * 0)
                if inputs.clean is not None:
                    clean.append(inputs.clean)
                else:
                    conds.append(inputs.cond)
            if self.masks:  # an all-zero mask: T_b = 0, the sample weighs nothing and B_global skips it
                weight = masked(weight, item.mask[:frames], self.patch)
            gives = -1  # the stream given clean (cond.given_stream), only to a clip with sound
            if self.cross_stream and getattr(item, "audio", None) is not None:
                gives = given_stream(self.seed, sid, step, self.given_index, self.given_prob)
            if gives == 0:  # video-to-audio: the clip's frames clean, weightless (out of T_{b,video})
                xt, weight = x0, torch.zeros_like(weight)
            if self.cross_stream:
                clean.append(torch.full(weight.shape, gives == 0))
            weights.append(weight)
            if self.control:
                controls.append(self.control_input(item)[:, :frames])
            xs.append(xt)
            targets.append(v)
            ts.append(t)
            if self.audio_patch:
                self._sound(item, sid, step, t, sound, given=gives == 1, picture=x0 if gives == 0 else None)
            if self.text_dim:
                dropped = drop_caption(self.seed, sid, step, self.caption_dropout)
                ctx.append(self.null_caption() if dropped else self.caption_embedding(item))
        samples = {"t": torch.tensor(ts, dtype=torch.float32)}
        if self.block_noise:  # [S, B] each block's t (B: the most blocks of a clip; the rest unused)
            samples["block_t"] = block_table(block_ts)
        if self.text_dim:
            samples["context"], samples["context_len"] = pad_contexts(ctx, self.text_dim)
        if images:
            samples["image"] = torch.stack(images)  # [S, Li, image_dim]
        ids = torch.tensor(kept, dtype=torch.long)
        batch = self._pack(xs, targets, conds, clean, controls, weights, samples, ids)
        if self.audio_patch:
            given = self.cross_stream
            batch = join_audio_tokens(batch, *sound[:3], sound[3] if given else None, sound[4] if given else None,
                                      sound[5] if self.inputs.sync_encoder else None)
        return join_text_tokens(batch, samples["context_len"]) if self.joint_text else batch

    def _sound(self, item: Any, sid: int, step: int, t: float, out: tuple[list, ...], given: bool = False,
               picture: torch.Tensor | None = None) -> None:
        """Append one clip's noised audio tokens [n, P], their velocity target, RoPE positions,
        weights [n], clean flags [n] and sync feature [n] to `out`: the clip's own t, noise from
        its own "audio_noise" stream of (seed, id, step); `given` (audio-to-video): the clean sound,
        weight 0, at timestep 0; `picture` [3, F, H, W]: the clean frames it is given (video-to-
        audio), read by model.sync_encoder (tasks/av_sync.py; zeros without)."""
        latents = getattr(item, "audio_latents", None)  # a cache's LTX-2 audio tokens (--audio-vae), else the waveform's
        a0 = latents.float() if latents is not None else audio_tokens(getattr(item, "audio", None), self.audio_patch,
                                                                      self.inputs.audio_features)
        eps = torch.randn(a0.shape, generator=sample_generator(self.seed, sid, step, "audio_noise"))
        # (positions by time, the two-stream DiT's, from a waveform; cached latents train LTX-2: by index)
        fps = item.pixels.shape[1] * SAMPLE_RATE / max(1, item.audio.numel()) if latents is None and a0.shape[0] else 0.0
        out[3].append(torch.full((a0.shape[0],), 0 if given else WEIGHT_ONE, dtype=torch.int64))
        out[4].append(torch.full((a0.shape[0],), given))
        out[0].append(a0 if given else (1.0 - t) * a0 + t * eps)
        out[1].append(eps - a0)
        out[2].append(audio_positions(a0.shape[0], self.audio_patch, fps, self.patch[0], self.inputs.audio_index))
        if self.inputs.sync_encoder:
            out[5].append(self._sync_feature(sid, picture, a0.shape[0], fps))

    def _sync_feature(self, sid: int, picture: torch.Tensor | None, n: int, fps: float) -> torch.Tensor:
        """[n] the sync feature of sample `sid`'s audio tokens (tasks/av_sync.py): zeros without a
        given picture; else computed once per sample (a sample's frames are the same at every
        step, and the encoder cost ~30 ms a clip: a quarter of a step)."""
        if picture is None:
            return torch.zeros(n)
        if sid not in self._sync_cache:
            self._sync_cache[sid] = clip_sync(self.inputs.sync_encoder, picture, n, self.audio_patch, fps)
        return self._sync_cache[sid]

    def _pack(self, xs, targets, conds, clean, controls, weights, samples, ids) -> PackedBatch:
        """The clips' fields packed (pack_clips): x and target, and what conditioning, masks and
        control add."""
        given = self.cross_stream  # cross-stream conditioning: weights and clean flags per token
        if self.conditioner is None and not self.masks and not self.control and not self.block_noise and not given:
            return pack_clips({"x": xs, "target": targets}, self.patch, self.patch_dim, samples, ids,
                              causal_block=self.causal_block)
        fields, dims = {"x": xs, "target": targets}, {"x": self.patch_dim, "target": self.patch_dim}
        if self.inputs.concat:
            fields["cond"], dims["cond"] = conds, self.inputs.cond_dim
        if self.control:
            fields["control"], dims["control"] = controls, self.inputs.control_dim
        per_token = {"clean": clean} if self.inputs.clean or given else None
        return pack_clips(fields, self.patch, dims, samples, ids, per_token=per_token, weights=weights,
                          causal_block=self.causal_block)

    def per_token_loss(self, model: nn.Module, batch: PackedBatch, attn_meta: Any) -> torch.Tensor:
        """[L_local] MSE of the predicted velocity of each local token, times w(t_b) of its sample
        (`loss.weighting`). The weight is a function of the sample's t alone, applied before the
        reduction's weights, so the reduction and its exactness are unchanged. A model with
        model.prediction=x0 outputs x̂0, turned into the velocity it stands for first."""
        out = video_forward(model, batch, attn_meta)
        if self.prediction != "velocity":
            out = velocity_from_output(out.float(), batch.tokens["x"], token_times(batch), self.prediction, self.x0_min_t)
        width = None
        if batch.stream is not None and self.audio_patch:  # each stream's rows: their own features, zeros after
            width = torch.tensor([self.patch_dim, self.inputs.audio_width])[batch.stream.cpu()]
        loss = per_token_mse(out, batch.tokens["target"], width)
        if self.loss_cfg.weighting == "none":
            return loss
        # padding tokens get t = 1; weightless tokens (history blocks at t = 0, where sigma_sqrt is
        # infinite) get w = 1, so that their reduction weight 0 gives 0, not 0·inf = nan
        w = loss_weight(token_times(batch), self.loss_cfg.weighting).to(loss.device)
        return loss * torch.where(batch.valid.to(loss.device), w, w.new_ones(()))



def block_table(block_ts: list[torch.Tensor]) -> torch.Tensor:
    """[S, B] float32 of the clips' per-block t ([nb_k] each), B = max nb_k (at least 1); the
    cells past a clip's last block are 0 and never read."""
    table = torch.zeros(len(block_ts), max((len(t) for t in block_ts), default=1))
    for k, t in enumerate(block_ts):
        table[k, : len(t)] = t.float()
    return table


def token_times(batch: PackedBatch) -> torch.Tensor:
    """[L] float32 the t of each token: its clip's samples["t"], or its block's t of
    samples["block_t"] (diffusion forcing); padding (seg -1, also a rank's empty pack) gets 1."""
    seg = batch.seg
    if "block_t" in batch.samples:
        table = batch.samples["block_t"].float()
        S, B = table.shape
        rows = torch.cat([table.reshape(-1), table.new_ones(1)]).to(seg.device)
        return rows[torch.where(seg < 0, torch.full_like(seg, S * B), seg * B + batch.block)]
    t = batch.samples["t"].float()
    return torch.cat([t, t.new_ones(1)]).to(seg.device)[seg]
