"""diffusers' WanVACETransformer3DModel (Wan VACE: control through its own context blocks) trained
through the packed path of models/wan.py (`model.name=wan_vace`, docs/conditioning.md#wan-vace).

VACE is a Wan transformer plus a context branch: `vace_patch_embedding` (a Conv3d like the patch
embedding, over `vace_in_channels` = [inactive C | reactive C | mask k] of the control video) and
`vace_blocks`, one per entry of `vace_layers`. The branch runs first: its block j takes the
previous block's control states (block 0: proj_in(control) + the patch-embedded input), runs the
same self-attention / cross-attention / FFN as a Wan block, and gives a hint proj_out(states); the
main blocks then run as in Wan, and after block sorted(vace_layers)[j] the hint j is added to the
hidden states (times `control_hidden_states_scale`, 1 in training and by default in diffusers).

`PackedWanVACE` is `PackedWan` with those modules under diffusers' names (its state dict IS a
WanVACETransformer3DModel's): the input tokens carry the VACE context as their last
vace_in_channels·pt·ph·pw features (cond.control=true; tasks/conditioning.vace_context builds it
from each clip's control video), so a hint token lives on the rank of its hidden token under
any CP split — they are the same token. diffusers' WanVACETransformerBlock reads a per-sample
time embedding [B, 6, dim]; the packed sequence gives one per token, so the branch runs with the
L tokens as L batches of one ([L, 1, dim], temb [L, 6, dim]): the same arithmetic, per token, in
diffusers' own forward (the packed attention processor takes either shape).

No parallelism here (no torch.distributed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import json

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.config.choices import Mode
from dit_train.models.registry import ActivationModel, ModelSpec, register_model
from dit_train.models.wan import (_block_linears, _checks, _ffn, PackedContext, PackedRope, PackedWan, packed_attention,
                                  read_pretrained, to_diffusers, wan_config, WanConfig)
from dit_train.models.wan_experts import JoinedBlocks, pretrained_folder


@dataclass
class WanVACEConfig(WanConfig):
    """diffusers' WanVACETransformer3DModel through the packed path (`model.name=wan_vace`)."""

    name: str = "wan_vace"
    # main blocks after which a VACE hint is added (one VACE block each; must include 0):
    # Wan2.1-VACE-14B [0, 5, ..., 35], Wan2.1-VACE-1.3B [0, 2, ..., 28]
    vace_layers: List[int] = field(default_factory=lambda: [0, 5, 10, 15, 20, 25, 30, 35])
    # mask channels of the VACE context: the VAE's spatial stride squared (each latent pixel's
    # 8 x 8 pixel mask, WanVACEPipeline.prepare_masks: 64 for Wan's VAE); 1 on pixels (no VAE)
    vace_mask_channels: int = 64

    def control_channels(self) -> int:
        """The VACE context's channels per token (cond.control): [inactive C | reactive C | mask]."""
        return 2 * self.in_channels + self.vace_mask_channels

    def diffusers_model(self) -> type:
        from diffusers import WanVACETransformer3DModel  # deferred: diffusers takes ~2 s to import

        return WanVACETransformer3DModel

    def diffusers_kwargs(self) -> dict[str, Any]:
        return vace_config(self)


def vace_config(cfg: WanVACEConfig) -> dict[str, Any]:
    """WanVACETransformer3DModel(**kwargs) of the same shape as `cfg`: Wan's, with the patch
    embedding reading the input without the VACE context (cond.control's channels)."""
    kwargs = wan_config(cfg)
    vace_in = cfg.control_channels()
    if cfg.cond_channels < vace_in:
        raise ValueError(f"model.name=wan_vace reads each clip's control video as its VACE context "
                         f"({vace_in} channels): set cond.control=true (a control video beside each clip)")
    layers = list(cfg.vace_layers)
    if 0 not in layers or len(set(layers)) != len(layers) or max(layers) >= cfg.depth or min(layers) < 0:
        raise ValueError(f"model.vace_layers={layers} must be distinct block indices below model.depth={cfg.depth}, "
                         f"0 among them (diffusers' WanVACETransformer3DModel)")
    if cfg.vace_mask_channels < 1:
        raise ValueError(f"model.vace_mask_channels={cfg.vace_mask_channels} must be >= 1 (64 for Wan's VAE, 1 on pixels)")
    if cfg.expert:
        raise ValueError(f"model.expert={cfg.expert}: Wan VACE is one transformer here; set model.expert=''")
    return kwargs | dict(in_channels=kwargs["in_channels"] - vace_in, vace_layers=layers, vace_in_channels=vace_in)


