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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn

from dit_train.models.family_forward import PackedContext, packed_processors, PackedRope
from dit_train.models.registry import register_model
from dit_train.models.wan import (block_linears, PackedWan, PackedWanAttnProcessor, WAN, WAN_BLOCK, wan_config,
                                  wan_spec, WanConfig)
from dit_train.models.wan_experts import JoinedBlocks


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


def _needs_vace_blocks(theirs: dict, cfg: WanVACEConfig, path: str) -> list[str]:
    """DiffusersFamily.refuse: a folder without VACE blocks (a T2V Wan), naming what to give (its
    VACE blocks would be untrained)."""
    if "vace_layers" in theirs:
        return []
    return [f"model.pretrained={path} holds a {theirs.get('_class_name', 'model')} without VACE blocks: "
            f"model.name=wan_vace starts from a WanVACETransformer3DModel folder (Wan2.1-VACE-1.3B / -14B diffusers), "
            f"or from model.pretrained=''"]


VACE = dataclasses.replace(
    WAN, class_name="WanVACETransformer3DModel", kwargs=vace_config, folder_kind="a Wan VACE folder",
    our_keys=WAN.our_keys | {"vace_layers": "vace_layers",
                             "vace_in_channels": "2 in_channels + vace_mask_channels (cond.control)"},
    refuse=_needs_vace_blocks,
    # a VACE block is a Wan block (same names) plus block 0's before_proj and every block's after_proj:
    # Wan's original vace_blocks.N.*, as diffusers' scripts/convert_wan_to_diffusers.py renames them
    # (VACE_TRANSFORMER_KEYS_RENAME_DICT: "before_proj" -> "proj_in", "after_proj" -> "proj_out",
    # vace_blocks kept) and ComfyUI's VaceWanModel names them; no diffusers LoRA reader takes vace_blocks
    lora_keys=WAN.lora_keys.with_blocks(vace_blocks=("vace_blocks", WAN_BLOCK | {"proj_in": "before_proj",
                                                                                 "proj_out": "after_proj"})))


class PackedWanVACE(PackedWan):
    """PackedWan plus Wan VACE's context branch (the module docstring).

    forward(x, ...) as PackedWan's, x [L, (C_in + vace_in)·pt·ph·pw]: the patch embedding's
    input features, then the VACE context's (batch.input_tokens appends the control
    last). Returns [L, C·pt·ph·pw], the predicted velocity.
    """

    family = VACE

    def adopt(self, wan: nn.Module, backend: str) -> None:
        super().adopt(wan, backend)
        self.vace_patch_embedding = wan.vace_patch_embedding
        self.vace_blocks = wan.vace_blocks
        packed_processors(self.vace_blocks, PackedWanAttnProcessor, backend)
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


def vace_blocks(model: nn.Module) -> JoinedBlocks:
    """ModelSpec.blocks: the VACE blocks, then Wan's (the order the forward runs them): FSDP2
    units, activation checkpointing and compile each take both kinds."""
    return JoinedBlocks(model.vace_blocks, model.blocks)


def _vace_block_linears(b: nn.Module) -> list[nn.Module]:
    """A Wan block's per-token matmuls, and a VACE block's proj_in / proj_out."""
    return block_linears(b) + [m for m in (getattr(b, "proj_in", None), getattr(b, "proj_out", None)) if m is not None]


register_model(wan_spec(
    VACE, name="wan_vace", config=WanVACEConfig, build=lambda cfg, backend="sdpa": PackedWanVACE(cfg, backend),
    # Wan's block figures (tests/test_planner.py re-measures them); a VACE block saves what a Wan
    # block does, its proj_in/proj_out outputs aside. The LoRA targets' suffixes also name the VACE
    # blocks' attention and FFN (vace_blocks.N.attn1.to_q, ...), as DiffSynth-Studio's VACE LoRA trains them
    blocks=vace_blocks, block_linears=_vace_block_linears,
    io_linears=lambda m: [m.patch_embedding, m.vace_patch_embedding, m.proj_out],
))
