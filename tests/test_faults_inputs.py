"""The fault suite, continued (tests/test_faults.py, tests/test_faults_run.py): inputs that used to
give a silent wrong result (issue 43) — a run "completed" that trained something else than asked,
or a tool that proposed the impossible. Each is now an error before step 0, or a counted outcome,
never a run that reports `completed`. Documented in docs/checkpoints.md, "Faults and bad inputs tried"."""
from __future__ import annotations

import time

import pytest


# -- the planner: impossible or absurd inputs ------------------------------------------------------


PLAN_REFUSED = [  # (arguments, what the one error line says)
    (["--mean-sample-tokens", "99999999", "--max-sample-tokens", "10"],
     "--mean-sample-tokens=99999999 is above the longest sample (--max-sample-tokens=10)"),
    (["--mean-sample-tokens", "5000"], "--mean-sample-tokens=5000 is above the longest sample (train.micro_batch_tokens"),
    (["--world", "1000000000"], "argument --world: 1000000000 must be in [1, 131072]"),
    (["parallel.dp_shard=1000000000"], "parallel.dp_shard=1000000000 asks for 1000000000 ranks"),
    (["--vae-stride", "0,8,8", "--frames", "9"], "argument --vae-stride: '0,8,8' must be three integers >= 1 (t,h,w)"),
    (["--vae-stride", "4,8", "--frames", "9"], "argument --vae-stride: '4,8' must be three integers >= 1 (t,h,w)"),
]


@pytest.mark.parametrize("args,message", PLAN_REFUSED, ids=[" ".join(a) for a, _ in PLAN_REFUSED])
def test_the_planner_refuses_impossible_inputs_in_one_line_at_once(args, message, capsys):
    """Before: a plan for a mean sample longer than the longest, minutes of search for a world of
    1e9 ranks, a ZeroDivisionError traceback for a zero VAE stride."""
    from dit_train.tools.plan import main

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert time.perf_counter() - t0 < 30

