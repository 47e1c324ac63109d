"""One varlen attention interface over several single-device kernels.

A packed micro-batch is one flat sequence of L tokens holding several samples. Attention must
stay inside a sample (block-diagonal mask), optionally causal within it. Every backend here
computes exactly that from the same `VarlenLayout`:

    q, k, v: [L, H, D]  ->  out: [L, H, D]

Backends:
  sdpa        per-sample loop over torch SDPA (no mask materialised); CPU default.
  sdpa_dense  one SDPA call with a dense [L, L] boolean mask: the reference, whose memory grows
              with L² (ring attention under it also uses the dense `lse.attention_with_lse`);
              select it only to check the others.
  flex        torch flex_attention with a block mask built from the sample ids (compiled on
              CUDA; eager on the CPU, where torch materialises its scores and has no backward:
              a forward-only path there).
  xformers    xformers `BlockDiagonalMask` + memory_efficient_attention (CUDA only, optional).
  flash       flash-attn `flash_attn_varlen_func` (CUDA only, optional).
  auto        flash > xformers > sdpa on CUDA; sdpa on CPU.

A permuted layout (a sample's tokens not contiguous, e.g. after a zigzag CP split) cannot use
the contiguous kernels (sdpa, xformers, flash): it runs through the per-sample blocks of
`block_attention.py` (tokens gathered by index), never through a dense mask.

Padding tokens carry sample id -1 and in-order positions; they form their own segment (they
attend to each other) so that no query row is empty and no NaN appears. Their outputs get
loss weight 0.

Ring attention's partial results with log-sum-exp: `block_attention.block_attention_with_lse`
(per-sample blocks) and the dense reference `lse.attention_with_lse`, merged by `lse.merge_partials`.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dit_train.kernels.block_attention import block_attention_with_lse
from dit_train.kernels.blocks import sample_blocks
from dit_train.kernels.eager import eager
from dit_train.kernels.flex import flex_kernel
from dit_train.kernels.lse import attention_mask
from dit_train.kernels.runs import group_neighbours, run_starts

BACKENDS = ("auto", "sdpa", "sdpa_dense", "flex", "xformers", "flash")


@dataclass
class VarlenLayout:
    """Layout of one packed sequence.

    seg: [L] int64, sample index of each token inside the pack; -1 = padding.
    pos: [L] int64, the token's causal key inside its sample: its position (LLM), or the
        temporal block of block-causal video, equal for every token of a block (model.causal_block_frames).
    causal: mask keys whose key pos is greater than the query's inside the same sample
        (pos_k <= pos_q is seen: tokens of one block see each other).
    cu_seqlens: [S+1] int32 boundaries when every segment is contiguous and in order (the
        usual packed layout); None when tokens are permuted (then the per-sample gather path of
        `block_attention.py` serves the contiguous backends).
    max_seqlen: longest segment.
    key_seg: [L] int64 or None, the keys' own segment ids when they differ from the queries'
        (LTX-2's audio<->video cross-attention: a clip's video queries see its audio keys); None =
        `seg` on both sides. Such a layout always runs as per-sample blocks (`block_attention.py`).
    cache: per-pack derived structures of the backends (flex's block mask).
    """

    seg: torch.Tensor
    pos: torch.Tensor
    causal: bool
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    key_seg: torch.Tensor | None = None
    # what a backend derives from the layout once per pack and reuses in every layer (flex's
    # block mask); not part of the layout's value
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def build(seg: torch.Tensor, pos: torch.Tensor, causal: bool) -> "VarlenLayout":
        cu, max_len = contiguous_segments(seg, pos)
        return VarlenLayout(seg=seg, pos=pos, causal=causal, cu_seqlens=cu, max_seqlen=max_len)

    def restricted(self, seg: torch.Tensor, key_seg: torch.Tensor | None = None) -> "VarlenLayout":
        """The same pack with other segment ids [L] (and keys' own ids, `key_seg`): a query sees
        the keys whose id equals its own. A model derives the layouts of its attentions from the
        pack's with this (LTX-2: per stream); the CP layout has the same method."""
        if key_seg is None:
            return VarlenLayout.build(seg, self.pos, self.causal)
        return VarlenLayout(seg=seg, pos=self.pos, causal=self.causal, cu_seqlens=None, max_seqlen=0, key_seg=key_seg)


def contiguous_segments(seg: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """cu_seqlens [S+1] if each segment id occupies one contiguous run in increasing position
    order, else (None, 0). Runs are split wherever the id changes."""
    L = seg.numel()
    if L == 0:
        return torch.zeros(1, dtype=torch.int32, device=seg.device), 0
    change, starts = run_starts(seg)
    run_ids = seg[starts]
    if torch.unique(run_ids).numel() != run_ids.numel():
        return None, 0  # some id appears in two runs: not contiguous
    # inside a run, positions must increase by one (then per-run is_causal is the same mask); equal
    # keys (block-causal) are not: such a pack takes the per-sample blocks, which mask by key
    same = ~change[1:]
    if not bool(torch.all((pos[1:] - pos[:-1] == 1) | ~same)):
        return None, 0
    cu = torch.cat([starts, torch.tensor([L], device=seg.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


# --------------------------------------------------------------------------- backends


# Not traced by torch.compile (train.compile): the loop's run sizes come from .tolist(), so a
# compiled block breaks its graph here anyway, and with dynamic=True inductor (torch 2.13, CPU)
# failed on the sizes it gets (LoweringException in SDPA's backward, then a NameError for an
# unbound size symbol). Eager, the loop is one SDPA kernel per run; the rest of the block compiles.
@eager
def _sdpa_loop(q, k, v, meta: VarlenLayout) -> torch.Tensor:
    """One SDPA call per run of consecutive samples of equal length (a contiguous run of n
    samples of T tokens is a free [n, T, H, D] view: one batched call instead of n).

    Built from `split`/`cat` rather than slicing into a preallocated output: the backward of
    a slice materialises a zero tensor of the whole sequence per sample (O(S·L) work and
    memory per layer); split's backward is a single concatenation.
    """
    assert meta.cu_seqlens is not None
    bounds = meta.cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    runs = group_neighbours(lens)  # (tokens per sample, samples in the run)
    sizes = [n * count for n, count in runs]
    outs = []
    for (n, count), qs, ks, vs in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes)):
        # [count·n, H, D] -> [count, H, n, D]; is_causal is exact because positions increase inside a run
        qb, kb, vb = (t.reshape(count, n, *t.shape[1:]).transpose(1, 2) for t in (qs, ks, vs))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=meta.causal)
        outs.append(o.transpose(1, 2).reshape(count * n, *q.shape[1:]))
    return torch.cat(outs) if len(outs) != 1 else outs[0]


def _sdpa_dense(q, k, v, meta: VarlenLayout) -> torch.Tensor:
    mask = attention_mask(meta.seg, meta.pos, meta.seg, meta.pos, meta.causal)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask[None, None],
    )
    return o.squeeze(0).transpose(0, 1)


def _flex_block_mask(meta: VarlenLayout, length: int, device: torch.device):
    """The pack's block mask, built once per layout and device: every layer of a step attends
    over the same pack, so building it per call would repeat an O(L²/block²) pass per layer."""
    from torch.nn.attention.flex_attention import create_block_mask  # deferred: imports torch._dynamo (~1.8 s)

    key = ("flex_block_mask", length, str(device))
    if key not in meta.cache:
        seg, pos, causal = meta.seg.to(device), meta.pos.to(device), meta.causal

        def mask_mod(b, h, qi, ki):
            m = seg[qi] == seg[ki]
            if causal:
                m = m & (pos[ki] <= pos[qi])
            return m

        meta.cache[key] = create_block_mask(mask_mod, None, None, length, length, device=device)
    return meta.cache[key]


def _flex(q, k, v, meta: VarlenLayout) -> torch.Tensor:
    bm = _flex_block_mask(meta, q.shape[0], q.device)
    o = flex_kernel(q.is_cuda)(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), block_mask=bm
    )
    return o.squeeze(0).transpose(0, 1)


@eager  # sizes from .tolist(), like _sdpa_loop
def _xformers(q, k, v, meta: VarlenLayout) -> torch.Tensor:
    from xformers.ops import fmha  # deferred: optional CUDA kernels

    assert meta.cu_seqlens is not None
    seqlens = (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).tolist()
    bias = fmha.BlockDiagonalMask.from_seqlens(seqlens)
    if meta.causal:
        bias = bias.make_causal()
    o = fmha.memory_efficient_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_bias=bias)
    return o.squeeze(0)


