"""Signals to a run or a tool (docs/checkpoints.md, "Faults and bad inputs tried"): a stop is a
step boundary, never half an optimizer update, and ends as a stop (status interrupted, one line,
128 + the signal) even where the signal's exception lands inside library code. The real SIGTERM
to a whole tool is in test_faults_tools.py (video_rl) and test_faults_run.py (training)."""
from __future__ import annotations

import pytest


def test_a_signal_during_an_update_stops_after_it_and_a_second_one_at_once():
    """video_rl's update runs under `signals_deferred`: the stop it saves is a step boundary, never
    half an optimizer step; asked twice, it stops at once (the trainer's handler, not a second one)."""
    import os
    import signal

    from dit_train.engine import launch

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch.interrupt_on_signals()
        done = []
        with pytest.raises(launch.Interrupted) as err:
            with launch.signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("the rest of the update")
        assert done == ["the rest of the update"] and err.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is launch._raise_interrupted  # the usual handler is back
        with pytest.raises(launch.Interrupted) as err:
            with launch.signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                done.append("never")
        assert done == ["the rest of the update"] and err.value.signum == signal.SIGINT
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        launch._pending.clear()  # no top-level handler reported these signals: leave none pending for later tests


def test_a_signal_whose_exception_a_cleanup_replaced_still_stops_as_a_signal():
    """A SIGTERM's Interrupted can land inside library code whose cleanup then raises on the
    half-done state (seen: omegaconf's flag_override, an AttributeError; the tool exited 1 with a
    traceback instead of 143 and its one line): run_stoppable, around every run and worker, turns
    an exception that arrives with a signal pending back into the signal's Interrupted."""
    import os
    import signal

    from dit_train.engine import launch

    def cut_in_half():
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Interrupted here
        finally:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch.interrupt_on_signals()
        with pytest.raises(launch.Interrupted) as err:
            launch.run_stoppable(cut_in_half)
        assert err.value.signum == signal.SIGTERM and isinstance(err.value.__cause__, AttributeError)
        assert launch.interruption(err.value) == ("stopped by SIGTERM", 143)
        with pytest.raises(ValueError):  # without a pending signal an error stays the error
            launch.run_stoppable(int, "x")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        launch._pending.clear()
