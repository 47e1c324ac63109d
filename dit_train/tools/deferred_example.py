"""Post-training through the session API, runnable: SFT, GRPO or DPO with the tiny causal LM on
the embedded corpus (CPython's pydoc topics), the caller's own sequences in every call.

    python -m dit_train.tools.deferred_example --recipe sft                       # 1 process
    python -m dit_train.tools.deferred_example --recipe grpo parallel.dp_shard=2  # 2 local workers
    torchrun --nproc-per-node 2 -m dit_train.tools.deferred_example --recipe dpo parallel.dp_shard=2

sft:  prompt "topic: " (weight 0) + a paragraph (weight 1); a variable number of calls of
      variable size per step, normalized by all their loss tokens (verl: token-mean).
grpo: 3 prompts × 4 sampled continuations per step (session.generate); reward = share of
      lowercase letters and spaces in the continuation; group-normalized advantages; old
      log-probs from session.forward, reference log-probs from a frozen second session (KL);
      two PPO mini-steps per batch of rollouts (the second sees ratios != 1).
dpo:  pairs (a paragraph, the same bytes shuffled) after the same prompt; reference log-probs
      of the initial weights; normalized by pairs (num_sequences).
Every rank builds the same batches (same seeds) and passes the full list.
"""
from __future__ import annotations

import argparse
import functools
import random
import sys

from dit_train.compose import compose
from dit_train.data_pipelines.text import ByteTokenizer, embedded_corpus
from dit_train.engine.launch import launch
from dit_train.posttrain import Datum, dpo_loss, grpo_loss, sft_loss, TrainingSession

TOK = ByteTokenizer()


def paragraphs(max_chars: int) -> list[tuple[str, str]]:
    """(topic, paragraph) of the embedded corpus: the prompt and the completion of a datum."""
    out = []
    for topic, text in embedded_corpus():
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= 40 and not para.startswith("*"):
                out.append((topic, para[:max_chars]))
    return out


def datum(prompt: str | list[int], completion: str | list[int], **fields):
    """Prompt tokens weigh 0 (no gradient), completion tokens 1 (text or token ids)."""
    p = TOK.encode(prompt) if isinstance(prompt, str) else list(prompt)
    c = TOK.encode(completion) if isinstance(completion, str) else list(completion)
    return Datum(tokens=p + c, weights=[0.0] * len(p) + [1.0] * len(c), **fields)


def sft(session, steps: int, rng: random.Random, say) -> None:
    pool = paragraphs(96)
    for step in range(steps):
        for _ in range(rng.randint(1, 3)):  # a variable number of calls of variable size
            batch = [datum(f"{t}: ", p) for t, p in rng.sample(pool, rng.randint(1, 4))]
            session.forward_backward(batch, sft_loss())  # raw sums; the step divides by all tokens
        out = session.optim_step("num_loss_tokens")
        say(f"step {step}: loss {out['loss']:.3f} over {out['num_loss_tokens']} tokens / "
            f"{out['num_sequences']} sequences, grad_norm {out['grad_norm']:.3f}")


def reward(text: str) -> float:
    """The toy task: write lowercase prose (share of lowercase letters and spaces)."""
    return sum(ch.islower() or ch == " " for ch in text) / max(1, len(text))


def grpo(session, steps: int, rng: random.Random, say, kl_coef: float, group: int = 4, new_tokens: int = 12) -> None:
    reference = TrainingSession(session.cfg, ctx=session.ctx) if kl_coef else None  # the initial weights, frozen
    loss = grpo_loss(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef)
    pool = paragraphs(16)
    for step in range(steps):
        prompts = [TOK.encode(p[:12]) for _, p in rng.sample(pool, 3) for _ in range(group)]
        rollouts = session.generate(prompts, new_tokens, top_k=256, seed=1000 * step)  # same on every rank
        rewards = [reward(TOK.decode(r[len(p):])) for p, r in zip(prompts, rollouts)]
        batch = []
        for g in range(0, len(prompts), group):
            rs = rewards[g:g + group]
            mean = sum(rs) / group
            std = (sum((r - mean) ** 2 for r in rs) / group) ** 0.5
            for p, r, rew in zip(prompts[g:g + group], rollouts[g:g + group], rs):
                batch.append(datum(p, r[len(p):], advantages=(rew - mean) / (std + 1e-4)))  # sampled ids as they are
        old = session.forward(batch)  # the sampling policy's log-probs (the ratio's denominator)
        ref = reference.forward(batch) if reference is not None else [None] * len(batch)
        for d, o, f in zip(batch, old, ref):
            d.old_logprobs, d.ref_logprobs = o, f
        half = len(batch) // 2
        for mini in (batch[:half], batch[half:]):  # two PPO mini-steps on the same rollouts
            session.forward_backward(mini, loss)
            out = session.optim_step("num_loss_tokens")
        say(f"step {step}: reward {sum(rewards) / len(rewards):.3f}, loss {out['loss']:.4f}, "
            f"clip_fraction {out['clip_fraction']:.3f}, kl {out.get('kl', 0.0):.4f}, "
            f"tokens {out['num_loss_tokens']}, grad_norm {out['grad_norm']:.3f}")


def dpo(session, steps: int, rng: random.Random, say) -> None:
    pairs = []
    for topic, para in rng.sample(paragraphs(48), 16):
        shuffled = list(para)
        rng.shuffle(shuffled)
        pairs += [datum(f"{topic}: ", para), datum(f"{topic}: ", "".join(shuffled))]  # chosen, rejected
    for d, ref in zip(pairs, session.forward(pairs)):  # the reference: the initial weights
        d.ref_logprobs = ref
    loss = dpo_loss(beta=0.1)
    for step in range(steps):
        k = rng.sample(range(len(pairs) // 2), 4)
        chosen = [pairs[i] for j in k for i in (2 * j, 2 * j + 1)]
        session.forward_backward(chosen[:2], loss)  # calls hold whole pairs
        session.forward_backward(chosen[2:], loss)
        out = session.optim_step("num_sequences")  # divides by pairs
        say(f"step {step}: loss {out['loss']:.4f} over {out['num_sequences']} pairs, reward accuracy "
            f"{out['reward_accuracy']:.2f}, margin {out['reward_margin']:.3f}, grad_norm {out['grad_norm']:.3f}")


def train(cfg, recipe: str = "sft", steps: int = 8, kl_coef: float = 0.05, out: str = "") -> None:
    session = TrainingSession(cfg)
    rng = random.Random(0)  # same on every rank: every rank passes the same batches
    say = (lambda s: print(s, flush=True)) if session.ctx.is_main else (lambda s: None)
    if recipe == "sft":
        sft(session, steps, rng, say)
    elif recipe == "grpo":
        grpo(session, steps, rng, say, kl_coef)
    else:
        dpo(session, steps, rng, say)
    if out:
        ckpt = session.save(out)  # TrainingSession.load(out) resumes, on any layout
        say(f"saved {ckpt} and {out}/weights.safetensors")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=("sft", "grpo", "dpo"), default="sft")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kl", type=float, default=0.05, help="GRPO: KL coefficient to the initial weights (0 = off)")
    ap.add_argument("--out", default="", help="save the session here at the end")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.dp_shard=2 optim.lr=3e-3")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = compose(["mode=llm", "optim.lr=3e-3", "train.eval_every=0", "train.progress=false", *args.overrides])
    # fn(cfg) on every worker the layout needs (a partial of a module function: spawn pickles it)
    launch(cfg, functools.partial(train, recipe=args.recipe, steps=args.steps, kl_coef=args.kl, out=args.out))
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
