"""Per-rank memory model of a training step (what the planner ranks layouts by).

All sizes are bytes on ONE rank. Notation: P parameters (P_blk per transformer block), d model
width, h MLP hidden width, H heads, p patch values per token (video) / V vocabulary (LLM),
S the FSDP shard degree, L the micro-batch's tokens on this rank (micro_batch_tokens / cp),
c the compute dtype's size (4 fp32, 2 bf16/fp16).

State (sharded by FSDP over S = dp_shard · cp when parallel.cp_fsdp_mode=all, dp_shard otherwise;
dp_replicate never shards):
    params 4P/S  +  grads 4P/S  +  optimizer (AdamW 8P/S; SGD 4P/S with momentum, else 0)
    + FSDP buffers: the all-gathered block being computed and the prefetched next one
      (2·c·P_blk), the unsharded gradient of one block and its fp32 reduce-scatter input
      (c+4)·P_blk, the root's unsharded parameters c·P_other; without resharding after forward
      every block stays gathered (depth·c·P_blk).
    DDP keeps full params/grads/optimizer plus a 4P gradient bucket copy.

Activations saved for backward, per token per block, read off the autograd graph of
`models/layers.Block` (checked against `saved_activation_bytes`, which hooks the real graph):
    fp32 run:    (10·d + h)·4  +  (3·H + 4)·4       (LSE, norm statistics)
      10·d = residual in; qkv (3), which QK-RMSNorm's hand-written backward reuses; RoPE'd
             q/k (2); attention out in SDPA layout and its packed copy (2); proj out (1); the
             residual after attention (1); fc2 out (1); h = fc1 out. The norms, adaLN modulate,
             GELU and gated residual are recomputed inside the next linear's backward
             (models/recompute.py), the per-token adaLN gathers never saved. Captions add ~5.4·d.
      model.recompute_prologues=false saves those too: + 9·d + h (+ 1·d with captions), and
      + 3·d outside the blocks (the final layer's modulate); the model's ActivationModel
      (registry.py) carries both settings, calibrated like the rest.
    bf16/fp16 autocast: the residual stream is in the compute dtype (the patch embedding's
      output is), and so is everything above: (10·d + h)·c. Calibrated on CPU autocast.
    LLM block (pre-RMSNorm, no modulation): 9·d + h in fp32; under autocast the residual
      stream stays fp32 (the embedding's output is): 2·d fp32 + (7·d + h)·c; + 2·d + h in the
      compute dtype with model.recompute_prologues=false.
    Ulysses (cp_ulysses > 1): + 4·d·c for the all-to-all'd q, k, v and output.
    Ring (cp_ring > 1; L_r = micro_batch_tokens/cp_ring queries per ring rank, T the longest
      sample, h = H/u): each ring step attends only the sample-diagonal blocks through a fused
      kernel with LSE (kernels/block_attention.py) and saves the gathered q, k, v and the
      kernel's output (c each) of the rows of samples present on both sides — over all steps at
      most min(R·L_r, L_r + 2·T) rows (a query meets its own sample's keys only) — plus the
      step's output for the merge in fp32 and the LSEs, counted for every step:
      + R·L_r·(4·d/u + 12·h) + min(R·L_r, L_r + 2·T)·(4·c·d/u + 16·h) bytes per block
      (`ring_block_bytes`; measured per ring step in tests/test_planner.py). Linear in the
      tokens: no score block is kept. model.attn_backend=sdpa_dense (the dense reference) keeps
      fp32 scores and probabilities of every [L_r, L_r] step: + R·L_r²·(8·h + 1).
Mixture-of-experts blocks (model.moe): each expert's weights count as parameters (sharded by
FSDP like the rest); a token runs k experts, so the FLOPs count k MLPs plus the router; saved
per token k·(3·d + 2·h)·c + 8·E + 16·k more than a dense block (`moe_block_extra_bytes_per_token`),
and one layer's dispatch holds 3·k·L·d·c transiently (`moe_dispatch`).
Expert parallelism (parallel.ep > 1): the X expert parameters leave FSDP; each rank keeps X/ep
of them whole (4 + 4 + optimizer bytes each), the gathered blocks lose their experts, the bf16
copies of the local experts are saved for backward (c·X/ep, `expert_casts`), and the dispatch
holds up to 7·k·L·d·c (the rows sent, received, regrouped, computed and returned).
Outside the blocks (embedding, final layer, loss, RoPE tables): (6·d)·c + 2·p·4 + Dh·4 per
token for the DiT; 2·V·4 logits (+ d·c) for the LLM.
Activation checkpointing (model.activation_checkpointing on every model.ac_every-th block):
full keeps only a checkpointed block's input (d·4 per token) and recomputes one block at a
time in backward (+ one block's full activations); selective keeps the matmul / attention
outputs ((selective_d·d + h)·c, registry.ActivationModel) and recomputes the elementwise ops.
Under autocast (one rank's whole weights, no FSDP2 sharding) the low-precision weight copies c·P
live only while forward runs, the recomputed block only in backward: the larger of the two
counts (`autocast_weight_cache` is the cache's excess over the recompute).
Activation offload (train.activation_offload): ~2 blocks' activations stay on the device, the
rest is in host memory (`MemoryEstimate.host`); parallel.cpu_offload moves params, grads and
optimizer state there too.

Attention workspace (transient, one call): sdpa loop: a packed output copy L·d·c; flash /
xformers: LSE H·L·4; flex: LSE + block mask ≈ 8·(L/128)²; sdpa_dense: the [L, L] boolean
mask and its additive bias L²·(1+c) (use only as a reference).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from dit_train.kernels import VarlenLayout
from dit_train.models import build_model, init_weights
from dit_train.models.moe import moe_layers
from dit_train.models.registry import ActivationModel, model_spec
from dit_train.optim.low_bit import QUANTIZED_BYTES
from dit_train.perf.saved import retained_bytes

GIB = 1024 ** 3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the memory and FLOP models need to know about a model (built on the meta device)."""

    name: str  # registered model name
    dim: int
    depth: int
    heads: int
    hidden: int
    io_dim: int  # patch values per token (video) or vocabulary size (llm)
    params: int
    params_block: int
    # parameters applied to every token by a matmul (what 6·N·T counts): blocks + embed/head
    params_per_token: int
    activations: ActivationModel
    params_blocks: int = 0  # all blocks together (params_block is the largest one's); 0 = depth·params_block
    moe_blocks: int = 0  # blocks whose MLP is a mixture of experts (models/moe.py)
    experts: int = 0  # experts per MoE block
    top_k: int = 0  # experts each token runs through
    params_experts: int = 0  # the stacked expert weights of all MoE blocks (what parallel.ep splits)

    @property
    def params_other(self) -> int:
        return self.params - (self.params_blocks or self.depth * self.params_block)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def model_shape(cfg) -> ModelShape:
    """Build the model on the meta device (no memory, no init) and read its sizes; the
    per-token matmuls and activation coefficients come from the model's spec."""
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    blocks = spec.blocks(model)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    per_tok_blocks = sum(m.weight.numel() for b in blocks for m in spec.block_linears(b))
    per_tok_other = sum(m.weight.numel() for m in spec.io_linears(model))
    moe = moe_layers(model)
    return ModelShape(name=cfg.name, dim=cfg.dim, depth=len(blocks), heads=cfg.heads, hidden=spec.hidden(cfg),
                      io_dim=spec.io_dim(cfg), params=params, params_block=max(block_params),
                      params_per_token=per_tok_blocks + per_tok_other, activations=spec.activations(cfg),
                      params_blocks=sum(block_params), moe_blocks=len(moe),
                      experts=moe[0].num_experts if moe else 0, top_k=moe[0].top_k if moe else 0,
                      params_experts=sum(p.numel() for m in moe for p in m.experts.parameters()))


