"""Self-Forcing (docs/causal.md): a block-causal few-step student of a bidirectional teacher,
trained on its own rollouts with DMD2's loss. Layout-exact against the one-process run on uneven
clips (4 to 8 frames: one or two causal blocks, 32 to 96 wide); resume is exact (the rollout's exits and noise
included); bad input is refused in one line before step 0."""
from __future__ import annotations

import shutil

import pytest
import torch

from dit_train.config.errors import ConfigError
from dit_train.engine.layout_equivalence import parse_layout, relative_difference
from tests.conftest import TINY, compose_config, train_in_process
from tests.layout_cases import TOL, Case, assert_distill_adapters_match

# 3 student steps per block, blocks of 4 frames (2 temporal patches), a student update at steps 0 and 2.
# 4 clips a step, not TINY's 6: the runs are Python-bound (each model call ~20 ms whatever its
# tokens), so a step costs its packs — 2-3 instead of 3-4, ~15 % less CPU per run, each rank of
# every layout included. train.seed=1 draws steps that keep what the layouts must get right: step 0,
# a student step, packs the one-block clip (6 frames, 144 tokens) beside two-block ones (64 to 384
# tokens) on one process, and on one DP rank of dp_shard=2; steps 1 and 2 give each DP rank two
# micro-batches, one of them empty on a rank at step 1
SELF_FORCING = ["+experiment=self_forcing", "model.causal_block_frames=4", "distill.student_steps=3",
                "distill.student_every=2", "distill.critic_lr=0.3", "optim=sgd", "optim.lr=0.2", "optim.max_grad_norm=0",
                "train.steps=3", "train.global_batch=4", "train.seed=1"]


@pytest.fixture(scope="module")
def teacher(tiny_teacher):
    """conftest's tiny trained run (read only: tests copy it to change it)."""
    return tiny_teacher


@pytest.fixture(scope="module")
def cfg(tiny_cfg, teacher):
    from dit_train.distill.build import student_config

    return student_config(compose_config([*TINY, *SELF_FORCING, f"distill.teacher={teacher}"],
                                         cache_dir=tiny_cfg.data.cache_dir))


@pytest.fixture(scope="module")
def layout_cfg(tiny_cfg, one_block_teacher):
    """cfg of the one-block teacher (conftest): the layout tests' runs. The one-process tests keep the
    two-block teacher (the KV cache holds one entry per block)."""
    from dit_train.distill.build import student_config

    return student_config(compose_config([*TINY, *SELF_FORCING, f"distill.teacher={one_block_teacher}"],
                                         cache_dir=tiny_cfg.data.cache_dir))


def test_rollout_blocks_and_exits(cfg):
    """The packs are block-causal with clips of one and two blocks, each block its own exit."""
    from dit_train.distill.build import build_distill_run
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.parallel.mesh import init_parallel

    c = apply_layout(cfg, {})
    run = build_distill_run(c, init_parallel(c.parallel))
    task = run.trainer.task
    assert task.causal and task.max_blocks == 2 and run.critic.cfg.model.causal_block_frames == 0
    b = task.build(list(range(16)), 0)
    blocks = [int(b.block[b.seg == s].max()) + 1 for s in range(b.num_samples)]
    assert set(blocks) == {1, 2}, blocks  # uneven: one- and two-block clips in one pack
    assert b.samples["exit"].shape == (b.num_samples, 2) and not torch.equal(b.samples["exit"], b.samples["exit_c"])


