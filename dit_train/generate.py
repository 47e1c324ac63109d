"""Text generation from a trained causal LM (greedy or top-k sampling), single process."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dit_train.config import Config, load_config
from dit_train.models import build_model
from kernels import VarlenLayout


def load_run(run_dir: str | Path, weights: str | Path | None = None, ema: bool = False) -> tuple[Config, nn.Module]:
    """The config and trained model of a run dir (config.yaml + weights.safetensors, or
    weights_ema.safetensors with `ema`)."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    cfg = load_config(run_dir)
    path = Path(weights) if weights else run_dir / ("weights_ema.safetensors" if ema else "weights.safetensors")
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path} (export them from a checkpoint first)")
    model = build_model(cfg.model)
    model.load_state_dict(load_file(str(path)))
    return cfg, model.eval()


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
        if top_k > 0:
            values, idx = torch.topk(logits / max(temperature, 1e-6), min(top_k, logits.numel()))
            nxt = idx[torch.multinomial(torch.softmax(values, -1), 1, generator=gen)]
        else:
            nxt = logits.argmax().view(1)
        ids = torch.cat([ids, nxt.view(1)])
    return ids.tolist()