# --------------------------------------------------------------------------- activations


def block_activation_bytes_per_token(s: ModelShape, precision: str) -> float:
    """Bytes saved for backward by one block, per local token (no CP terms); with MoE blocks, the
    mean over blocks (`moe_block_extra_bytes_per_token` on the MoE share of them)."""
    stats = (3 * s.heads + 4) * 4
    a = s.activations
    moe = moe_block_extra_bytes_per_token(s, precision) * s.moe_blocks / max(1, s.depth)
    if precision == "fp32":
        return (a.fp32_d * s.dim + a.h_elems * s.hidden) * 4 + stats + moe
    c = DTYPE_BYTES[precision]
    return a.autocast_f32_d * s.dim * 4 + (a.autocast_lp_d * s.dim + a.h_elems * s.hidden) * c + stats + moe


def moe_block_extra_bytes_per_token(s: ModelShape, precision: str) -> float:
    """What a mixture-of-experts block saves per token beyond the dense block (registry's
    ActivationModel.moe_dense_d and moe_dense_h; calibrated with `calibrate_block` on DiT and LM
    blocks at d = 64, 128, E = 4, 8, k = 1, 2: within 1% in fp32, 4% under bf16 autocast)."""
    if not s.moe_blocks:
        return 0.0
    c = DTYPE_BYTES[precision]
    k = s.top_k
    a = s.activations
    return k * (3 * s.dim + 2 * s.hidden) * c + 8 * s.experts + 16 * k - (a.moe_dense_d * s.dim + a.moe_dense_h * s.hidden) * c


