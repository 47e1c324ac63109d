#!/usr/bin/env python
"""Deferred normalization, runnable: forward_backward × N, then optim_step(normalization=...).

A service-style loop on the causal LM and the embedded corpus: each "request" brings a
different number of documents; one optimizer step normalizes by all their valid tokens.

    python tools/deferred_example.py                       # 1 process
    python tools/deferred_example.py parallel.dp_shard=2   # any layout (starts local workers)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def train(cfg) -> None:
    import random

    from dit_train.session import TrainingSession, token_sum_loss

    session = TrainingSession(cfg)
    n_docs = len(session.task.lengths())
    rng = random.Random(0)  # same on every rank: every rank passes the same ids
    for step in range(cfg.train.steps):
        for _ in range(rng.randint(1, 4)):                      # a variable number of calls
            ids = rng.sample(range(n_docs), rng.randint(1, 6))  # of variable size
            session.forward_backward(ids, token_sum_loss())     # raw sums, counts accumulated
        out = session.optim_step(normalization="num_loss_tokens")  # grads /= N, clip, step
        if session.ctx.is_main:
            print(f"step {step}: loss {out['loss']:.3f} over {out['num_loss_tokens']} tokens / "
                  f"{out['num_sequences']} documents, grad_norm {out['grad_norm']:.3f}", flush=True)


def main() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from dit_train.config import register_configs
    from dit_train.launch import launch

    register_configs()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=["mode=llm", "train.steps=10", *sys.argv[1:]]))
    launch(cfg, train)


if __name__ == "__main__":
    main()