def test_the_trained_block_is_the_kv_cached_forward(cfg):
    """Block 1 of a two-block clip, differentiated as the trainer does it (the whole pack under the
    block-causal mask, the history's K/V frozen) equals streaming.py's cached forward whose cache
    was filled under no_grad: the same x̂0 and the same parameter gradients of <x̂0, w>."""
    from dit_train.distill.build import build_distill_run
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.objectives.flow_matching import velocity_from_output
    from dit_train.parallel.mesh import init_parallel
    from dit_train.sampling.streaming import KVCache, block_forward
    from dit_train.tasks.video import patchify, unpatchify

    c = apply_layout(cfg, {})
    run = build_distill_run(c, init_parallel(c.parallel))
    tr, model = run.trainer, run.model
    task = tr.task
    mb = tr.student.prepare([[0]], 5, task=task)[0]
    b = mb.batch
    assert int(b.block[b.seg == 0].max()) == 1  # sample 0 has two blocks
    x0, state = tr.generate(mb, "x", 0)
    w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    mask, block_x0, scope = tr.trained_x0(mb, state, 0)[1]
    with scope():
        got_x0 = block_x0()
        ((got_x0 * w).sum(-1) * mask).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    patch, kt = task.patch, task.causal_block
    grid = (kt, *(int(b.pos[b.seg == 0, a].max()) + 1 for a in (1, 2)))
    clip = lambda tok: unpatchify(tok, grid, patch, c.model.in_channels)  # noqa: E731
    first, second = (b.seg == 0) & (b.block == 0), (b.seg == 0) & (b.block == 1)
    caption = b.samples["context"][0, : int(b.samples["context_len"][0])] if "context" in b.samples else None
    cache = KVCache()
    with torch.no_grad():
        block_forward(model, clip(state.x0[first]), 0, 0.0, cache, patch, caption, record=True)
    t = float(state.t_exit[0, 1])
    x = clip(state.x_exit[second])
    out = block_forward(model, x, kt, t, cache, patch, caption).float()
    x_tok = patchify(x, patch)[0]
    want_x0 = x_tok - t * velocity_from_output(out, x_tok, t, task.prediction, task.x0_min_t)
    (want_x0 * w[second]).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert torch.allclose(got_x0[second], want_x0, atol=1e-5)
    assert got.keys() == want.keys() and got
    scale = max(float(g.abs().max()) for g in want.values())
    diff = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert diff <= 1e-5 * scale, f"gradients differ from the cached forward's by {diff / scale:.2e} of the largest"


def _rollouts_agree(tr, mb) -> None:
    """The cached and the recomputed rollouts of `mb`, from both noises (student, critic)."""
    b = mb.batch
    for start in ("x", "x_c"):
        with torch.no_grad():  # as generate runs them
            got, want = tr.rollout_cached(mb, start)[1], tr.rollout_recomputed(mb, start)[1]
        assert torch.equal(got.t_exit, want.t_exit)
        valid = b.seg >= 0
        for name in ("x0", "x_exit"):
            a, w = getattr(got, name)[valid], getattr(want, name)[valid]
            diff = float((a - w).abs().max()) / float(w.abs().max())
            assert diff <= 1e-5, f"{start} {name}: the cached rollout differs by {diff:.2e} of the largest value"


def test_the_cached_rollout_equals_the_recomputed_one(tiny_cfg, teacher):
    """The KV-cached rollout (each block's tokens against the packed cache of the clips' finished
    blocks) equals the recomputing one (the whole pack under the block-causal mask at every step):
    x̂0, the exit inputs and levels, on one pack of clips of 2, 3 and 4 blocks (K = 2 frames), and
    on a pack without the last blocks."""
    from dit_train.distill.build import build_distill_run, student_config
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.parallel.mesh import init_parallel

    c = apply_layout(student_config(compose_config([*TINY, *SELF_FORCING, "model.causal_block_frames=2",
                                                    f"distill.teacher={teacher}"], cache_dir=tiny_cfg.data.cache_dir)), {})
    tr = build_distill_run(c, init_parallel(c.parallel)).trainer
    assert tr.task.max_blocks == 4
    # 4, 3, 2 and 4 blocks (64 to 216 tokens); then one 2-block clip alone, whose pack has no
    # blocks 2 and 3: those forwards run the stand-in token (as a DP rank without them does)
    packs = tr.student.prepare([[1, 9, 10, 3], [10]], 1, task=tr.task)
    for mb, want_blocks in zip(packs, ([2, 3, 4, 4], [2])):
        b = mb.batch
        assert sorted(int(b.block[b.seg == s].max()) + 1 for s in range(b.num_samples)) == want_blocks
        _rollouts_agree(tr, mb)


