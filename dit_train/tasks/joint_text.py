"""Text tokens as slots of the pack, for models with joint text-video attention (HunyuanVideo 1.5).

Such a model attends over a clip's video tokens and its caption's tokens together. Its caption
tokens are made tokens of the pack: right after each clip's video tokens come `n_k` text slots
(n_k = the clip's valid caption tokens) with the clip's seg and in-clip order, so the clip's
attention run is the joint one, whatever the backend, and CP (Ulysses, ring) splits it like any
run. The slots carry loss weight 0 and are not `valid`: they are outside T_b, so the metadata
sync (loss/counts.py) and every reduction stay exact; their input and target are zeros and the
model outputs 0 there. tokens["text"] [L] int64 tells the model which caption token a slot is
(1 + its index in the clip's valid text; 0 on video and padding tokens, as padding pads with 0).

Nothing here communicates.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dit_train.batch import PackedBatch


def join_text_tokens(batch: PackedBatch, counts: torch.Tensor) -> PackedBatch:
    """`batch` (clips contiguous and in seg order, no padding, as pack_clips builds it) with
    counts[k] text slots after clip k's tokens: [L + Σ counts] tokens."""
    S = batch.num_samples
    counts = counts.to(torch.long)
    clip_len = torch.bincount(batch.seg, minlength=S)[:S] if batch.num_tokens else torch.zeros(S, dtype=torch.long)
    seg_t = torch.repeat_interleave(torch.arange(S), counts)
    # slot j of clip k: in-clip order after its T_k video tokens; text index j + 1
    start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    j = torch.arange(seg_t.numel()) - start
    seg = torch.cat([batch.seg, seg_t])
    where = torch.argsort(seg, stable=True)  # each clip's video tokens, then its text slots

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b])[where]

    def slots(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((seg_t.numel(), *t.shape[1:]))

    tokens = {k: cat(v, slots(v)) for k, v in batch.tokens.items()}
    tokens["text"] = cat(torch.zeros(batch.num_tokens, dtype=torch.long), j + 1)
    out = replace(batch, seg=seg[where], pos=cat(batch.pos, slots(batch.pos)), order=cat(batch.order, clip_len[seg_t] + j),
                  valid=cat(batch.valid, torch.zeros(seg_t.numel(), dtype=torch.bool)), tokens=tokens, weight=None)
    if batch.stream is not None:  # audio tokens too (MiniMax-H3): the slots are stream 0 at weight 0, outside every T_{b,s}
        out = replace(out, stream=cat(batch.stream, torch.zeros(seg_t.numel(), dtype=torch.long)))
    if batch.weight is not None:
        out = out.with_weight(cat(batch.weight, torch.zeros(seg_t.numel(), dtype=torch.int64)))
    return out


def video_rows(batch: PackedBatch) -> torch.Tensor:
    """[L] bool: the tokens of `batch` that are not text slots (all of them without slots)."""
    if "text" not in batch.tokens:
        return torch.ones(batch.num_tokens, dtype=torch.bool, device=batch.seg.device)
    return batch.tokens["text"] == 0
