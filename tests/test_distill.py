"""DMD2 distillation (docs/distillation.md): the student's and the critic's weights after a few
steps equal an independent one-process computation written from the paper's formulas, on one
process and on dp × cp layouts (uneven clips; student and critic steps); resume is exact; bad
teachers are refused in one line before step 0."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dit_train.config.errors import ConfigError
from dit_train.engine.layout_equivalence import apply_layout, relative_difference
from tests.conftest import TINY, compose_config, train_in_process
from tests.layout_cases import assert_distill_adapters_match

TOL = 1e-4  # weights: max |Δ| relative to the largest update (see layout_equivalence)
# 3 student steps of 3 sigmas, a student update at steps 0 and 2, guidance on the teacher
DISTILL = ["distill.method=dmd2", "distill.student_steps=3", "distill.student_every=2", "distill.teacher_guidance=2.0",
           "distill.critic_lr=0.3", "optim.lr=0.2", "optim.max_grad_norm=0", "train.steps=3", "train.global_batch=4"]


@pytest.fixture(scope="module")
def teacher(one_block_teacher):
    """conftest's tiny trained run of one block (read only: tests copy it to change it): the runs
    are Python-bound, a second block was ~1/4 of each layout rank's CPU, and neither the DMD
    formulas nor what the layouts split (clips, counts, shards, the offloaded teacher) need it."""
    return one_block_teacher


@pytest.fixture(scope="module")
def cfg(tiny_cfg, teacher):
    from dit_train.distill.build import student_config

    c = compose_config([*TINY, *DISTILL, f"distill.teacher={teacher}"], cache_dir=tiny_cfg.data.cache_dir)
    return apply_layout(student_config(c), {})


LORA = ["model.lora.rank=4"]  # the student and the critic: two adapters on the teacher's frozen base
# adapters start at B = 0 and move slowly under SGD: rates that move them visibly in 3 steps; no
# guidance, so step 0's gradient is exactly 0 (critic = teacher) instead of rounding noise
LORA_STEPS = [*LORA, "distill.teacher_guidance=1.0", "distill.critic_lr=100", "optim.lr=20000"]


@pytest.fixture(scope="module")
def lora_cfg(tiny_cfg, teacher):
    from dit_train.distill.build import student_config

    c = compose_config([*TINY, *DISTILL, *LORA_STEPS, f"distill.teacher={teacher}"], cache_dir=tiny_cfg.data.cache_dir)
    return apply_layout(student_config(c), {})


def distill_steps(cfg, ctx, steps):
    """{student/..., critic/...: full weights} after `steps` distillation steps (rank 0), both
    models gathered in one collective as the layout tests gather theirs (layout_equivalence)."""
    return gathered(trained_run(cfg, ctx, steps), ctx)


def trained_run(cfg, ctx, steps):
    """The distillation run of `cfg` after `steps` steps."""
    from dit_train.distill.build import build_distill_run

    run = build_distill_run(cfg, ctx)
    for step in range(steps):
        run.trainer.step(step)
    return run


def gathered(run, ctx):
    """distill_steps' weights of a trained run."""
    from dit_train.engine.layout_equivalence import gather_pieces, local_pieces, sharded_state_dict

    weights = gather_pieces(local_pieces(sharded_state_dict(run.model), "student/")
                            + local_pieces(sharded_state_dict(run.critic.model), "critic/"), ctx)
    if not ctx.is_main:
        return {}
    return weights | {"teacher_offload": offload_policies(run.teacher)}


def offload_policies(model):
    """The FSDP2 offload policies of a model's units (none unsharded), as in test_memory_options."""
    return sorted({type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                   for m in model.modules() if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group})


# -- the one-process oracle: one clip at a time, the formulas written out -------------------------------


def clip_velocity(cfg, model, x, t, caption):
    """v [T, D] of one clip alone ([C, F, H, W] at noise level t), and its tokens."""
    from tests.test_video_rl import clip_velocity as velocity

    return velocity(cfg, model, x, float(t), caption)