def moe_dispatch_bytes(s: ModelShape, micro_batch_tokens: int, precision: str, cp: int = 1, ep: int = 1) -> float:
    """Transient bytes of one MoE layer's dispatch on one rank: the token rows repeated k times,
    their expert-sorted copy and the expert outputs ([L·k, d] each, compute dtype); with ep > 1
    also the rows received, regrouped by expert, sent back and returned (balanced routing)."""
    if not s.moe_blocks:
        return 0.0
    return (7 if ep > 1 else 3) * s.top_k * math.ceil(micro_batch_tokens / cp) * s.dim * DTYPE_BYTES[precision]


def outside_activation_bytes_per_token(s: ModelShape, precision: str) -> float:
    c = DTYPE_BYTES[precision]
    return s.activations.outside_d * s.dim * c + 2 * s.io_dim * 4 + s.head_dim * 4


def ring_block_bytes(s: ModelShape, micro_batch_tokens: int, cp_ulysses: int, cp_ring: int, precision: str,
                     backend: str = "flash", sample_tokens: int | None = None) -> float:
    """Saved bytes of one block's ring attention on one rank (module docstring): linear in the
    tokens for the per-sample block kernels, the dense reference's [L_r, L_r] scores for
    backend sdpa_dense. sample_tokens: the longest sample (default: one sample fills the
    micro-batch, the most a ring rank's queries can meet)."""
    if cp_ring <= 1:
        return 0.0
    c = DTYPE_BYTES[precision]
    lr = micro_batch_tokens / cp_ring
    h = s.heads / cp_ulysses
    if backend == "sdpa_dense":
        return cp_ring * lr * lr * (8 * h + 1)
    longest = min(sample_tokens or micro_batch_tokens, micro_batch_tokens)
    rows = min(cp_ring * lr, lr + 2 * longest)  # gathered rows over all steps
    return cp_ring * lr * (4 * s.dim / cp_ulysses + 12 * h) + rows * (4 * c * s.dim / cp_ulysses + 16 * h)


def cp_block_bytes(s: ModelShape, micro_batch_tokens: int, cp_ulysses: int, cp_ring: int, precision: str,
                   backend: str = "flash", sample_tokens: int | None = None) -> float:
    """Extra saved bytes per block on one rank caused by context parallelism (whole micro-batch)."""
    c = DTYPE_BYTES[precision]
    local = micro_batch_tokens / (cp_ulysses * cp_ring)
    extra = 0.0
    if cp_ulysses > 1:
        extra += 4 * s.dim * c * local
    return extra + ring_block_bytes(s, micro_batch_tokens, cp_ulysses, cp_ring, precision, backend, sample_tokens)


def selective_block_bytes_per_token(s: ModelShape, precision: str) -> float:
    """Bytes one block keeps per local token under selective checkpointing (matmul and
    attention outputs, in the compute dtype, plus the attention statistics)."""
    a = s.activations
    return (a.selective_d * s.dim + a.h_elems_selective * s.hidden) * DTYPE_BYTES[precision] + (s.heads + 1) * 4


def ac_split(depth: int, every: int) -> tuple[int, int]:
    """(checkpointed blocks, plain blocks) for model.ac_every = every."""
    n = depth // max(1, every)
    return n, depth - n


def activation_bytes(s: ModelShape, micro_batch_tokens: int, precision: str, checkpointing: bool | str,
                     cp_ulysses: int = 1, cp_ring: int = 1, every: int = 1, offload: bool = False,
                     backend: str = "flash", sample_tokens: int | None = None) -> float:
    """Activation bytes held on the device at the peak of backward on one rank for one
    micro-batch: `activation_parts`' saved and recomputed bytes together."""
    return sum(activation_parts(s, micro_batch_tokens, precision, checkpointing, cp_ulysses, cp_ring, every, offload,
                                backend, sample_tokens))


