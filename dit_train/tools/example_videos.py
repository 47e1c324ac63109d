"""Write three example clips of different sizes and frame rates, each with its caption .txt, into
a folder: a stand-in for your own videos to try `data=video_folder` on (docs/own-videos.md).

    python -m dit_train.tools.example_videos videos/
    python -m dit_train data=video_folder data.root=videos/ data.max_frames=16 data.fps=8 train.global_batch=3
    python -m dit_train.tools.example_videos videos/ --masks --control     # also clip.mask.mp4, clip.control.mp4
    python -m dit_train data=video_folder data.root=videos/ data.masks=true cond.control=true train.global_batch=3

The clips (height x width): 144x176 at 30 fps (3 s), 272x640 at 25 fps (2 s), 720x1280 at
25 fps (1 s); a coloured shape crossing a flat background, written with PyAV (libx264).
"""
from __future__ import annotations

import argparse

from dit_train.data_pipelines.example_videos import EXAMPLE_CLIPS, write_example_videos


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="where to write the clips (created)")
    ap.add_argument("--masks", action="store_true", help="also a loss mask beside each clip (clip.mask.mp4; data.masks=true)")
    ap.add_argument("--control", action="store_true",
                    help="also a control video beside each clip (clip.control.mp4; cond.control=true)")
    args = ap.parse_args(argv)

    for clip, path in zip(EXAMPLE_CLIPS, write_example_videos(args.folder, masks=args.masks, control=args.control)):
        print(f"{path}  {clip.height}x{clip.width} at {clip.fps} fps, {clip.frames} frames: {clip.caption!r}")
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