def clip_sigmas(cfg, clip_shape):
    """The student's σ_0..σ_K of a clip: diffusers' scheduler set up as the Euler sampler does."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from dit_train.objectives.flow_matching import sample_shift
    from dit_train.tasks.video import num_patches

    lc = cfg.loss
    shift = sample_shift(lc.timestep_shift, lc.shift_reference_tokens, num_patches(clip_shape, tuple(cfg.model.patch_size)))
    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    plain.set_timesteps(cfg.distill.student_steps)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(sigmas=plain.sigmas[:-1].tolist())
    return sched.sigmas.tolist(), shift


def student_sample(cfg, student, x, sigmas, j, caption, grad=False):
    """x̂0 tokens of the student's step j from the start noise x (Euler steps 0..j-1 without gradient)."""
    from dit_train.tasks.video import unpatchify

    patch, C = tuple(cfg.model.patch_size), x.shape[0]
    grid = (x.shape[1] // patch[0], x.shape[2] // patch[1], x.shape[3] // patch[2])
    with torch.no_grad():
        for k in range(j):
            v, _ = clip_velocity(cfg, student, x, sigmas[k], caption)
            x = x + (sigmas[k + 1] - sigmas[k]) * unpatchify(v, grid, patch, C)
    with torch.enable_grad() if grad else torch.no_grad():
        v, tokens = clip_velocity(cfg, student, x, sigmas[j], caption)
        return tokens - sigmas[j] * v


def oracle(cfg, teacher_dir, steps):
    """{student/..., critic/...} after `steps` steps: plain models, SGD by hand."""
    from dit_train.data_pipelines.packing import plan_step
    from dit_train.models import build_model
    from dit_train.objectives.flow_matching import sample_timestep, shift_timestep
    from dit_train.rng import sample_generator
    from dit_train.tasks import build_task
    from dit_train.tasks.video import patchify
    from dit_train.checkpoint.export import run_weights

    weights = run_weights(teacher_dir, None)[0]
    student, critic, teacher = (build_model(cfg.model) for _ in range(3))
    for m in (student, critic, teacher):
        m.load_state_dict(weights)
    data = build_task(cfg.mode, cfg.data, cfg.model, cfg.loss, cfg.train.seed).dataset
    d, t_cfg, patch = cfg.distill, cfg.train, tuple(cfg.model.patch_size)
    K, g = d.student_steps, d.teacher_guidance
    for step in range(steps):
        plan = plan_step(step, data.lengths(), t_cfg.global_batch, 1, 1, t_cfg.micro_batch_tokens, t_cfg.seed)
        ids = sorted(i for pack in plan.micro_batches[0] for i in pack)
        B = len(ids)
        if step % d.student_every == 0:
            j = int(torch.randint(K, (), generator=sample_generator(t_cfg.seed, -1, step, "distill_student")))
            loss = 0.0
            for sid in ids:
                item = data[sid]
                sigmas, _ = clip_sigmas(cfg, item.pixels.shape)
                gen = sample_generator(t_cfg.seed, sid, step, "distill_student")
                t = d.t_min + (d.t_max - d.t_min) * float(torch.rand((), generator=gen))
                x = torch.randn(item.pixels.shape, generator=gen)
                eps = patchify(torch.randn(item.pixels.shape, generator=gen), patch)[0]
                x0 = student_sample(cfg, student, x, sigmas, j, item.caption, grad=True)
                from dit_train.tasks.video import unpatchify

                grid = tuple(s // p for s, p in zip(item.pixels.shape[1:], patch))
                x_t = unpatchify((1 - t) * x0.detach() + t * eps, grid, patch, item.pixels.shape[0])
                with torch.no_grad():
                    v_c, xt_tok = clip_velocity(cfg, teacher, x_t, t, item.caption)
                    v_u, _ = clip_velocity(cfg, teacher, x_t, t, "")
                    x0_real = xt_tok - t * (v_u + g * (v_c - v_u))
                    x0_fake = xt_tok - t * clip_velocity(cfg, critic, x_t, t, item.caption)[0]
                    grad = (x0_fake - x0_real) / (x0.detach() - x0_real).abs().mean()
                # DMD2's line: 0.5 * F.mse_loss(x0, (x0 - grad).detach()), one sample's mean; / B
                loss = loss + 0.5 * torch.nn.functional.mse_loss(x0, (x0 - grad).detach()) / B
            student.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in student.parameters():
                    p -= cfg.optim.lr * p.grad
        j = int(torch.randint(K, (), generator=sample_generator(t_cfg.seed, -1, step, "distill_critic")))
        loss = 0.0
        for sid in ids:
            item = data[sid]
            sigmas, shift = clip_sigmas(cfg, item.pixels.shape)
            gen = sample_generator(t_cfg.seed, sid, step, "distill_critic")
            t = float(shift_timestep(sample_timestep(gen, cfg.loss), shift))
            x = torch.randn(item.pixels.shape, generator=gen)
            eps = patchify(torch.randn(item.pixels.shape, generator=gen), patch)[0]
            x0 = student_sample(cfg, student, x, sigmas, j, item.caption)
            from dit_train.tasks.video import unpatchify

            grid = tuple(s // p for s, p in zip(item.pixels.shape[1:], patch))
            x_t = unpatchify((1 - t) * x0 + t * eps, grid, patch, item.pixels.shape[0])
            v, _ = clip_velocity(cfg, critic, x_t, t, item.caption)
            loss = loss + (v - (eps - x0)).pow(2).mean() / B  # flow matching on the student's sample
        critic.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in critic.parameters():
                p -= d.critic_lr * p.grad
    init = {f"__init__/{who}/{k}": v for k, v in weights.items() for who in ("student", "critic")}
    return (init | {f"student/{k}": v.detach().clone() for k, v in student.state_dict().items()}
            | {f"critic/{k}": v.detach().clone() for k, v in critic.state_dict().items()})


def part(weights, who):
    """The student's or the critic's weights (with their initial ones) of a result."""
    return {k: v for k, v in weights.items() if k.startswith((who, f"__init__/{who}"))}


@pytest.fixture(scope="module")
def lora_one_process(lora_cfg):
    """The one-process LoRA run after 3 steps and its weights: the LoRA layout's reference and the
    module test_lora_roles_are_one_base_and_two_adapters reads (one run for both)."""
    from dit_train.parallel.mesh import init_parallel

    ctx = init_parallel(lora_cfg.parallel)
    run = trained_run(lora_cfg, ctx, 3)
    return run, gathered(run, ctx)


@pytest.fixture(scope="module")
def expected(cfg, teacher):
    return oracle(cfg, teacher, 3)


def test_one_process_matches_the_dmd_formulas(cfg, expected):
    from dit_train.parallel.mesh import init_parallel

    got = distill_steps(cfg, init_parallel(cfg.parallel), 3)
    for who in ("student", "critic"):
        rel = relative_difference(part(expected, who), part(got, who))
        assert rel <= TOL, f"{who}: weights differ from the hand-written DMD2 computation by {rel:.2e} of the update"


def _worker(runs, steps):
    """{key: distill_steps} of each (config, layout) of `runs`; only rank 0 can read the teacher's
    weights (the others' read raises), so the runs pass only if rank 0 broadcasts them."""
    import torch.distributed as dist

    from dit_train.distill import build
    from dit_train.parallel.mesh import init_parallel

    def unreadable(folder):
        raise OSError(f"rank {dist.get_rank()} read the teacher's weights ({folder}): only rank 0 should")

    readable, out = build.teacher_weights, {}
    if dist.get_rank() != 0:
        build.teacher_weights = unreadable
    try:  # the pool's workers outlive this job: put the reader back
        for key, (cfg, layout) in runs.items():
            c = apply_layout(cfg, layout)
            out[key] = distill_steps(c, init_parallel(c.parallel), steps)
    finally:
        build.teacher_weights = readable
    return out


@pytest.mark.slow
def test_layouts_match_the_dmd_formulas(cfg, lora_cfg, lora_one_process, expected):
    """One launch of 4 workers: FSDP2 dp_shard=2 × cp_ring=2 and DDP 2 × Ulysses 2 (a sample's
    tokens, and so its DMD normaliser, split over two ranks); student and critic weights after
    3 steps (student updates at 0 and 2) equal the oracle's; the same with the teacher's shards
    offloaded (distill.teacher_offload). LoRA (one base, two adapters) on FSDP2 dp_shard=2 ×
    cp_ring=2 equals the one-process LoRA run. The teacher's weights are read by rank 0 only."""
    from dit_train.engine.launch import launch_local

    offload = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, teacher_offload=True))
    dp2_ring2 = {"dp_shard": 2, "cp_ring": 2}
    runs = {"dp2_ring2": (cfg, dp2_ring2), "ddp2_ulysses2": (cfg, {"dp_shard": 2, "dp_mode": "ddp", "cp_ulysses": 2}),
            "dp2_ring2_offload": (offload, dp2_ring2), "lora_dp2_ring2": (lora_cfg, dp2_ring2)}
    results = launch_local(_worker, (runs, 3), 4, cfg.launcher)
    one = lora_one_process[1]
    assert_distill_adapters_match(one, results[0]["lora_dp2_ring2"], "dp2_ring2")
    for key in ("dp2_ring2", "ddp2_ulysses2", "dp2_ring2_offload"):
        for who in ("student", "critic"):
            rel = relative_difference(part(expected, who), part(results[0][key], who))
            assert rel <= TOL, f"{key} {who}: weights differ from the oracle by {rel:.2e} of the update"
    assert results[0]["dp2_ring2"]["teacher_offload"] == ["OffloadPolicy"]
    assert results[0]["dp2_ring2_offload"]["teacher_offload"] == ["CPUOffloadPolicy"]


def merged(weights, adapter, scale=1.0):
    """Plain weights of a LoRA model's full state dict with `adapter` merged: W + scale·B·A."""
    from dit_train.models.lora import is_lora_name, plain_lora_name

    out = {plain_lora_name(k): v for k, v in weights.items() if not is_lora_name(k)}
    for k, a in weights.items():
        if f".lora_A.{adapter}." in k:
            module = k.split(".lora_A.")[0]
            w = f"{plain_lora_name(module)}.weight"
            out[w] = out[w] + scale * weights[f"{module}.lora_B.{adapter}.weight"] @ a
    return out


def test_lora_roles_are_one_base_and_two_adapters(lora_cfg, lora_one_process, teacher):
    """One LoRA module after 3 distillation steps: as the teacher it computes the teacher run's
    model (the base, adapters off), as the student the base with the student's adapter merged,
    as the critic with the critic's; student and critic differ from the teacher and each other."""
    from dit_train.checkpoint import full_state_dict
    from dit_train.distill.build import teacher_weights
    from dit_train.models import build_model

    run = lora_one_process[0]  # after 3 steps
    assert run.critic.model is run.model is run.teacher  # one module: no copies
    weights = full_state_dict(run.model)
    expected = {"teacher": teacher_weights(teacher)[0], "student": merged(weights, "default"),
                "critic": merged(weights, "critic")}
    x = torch.randn(3, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    caption, plain, got = "a red circle moving up", build_model(dataclasses.replace(lora_cfg.model, lora=dataclasses.replace(
        lora_cfg.model.lora, rank=0))), {}
    with torch.no_grad():
        for who, sd in expected.items():
            plain.load_state_dict(sd)
            with run.trainer.roles.use(who) as model:
                got[who] = clip_velocity(lora_cfg, model, x, 0.6, caption)[0]
            want = clip_velocity(lora_cfg, plain, x, 0.6, caption)[0]
            assert torch.allclose(got[who], want, atol=1e-5), f"{who}: {float((got[who] - want).abs().max()):.2e}"
    for a, b in (("student", "teacher"), ("critic", "teacher"), ("student", "critic")):
        assert float((got[a] - got[b]).abs().max()) > 1e-4, f"{a} computes the {b}"


def test_resume_is_exact(tiny_cfg, teacher, tmp_path):
    """Stopped after step 1 (checkpoint: student, its optimizer, the critic and its optimizer),
    resumed: the student after step 2 equals the uninterrupted run's (its update at step 2 reads
    the resumed critic). 3 steps, not 4: step 3 would only update the critic, which the compared
    weights never see."""
    from safetensors.torch import load_file

    base = [*TINY, *DISTILL, f"distill.teacher={teacher}", "train.steps=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=2"], full, cache_dir=tiny_cfg.data.cache_dir)
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000001'}"], part,
                     cache_dir=tiny_cfg.data.cache_dir)
    a, b = load_file(full / "weights.safetensors"), load_file(part / "weights.safetensors")
    t = load_file(teacher / "weights_ema.safetensors") if (teacher / "weights_ema.safetensors").exists() else \
        load_file(teacher / "weights.safetensors")
    # the student moved: 10x the exactness tolerance below, so a and b agreeing says something
    assert max(float((a[k] - t[k]).abs().max()) for k in a) > 1e-5
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # the run samples like the student trained: its steps, no guidance, the Euler ODE
    from dit_train.compose import load_config
    from dit_train.tools import sample

    run_cfg = load_config(full)
    assert (run_cfg.train.sample_steps, run_cfg.train.guidance_scale, run_cfg.train.stochastic_sampling) == (3, 1.0, False)
    assert sample.main([str(full), "--prompt", "a red circle moving up and left on a navy background", "--steps", "3",
                        "--frames", "4", "--height", "32", "--width", "32", "--out", str(tmp_path / "gen")]) == 0
    assert any((tmp_path / "gen").iterdir())