def activation_parts(s: ModelShape, micro_batch_tokens: int, precision: str, checkpointing: bool | str,
                     cp_ulysses: int = 1, cp_ring: int = 1, every: int = 1, offload: bool = False,
                     backend: str = "flash", sample_tokens: int | None = None) -> tuple[float, float]:
    """(saved, recomputed) activation bytes of one micro-batch on one rank: what forward saves
    for backward (held from forward's end into backward), and what backward re-materialises of
    one checkpointed block at a time (backward only). checkpointing: none | full | selective
    (bools: full / none) on every `every`-th block. offload (train.activation_offload): what
    forward saves goes to host memory as it is saved and comes back one block at a time: the
    device holds about two blocks' activations (the one in use, the next one in flight), plus,
    under selective, the cached matmul outputs (the checkpoint keeps them on the device).
    backend / sample_tokens (the longest sample): what ring attention keeps (`ring_block_bytes`)."""
    policy = {True: "full", False: "none"}.get(checkpointing, checkpointing)
    local = math.ceil(micro_batch_tokens / (cp_ulysses * cp_ring))
    cp_extra = cp_block_bytes(s, micro_batch_tokens, cp_ulysses, cp_ring, precision, backend, sample_tokens)
    per_block = block_activation_bytes_per_token(s, precision) * local + cp_extra
    outside = outside_activation_bytes_per_token(s, precision) * local
    n_ckpt, n_plain = ac_split(s.depth, every) if policy != "none" else (0, s.depth)
    if policy == "full":
        kept = 4 * s.dim * local  # the block's input
    elif policy == "selective":
        kept = selective_block_bytes_per_token(s, precision) * local + cp_extra
    else:
        kept = 0.0
    # backward re-materialises one checkpointed block at a time: what it did not keep
    recompute = per_block - kept if n_ckpt else 0.0
    if offload:
        return (n_ckpt * kept if policy == "selective" else 0.0) + 2 * per_block + outside, 0.0
    return n_plain * per_block + n_ckpt * kept + outside, recompute


def offloaded_activation_bytes(s: ModelShape, micro_batch_tokens: int, precision: str, checkpointing: bool | str,
                               cp_ulysses: int = 1, cp_ring: int = 1, every: int = 1, backend: str = "flash",
                               sample_tokens: int | None = None) -> float:
    """Host bytes train.activation_offload needs on one rank: what the device would keep without it."""
    return activation_bytes(s, micro_batch_tokens, precision, checkpointing, cp_ulysses, cp_ring, every,
                            backend=backend, sample_tokens=sample_tokens)


def attention_workspace_bytes(s: ModelShape, backend: str, micro_batch_tokens: int, precision: str,
                              cp_ulysses: int = 1, cp_ring: int = 1) -> float:
    """Transient bytes of one attention call (forward or backward) on one rank."""
    c = DTYPE_BYTES[precision]
    L = micro_batch_tokens / cp_ring  # sequence seen by the kernel after the Ulysses all-to-all
    h = s.heads / cp_ulysses
    if backend == "sdpa":
        return L * h * s.head_dim * c
    if backend in ("flash", "xformers"):
        return h * L * 4
    if backend == "flex":
        return h * L * 4 + 8 * (L / 128) ** 2
    if backend == "sdpa_dense":
        return L * L * (1 + c)
    raise ValueError(f"unknown attention backend {backend!r}")


# --------------------------------------------------------------------------- state


@dataclass
class MemoryEstimate:
    """Per-rank bytes by component; `total` includes the fixed reserve."""

    params: float
    grads: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    attention_workspace: float
    reserve: float
    extra: dict[str, float] = field(default_factory=dict)
    host: float = 0.0  # host memory the offload options need on this rank (not in `total`)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.fsdp_buffers + self.activations
                + self.attention_workspace + self.reserve + sum(self.extra.values()))

    def as_gib(self) -> dict[str, float]:
        d = {k: v / GIB for k, v in asdict(self).items() if k not in ("extra", "host")}
        d.update({k: v / GIB for k, v in self.extra.items()})
        d["total"] = self.total / GIB
        d["host"] = self.host / GIB
        return d


