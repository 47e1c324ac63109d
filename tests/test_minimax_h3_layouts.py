"""MiniMax-H3 (model=minimax_h3_tiny: diffusers' MiniMaxH3Transformer3DModel, caption, audio and
video tokens of a clip in one sequence) trains layout-exact against one process: dp_shard=2,
dp_shard=2 x cp_ulysses=2 and dp_shard=2 x cp_ring=2, on the embedded set with sound (uneven
clips, a quarter without audio, text slots in every pack, CP ranks holding part of a clip), full
training, and LoRA on Ulysses, under the per-stream hierarchical mean (T_{b,s} summed in the CP
group, B_s across DP) (docs/audio-video.md#minimax-h3-modelminimax_h3_tiny-modelminimax_h3)."""
from __future__ import annotations

import pytest
import torch

from tests.families import family_run_cfg, lora_run_cfg
from tests.layout_cases import Case, assert_exact, run_cases

# short captions and these packs: CP splits where a rank holds media tokens of a clip but not its
# whole grid (checked below)
AV = ["model=minimax_h3_tiny", "data.audio=true", "model.text_len=4", "train.micro_batch_tokens=700"]
LAYOUTS = {"dp": "dp_shard=2", "ulysses": "dp_shard=2,cp_ulysses=2", "ring": "dp_shard=2,cp_ring=2"}


@pytest.fixture(scope="module")
def h3_cfg(data_cache):
    return family_run_cfg(AV, data_cache)  # TINY, data prepared; always clips: the global norm must be exact too


@pytest.fixture(scope="module")
def layouts(h3_cfg, tmp_path_factory):
    from dataclasses import replace

    # one transformer block (the token refiner keeps its one): the runs are Python-bound, and the
    # CP splits of the joint sequence, the per-stream counts, the shards and the adapters need no second
    cfg = replace(h3_cfg, model=replace(h3_cfg.model, depth=1))
    lora = lora_run_cfg(cfg, tmp_path_factory.mktemp("h3_pretrained"))  # rank 4 on a random one-block folder
    cases = {name: Case(cfg, spec) for name, spec in LAYOUTS.items()}
    return run_cases(cases | {"lora": Case(lora, LAYOUTS["ulysses"])})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_minimax_h3_training_matches_one_process(name, layouts):
    assert_exact(*layouts[name], f"MiniMax-H3 audio + video + text on {LAYOUTS[name]}")


@pytest.mark.slow
def test_minimax_h3_lora_matches_one_process(layouts):
    """LoRA adapts the blocks' attention and SwiGLU (not the token refiner's), the base stays put,
    and the adapters on dp_shard=2 x cp_ulysses=2 equal one process's."""
    ref, got = layouts["lora"]
    adapted = {k.split(".lora_")[0] for k in ref if ".lora_" in k and not k.startswith("__")}
    assert adapted and all(k.startswith("transformer_blocks.") for k in adapted), adapted
    assert all(torch.equal(ref[k], ref[f"__init__/{k}"]) for k in ref if not k.startswith("__") and ".lora_" not in k)
    assert_exact(ref, got, f"MiniMax-H3 LoRA on {LAYOUTS['ulysses']}")


def test_the_layout_case_is_not_vacuous(h3_cfg):
    """The steps trained hold clips with and without sound, every clip's caption as text slots,
    each DP rank's share of a step a different number of clips with sound (B_audio must be summed
    over DP), and CP splits where a rank holds video or audio tokens of a clip whose grid its own
    tokens do not show (the grid must come from the whole pack)."""
    from dit_train.batch import cp_token_index
    from dit_train.data_pipelines.packing import plan_step
    from dit_train.models.minimax_h3 import clip_grids
    from dit_train.tasks import build_task

    c = h3_cfg
    task = build_task(c.mode, c.data, c.model, c.loss, c.train.seed)
    assert task.streams == 2 and task.joint_text
    uneven = with_audio = without = split = 0
    for step in range(c.train.steps):
        plan = plan_step(step, task.lengths(), c.train.global_batch, 2, 1, c.train.micro_batch_tokens, c.train.seed)
        per_rank = [0, 0]
        for r, packs in enumerate(plan.micro_batches):
            for ids in (p for p in packs if p):  # (a rank's micro-batch may hold no clip)
                full = task.build(ids, step)
                assert int((full.tokens["text"] > 0).sum()) > 0 and full.stream.shape == full.seg.shape
                has = torch.bincount(full.seg[full.stream == 1], minlength=full.num_samples) > 0
                with_audio, without = with_audio + int(has.sum()), without + int((~has).sum())
                per_rank[r] += int(has.sum())
                full = full.pad_to_multiple(2)
                whole = clip_grids(full.pos, full.seg, full.num_samples)
                for cp_rank in range(2):
                    idx = cp_token_index(full.num_tokens, 2, cp_rank, "contiguous")
                    seg, media = full.seg[idx], full.tokens["text"][idx] == 0
                    local = clip_grids(full.pos[idx], seg, full.num_samples)
                    held = torch.unique(seg[(seg >= 0) & media])
                    split += int((local[held] != whole[held]).any(1).sum())
        uneven += per_rank[0] != per_rank[1]
    assert with_audio > 0 and without > 0 and uneven > 0 and split > 0, (with_audio, without, uneven, split)