@pytest.mark.slow
def test_layouts_equal_the_one_process_run(layout_cfg, one_block_teacher):
    """FSDP2 dp_shard=2, Ulysses cp=2, and dp_shard=2 x ring cp=2 on 4 ranks (a sample's blocks
    split over two ranks, zigzag, beside another DP rank's samples): student and critic weights
    after 3 steps (student updates at 0 and 2) equal the one-process run's."""
    from safetensors.torch import load_file

    from dit_train.engine.launch import launch_local
    from dit_train.parallel.mesh import init_parallel
    from tests.test_distill import _worker, distill_steps, part

    cfg, teacher = layout_cfg, one_block_teacher
    cases = {"dp2": Case(cfg, "dp_shard=2"), "ulysses2": Case(cfg, "cp_ulysses=2"),
             "dp2_ring2": Case(cfg, "dp_shard=2,cp_ring=2")}
    oracle = distill_steps(cases["dp2"].oracle_cfg(), init_parallel(cases["dp2"].oracle_cfg().parallel), 3)
    results = {}
    for world, keys in ((2, ("dp2", "ulysses2")), (4, ("dp2_ring2",))):
        runs = {k: (cases[k].cfg, parse_layout(cases[k].layout)) for k in keys}
        results |= launch_local(_worker, (runs, 3), world, cfg.launcher)[0]
    init = load_file(teacher / "weights.safetensors")  # both start from the teacher's weights
    oracle |= {f"__init__/{who}/{k}": v for who in ("student", "critic") for k, v in init.items()}
    for key in cases:
        for who in ("student", "critic"):
            moved = relative_difference(part(oracle, who), part(results[key], who))
            assert moved <= TOL, f"{key} {who}: weights differ from the one-process run by {moved:.2e} of the update"


@pytest.mark.slow
def test_lora_layouts_equal_the_one_process_run(tiny_cfg, one_block_teacher):
    """A LoRA student (one frozen base, the student's and the critic's adapters): FSDP2
    dp_shard=2 and Ulysses cp=2 on the uneven clips equal the one-process LoRA run after 3 steps,
    adapter by adapter; both adapters moved."""
    from dit_train.distill.build import student_config
    from dit_train.engine.launch import launch_local
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.parallel.mesh import init_parallel
    from tests.test_distill import _worker, distill_steps

    # adapters start at B = 0 and move slowly under SGD: test_distill's rates; no teacher guidance
    lora = apply_layout(student_config(compose_config(
        [*TINY, *SELF_FORCING, "model.lora.rank=4", "distill.teacher_guidance=1.0", "distill.critic_lr=100",
         "optim.lr=20000", f"distill.teacher={one_block_teacher}"], cache_dir=tiny_cfg.data.cache_dir)), {})
    one = distill_steps(lora, init_parallel(lora.parallel), 3)
    runs = {"lora_dp2": (lora, {"dp_shard": 2}), "lora_ulysses2": (lora, {"cp_ulysses": 2})}
    results = launch_local(_worker, (runs, 3), 2, lora.launcher)[0]
    for key in runs:
        assert_distill_adapters_match(one, results[key], key)