def fsdp_shard_degree(dp_shard: int, cp: int, cp_fsdp_mode: str) -> int:
    """Ranks FSDP2 shards each parameter over: the CP ranks join the shard group with
    parallel.cp_fsdp_mode=all (parallel/mesh.py), else only dp_shard."""
    return dp_shard * (cp if cp_fsdp_mode == "all" else 1)


def optimizer_bytes_per_param(optimizer: str, momentum: float = 0.0) -> float:
    if optimizer == "adamw":
        return 8
    if optimizer == "adamw8bit":  # uint8 codes + an fp32 scale per 256 values, both moments (optim/low_bit.py);
        # tensors under 4096 values keep fp32 moments (8 B): small next to the large ones counted here
        return QUANTIZED_BYTES
    if optimizer == "muon":  # an upper bound: the blocks' matrices keep one momentum buffer (4), the rest AdamW's two
        return 8
    if optimizer == "sgd":
        return 4 if momentum > 0 else 0
    raise ValueError(f"optim.name={optimizer!r} must be adamw, adamw8bit, muon or sgd")


@dataclass(frozen=True, kw_only=True)
class RankSetup:
    """What one rank runs, beside the model's shape: its layout (the parallel degrees, the
    micro-batch, activation checkpointing and offload) and the run's settings that size its
    memory (precision, optimizer, attention backend, FSDP options). Variants of one setup are
    `dataclasses.replace(setup, ...)`.

    checkpointing: False / "none", True / "full", "selective" (every `ac_every`-th block);
    cpu_offload (FSDP2 CPUOffloadPolicy): the sharded parameters, gradients and optimizer state
    move to `host`, the device keeps the FSDP buffers (gathered blocks, one block's gradient);
    ep (parallel.ep): the expert weights are split over ep ranks instead of FSDP / DDP;
    sample_tokens: the longest sample of a micro-batch (ring attention's saved bytes grow with
    it; None: one sample fills the micro-batch)."""

    micro_batch_tokens: int
    checkpointing: bool | str
    dp_replicate: int = 1
    dp_shard: int = 1
    cp_ulysses: int = 1
    cp_ring: int = 1
    ep: int = 1
    ac_every: int = 1
    activation_offload: bool = False
    cpu_offload: bool = False
    sample_tokens: int | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.0
    backend: str = "flash"
    dp_mode: str = "fsdp2"
    cp_fsdp_mode: str = "all"
    reshard_after_forward: bool = True
    reserve_bytes: float = 0.0


