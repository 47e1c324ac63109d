"""The session API with the caller's data (dit_train/posttrain).

SFT / GRPO / DPO over several forward_backward calls + one optim_step equal an independent
one-process computation — a plain model, one forward per sequence, the loss written out as the
textbook formula, one SGD step by hand — on one process and on dp × cp × ring layouts, with
uneven sequence lengths and uneven calls; forward() log-probs; the checks of the caller's data;
save / load resuming exactly, also onto another layout."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dit_train.engine.layout_equivalence import apply_layout, relative_difference
from dit_train.posttrain import Datum, dpo_loss, grpo_loss, sft_loss
from tests.conftest import compose_config

# depth 1: the tiny runs are Python-bound (a step costs its blocks' calls, not their width), and
# what the layouts must get right (tokens split over CP, the counts summed, FSDP2/DDP over the root
# and a block) does not need a second block
LLM = ["mode=llm", "model.dim=32", "model.depth=1", "model.heads=4", "model.init=normal", "optim=sgd",
       "optim.lr=0.5", "optim.max_grad_norm=0", "train.micro_batch_tokens=96", "train.progress=false",
       "train.eval_every=0", "data.max_doc_tokens=64", "data.heldout_fraction=0"]
# The session trains on the caller's datums, never on the configured corpus, but builds its task
# from it: the embedded corpus (pydoc_data.topics, ~7000 pieces of 64 tokens) cost ~0.3 CPU-s a
# session to read and measure, ~25 % of a layout worker's time; this corpus is a few pieces.
CORPUS = "\n\n".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(4))
TOL = 1e-4  # weights: max |Δ| relative to the largest update (see layout_equivalence)

# (name, batch, loss, optim_step normalization, call boundaries inside the batch)
CASES = [
    ("sft_token_mean", "sft", sft_loss(), "num_loss_tokens", [2, 5]),
    ("sft_seq_mean_token_sum", "sft", sft_loss(), "num_sequences", []),
    ("grpo_token_mean_kl", "grpo", grpo_loss(0.2, 0.28, kl_coef=0.1), "num_loss_tokens", [3, 4]),
    ("grpo_seq_mean_token_mean", "grpo", grpo_loss(agg="sequence"), "num_sequences", [5]),
    ("dpo", "dpo", dpo_loss(beta=0.5), "num_sequences", [2, 8]),  # calls hold whole pairs
]


# -- the one-process oracle: a plain model and the losses written out ---------------------------------


def plain_model(cfg):
    from dit_train.models import build_model, initialize

    model = build_model(cfg.model)
    initialize(model, cfg.model, cfg.train.seed)
    return model


def oracle_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[T-1] log p(tokens[t] | tokens[:t]) for t >= 1, one sequence alone (no packing)."""
    from dit_train.kernels import VarlenLayout

    n = tokens.numel() - 1
    pos = torch.arange(n)
    logits = model(tokens[:-1], pos[:, None], VarlenLayout.build(torch.zeros(n, dtype=torch.long), pos, causal=True))
    return F.log_softmax(logits.float(), dim=-1).gather(1, tokens[1:, None])[:, 0]


def oracle_loss(name: str, model, batch: list[Datum]) -> torch.Tensor:
    lp = [oracle_logprobs(model, d.tokens) for d in batch]
    w = [torch.as_tensor(d.weights)[1:].float() for d in batch]
    if name.startswith("sft"):
        per_seq = [(wi * -li).sum() for wi, li in zip(w, lp)]
        if name == "sft_token_mean":
            return sum(per_seq) / sum(int((wi != 0).sum()) for wi in w)
        return sum(per_seq) / sum(int((wi != 0).any()) for wi in w)
    if name.startswith("grpo"):
        clip_high, kl_coef = (0.28, 0.1) if name == "grpo_token_mean_kl" else (0.2, 0.0)
        per_token = []
        for d, li in zip(batch, lp):
            ratio = torch.exp(li - d.old_logprobs[1:])
            adv = d.advantages[1:]
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.0 + clip_high))
            ref = d.ref_logprobs[1:]
            per_token.append(pg + kl_coef * (torch.exp(ref - li) - (ref - li) - 1))
        if name == "grpo_token_mean_kl":
            return sum((wi * l).sum() for wi, l in zip(w, per_token)) / sum(int((wi != 0).sum()) for wi in w)
        means = [(wi * l).sum() / (wi != 0).sum() for wi, l in zip(w, per_token) if (wi != 0).any()]
        return sum(means) / len(means)
    assert name == "dpo"
    pi = [(wi * li).sum() for wi, li in zip(w, lp)]
    ref = [(wi * d.ref_logprobs[1:]).sum() for wi, d in zip(w, batch)]
    losses = [-F.logsigmoid(0.5 * ((pi[k] - ref[k]) - (pi[k + 1] - ref[k + 1]))) for k in range(0, len(batch), 2)]
    return sum(losses) / len(losses)


