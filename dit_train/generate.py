"""Text generation from a trained causal LM (greedy or top-k sampling), single process."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dit_train.checkpoint.export import load_safetensors
from dit_train.config import Config
from dit_train.compose import load_config
from dit_train.models import build_model
from dit_train.kernels import VarlenLayout


def load_run(run_dir: str | Path, weights: str | Path | None = None, ema: bool = False) -> tuple[Config, nn.Module]:
    """The config and trained model of a run dir (config.yaml + weights.safetensors, or
    weights_ema.safetensors with `ema`)."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir)
    path = Path(weights) if weights else run_dir / ("weights_ema.safetensors" if ema else "weights.safetensors")
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path} (export them from a checkpoint first)")
    model = build_model(cfg.model)
    sd, want = load_safetensors(path), model.state_dict()
    missing, unexpected = sorted(want.keys() - sd.keys()), sorted(sd.keys() - want.keys())
    if missing or unexpected:
        raise ValueError(f"{path} does not hold the weights of the model in {run_dir / 'config.yaml'}: missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    try:
        model.load_state_dict(sd)
    except RuntimeError as err:  # a tensor of another shape
        raise ValueError(f"{path} does not fit the model in {run_dir / 'config.yaml'}: "
                         f"{' '.join(str(err).split())[:300]}") from None
    return cfg, model.eval()


def _next_token(logits: torch.Tensor, top_k: int, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """[1] the next token from one position's logits [vocab]: greedy when top_k == 0, else
    sampled among the top_k."""
    if top_k > 0:
        values, idx = torch.topk(logits / max(temperature, 1e-6), min(top_k, logits.numel()))
        return idx[torch.multinomial(torch.softmax(values, -1), 1, generator=gen)]
    return logits.argmax().view(1)


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, top_k: int = 0, temperature: float = 1.0,
             seed: int = 0) -> list[int]:
    """Continue `prompt`: greedy when top_k == 0, else sample among the top_k logits.

    Recomputes the whole sequence per token (no KV cache): fine for the small models this
    trains on CPU.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(prompt, dtype=torch.long)
    for _ in range(max_new_tokens):
        n = ids.numel()
        pos = torch.arange(n)
        meta = VarlenLayout.build(torch.zeros(n, dtype=torch.long), pos, causal=True)
        logits = model(ids, pos[:, None], meta)[-1].float()
        ids = torch.cat([ids, _next_token(logits, top_k, temperature, gen).view(1)])
    return ids.tolist()


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, top_k: int = 0,
                   temperature: float = 1.0, seed: int = 0) -> list[list[int]]:
    """`generate` for several prompts at once: the sequences are packed (block-causal, one
    sample each) so every new token costs one forward for all of them. Prompt i samples with
    its own generator seeded seed + i. Returns each prompt followed by its continuation."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        lengths = torch.tensor([len(s) for s in seqs])
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        seg = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        logits = model(ids, pos[:, None], VarlenLayout.build(seg, pos, causal=True))[lengths.cumsum(0) - 1].float()
        for s, row, gen in zip(seqs, logits, gens):
            s.append(int(_next_token(row, top_k, temperature, gen)))
    return seqs