def estimate_memory(s: ModelShape, r: RankSetup) -> MemoryEstimate:
    """Peak bytes of one rank running `r` (see the module docstring for every term)."""
    cp = r.cp_ulysses * r.cp_ring
    world = r.dp_replicate * r.dp_shard * cp
    c = DTYPE_BYTES[r.precision]
    opt = optimizer_bytes_per_param(r.optimizer, r.momentum)
    extra: dict[str, float] = {}
    # with EP the experts are not FSDP's or DDP's: the dense rest is, the experts come after
    experts = s.params_experts if r.ep > 1 else 0
    dense = s.params - experts
    block = s.params_block - (experts // max(1, s.moe_blocks))
    if r.dp_mode == "fsdp2" and world > 1:
        shard = fsdp_shard_degree(r.dp_shard, cp, r.cp_fsdp_mode)
        params, grads, optim_b = 4 * dense / shard, 4 * dense / shard, opt * dense / shard
        if shard > 1:
            gathered = (s.depth if not r.reshard_after_forward else 2) * c * block
            fsdp = gathered + (c + 4) * block + c * s.params_other
        else:
            fsdp = 0.0
        autocast_cache = c * dense if r.precision != "fp32" and shard == 1 else 0.0
    else:
        params, grads, optim_b = 4.0 * dense, 4.0 * dense, float(opt * dense)
        fsdp = 4.0 * dense if r.dp_mode == "ddp" and world > 1 else 0.0  # DDP's bucket copy
        autocast_cache = c * dense if r.precision != "fp32" else 0.0
    saved, recompute = activation_parts(s, r.micro_batch_tokens, r.precision, r.checkpointing, r.cp_ulysses, r.cp_ring,
                                        r.ac_every, r.activation_offload, r.backend, r.sample_tokens)
    acts = saved + recompute
    if autocast_cache:
        # autocast's low-precision weight copies live while forward's autocast context is open
        # and are freed when it closes; backward's recompute of a checkpointed block comes after.
        # The two never coexist: only the part of the cache larger than the recompute adds to
        # the peak (measured on an H200: dit_1b at 32k tokens, full AC, docs/performance.md)
        extra["autocast_weight_cache"] = max(0.0, autocast_cache - recompute)
    if experts:
        params, grads, optim_b = params + 4 * experts / r.ep, grads + 4 * experts / r.ep, optim_b + opt * experts / r.ep
        if r.precision != "fp32":
            extra["expert_casts"] = c * experts / r.ep
    host = offloaded_activation_bytes(s, r.micro_batch_tokens, r.precision, r.checkpointing, r.cp_ulysses, r.cp_ring,
                                      r.ac_every, r.backend, r.sample_tokens) if r.activation_offload else 0.0
    if r.cpu_offload:
        host += params + grads + optim_b
        params = grads = optim_b = 0.0
    ws = attention_workspace_bytes(s, r.backend, r.micro_batch_tokens, r.precision, r.cp_ulysses, r.cp_ring)
    if s.moe_blocks:
        extra["moe_dispatch"] = moe_dispatch_bytes(s, r.micro_batch_tokens, r.precision, cp, r.ep)
    return MemoryEstimate(params=params, grads=grads, optimizer=optim_b, fsdp_buffers=fsdp, activations=acts,
                          attention_workspace=ws, reserve=r.reserve_bytes, extra=extra, host=host)


# --------------------------------------------------------------------------- measurement


def saved_activation_bytes(fn: Callable[[], Any], exclude: list[torch.Tensor] | tuple = ()) -> tuple[int, Any]:
    """Run `fn()` and return (bytes of distinct storages autograd saved for backward, fn's result).

    Works on any device without an allocator: every tensor saved by the autograd graph passes
    through `saved_tensors_hooks`; storages are de-duplicated (a view of a saved tensor costs
    nothing) and tensors in `exclude` (the parameters) are not activations.
    Activation-checkpointed regions save through their own hooks and are not seen here.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def example_inputs(cfg, tokens: int, seed: int = 0) -> tuple:
    """Forward arguments of a model of `cfg` for one pack of two samples of `tokens` tokens in all
    (video: patches, (t, h, w) positions, times and, with captions, 8-token contexts; llm: ids)."""
    spec = model_spec(cfg)
    gen = torch.Generator().manual_seed(seed)
    lens = [tokens // 3, tokens - tokens // 3]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    order = torch.cat([torch.arange(n) for n in lens])
    layout = VarlenLayout.build(seg, order, causal=spec.mode == "llm")
    if spec.mode == "llm":
        return (torch.randint(0, spec.io_dim(cfg), (tokens,), generator=gen), order[:, None], layout)
    pos = torch.stack([order // 64, (order // 8) % 8, order % 8], dim=-1)
    args = (torch.randn(tokens, spec.io_dim(cfg), generator=gen), pos, seg, torch.rand(len(lens), generator=gen), layout)
    if cfg.text_dim:
        args += (torch.randn(len(lens), 8, cfg.text_dim, generator=gen), torch.full((len(lens),), 8))
    return args


def calibrate_block(cfg, tokens: int = 256, precision: str = "fp32", seed: int = 0) -> dict[str, float]:
    """Measure one block's saved bytes per token on the CPU with the real dims of `cfg`.

    Builds the model with depth 1 and 2 (the difference is one block, whatever is outside),
    runs a forward over two samples of `tokens` tokens in total and compares with
    `block_activation_bytes_per_token`. Returns measured, estimated and the relative error.
    """
    measured = []
    for depth in (1, 2):
        c = replace(cfg, depth=depth)
        model = build_model(c)
        init_weights(model, seed, "normal")
        args = example_inputs(c, tokens, seed)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cpu", enabled=False)
        with ctx:
            got, _ = retained_bytes(lambda: model(*args), list(model.parameters()))
        # autocast's bf16 weight copies are per parameter, not per-token activations (the
        # planner counts them once, as `autocast_weight_cache`): retained_bytes reports them apart
        measured.append(got["activations"])
    shape = model_shape(cfg)
    per_token = (measured[1] - measured[0]) / tokens
    est = block_activation_bytes_per_token(shape, precision)
    return {"measured_bytes_per_token_block": per_token, "estimated_bytes_per_token_block": est,
            "rel_error": (est - per_token) / per_token, "tokens": tokens, "precision": precision}