def test_resume_is_exact(tiny_cfg, teacher, tmp_path):
    """Stopped after step 1, resumed: the student after step 2 equals the unbroken run's (its
    update at step 2 reads the resumed critic, and its rollout draws the same exits and noise).
    3 steps, not 4: step 3 would only update the critic, which the compared weights never see."""
    from safetensors.torch import load_file

    base = [*TINY, *SELF_FORCING, f"distill.teacher={teacher}", "train.steps=3"]
    full, resumed = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=2"], full, cache_dir=tiny_cfg.data.cache_dir)
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000001'}"], resumed,
                     cache_dir=tiny_cfg.data.cache_dir)
    a, b = load_file(full / "weights.safetensors"), load_file(resumed / "weights.safetensors")
    t = load_file(teacher / "weights.safetensors")
    assert max(float((a[k] - t[k]).abs().max()) for k in a) > 1e-5  # the student moved
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_lora_resume_is_exact(tiny_cfg, teacher, tmp_path):
    """A LoRA student with AdamW (moments in both adapters' optimizers) stopped after step 1 and
    resumed: the student's adapter after step 2 equals the unbroken run's (its update reads the
    resumed critic adapter, both optimizers' moments and the rollouts' exits and noise). 3 steps,
    as test_resume_is_exact: a step 3 would only update the critic, which the saved adapter never sees."""
    from safetensors.torch import load_file

    base = [*TINY, *SELF_FORCING, "model.lora.rank=4", "optim=adamw", "optim.lr=0.05", "distill.critic_lr=0.05",
            f"distill.teacher={teacher}", "train.steps=3"]
    full, resumed = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=2"], full, cache_dir=tiny_cfg.data.cache_dir)
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000001'}"], resumed,
                     cache_dir=tiny_cfg.data.cache_dir)
    lora = "lora/pytorch_lora_weights.safetensors"
    a, b = load_file(full / lora), load_file(resumed / lora)
    assert max(float(v.abs().max()) for k, v in a.items() if ".lora_B." in k) > 1e-4  # the student's adapter moved
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_bad_input_is_refused_in_one_line(tiny_cfg, teacher, tmp_path):
    from dit_train.distill.build import student_config

    def refused(*overrides):
        c = compose_config([*TINY, *overrides], cache_dir=tiny_cfg.data.cache_dir)
        with pytest.raises(ConfigError) as err:
            student_config(c)
        assert "\n" not in str(err.value)
        return str(err.value)

    sf = ["+experiment=self_forcing"]
    assert "distill.teacher is required by distill.method=self_forcing" in refused(*sf)
    assert "no config.yaml there" in refused(*sf, f"distill.teacher={tmp_path / 'nowhere'}")
    assert "trains a block-causal student" in refused(*sf, f"distill.teacher={teacher}", "model.causal_block_frames=0")
    # a block that does not divide the clips: the teacher's clips are 8 frames (data.frames=[8, 8])
    fixed = tmp_path / "fixed"
    shutil.copytree(teacher, fixed)
    text = (teacher / "config.yaml").read_text()
    assert "  - 4\n  - 24\n" in text
    (fixed / "config.yaml").write_text(text.replace("  - 4\n  - 24\n", "  - 8\n  - 8\n", 1))
    assert "not a multiple of model.causal_block_frames=6" in refused(*sf, f"distill.teacher={fixed}",
                                                                      "model.causal_block_frames=6")
    assert "longer than the teacher's clips" in refused(*sf, f"distill.teacher={fixed}", "model.causal_block_frames=10")
    causal = tmp_path / "causal"  # a block-causal teacher: its real score would not see the whole clip
    shutil.copytree(teacher, causal)
    (causal / "config.yaml").write_text(text.replace("  causal_block_frames: 0\n", "  causal_block_frames: 4\n", 1))
    assert "a block-causal run" in refused(*sf, f"distill.teacher={causal}")
    # through the CLI's path (run_from_config): refused before the run folder is written. In this
    # process: that the CLI prints such a refusal as one `error:` line on stderr is the same
    # `except` for every ConfigError of run_from_config, run in a fresh Python by test_cli's
    # test_bad_override_fails_before_running
    out = tmp_path / "student"
    with pytest.raises(ConfigError, match="^distill.teacher=.*a block-causal run"):
        train_in_process([*TINY, *sf, f"distill.teacher={causal}"], out, cache_dir=tiny_cfg.data.cache_dir)
    assert not (out / "config.yaml").exists()
