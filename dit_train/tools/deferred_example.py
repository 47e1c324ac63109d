"""Deferred normalization, runnable: forward_backward × N, then optim_step(normalization=...).

A service-style loop on the causal LM and the embedded corpus: each "request" brings a
different number of documents; one optimizer step normalizes by all their valid tokens.

    python -m dit_train.tools.deferred_example                       # 1 process
    python -m dit_train.tools.deferred_example parallel.dp_shard=2   # any layout (starts local workers)
"""
from __future__ import annotations

import sys



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


def main() -> int:
    from dit_train.config import compose
    from dit_train.engine.launch import launch

    cfg = compose(["mode=llm", "train.steps=10", *sys.argv[1:]])
    launch(cfg, train)
    return 0


if __name__ == "__main__":
    main()
