"""The errors that end a run with one line: `python -m dit_train` (and every tool) prints
`error: <message>` and exits non-zero. Each message names the key, file or flag to change and
how. They live at the bottom of the layers, so that any part of the package can raise them."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the keys to change. `problems`: one
    line per problem (check_config finds them all at once)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


def check(ok: bool, message: str, errors: list[str]) -> None:
    """Add `message` to `errors` unless `ok`: the pre-run checks collect every problem of a
    config, then check_config raises one ConfigError naming them all."""
    if not ok:
        errors.append(message)


class RunFolderError(ConfigError):
    """The run folder cannot be used as asked; the message says what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and the fix."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file holds objects a checkpoint never holds (forged, or not from this
    project): refused without being loaded."""


class WorkerFailure(RuntimeError):
    """A local worker exited with an error; the message names the rank and the cause."""


class RunFailed(RuntimeError):
    """The run stopped before its last step; the message says why and what to change."""


class NonFiniteTraining(RunFailed):
    """Too many consecutive steps with non-finite gradients."""


class LossDiverged(RunFailed):
    """The loss stayed far above its first value (train.divergence_factor): the run diverged."""


class DataFailure(RunFailed):
    """Too much of the data could not be read (or none of a step's)."""


class DataUnreachable(RunFailed):
    """Remote data (shards on object storage) could not be read after the retries: a network or
    endpoint problem, not a bad sample. The message names the URL, the tries and the keys to check."""
