"""Wan 2.2 A14B: two transformers, one per side of a timestep boundary.

diffusers' `WanPipeline(transformer=..., transformer_2=..., boundary_ratio=b)` denoises with
`transformer` (the high-noise expert) while the scheduler timestep is >= b·1000, i.e. while
our flow time t >= b, and with `transformer_2` (the low-noise expert) below. Each expert is a
`WanTransformer3DModel` of Wan 2.1 14B's shape, so each trains as `model.name=wan` with
`model.expert=high|low`, or both in one run with `model.expert=both`:

- its flow times are drawn in its range (`timestep_range`: [b, 1] or [0, b]; the drawn,
  shifted t is mapped linearly onto it, objectives/flow_matching.py `noisy_sample`);
- `model.pretrained` of a pipeline folder reads that expert's subfolder (`transformer/` or
  `transformer_2/`), and `export_weights --diffusers DIR` writes into the same subfolder of
  DIR, so exporting both experts' runs into one DIR gives the pipeline's layout;
- `ExpertPair` samples with both (tools.sample RUN --low-noise RUN2), switching per clip at
  the boundary like the pipeline;
- `model.expert=both` builds an `ExpertPair` of two fresh experts (state-dict prefixes
  `transformer.` and `transformer_2.`, the pipeline's component names): every clip's drawn t
  (the whole (0, 1)) routes it to its expert, `components` maps each prefix to its export
  subfolder (full weights and LoRA files), `JoinedBlocks` gives FSDP2 / checkpointing both
  experts' blocks.

No parallelism here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

# model.expert -> the pipeline component holding it
SUBFOLDER = {"high": "transformer", "low": "transformer_2"}
BOTH = "both"  # model.expert=both: one run trains the two experts (an ExpertPair)


def expert_checks(cfg: Any) -> list[str]:
    """One line per wrong expert key (model.expert, model.boundary_ratio)."""
    if cfg.expert not in ("", *SUBFOLDER, BOTH):
        return [f"model.expert={cfg.expert!r} must be high, low, both or empty (one transformer for every t)"]
    if cfg.expert and not 0.0 < cfg.boundary_ratio < 1.0:
        return [f"model.expert={cfg.expert} needs model.boundary_ratio in (0, 1) (Wan 2.2 A14B T2V: 0.875), "
                f"got {cfg.boundary_ratio}"]
    return []


def timestep_range(cfg: Any) -> tuple[float, float]:
    """(lo, hi) of the flow times `cfg` trains on: the whole (0, 1) without an expert."""
    if cfg.expert == "high":
        return (float(cfg.boundary_ratio), 1.0)
    if cfg.expert == "low":
        return (0.0, float(cfg.boundary_ratio))
    return (0.0, 1.0)


def components(cfg: Any) -> dict[str, str]:
    """{state-dict prefix: subfolder of an export DIR} of the model's diffusers transformers
    ("" = the whole state dict / DIR itself): one expert goes into its pipeline component,
    model.expert=both's two into transformer/ and transformer_2/ (their own prefixes)."""
    if cfg.expert == BOTH:
        return {sub: sub for sub in SUBFOLDER.values()}
    return {"": SUBFOLDER.get(cfg.expert, "")}


def sampling_boundary(cfg: Any) -> float:
    """The flow time at which the model's own sampling switches experts (and guidance scales):
    model.boundary_ratio for model.expert=both, 0 (no switch) for one transformer."""
    return float(cfg.boundary_ratio) if cfg.expert == BOTH else 0.0


def pretrained_folder(path: str, cfg: Any) -> Path:
    """The WanTransformer3DModel folder `model.pretrained=path` names for `cfg`: path itself
    when it holds config.json, else its `transformer/` (or, for model.expert=low,
    `transformer_2/`). A pipeline folder whose boundary_ratio (model_index.json) differs from
    model.boundary_ratio, or that has no low-noise expert, is refused naming what differs."""
    folder = Path(path).expanduser()
    if (folder / "config.json").exists():
        if cfg.expert == BOTH:
            raise ValueError(f"model.pretrained={path} is one transformer, but model.expert=both trains Wan 2.2 "
                             f"A14B's two experts: point at the pipeline folder holding transformer/ and transformer_2/")
        return folder
    sub = SUBFOLDER.get(cfg.expert, "transformer")
    index = folder / "model_index.json"
    if cfg.expert and index.exists():
        theirs = json.loads(index.read_text()).get("boundary_ratio")
        if theirs is None:
            raise ValueError(f"model.pretrained={path} is a single-transformer pipeline (no boundary_ratio in "
                             f"model_index.json: Wan 2.1 or Wan 2.2 TI2V), not Wan 2.2 A14B's two experts; "
                             f"drop model.expert or point at an A14B folder")
        if abs(float(theirs) - cfg.boundary_ratio) > 1e-9:
            raise ValueError(f"model.pretrained={path} has boundary_ratio={theirs} (model_index.json) but "
                             f"model.boundary_ratio={cfg.boundary_ratio}; set model.boundary_ratio={theirs}")
    if (folder / sub / "config.json").exists():
        return folder / sub
    if cfg.expert == "low":
        raise FileNotFoundError(f"model.pretrained={path}: no {sub}/config.json there (model.expert=low reads the "
                                f"low-noise expert, transformer_2/ of a Wan 2.2 A14B pipeline folder)")
    raise FileNotFoundError(f"model.pretrained={path}: no config.json there (expected a diffusers "
                            f"WanTransformer3DModel folder, or a pipeline folder with {sub}/)")