def test_lora_resumes_exactly_samples_and_exports(tiny_cfg, teacher, tmp_path):
    """LoRA distillation with AdamW (optimizer state in both adapters' optimizers): stopped after
    step 0, resumed: the student after step 2 (its update there takes its resumed moments and reads
    the critic's step 1, taken with the critic's resumed moments) equals the uninterrupted run's;
    `tools.sample --steps 4` samples it; the newest
    checkpoint alone (the teacher's base + the student's adapter) gives the run's merged
    weights, and `tools.export_weights` writes its adapter and merged weights."""
    from safetensors.torch import load_file

    from dit_train.checkpoint.export import run_weights
    from dit_train.tools import export_weights, sample

    base = [*TINY, *DISTILL, *LORA, f"distill.teacher={teacher}", "distill.student_steps=4", "optim=adamw",
            "optim.lr=0.05", "distill.critic_lr=0.05"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process([*base, "train.ckpt_every=1", "train.keep_last=3"], full, cache_dir=tiny_cfg.data.cache_dir)
    train_in_process([*base, f"train.resume={full / 'checkpoints' / 'step_00000000'}"], part,
                     cache_dir=tiny_cfg.data.cache_dir)
    lora = "lora/pytorch_lora_weights.safetensors"
    a, b = load_file(full / lora), load_file(part / lora)
    assert max(float(v.abs().max()) for k, v in a.items() if ".lora_B." in k) > 1e-4  # the student's adapter moved
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # the newest checkpoint alone: the teacher's weights as the base, the student's adapter merged
    merged_run = load_file(full / "weights.safetensors")
    ckpt = full / "checkpoints" / "step_00000002"
    out = tmp_path / "merged.safetensors"
    assert export_weights.main([str(ckpt), "--merge-lora", "--out", str(out)]) == 0
    for sd in (load_file(out), run_weights(ckpt, False)[0]):
        assert max(float((sd[k] - merged_run[k]).abs().max()) for k in merged_run) < 1e-6
    assert export_weights.main([str(ckpt), "--out", str(tmp_path / "adapter")]) == 0
    c = load_file(tmp_path / "adapter" / "pytorch_lora_weights.safetensors")
    assert c.keys() == a.keys() and max(float((a[k] - c[k]).abs().max()) for k in a) < 1e-6
    assert sample.main([str(full), "--prompt", "a red circle moving up and left on a navy background", "--steps", "4",
                        "--frames", "4", "--height", "32", "--width", "32", "--out", str(tmp_path / "gen")]) == 0
    assert any((tmp_path / "gen").iterdir())


def test_bad_teachers_are_refused_in_one_line_before_step_0(tiny_cfg, teacher, tmp_path):
    import shutil

    from dit_train.distill.build import student_config

    def refused(*overrides):
        c = compose_config([*TINY, *overrides], cache_dir=tiny_cfg.data.cache_dir)
        with pytest.raises(ConfigError) as err:
            student_config(c)
        return str(err.value)

    assert "distill.teacher is required" in refused("+experiment=distill_dmd2")
    assert "no config.yaml there" in refused("+experiment=distill_dmd2", f"distill.teacher={tmp_path}")
    assert "distill.method=none" in refused(f"distill.teacher={teacher}")
    dmd = ["+experiment=distill_dmd2", f"distill.teacher={teacher}"]
    assert "DDP cannot reduce" in refused(*dmd, *LORA, "parallel.dp_shard=2", "parallel.dp_mode=ddp")
    assert "nothing separate to offload" in refused(*dmd, *LORA, "distill.teacher_offload=true", "parallel.dp_shard=2")
    assert "needs FSDP2 over >= 2 ranks" in refused(*dmd, "distill.teacher_offload=true")
    assert "needs FSDP2 over >= 2 ranks" in refused(*dmd, "distill.teacher_offload=true", "parallel.dp_shard=2",
                                                   "parallel.dp_mode=ddp")
    lora_teacher = tmp_path / "lora_teacher"  # a LoRA run as the teacher: its config says model.lora.rank=4
    shutil.copytree(teacher, lora_teacher)
    text = (teacher / "config.yaml").read_text()
    assert "    rank: 0\n" in text
    (lora_teacher / "config.yaml").write_text(text.replace("    rank: 0\n", "    rank: 4\n", 1))
    assert "a LoRA run (model.lora.rank=4" in refused("+experiment=distill_dmd2", f"distill.teacher={lora_teacher}", *LORA)
    causal = tmp_path / "causal_teacher"  # a block-causal run: its losses here would take another mask
    shutil.copytree(teacher, causal)
    assert "  causal_block_frames: 0\n" in text
    (causal / "config.yaml").write_text(text.replace("  causal_block_frames: 0\n", "  causal_block_frames: 4\n", 1))
    assert "a block-causal run" in refused("+experiment=distill_dmd2", f"distill.teacher={causal}")
    # a causal student asked of a bidirectional teacher (Self-Forcing's setup): the student would
    # silently take the teacher's bidirectional model
    assert "a block-causal student" in refused(*dmd, "model.causal_block_frames=4")
    # another model's weights: a copy of the teacher whose config says model.dim=48
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    (other / "config.yaml").write_text((teacher / "config.yaml").read_text().replace("  dim: 32\n", "  dim: 48\n"))
    msg = refused("+experiment=distill_dmd2", f"distill.teacher={other}")
    assert "does not fit the model of its config.yaml" in msg and "\n" not in msg
    # through the CLI's path (run_from_config): refused before the run folder is written. In this
    # process: the CLI prints every ConfigError of run_from_config as one `error:` line with one
    # `except`, run in a fresh Python by test_cli's test_bad_override_fails_before_running
    out = tmp_path / "student"
    with pytest.raises(ConfigError, match="^distill.teacher=.*does not fit the model of its config.yaml"):
        train_in_process([*TINY, "+experiment=distill_dmd2", f"distill.teacher={other}"], out,
                         cache_dir=tiny_cfg.data.cache_dir)
    assert not (out / "config.yaml").exists()


def test_the_planner_counts_the_critic_and_the_teacher(tiny_cfg):
    from dit_train.perf.memory import model_shape
    from dit_train.planning.planner import Workload, adapter_parameters, plan

    work = Workload(global_batch=8, max_sample_tokens=1024, mean_sample_tokens=1024)
    shape = model_shape(tiny_cfg.model)
    distill = dataclasses.replace(tiny_cfg, distill=dataclasses.replace(tiny_cfg.distill, method="dmd2"))
    plain, _ = plan(tiny_cfg, 2, 64 * 2 ** 30, work, backend="sdpa", shape=shape)
    three, _ = plan(distill, 2, 64 * 2 ** 30, work, backend="sdpa", shape=shape)
    a = {c.layout: c.memory for c in plain}
    for c in three:
        m = a[c.layout]
        assert c.memory.total == pytest.approx(m.total + 2 * m.params + m.grads + m.optimizer)
    # distill.teacher_offload: the teacher's weights move from the device estimate to the host's
    offload = dataclasses.replace(distill, distill=dataclasses.replace(distill.distill, teacher_offload=True))
    moved, _ = plan(offload, 2, 64 * 2 ** 30, work, backend="sdpa", shape=shape)
    b = {c.layout: c.memory for c in three}
    for c in moved:
        m = b[c.layout]
        assert c.memory.total == pytest.approx(m.total - a[c.layout].params)
        assert c.memory.host == pytest.approx(m.host + a[c.layout].params)
    # LoRA (one base, two adapters): no teacher copy, the critic's adapter with its gradients and moments
    lora = dataclasses.replace(distill, model=dataclasses.replace(distill.model, lora=dataclasses.replace(
        distill.model.lora, rank=4)))
    adapters, _ = plan(lora, 2, 64 * 2 ** 30, work, backend="sdpa", shape=shape)
    n = adapter_parameters(lora.model)
    assert 0 < n < shape.params / 10
    for c in adapters:
        m, extra = a[c.layout], c.memory.extra
        assert "distill_teacher" not in extra and extra["distill_critic"] == pytest.approx(
            (m.params + m.grads + m.optimizer) * n / shape.params)
