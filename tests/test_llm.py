"""mode=llm: documents packed with block-causal masks, token-mean on the same backbone."""
from __future__ import annotations

import json

import pytest
import torch

from dit_train.data_pipelines.text import IGNORE, ByteTokenizer, TextDataset, load_text_datasets
from dit_train.tasks.llm import LMTask
from dit_train.engine.layout_equivalence import apply_layout, relative_difference, run_layouts
from tests.conftest import compose_config, train_in_process

LLM_TINY = [
    "mode=llm", "model.dim=32", "model.depth=2", "model.heads=4", "model.init=normal",
    "optim=sgd", "optim.lr=0.5", "train.steps=2", "train.global_batch=6", "train.micro_batch_tokens=160",
    "train.progress=false", "data.max_doc_tokens=128", "data.heldout_fraction=0.0", "train.eval_every=0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Uneven documents (2..300 bytes) plus prompt-only rows whose labels are all ignored, so
    some packs hold no valid token at all."""
    g = torch.Generator().manual_seed(0)
    words = "the cat sat on a mat while dogs ran far away from every green hill".split()
    rows = []
    for i in range(30):
        n = int(torch.randint(1, 60, (1,), generator=g))
        rows.append({"text": " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))})
        if i % 5 == 0:
            rows.append({"prompt": f"question {i}: what sat on the mat?", "completion": ""})
    p = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return str(p)


@pytest.fixture(scope="module")
def llm_cfg(corpus):
    """LLM_TINY with one block: the layout runs are Python-bound (a step costs its blocks' calls,
    not their width), and the zigzag splits, causal masks across CP chunks, counts and shards the
    layouts must get right need no second block."""
    return compose_config([*LLM_TINY, "model.depth=1", f"data.text_path={corpus}"])


def test_embedded_corpus_loads_with_heldout_split():
    train, heldout = load_text_datasets("", "byte", 512, 0.05)
    assert len(train) > 500 and heldout is not None and len(heldout) > 10
    assert max(train.lengths()) == 512 and min(train.lengths()) >= 1


def test_labels_shift_inside_documents_and_prompts_are_ignored():
    tok = ByteTokenizer()
    ds = TextDataset([("0", "abcd"), ("1\x00prompt", json.dumps(["Q:", "yes"])), ("2", "xy")], tok, 128, heldout_fraction=0)
    batch = LMTask(ds).build([0, 1, 2], step=0)
    assert batch.tokens["ids"].tolist() == tok.encode("abc") + tok.encode("Q:ye") + tok.encode("x")
    labels = batch.tokens["labels"].tolist()
    assert labels[:3] == tok.encode("bcd")  # shifted within doc 0, nothing crosses into doc 1
    assert labels[3:7] == [IGNORE] + tok.encode("yes")  # "Q:" predicts ":" -> ignored prompt label
    assert labels[7:] == tok.encode("y")
    assert batch.seg.tolist() == [0] * 3 + [1] * 4 + [2] and batch.order.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert batch.valid.tolist() == [x != IGNORE for x in labels]



def test_long_documents_are_cut_into_pieces_that_share_one_token():
    """A document longer than max_doc_tokens becomes pieces of at most max_doc_tokens + 1 ids, each
    starting at the previous one's last id (every label predicted once); a prompt's ignored
    labels carry into the pieces it reaches; lengths() are the pieces' positions."""
    tok = ByteTokenizer()
    ds = TextDataset([("0", "abcdefghij"), ("1\x00prompt", json.dumps(["PROMPT", "yes"]))], tok, 4, heldout_fraction=0)
    assert [tok.decode(d.ids) for d in ds.docs] == ["abcde", "efghi", "ij", "PROMP", "PTyes"]
    assert [d.prompt_len for d in ds.docs] == [0, 0, 0, 5, 1]
    assert ds.lengths() == [ds.num_tokens(i) for i in range(len(ds))] == [4, 4, 1, 4, 4]

def test_packs_without_valid_tokens_give_finite_zero_loss(llm_cfg):
    from dit_train.tasks import build_task
    from dit_train.loss import sync_counts, token_weights
    from dit_train.models import build_model, init_weights
    from dit_train.kernels import VarlenLayout

    task = build_task(llm_cfg.mode, llm_cfg.data, llm_cfg.model, llm_cfg.loss, 0)
    prompt_only = [i for i in range(len(task.dataset)) if task.dataset[i].prompt_len >= task.dataset.num_tokens(i)]
    assert prompt_only, "the fixture corpus must contain prompt-only documents"
    batch = task.build(prompt_only[:2], step=0).pad_to_multiple(1)
    assert not batch.valid.any()
    model = build_model(llm_cfg.model)
    init_weights(model, 0, "normal")
    meta = sync_counts([batch], None, None)
    for reduction in ("token_mean", "sample_mean", "sample_sum"):
        per_token = task.per_token_loss(model, batch, VarlenLayout.build(batch.seg, batch.order, True))
        loss = (per_token * token_weights(reduction, batch.seg, batch.valid, meta, 0)).sum()
        loss.backward()
        assert torch.isfinite(loss) and float(loss) == 0.0
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


LLM_LAYOUTS = [
    "dp_shard=2",
    "cp_ulysses=2",                                   # zigzag + permuted varlen path
    "cp_ring=2,grad_accum=2",                         # zigzag ring, causal masks across chunks
    "dp_shard=2,cp_ulysses=2,cp_ring=2",              # hybrid, 8 workers
    "dp_replicate=2,cp_ring=2,dp_mode=ddp,cp_fsdp_mode=none",
]


LLM_REDUCTIONS = ["token_mean", "sample_mean", "sample_sum"]


@pytest.fixture(scope="module")
def llm_layouts(llm_cfg):
    """Every layout and the one-process oracle, one launch of workers per world size."""
    return run_layouts(llm_cfg, ["1", *LLM_LAYOUTS], LLM_REDUCTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", LLM_LAYOUTS)
def test_llm_layout_matches_one_process(spec, llm_layouts):
    for r, ref, other in zip(LLM_REDUCTIONS, llm_layouts["1"], llm_layouts[spec]):
        rel = relative_difference(ref, other)
        assert rel <= 1e-4, f"{spec} {r}: {rel:.2e}"


def _eval_worker(cfg):
    from dit_train.engine.build import build_run

    run = build_run(cfg)
    return run.trainer.heldout_loss(run.task)


@pytest.mark.slow
def test_perplexity_is_layout_independent(llm_cfg):
    from dit_train.engine.launch import launch_local

    one = _eval_worker(llm_cfg)
    cfg = apply_layout(llm_cfg, {"dp_shard": 2, "cp_ring": 2})
    four = launch_local(_eval_worker, (cfg,), 4, cfg.launcher)[0]
    assert one["eval_tokens"] == four["eval_tokens"] > 0
    assert abs(one["eval_loss"] - four["eval_loss"]) < 1e-5 * one["eval_loss"]


@pytest.mark.slow
def test_llm_run_on_embedded_corpus_lowers_loss_and_generates(tmp_path, capsys):
    from dit_train.tools import generate

    out = tmp_path / "lm"
    # 2 blocks, 30 steps: the loss still falls well below 3.5 (3.1) and half the cost of 4 x 40.
    # In this process (the CLI's own path is test_cli's): a fresh Python costs more than the check
    train_in_process(["mode=llm", "model.dim=64", "model.depth=2", "train.steps=30", "train.eval_every=15",
                      "optim.lr=5e-3", "train.progress=false"], out)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["loss"] > 5.0 and recs[-1]["loss"] < 3.5  # ln(256) = 5.55 at the start
    evals = [x for x in recs if "eval_ppl" in x]
    assert len(evals) == 2 and evals[-1]["eval_ppl"] < evals[0]["eval_ppl"] * 1.2 and evals[-1]["eval_ppl"] < 40
    capsys.readouterr()
    assert generate.main([str(out), "--prompt", "The ", "--max-new", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text) > 15, text