def _flash(q, k, v, meta: VarlenLayout) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # deferred: optional CUDA kernels

    assert meta.cu_seqlens is not None
    cu = meta.cu_seqlens.to(device=q.device, dtype=torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, causal=meta.causal)


_IMPLS = {"sdpa": _sdpa_loop, "sdpa_dense": _sdpa_dense, "flex": _flex, "xformers": _xformers, "flash": _flash}
_NEEDS_CONTIGUOUS = {"sdpa", "xformers", "flash"}


@functools.lru_cache(maxsize=None)
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Pick a concrete backend; raise a clear error for one that cannot run on `device`."""
    if name not in BACKENDS:
        raise ValueError(f"model.attn_backend={name!r} is not one of {BACKENDS}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if cuda and _has("flash_attn"):
            return "flash"
        if cuda and _has("xformers"):
            return "xformers"
        return "sdpa"
    if name in ("xformers", "flash"):
        module = "flash_attn" if name == "flash" else "xformers"
        if not cuda:
            raise ValueError(f"model.attn_backend={name} needs CUDA; use sdpa (or auto) on CPU")
        if not _has(module):
            raise ValueError(f"model.attn_backend={name} needs `pip install {module.replace('_', '-')}`")
    return name


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenLayout, backend: str) -> torch.Tensor:
    """Block-diagonal (optionally causal) attention over a packed sequence.

    q, k, v: [L, H, D]; returns [L, H, D]. `backend` must be resolved (not "auto").
    A layout that is not contiguous (a permuted sequence) sends the contiguous backends (sdpa,
    xformers, flash) through per-sample blocks gathered by index (`block_attention.py`): memory
    Σ over samples, never [L, L].
    """
    if meta.key_seg is not None or (meta.cu_seqlens is None and backend in _NEEDS_CONTIGUOUS):
        return _permuted(q, k, v, meta, backend)
    return _IMPLS[backend](q, k, v, meta)


def _permuted(q, k, v, meta: VarlenLayout, backend: str) -> torch.Tensor:
    """Per-sample attention of a permuted pack; its plan is built once per layout (meta.cache)."""
    key = ("sample_blocks", str(q.device))
    if key not in meta.cache:
        key_seg = meta.seg if meta.key_seg is None else meta.key_seg
        meta.cache[key] = sample_blocks(meta.seg, meta.pos, key_seg, meta.pos, meta.causal).to(q.device)
    out, _ = block_attention_with_lse(q, k, v, meta.cache[key], backend)
    return out


class LocalAttention:
    """The default attention callable held by every attention layer: one device, whole pack.

    `dit_train.parallel.parallelize` swaps it for a context-parallel one; models never know.
    """

    def __init__(self, backend: str = "sdpa"):
        self.backend = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenLayout) -> torch.Tensor:
        return varlen_attention(q, k, v, meta, self.backend)
