"""python -m dit_train.tools.sample: prompts -> videos from a trained run, any layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TINY

PROMPTS = ["a red circle moving up and left on a navy background", "a white square on a black background"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_cfg):
    from dit_train.engine.layout_equivalence import apply_layout
    from dit_train.engine.worker import train

    cfg = apply_layout(tiny_cfg, {})
    cfg.train.ema_decay = 0.5
    # validation at the end (3 clips, 3 steps): what --data-captions must reproduce
    cfg.train.sample_every, cfg.train.num_samples, cfg.train.sample_steps = cfg.train.steps, 3, 3
    cfg.run_dir = str(tmp_path_factory.mktemp("run"))
    train(cfg)
    return cfg.run_dir


def _sample(run_dir, out, *extra):
    from dit_train.tools.sample import main

    args = [str(run_dir), *(a for p in PROMPTS for a in ("--prompt", p)), "--num", "2", "--frames", "4",
            "--height", "32", "--width", "64", "--steps", "3", "--guidance", "2", "--out", str(out), *extra]
    assert main(args) == 0
    return load_file(str(out / "samples.safetensors")), json.loads((out / "info.json").read_text())


def test_prompts_become_clips_of_the_asked_size_with_scores(trained_run, tmp_path):
    got, info = _sample(trained_run, tmp_path / "a")
    assert sorted(got) == ["prompt_0_0", "prompt_0_1", "prompt_1_0", "prompt_1_1"]
    assert all(x.shape == (3, 4, 32, 64) and float(x.abs().max()) <= 1 for x in got.values())
    assert not torch.equal(got["prompt_0_0"], got["prompt_0_1"])  # --num: different noise
    assert info["weights"] == "weights_ema.safetensors" and "eval/all_ok" in info["scores"]
    captions = json.loads((tmp_path / "a" / "captions.json").read_text())
    assert captions["prompt_1_1"] == PROMPTS[1] and (tmp_path / "a" / "prompt_1_1.mp4").exists()
    no_ema, info = _sample(trained_run, tmp_path / "b", "--no-ema")
    assert info["weights"] == "weights.safetensors"
    assert not torch.equal(no_ema["prompt_0_0"], got["prompt_0_0"])


def test_shift_comes_from_the_run_unless_given(trained_run, tmp_path):
    base, info = _sample(trained_run, tmp_path / "a", "--steps", "2")
    assert info["shifts"] == [1.0] * 4  # the run trained with loss.timestep_shift=1
    shifted, info = _sample(trained_run, tmp_path / "b", "--steps", "2", "--shift", "3")
    assert info["shifts"] == [3.0] * 4
    assert not torch.equal(base["prompt_0_0"], shifted["prompt_0_0"])


@pytest.mark.slow
def test_sampling_on_two_workers_matches_one_process(trained_run, tmp_path):
    one, _ = _sample(trained_run, tmp_path / "one")
    two, _ = _sample(trained_run, tmp_path / "two", "--layout", "cp_ulysses=2")
    for k in one:
        torch.testing.assert_close(one[k], two[k], atol=1e-4, rtol=1e-4)


def test_data_captions_reproduce_the_runs_validation(trained_run, tmp_path):
    """--data-captions N (steps, guidance and seed default to the run's) is the run's validation
    with train.num_samples=N: the same clips, sizes, captions and noise."""
    from dit_train.tools.sample import main

    out = tmp_path / "again"
    assert main([str(trained_run), "--data-captions", "3", "--out", str(out)]) == 0
    validation = trained_run + "/samples/step_000002"
    want = load_file(validation + "/samples.safetensors")
    got = load_file(str(out / "samples.safetensors"))
    assert sorted(got) == sorted(want) and len(want) == 3
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)
    assert json.loads((out / "captions.json").read_text()) == json.loads(open(validation + "/captions.json").read())


def test_bad_requests_are_one_error_line(trained_run, tmp_path, capsys):
    from dit_train.tools.sample import main

    assert main([str(trained_run), "--prompt", "x", "--guidance", "0.5"]) == 2
    assert main([str(tmp_path), "--prompt", "x"]) == 2
    assert main([str(trained_run), "--prompt", "x", "--shift", "0"]) == 2
    assert main([str(trained_run), "--prompt", "x", "--data-captions", "2"]) == 2
    assert main([str(trained_run)]) == 2
    # sizes that cannot fit: refused before a model is built (was a traceback deep in the sampler)
    assert main([str(trained_run), "--prompt", "x", "--height", "100000", "--width", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 6 and "not both" in err and "nothing to sample" in err and "guidance" in err and "config.yaml" in err and "--shift=0.0" in err
    assert "1 clip(s) of 16 x 100000 x 100000 need ~" in err and "lower --height/--width/--frames or --num" in err


def test_sampling_shows_a_progress_bar(trained_run, tmp_path, capsys):
    """`--num 10000` printed nothing for 100 s: the steps show as a bar (stderr)."""
    _sample(trained_run, tmp_path / "a")
    assert "sampling 4 clip(s)" in capsys.readouterr().err


def test_evaluate_scores_the_heldout_compositions_and_training_captions(trained_run, tmp_path):
    """tools.evaluate: --heldout samples the compositions the data keeps out, --train-captions
    the run's first training clips (as --data-captions does); each writes evaluate.json and a
    grid and appends a row to RUN/eval/evaluations.jsonl."""
    from dit_train.data_pipelines.synthetic_video import caption_split
    from dit_train.tools.evaluate import main
    from dit_train.tools.sample import main as sample

    assert main([str(trained_run), "--n", "3", "--steps", "2", "--out", str(tmp_path / "h")]) == 0
    held = json.loads((tmp_path / "h" / "evaluate.json").read_text())
    assert held["which"] == "heldout" and held["n"] == 3 and "all_ok" in held["scores"]
    assert list(json.loads((tmp_path / "h" / "captions.json").read_text()).values()) == caption_split()[1][:3]
    assert (tmp_path / "h" / "grid.png").exists()
    assert main([str(trained_run), "--train-captions", "--n", "3", "--steps", "2", "--out", str(tmp_path / "t")]) == 0
    assert sample([str(trained_run), "--data-captions", "3", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    same = load_file(str(tmp_path / "s" / "samples.safetensors"))
    got = load_file(str(tmp_path / "t" / "samples.safetensors"))
    assert sorted(got) == sorted(same) and all(torch.equal(got[k], same[k]) for k in got)
    rows = [json.loads(line) for line in (Path(trained_run) / "eval" / "evaluations.jsonl").read_text().splitlines()]
    assert [r["which"] for r in rows[-2:]] == ["heldout", "train"]


def test_evaluate_refuses_runs_it_cannot_score_in_one_line(trained_run, tmp_path, capsys):
    """tools.evaluate on a folder that is no run, and on a text run: one `error:` line, exit 2,
    nothing written."""
    import shutil

    from dit_train.tools.evaluate import main

    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    text_run = tmp_path / "text_run"
    shutil.copytree(trained_run, text_run)
    cfg = (text_run / "config.yaml").read_text()
    assert "mode: video" in cfg
    (text_run / "config.yaml").write_text(cfg.replace("mode: video", "mode: llm"))
    assert main([str(text_run), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