def oracle_step(cfg, name: str, batch: list[Datum]) -> tuple[dict[str, torch.Tensor], float]:
    """({"__init__/<p>": before, "<p>": after one SGD step}, the loss)."""
    model = plain_model(cfg)
    init = {f"__init__/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    loss = oracle_loss(name, model, batch)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= cfg.optim.lr * p.grad
    return init | {k: v.detach().clone() for k, v in model.state_dict().items()}, float(loss.detach())


# -- the caller's data -------------------------------------------------------------------------------------


def _sequences(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (tokens, weights) of uneven lengths (3..89 tokens) with a weight-0 prompt each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(3, 90, (1,), generator=g))
        w = torch.ones(T)
        w[: int(torch.randint(1, T, (1,), generator=g))] = 0
        out.append((torch.randint(0, 256, (T,), generator=g), w))
    return out


def make_batches(cfg) -> dict[str, list[Datum]]:
    """sft: fractional weights and one all-zero sequence (counted by no count); grpo: per-token
    advantages, old / reference log-probs around the model's own (ratios on both sides of the
    clip); dpo: 6 pairs with reference log-probs."""
    model = plain_model(cfg)
    g = torch.Generator().manual_seed(7)

    def near(tokens, scale):
        with torch.no_grad():
            lp = oracle_logprobs(model, tokens)
        return torch.cat([torch.zeros(1), (lp + scale * torch.randn(lp.shape, generator=g)).clamp(max=0)])

    sft = [Datum(t, w.clone()) for t, w in _sequences(0, 9)]
    sft[1].weights[sft[1].weights > 0] = 0.5
    sft[4].weights.zero_()
    grpo = [Datum(t, w, advantages=torch.randn(t.numel(), generator=g), old_logprobs=near(t, 0.3),
                  ref_logprobs=near(t, 0.2)) for t, w in _sequences(1, 9)]
    grpo[6].weights = torch.zeros_like(grpo[6].weights)
    dpo = [Datum(t, w, ref_logprobs=near(t, 0.5)) for t, w in _sequences(2, 12)]
    return {"sft": sft, "grpo": grpo, "dpo": dpo}


def expected_counts(name: str, batch: list[Datum]) -> tuple[int, int]:
    nonzero = [int((torch.as_tensor(d.weights)[1:] != 0).sum()) for d in batch]
    sequences = len(batch) // 2 if name == "dpo" else sum(n > 0 for n in nonzero)
    return sum(nonzero), sequences


# -- the session side (runs in every worker) ----------------------------------------------------------------


def session_step(cfg, ctx, batch, loss, norm, splits, with_init: bool = True) -> tuple[dict, dict, dict]:
    """with_init=False leaves out the initial weights (a gather under FSDP): a result compared with
    the oracle's needs none (relative_difference measures the update on the reference)."""
    from dit_train.posttrain import TrainingSession

    sess = TrainingSession(cfg, ctx=ctx)
    init = sess.state_dict() if with_init else {}
    bounds = [0, *splits, len(batch)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        sess.forward_backward(batch[a:b], loss)
    out = sess.optim_step(norm)
    final = sess.state_dict()
    weights = {f"__init__/{k}": v for k, v in init.items()} | final if sess.ctx.is_main else {}
    return weights, out, sess


def resume_steps(cfg, ctx, batches, save_to=None, load_from=None, overrides=()) -> dict:
    """Step 1 (SFT), optional save, step 2 (GRPO) — or load a step-1 checkpoint and take step 2.
    Returns the final weights (rank 0)."""
    from dit_train.posttrain import TrainingSession

    if load_from is None:
        sess = TrainingSession(cfg, ctx=ctx)
        sess.forward_backward(batches["sft"][:4], sft_loss())
        sess.forward_backward(batches["sft"][4:], sft_loss())
        sess.optim_step("num_loss_tokens")
        if save_to is not None:
            sess.save(save_to)
    else:
        sess = TrainingSession.load(load_from, overrides, ctx=ctx)
        assert sess.step_count == 1
    sess.forward_backward(batches["grpo"], grpo_loss(kl_coef=0.1))
    sess.optim_step("num_loss_tokens")
    return sess.state_dict()


def adam(cfg):
    from dataclasses import replace

    c = apply_layout(cfg, {})  # a copy
    c.optim = replace(c.optim, name="adamw", lr=1e-2, max_grad_norm=1.0)
    return c


def _worker(cfg, layouts, batches, ckpt_one_process, ckpt_dir):
    """Every case on every layout (one mesh per layout, shared by its sessions), the fingerprint
    check, and both directions of resuming across layouts."""
    from dit_train.parallel.mesh import init_parallel
    from dit_train.posttrain import TrainingSession

    out = {}
    for key, layout in layouts.items():
        c = apply_layout(cfg, layout)
        ctx = init_parallel(c.parallel)
        for name, kind, loss, norm, splits in CASES:
            weights, stats, _ = session_step(c, ctx, batches[kind], loss, norm, splits, with_init=False)
            out[(key, name)] = (weights, stats)
        sess = TrainingSession(c, ctx=ctx)
        out[(key, "forward")] = sess.forward(batches["grpo"])  # every rank: all get the whole result
        mine = batches["sft"][: 2 + sess.ctx.rank % 2]  # ranks disagree on the batch
        try:
            sess.forward_backward(mine, sft_loss())
            out[(key, "different_batches")] = "accepted"
        except ValueError as err:
            out[(key, "different_batches")] = str(err)
    key, layout = next(iter(layouts.items()))
    c = adam(apply_layout(cfg, layout))
    ctx = init_parallel(c.parallel)
    flags = [f"parallel.{k}={v}" for k, v in layout.items()]
    out["resumed_here"] = resume_steps(c, ctx, batches, load_from=ckpt_one_process, overrides=flags)
    out["continuous_here"] = resume_steps(c, ctx, batches, save_to=ckpt_dir)
    return out


# -- tests -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(CORPUS)
    return compose_config([*LLM, f"data.text_path={corpus}"])


@pytest.fixture(scope="module")
def batches(cfg):
    return make_batches(cfg)


@pytest.fixture(scope="module")
def oracle(cfg, batches):
    return {name: oracle_step(cfg, name, batches[kind]) for name, kind, *_ in CASES}


def _check_case(name, kind, batches, oracle, weights, stats):
    ref, ref_loss = oracle[name]
    rel = relative_difference(ref, weights)
    assert rel <= TOL, f"{name}: weights differ from the one-process oracle by {rel:.2e} of the update"
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5), name
    assert (stats["num_loss_tokens"], stats["num_sequences"]) == expected_counts(name, batches[kind]), name


def _check_forward(got, cfg, batches):
    model = plain_model(cfg)
    for d, lp in zip(batches["grpo"], got):
        with torch.no_grad():
            ref = oracle_logprobs(model, d.tokens)
        assert lp.shape == d.tokens.shape and lp[0] == 0
        torch.testing.assert_close(lp[1:], ref, atol=2e-5, rtol=1e-5)


def test_one_process_matches_the_oracle(cfg, batches, oracle):
    from dit_train.parallel.mesh import init_parallel
    from dit_train.posttrain import TrainingSession

    ctx = init_parallel(cfg.parallel)
    for name, kind, loss, norm, splits in CASES:
        weights, stats, _ = session_step(cfg, ctx, batches[kind], loss, norm, splits)
        _check_case(name, kind, batches, oracle, weights, stats)
    _check_forward(TrainingSession(cfg, ctx=ctx).forward(batches["grpo"]), cfg, batches)


def test_uneven_calls_equal_one_call(cfg, batches):
    """The same GRPO step as 1 call, as 9 calls of one datum, and as calls of 2, 5 and 2."""
    from dit_train.parallel.mesh import init_parallel

    ctx = init_parallel(cfg.parallel)
    loss = grpo_loss(kl_coef=0.1, agg="sequence")
    runs = [session_step(cfg, ctx, batches["grpo"], loss, "num_sequences", s)[0]
            for s in ([], list(range(1, 9)), [2, 7])]
    for other in runs[1:]:
        assert relative_difference(runs[0], other) <= 1e-5


@pytest.mark.slow
def test_layouts_match_the_oracle_and_resume_across_layouts(cfg, batches, oracle, tmp_path):
    """One launch of 4 workers: dp_shard × cp_ring (FSDP2 over dp·cp), DDP × Ulysses, and
    ring × Ulysses (hybrid CP); a step-1 checkpoint of one process resumed there, and theirs
    resumed here."""
    from dit_train.engine.launch import launch_local
    from dit_train.parallel.mesh import init_parallel

    layouts = {"dp2_ring2": {"dp_shard": 2, "cp_ring": 2},
               "ddp2_ulysses2": {"dp_shard": 2, "dp_mode": "ddp", "cp_ulysses": 2},
               "ring2_ulysses2": {"cp_ring": 2, "cp_ulysses": 2}}
    one = adam(cfg)
    ctx = init_parallel(one.parallel)
    continuous_one = resume_steps(one, ctx, batches, save_to=tmp_path / "one")
    results = launch_local(_worker, (cfg, layouts, batches, tmp_path / "one", tmp_path / "four"), 4, cfg.launcher)
    got = results[0]
    for key in layouts:
        for name, kind, *_ in CASES:
            _check_case(name, kind, batches, oracle, *got[(key, name)])
        for rank in results:
            _check_forward(results[rank][(key, "forward")], cfg, batches)
            assert "ranks passed different batches" in results[rank][(key, "different_batches")]
    init = {f"__init__/{k}": v for k, v in plain_model(cfg).state_dict().items()}
    assert relative_difference(init | continuous_one, init | got["resumed_here"]) <= TOL
    resumed_one = resume_steps(one, ctx, batches, load_from=tmp_path / "four",
                               overrides=["parallel.dp_shard=1", "parallel.cp_ring=1"])
    assert relative_difference(init | got["continuous_here"], init | resumed_one) <= TOL


def test_save_load_resumes_exactly(cfg, batches, tmp_path):
    """One process: a resumed session takes the very same step 2 (optimizer moments, LR
    schedule and step count restored); the export loads with generate.load_run."""
    from dit_train.generate import load_run
    from dit_train.parallel.mesh import init_parallel

    c = adam(cfg)
    ctx = init_parallel(c.parallel)
    continuous = resume_steps(c, ctx, batches, save_to=tmp_path)
    resumed = resume_steps(c, ctx, batches, load_from=tmp_path)
    for k in continuous:
        assert torch.equal(continuous[k], resumed[k]), k
    _, model = load_run(tmp_path)  # the step-1 export
    assert set(model.state_dict()) == set(continuous)


def test_raw_sum_false_with_a_normalizing_step_is_refused(cfg, batches):
    from dit_train.posttrain import DoubleNormalizationError, TrainingSession

    sess = TrainingSession(cfg)
    for loss in (grpo_loss(raw_sum=False), dpo_loss(raw_sum=False), sft_loss(raw_sum=False, agg="sequence")):
        kind = "dpo" if loss.name == "dpo" else "grpo"
        sess.forward_backward(batches[kind], loss)
        for norm in ("num_loss_tokens", "num_sequences"):
            with pytest.raises(DoubleNormalizationError, match="normalized twice"):
                sess.optim_step(norm)
        sess.optim_step("none")
    # one call pre-normalized by its own counts == raw sums normalized by the step
    init = sess.state_dict()
    sess.forward_backward(batches["dpo"], dpo_loss(raw_sum=False))
    sess.optim_step("none")
    after_pre = sess.state_dict()
    sess.model.load_state_dict(init)
    sess.forward_backward(batches["dpo"], dpo_loss())
    sess.optim_step("num_sequences")
    for k, v in sess.state_dict().items():
        torch.testing.assert_close(v, after_pre[k], atol=1e-6, rtol=1e-5)


def test_moe_router_losses_are_refused_not_dropped(cfg, batches):
    """The session takes its loss from the caller: an MoE config asking for router losses is
    refused before anything is built; with both coefficients 0 the experts post-train."""
    from dataclasses import replace

    from dit_train.config.errors import ConfigError
    from dit_train.posttrain import TrainingSession

    c = copy.deepcopy(cfg)
    c.model.moe = replace(c.model.moe, num_experts=4, top_k=2, aux_loss_coef=0.01)
    with pytest.raises(ConfigError, match="aux_loss_coef=0.01"):
        TrainingSession(c)
    c.model.moe = replace(c.model.moe, aux_loss_coef=0.0, z_loss_coef=0.0)
    sess = TrainingSession(c)
    sess.forward_backward(batches["grpo"], grpo_loss())
    assert math.isfinite(sess.optim_step()["grad_norm"])


def test_bad_datums_are_refused_naming_the_datum_and_field(cfg, batches):
    from dit_train.posttrain import TrainingSession, VideoDatum

    sess = TrainingSession(cfg)
    ok = batches["grpo"][0]
    T = ok.tokens.numel()
    bad = {
        "datum 1: tokens has dtype torch.float32": Datum(ok.tokens.float()),
        r"datum 1: tokens holds id 300, outside \[0, model.vocab_size=256\)": Datum(torch.tensor([1, 300, 2])),
        r"datum 1: tokens has shape \[1\]": Datum([5]),
        "datum 1: tokens has 199 predicted positions, more than train.micro_batch_tokens=96":
            Datum(torch.zeros(200, dtype=torch.long)),
        rf"datum 1: weights has shape \[{T - 1}\]; expected \[{T}\]": Datum(ok.tokens, ok.weights[1:]),
        r"datum 1: weights \[0\] is 1.0: it must be 0": Datum(ok.tokens, torch.ones(T)),
        "datum 1: advantages is not finite at token 3": Datum(ok.tokens, advantages=torch.tensor(
            [0.0, 1.0, 1.0, float("nan")] + [0.0] * (T - 4))),
        "datum 1: old_logprobs holds 0.5 > 0: expected log-probabilities":
            Datum(ok.tokens, old_logprobs=torch.full((T,), 0.5)),
        "datum 1: ref_logprobs is missing but datum 0 has it": Datum(ok.tokens, advantages=1.0),
        "datum 1 is a VideoDatum": VideoDatum(pixels=torch.zeros(3, 2, 8, 8)),
    }
    for message, datum in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            sess.forward_backward([ok, datum], grpo_loss())
    with pytest.raises(ValueError, match="datum 0: advantages is required by grpo_loss"):
        sess.forward_backward([Datum(ok.tokens), Datum(ok.tokens)], grpo_loss())
    with pytest.raises(ValueError, match="datum 0: ref_logprobs is required by grpo_loss"):
        sess.forward_backward([Datum(ok.tokens, advantages=1.0), Datum(ok.tokens, advantages=0.5)],
                              grpo_loss(kl_coef=0.1))
    with pytest.raises(ValueError, match="dpo_loss takes pairs"):
        sess.forward_backward(batches["dpo"][:3], dpo_loss())
    chosen = batches["dpo"][0]
    empty = Datum(chosen.tokens, torch.zeros(chosen.tokens.numel()), ref_logprobs=chosen.ref_logprobs)
    with pytest.raises(ValueError, match="datum 1: weights are all 0, but it is the rejected sequence of pair 0"):
        sess.forward_backward([chosen, empty], dpo_loss())
    with pytest.raises(ValueError, match="needs the caller's data"):
        sess.forward_backward([0, 1], grpo_loss())
    assert sess.num_loss_tokens == 0  # nothing was accumulated by the refused calls


def test_video_datums_equal_the_same_dataset_clips(tiny_cfg):
    """Clips passed as VideoDatums (noise keyed by their dataset ids) give the gradients and
    counts of the same clips passed as dataset ids; bad clips are refused by name."""
    from dit_train.posttrain import TrainingSession, VideoDatum

    sess = TrainingSession(apply_layout(tiny_cfg, {}))
    ids = [3, 0, 5]
    by_id = sess.forward_backward(ids, sft_loss(agg="sequence"))
    grads = {n: p.grad.clone() for n, p in sess.model.named_parameters()}
    sess.optimizer.zero_grad(set_to_none=True)
    clips = [sess.task.dataset[i] for i in ids]
    datums = [VideoDatum(pixels=c.pixels, caption=c.caption, noise_key=i) for c, i in zip(clips, ids)]
    assert sess.forward_backward(datums, sft_loss(agg="sequence")) == by_id
    for n, p in sess.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-7, rtol=1e-6)
    x = clips[0].pixels
    for message, datum in {
        r"datum 1: pixels spans \[0, \d+\]; expected \[-1, 1\]": VideoDatum(pixels=(x + 1) * 127.5),
        r"datum 1: pixels has shape \[3, 3, .*multiples of model.patch_size": VideoDatum(pixels=x[:, :3]),
        "datum 1: pixels/latents must be given, exactly one of them": VideoDatum(caption="a red square"),
        "datum 1: noise_key 3 is used twice": VideoDatum(pixels=x, noise_key=3),
        "Datum is for mode=llm": Datum([1, 2, 3]),
    }.items():
        first = datums[0] if not isinstance(datum, Datum) else datum
        with pytest.raises((ValueError, TypeError), match=message):
            sess.forward_backward([first, datum], sft_loss())
    with pytest.raises(ValueError, match="grpo_loss needs token log-probs: mode=llm only"):
        sess.forward_backward(datums, grpo_loss())


