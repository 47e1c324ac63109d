"""diffusers' SkyReelsV2Transformer3DModel trained through our packed path (`model.name=skyreels_v2`).

SkyReels-V2 is the Wan 2.1 architecture (the same submodule names, projections, norms, RoPE and
time embedding values) with three additions, each handled here and nowhere else:

- per-frame timesteps (diffusion forcing): diffusers embeds a timestep per latent frame and gives
  its blocks a per-token modulation `temb [1, 6, L, dim]`. Our pack gives a t per causal block of
  each clip (samples["block_t"] [S, B], loss.frame_noise=block) and each token's `block`; every
  (clip, block) t is embedded once and each token reads its row, as the DiT does
  (`Conditioning.from_blocks`). A frame's t is its block's, so this is diffusers' per-frame
  embedding, computed once per block instead of once per frame;
- block-causal attention (`num_frame_per_block`): the mask is metadata of the pack
  (`model.causal_block_frames`, tasks/video_inputs.py), exactly as for our DiT: the attention
  callable every layer calls applies it, so Ulysses, ring and the streaming KV cache work unchanged;
- the fps embedding (`inject_sample_info`, the DF checkpoints): a class (0 for 16 fps, 1 else, as
  SkyReelsV2DiffusionForcingPipeline makes it from its `fps` argument) whose projection is added
  to every time row's modulation.

The attention modules are Wan's in all that our processor reads (to_q/k/v/out, norm_q/k, the I2V
branch's add_k/v_proj), so PackedWanAttnProcessor serves them. No parallelism here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dit_train.models.family_forward import NUM_TRAIN_TIMESTEPS, PackedContext, PackedRope, time_rows
from dit_train.models.registry import register_model
from dit_train.models.wan import block_linears, PackedWan, WAN, wan_config, wan_rope, wan_spec, WanConfig


@dataclass
class SkyReelsV2Config(WanConfig):
    """diffusers' SkyReelsV2Transformer3DModel through the packed path (`model.name=skyreels_v2`):
    Wan's keys plus these."""

    name: str = "skyreels_v2"
    # latent frames per causal block (diffusers' num_frame_per_block x patch_size[0]); 0 = bidirectional.
    # A multiple of patch_size[0] with at least 2 temporal patches: diffusers applies its mask only
    # for num_frame_per_block > 1, so a one-patch block would export as a bidirectional model
    causal_block_frames: int = 0
    # the DF checkpoints' fps embedding (fps_embedding, fps_projection); false = none
    inject_sample_info: bool = False
    # the frame rate the fps embedding is told (with inject_sample_info): class 0 for 16, 1 otherwise,
    # as SkyReelsV2DiffusionForcingPipeline(fps=...) makes it; sample in diffusers with the same fps
    fps: int = 24


_OUR_KEY = WAN.our_keys | {"inject_sample_info": "inject_sample_info"}


def skyreels_config(cfg: SkyReelsV2Config) -> dict[str, Any]:
    """SkyReelsV2Transformer3DModel(**kwargs) of the same shape as `cfg` (Wan's keys, plus the
    causal block and the fps embedding)."""
    kwargs = wan_config(cfg)
    if cfg.expert:
        raise ValueError(f"model.expert={cfg.expert}: SkyReels-V2 is one transformer; set model.expert=''")
    pt, k = cfg.patch_size[0], cfg.causal_block_frames
    if k < 0 or k % pt or k == pt:
        raise ValueError(f"model.causal_block_frames={k} must be 0 (bidirectional) or a multiple of "
                         f"model.patch_size[0]={pt} of at least 2 temporal patches ({2 * pt}, {3 * pt}, ...): "
                         f"diffusers' SkyReelsV2Transformer3DModel masks only blocks of num_frame_per_block > 1")
    return kwargs | dict(inject_sample_info=cfg.inject_sample_info, num_frame_per_block=max(1, k // pt))


# num_frame_per_block is not compared: diffusers' DF pipeline sets it per call (causal_block_size)
SKYREELS = dataclasses.replace(WAN, class_name="SkyReelsV2Transformer3DModel", kwargs=skyreels_config,
                               our_keys=_OUR_KEY, folder_kind="a SkyReels-V2 folder",
                               fixed={"qk_norm": "rms_norm_across_heads"})


class PackedSkyReelsV2(PackedWan):
    """Packed-sequence forward over a diffusers SkyReelsV2Transformer3DModel's modules.

    forward(x, pos, seg, t, meta, context=None, context_len=None, clean=None, image=None, block=None)
    -> [L, C·pt·ph·pw], as PackedWan's, with t either [S] (one flow time per clip) or [S, B] (one per
    causal block of each clip, diffusion forcing), in which case block [L] gives each token's block.
    """

    family = SKYREELS

    def adopt(self, model: nn.Module, backend: str) -> None:
        super().adopt(model, backend)
        if self.diffusers_config["inject_sample_info"]:
            self.fps_embedding, self.fps_projection = model.fps_embedding, model.fps_projection

    def __init__(self, cfg: SkyReelsV2Config, backend: str = "sdpa"):
        super().__init__(cfg, backend)
        self.fps_class = 0 if cfg.fps == 16 else 1

    def _modulation(self, proj: torch.Tensor) -> torch.Tensor:
        """DF checkpoints (inject_sample_info) add the fps class's embedding to the blocks'
        modulation only, as diffusers does; the output norm's shift and scale stay temb's."""
        if not self.diffusers_config["inject_sample_info"]:
            return proj
        fps = self.fps_embedding(torch.tensor([self.fps_class], device=proj.device))
        return proj + self.fps_projection(fps)

    @staticmethod
    def _rows(t: torch.Tensor, seg: torch.Tensor, clean: torch.Tensor | None,
              block: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [L], timestep [R]): per clip (t [S]: family_forward.time_rows) or per (clip, block)
        (t [S, B]: rows sample-major, then the padding row at t = 0)."""
        if t.dim() == 1:
            return time_rows(t, seg, clean)
        if block is None or clean is not None:
            raise ValueError("per-block timesteps t [S, B] need the tokens' `block` and no clean tokens")
        S, B = t.shape
        row = torch.where(seg < 0, torch.full_like(seg, S * B), seg * B + block)
        timestep = torch.cat([t.reshape(-1).float(), t.new_zeros(1, dtype=torch.float32)]) * NUM_TRAIN_TIMESTEPS
        return row, timestep

    def run_blocks(self, h: torch.Tensor, x: torch.Tensor, ctx: PackedContext, temb_tok: torch.Tensor,
                   rope: PackedRope) -> torch.Tensor:
        """SkyReels' blocks take the per-token modulation as [1, 6, L, dim] and an attention mask
        (None: the mask is in `rope.meta`, applied by attention_fn)."""
        temb = temb_tok.transpose(1, 2)
        for block in self.blocks:
            h = block(h, ctx, temb, rope, None)
        return h


register_model(wan_spec(
    SKYREELS, name="skyreels_v2", config=SkyReelsV2Config, build=lambda cfg, backend="sdpa": PackedSkyReelsV2(cfg, backend),
    block_linears=block_linears, io_linears=lambda m: [m.patch_embedding, m.proj_out],
))
