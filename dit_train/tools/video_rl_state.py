"""What `tools.video_rl` keeps in its --out folder.

The --out rules (`check_out`, before anything is built): --out is never the source run nor a
folder holding it; a folder that is not empty is refused unless --overwrite (its entries move to
--out/overwritten_<time>/, so no stale weights_ema.safetensors is taken for the new model).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dit_train.config.errors import ConfigError
from dit_train.engine.run_folder import move_aside


def check_out(run: Path, out: Path, args: Any) -> None:
    """Refuse an --out that would lose work (module doc), before anything is built; with
    --overwrite move what it holds aside."""
    src, dst = run.resolve(), out.resolve()
    if src == dst or src.is_relative_to(dst):
        what = "is the run it starts from" if src == dst else f"holds the run it starts from ({run})"
        raise ConfigError(f"--out {out} {what}: its weights and config would be replaced; give another --out")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not args.overwrite:
        held = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ConfigError(f"--out {out} is not empty ({held}): pass --overwrite to start over (what it holds moves to "
                          f"{out}/overwritten_<time>/), or give another --out")
    moving = [e for e in entries if not e.startswith("overwritten_")]
    if moving:
        print(f"--overwrite: moved {', '.join(moving)} to {move_aside(out, moving)}", flush=True)