def test_batched_generation_equals_one_prompt_at_a_time(cfg):
    """session.generate's sampler: packed prompts of different lengths continue exactly as
    each prompt alone (greedy, and sampled with generator seed + i)."""
    from dit_train.generate import generate, generate_batch

    model = plain_model(cfg).eval()
    prompts = [[72, 101, 108], [65, 66, 67, 68, 69, 70, 71], [1]]
    for top_k in (0, 256):
        alone = [generate(model, p, 6, top_k, 1.0, 5 + i) for i, p in enumerate(prompts)]
        assert generate_batch(model, prompts, 6, top_k, 1.0, 5) == alone


def test_verl_modes_map_to_losses_and_normalizations(cfg, batches):
    """verl's loss_agg_mode names give (loss keywords, normalization); the Dr. GRPO horizon
    divides the step exactly by H (SGD: the update is linear in the gradient)."""
    from dit_train.parallel.mesh import init_parallel
    from dit_train.posttrain import verl_loss_agg_mode

    assert verl_loss_agg_mode("token-mean") == ({"agg": "token"}, "num_loss_tokens")
    assert verl_loss_agg_mode("seq-mean-token-mean") == ({"agg": "sequence"}, "num_sequences")
    kwargs, norm = verl_loss_agg_mode("seq-mean-token-sum-norm", horizon=4)
    assert (kwargs, norm) == ({"agg": "token", "horizon": 4}, "num_sequences")
    with pytest.raises(ValueError, match="pass horizon=H"):
        verl_loss_agg_mode("seq-mean-token-sum-norm")
    ctx = init_parallel(cfg.parallel)
    plain, _, _ = session_step(cfg, ctx, batches["grpo"], grpo_loss(), norm, [4])
    normed, _, _ = session_step(cfg, ctx, batches["grpo"], grpo_loss(**kwargs), norm, [4])
    for k in normed:
        if not k.startswith("__init__/"):
            init = plain[f"__init__/{k}"]
            torch.testing.assert_close(normed[k] - init, (plain[k] - init) / 4, atol=1e-7, rtol=1e-5)
