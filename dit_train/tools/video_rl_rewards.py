"""The rewards of tools.video_rl: the built-in ones by name, a user's `module:function`, and
the checks that stop a run before a bad reward feeds a step."""
from __future__ import annotations

import importlib
import math
import threading
from typing import Any, Callable

import torch

from dit_train.config.errors import ConfigError
from dit_train.data_pipelines.shapes_metric import score_clip, scores_and_grade, shape_grade


def shapes_reward(clips: list[torch.Tensor], captions: list[str]) -> list[float]:
    """The default reward: the sum of the exact metric's figures of each clip (0 .. 7)."""
    return [float(sum(score_clip(c, p).values())) for c, p in zip(clips, captions)]


def brightness_reward(clips: list[torch.Tensor], captions: list[str]) -> list[float]:
    """The sanity reward: each clip's mean brightness in [0, 1] (clips [3, F, H, W] in [-1, 1]).
    Any recipe must raise it within a few steps; one that does not has a defect."""
    return [float((c.clamp(-1, 1).mean() + 1) / 2) for c in clips]


def shapes_graded_reward(clips: list[torch.Tensor], captions: list[str]) -> list[float]:
    """The shapes reward with shape_ok replaced by `shape_grade` (0 .. 1, how square or round the
    blob is toward the caption's word): 0 .. 7 as the default, but clips of one caption that all
    miss the shape kind still differ by how near they came (all_ok stays the exact conjunction)."""
    out = []
    for c, p in zip(clips, captions):
        scores, grade = scores_and_grade(c, p)
        out.append(float(sum(scores.values()) - scores["shape_ok"] + grade))
    return out


def shape_reward(clips: list[torch.Tensor], captions: list[str]) -> list[float]:
    """The shape word alone: `shape_grade` (0 .. 1). Nothing else is rewarded, so whatever else
    a run keeps it keeps by its proximal term (--old-decay) or learning rate."""
    return [shape_grade(c, p) for c, p in zip(clips, captions)]


BUILTIN = {"shapes": shapes_reward, "shapes_graded": shapes_graded_reward, "shape": shape_reward,
           "brightness": brightness_reward}


def load_reward(spec: str) -> Callable:
    """A built-in reward by name (shapes, shapes_graded, shape, brightness) or `module:function`; ConfigError otherwise."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError(f"--reward {spec}: expected {', '.join(BUILTIN)} or module:function (e.g. my_rewards:score)")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--reward {spec}: cannot load it ({err})") from None
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {name} is not callable")
    return fn


def with_timeout(fn: Callable, timeout_s: float, what: str) -> Callable:
    """fn, answered within `timeout_s` seconds (0 = no limit) or a ValueError naming `what`: a
    reward that never returns hung the tool. It runs in a daemon thread, which the process leaves
    behind when it ends; its exceptions reach the caller."""
    if timeout_s <= 0:
        return fn

    def call(*args: Any) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = fn(*args)
            except BaseException as err:  # handed to the caller, whatever it is
                box["err"] = err

        worker = threading.Thread(target=run, name="video_rl-reward", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise ValueError(f"{what} gave no answer within {timeout_s:g} s (--reward-timeout); make it faster, or "
                             f"raise --reward-timeout (0 = no limit)")
        if "err" in box:
            raise box["err"]
        return box["out"]

    return call


def checked_rewards(fn: Callable, name: str, clips: list[torch.Tensor], captions: list[str]) -> list[float]:
    """fn(clips, captions) as floats; ValueError naming the clip for a wrong count or a non-finite value."""
    out = fn(clips, captions)
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as err:
        raise ValueError(f"--reward {name} returned {type(out).__name__} ({err}); expected one float per clip") from None
    if len(values) != len(clips):
        raise ValueError(f"--reward {name} returned {len(values)} values for {len(clips)} clips: expected one per clip")
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"--reward {name} returned {v} for clip {i} ({captions[i]!r}): rewards must be finite")
    return values
