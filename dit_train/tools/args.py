"""Command-line parsing shared by the tools: a bad flag is one `error:` line, and numeric flags
carry their valid range (the same `Range` rule the config checks use)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from dit_train.engine.checks import Range


class ToolParser(argparse.ArgumentParser):
    """argparse with the project's error format: `error: <what> (see <prog> --help)` on one line,
    exit code 2, instead of the usage block followed by the message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def ranged(kind: type, rule: Range) -> Callable[[str], float]:
    """An argparse `type=`: parse the flag as `kind` and require it within `rule`
    (argparse names the flag: `argument --frames: 0 must be >= 1 (1 = a still image)`)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not rule.holds(value):
            raise argparse.ArgumentTypeError(f"{text} must be {rule.describe()}" + (f" ({rule.note})" if rule.note else ""))
        return value

    parse.__name__ = kind.__name__  # argparse's own messages name the type
    return parse


POSITIVE_INT = ranged(int, Range(1))
NON_NEGATIVE_INT = ranged(int, Range(0))
POSITIVE_FLOAT = ranged(float, Range(0, low_open=True))
