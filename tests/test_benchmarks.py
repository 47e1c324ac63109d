"""Every benchmark script runs end to end in its quick mode and writes its JSON (catches breakage;
the figures themselves come from the full runs quoted in the README, never from tests)."""
from __future__ import annotations

import json

import pytest


def test_bench_packing_quick(tmp_path):
    from dit_train.tools.bench_packing import main

    out = tmp_path / "p.json"
    assert main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["mix"] for r in rows} == {"lognormal", "pareto"}
    for r in rows:
        assert 0 < r["pad_to_max"] < r["ffd_stream"] <= 1 and 0 < r["ffd_per_step"] <= 1


def test_bench_reductions_quick(tiny_cfg, tmp_path):
    from dit_train.tools.bench_reductions import main

    out = tmp_path / "r.json"
    overrides = ["model.dim=32", "model.depth=2", "data.num_clips=16", "data.max_frames=8",
                 f"data.cache_dir={tiny_cfg.data.cache_dir}", "train.global_batch=4", "train.micro_batch_tokens=400"]
    assert main([*overrides, "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["reduction"] for r in rows] == ["naive_mean", "sample_mean", "token_mean"]
    assert all(r["median_step_ms"] > 0 and r["loss_path_ms"] > 0 for r in rows)


def test_bench_wan_quick(tmp_path):
    pytest.importorskip("diffusers")
    from dit_train.tools.bench_wan import main

    out = tmp_path / "w.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["params"]) == {"adaln", "adaln+text"}
    for p in data["params"].values():  # parameter counts matched, per variant
        assert 0.9 < p["wan"] / p["ours"] < 1.1
    assert {r["variant"] for r in data["rows"]} == {"adaln", "adaln+text"}
    assert all(r["ours_tok_s"] > 0 and r["wan_tok_s"] > 0 and r["prologue_cost"] > 0 for r in data["rows"])


def test_bench_wan22_quick(tmp_path):
    """Packed vs diffusers' own model on the same weights (one family: the other differs only in
    channels and per-token timesteps, which tests/test_wan22.py covers)."""
    from dit_train.tools.bench_wan22 import main

    out = tmp_path / "w22.json"
    assert main(["--quick", "--families", "ti2v", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["family"] == "ti2v" and row["params_equal"] and row["tokens"] == 368
    assert row["ours_tok_s"] > 0 and row["bucketed_tok_s"] > 0 and row["padded_tok_s"] > 0


def test_bench_mfu_cpu_dry_run(tmp_path):
    from dit_train.tools.bench_mfu import main

    out = tmp_path / "m.json"
    assert main(["--model", "dit_tiny", "--device", "cpu", "--tokens", "256", "--sample-tokens", "128", "--ac", "off,on",
                 "--backend", "sdpa", "--precision", "fp32", "--steps", "2", "--peak-tflops", "1", "--prologues", "off,on",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ac"], r["prologues"]) for r in rows] == [("none", "off"), ("none", "on"), ("full", "off"), ("full", "on")]
    assert all(r["TFLOPs"] > 0 and 0 < r["MFU"] for r in rows)
    assert rows[1]["est_GiB"] < rows[0]["est_GiB"]  # the model ran (and was costed) with the prologues on


def test_gpu_check_cpu_dry_run(tmp_path):
    """The GPU check's every section on tiny shapes on the CPU (gloo for its process group of
    one): it runs end to end and every bound holds, so a GPU session spends its minutes
    measuring, not debugging the script."""
    from dit_train.tools.gpu_check import SECTIONS, main

    assert main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(sections) == list(SECTIONS) and not any("error" in s for s in sections.values())
    attn = sections["attention"]["rows"]
    assert {r["backend"] for r in attn} == {"sdpa", "sdpa_dense", "flex"} and all(r["pass"] for r in attn)
    assert [r["precision"] for r in sections["fsdp_world1"]["rows"]] == ["fp32", "bf16"]
    (plan,) = sections["planner"]["rows"]
    assert plan["step_s"] > 0 and plan["micro_tokens"] >= 32  # holds the longest clip (2 x 4 x 4 patches)
    assert {r["workload"] for r in sections["vs_diffusers"]["rows"]} == {"one_clip", "mixed"}


@pytest.mark.slow
def test_bench_collectives_quick(tmp_path):
    from dit_train.tools.bench_collectives import main

    out = tmp_path / "c.json"
    assert main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["grad_accum"] for r in rows] == [1, 2] and rows[1]["micro_batches"] > rows[0]["micro_batches"]
    # the gradient reductions of one step do not grow with the accumulation
    assert rows[0]["reduce_scatter"] == rows[1]["reduce_scatter"] > 0
    assert rows[0]["all_reduce"] == rows[1]["all_reduce"]


@pytest.mark.slow
def test_bench_cp_quick(tmp_path):
    """One process, Ulysses 2, ring 2 and the dense reference ring on one pack of 8 clips (2
    workers): every variant has a time and a peak, the ring rows their ratios."""
    from dit_train.tools.bench_cp import VARIANTS, main

    out = tmp_path / "cp.json"
    assert main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == list(VARIANTS)
    assert all(r["step_s"] > 0 and r["peak_MiB"] > 0 and r["clips"] == 8 for r in rows)
    assert all("time / ulysses 2" in r for r in rows if r["layout"].startswith("ring"))


def test_suite_profile_samples_every_python_a_command_starts(tmp_path, capsys):
    """benchmarks/suite_profile.py: a Python and the Python it starts each write their stacks, and
    the report names the function that spent the CPU (seen failing with the timer not restarted
    in a forked child: the child's loop went unsampled)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_profile.py"
    spec = importlib.util.spec_from_file_location("suite_profile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = ("import os, sys, time\n"
            "def spin_parent():\n    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
            "def spin_child():\n    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
            "if os.fork() == 0:\n    spin_child()\n    sys.exit(0)\nos.wait()\nspin_parent()\n")
    assert mod.profile([sys.executable, "-c", code], tmp_path / "out") == 0
    mod.report(tmp_path / "out", top=50)
    text = capsys.readouterr().out
    assert "in 2 processes" in text, text
    assert "spin_parent (<string>)" in text and "spin_child (<string>)" in text, text