def expert_folders(path: str, cfg: Any) -> dict[str, Path]:
    """DiffusersFamily.folders of Wan: {state-dict prefix: folder} of `model.pretrained=path`: the
    one transformer's (`pretrained_folder`), or for model.expert=both each expert's subfolder of an
    A14B pipeline folder under its component's prefix (transformer. / transformer_2.)."""
    if cfg.expert != BOTH:
        return {"": pretrained_folder(path, cfg)}
    pretrained_folder(path, cfg)  # refuses a single transformer folder and another boundary
    return {sub: pretrained_folder(path, dataclasses.replace(cfg, expert=expert)) for expert, sub in SUBFOLDER.items()}


def check_pair(high: Any, low: Any, high_name: str, low_name: str) -> None:
    """Two runs' model configs that sample together: the high- and the low-noise expert of one
    boundary, same shape. Raises ValueError naming what does not fit."""
    experts = [getattr(c, "expert", "") for c in (high, low)]  # "" also for models without experts (model=dit_*)
    if BOTH in experts:
        raise ValueError(f"{high_name if experts[0] == BOTH else low_name} trained model.expert=both: it holds both "
                         f"experts and samples with them alone (drop --low-noise)")
    if experts[0] != "high":
        raise ValueError(f"{high_name} trained model.expert={experts[0] or '(none)'}: the run sampled first must be "
                         f"the high-noise expert (model.expert=high)")
    if experts[1] != "low":
        raise ValueError(f"--low-noise {low_name} trained model.expert={experts[1] or '(none)'}: it must be the "
                         f"low-noise expert (model.expert=low)")
    if high.boundary_ratio != low.boundary_ratio:
        raise ValueError(f"{high_name} has model.boundary_ratio={high.boundary_ratio} but --low-noise {low_name} "
                         f"{low.boundary_ratio}: the experts of one model share one boundary")
    keys = ("dim", "depth", "heads", "ffn_dim", "in_channels", "patch_size", "text_dim", "text_len")
    value = lambda c, k: list(getattr(c, k)) if isinstance(getattr(c, k), (list, tuple)) else getattr(c, k)  # noqa: E731
    wrong = [f"model.{k}={value(high, k)} vs {value(low, k)}" for k in keys if value(high, k) != value(low, k)]
    if wrong:
        raise ValueError(f"{high_name} and --low-noise {low_name} are not one model's experts: " + "; ".join(wrong))


class ExpertPair(nn.Module):
    """Both experts as one model for the sampler: each clip's tokens get the output of the
    expert its flow time selects (t >= boundary: high), as WanPipeline switches per step.

    forward(x, pos, seg, t, meta, **context) has PackedWan's signature ([L, ...] tokens, t [S]).
    Both experts run on the whole pack (every rank of a CP group must make the same calls, and
    the clips of one pack may sit on either side), and each token keeps its clip's expert's
    output (torch.where: the other expert's output gets weight 0, so its gradient is exactly 0
    there): exact, at twice one expert's cost.

    Training (model.expert=both, `self.training`): both experts ALWAYS run, forward and
    backward, whatever clips this rank holds, so every rank of an FSDP2 mesh issues the same
    all-gathers and reduce-scatters for both experts' blocks (a rank whose pack holds no clip
    of one expert gives that expert a zero gradient; the SUM over ranks is the one-process
    gradient). Sampling (eval: every rank samples the same clips, so the choice is the same on
    all of them): a pack wholly on one side runs one expert.

    State dict: `transformer.*` (high) and `transformer_2.*` (low), the pipeline's names.
    """

    zero_init = ("proj_out",)  # per expert, as PackedWan (models/init.py matches substrings)
    output_head = "transformer.proj_out"  # engine/sanity.py: both experts start alike

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = high, low, float(boundary)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor, t: torch.Tensor, meta: Any,
                **kw: Any) -> torch.Tensor:
        high = t.float() >= self.boundary  # [S], the same on every rank when sampling (samples are replicated)
        if not self.training and bool(high.all()):
            return self.transformer(x, pos, seg, t, meta, **kw)
        if not self.training and not bool(high.any()):
            return self.transformer_2(x, pos, seg, t, meta, **kw)
        a = self.transformer(x, pos, seg, t, meta, **kw)
        b = self.transformer_2(x, pos, seg, t, meta, **kw)
        tok = torch.cat([high, high.new_zeros(1)])[torch.where(seg < 0, torch.full_like(seg, len(t)), seg)]
        return torch.where(tok[:, None].to(a.device), a, b)


class JoinedBlocks:
    """Both experts' `blocks` as one list (high's, then low's: the order the forward runs them)
    for parallelize(): FSDP2 units, activation checkpointing and compile read blocks[i] and
    write wrappers back with blocks[i] = ..., which lands in the owning expert's ModuleList."""

    def __init__(self, *lists: nn.ModuleList):
        self.lists = lists

    def _where(self, i: int) -> tuple[nn.ModuleList, int]:
        for blocks in self.lists:
            if i < len(blocks):
                return blocks, i
            i -= len(blocks)
        raise IndexError(i)

    def __len__(self) -> int:
        return sum(len(b) for b in self.lists)

    def __iter__(self):
        return (block for blocks in self.lists for block in blocks)

    def __getitem__(self, i: int) -> nn.Module:
        blocks, j = self._where(i)
        return blocks[j]

    def __setitem__(self, i: int, module: nn.Module) -> None:
        blocks, j = self._where(i)
        blocks[j] = module


def experts_of(model: nn.Module) -> list[nn.Module]:
    """The transformers a model holds: an ExpertPair's two, else the model itself."""
    return [model.transformer, model.transformer_2] if isinstance(model, ExpertPair) else [model]


def expert_blocks(model: nn.Module) -> Any:
    """ModelSpec.blocks of model.name=wan: `model.blocks`, or both experts' (JoinedBlocks)."""
    return JoinedBlocks(*(m.blocks for m in experts_of(model))) if isinstance(model, ExpertPair) else model.blocks