class PackedWanVACE(PackedWan):
    """PackedWan plus Wan VACE's context branch (the module docstring).

    forward(x, ...) as PackedWan's, x [L, (C_in + vace_in)·pt·ph·pw]: the patch embedding's
    input features, then the VACE context's (tasks/conditioning.input_tokens appends the control
    last). Returns [L, C·pt·ph·pw], the predicted velocity.
    """

    def adopt(self, wan: nn.Module, backend: str) -> None:
        super().adopt(wan, backend)
        self.vace_patch_embedding = wan.vace_patch_embedding
        self.vace_blocks = wan.vace_blocks
        packed_attention(self.vace_blocks, backend)
        # hint j is added after the j-th smallest VACE layer, as diffusers pops them in block order
        self.hint_after = {layer: j for j, layer in enumerate(sorted(self.diffusers_config["vace_layers"]))}

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch embedding input, VACE context) features of the input tokens x."""
        n = self.patch_embedding.weight[0].numel()
        return x[:, :n], x[:, n:]

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return super().embed(self._split(x)[0])

    def run_blocks(self, h: torch.Tensor, x: torch.Tensor, ctx: PackedContext, temb_tok: torch.Tensor,
                   rope: PackedRope) -> torch.Tensor:
        """The VACE branch's hints, then Wan's blocks with hint j added after block vace_layers[j]."""
        w = self.vace_patch_embedding.weight
        c = F.linear(self._split(x)[1].to(w.dtype), w.flatten(1), self.vace_patch_embedding.bias)[:, None]  # [L, 1, dim]
        h_tok, temb = h[0][:, None], temb_tok[0]  # the L tokens as batches of one: [L, 1, dim], [L, 6, dim]
        hints = []
        for block in self.vace_blocks:
            hint, c = block(h_tok, ctx, c, temb, rope)
            hints.append(hint[:, 0])
        for i, block in enumerate(self.blocks):
            h = block(h, ctx, temb_tok, rope)
            if i in self.hint_after:  # diffusers multiplies by control_hidden_states_scale, 1 here
                h = h + hints[self.hint_after[i]][None]
        return h


def read_vace_pretrained(cfg: WanVACEConfig) -> dict[str, torch.Tensor]:
    """models/wan.read_pretrained of a WanVACETransformer3DModel folder; a folder without VACE
    blocks (a T2V Wan) is refused first, naming what to give (its VACE blocks would be untrained)."""
    folder = pretrained_folder(cfg.pretrained, cfg)
    config = json.loads((folder / "config.json").read_text())
    if "vace_layers" not in config:
        raise ValueError(f"model.pretrained={cfg.pretrained} holds a {config.get('_class_name', 'model')} without VACE "
                         f"blocks: model.name=wan_vace starts from a WanVACETransformer3DModel folder (Wan2.1-VACE-1.3B / "
                         f"-14B diffusers), or from model.pretrained=''")
    return read_pretrained(cfg.pretrained, cfg)


def vace_blocks(model: nn.Module) -> JoinedBlocks:
    """ModelSpec.blocks: the VACE blocks, then Wan's (the order the forward runs them): FSDP2
    units, activation checkpointing and compile each take both kinds."""
    return JoinedBlocks(model.vace_blocks, model.blocks)


def _vace_block_linears(b: nn.Module) -> list[nn.Module]:
    """A Wan block's per-token matmuls, and a VACE block's proj_in / proj_out."""
    return _block_linears(b) + [m for m in (getattr(b, "proj_in", None), getattr(b, "proj_out", None)) if m is not None]


register_model(ModelSpec(
    name="wan_vace", config=WanVACEConfig, mode=Mode.video, build=lambda cfg, backend="sdpa": PackedWanVACE(cfg, backend),
    blocks=vace_blocks, checks=_checks,
    # Wan's block figures (tests/test_planner.py re-measures them); a VACE block saves what a Wan
    # block does, its proj_in/proj_out outputs aside
    activations=lambda cfg: ActivationModel(fp32_d=32.4, autocast_f32_d=16, autocast_lp_d=20.5, outside_d=6,
                                            selective_d=10.5),
    block_linears=_vace_block_linears,
    io_linears=lambda m: [m.patch_embedding, m.vace_patch_embedding, m.proj_out],
    io_dim=lambda cfg: (cfg.in_channels + cfg.cond_channels) * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2],
    hidden=_ffn,
    pretrained=read_vace_pretrained, to_diffusers=to_diffusers,
))
