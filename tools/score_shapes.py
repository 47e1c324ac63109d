#!/usr/bin/env python
"""Same as `python -m dit_train.tools.score_shapes` (see its --help); kept so the tool also runs as a script."""
from dit_train.engine.process_exit import run_and_exit
from dit_train.tools.score_shapes import main

if __name__ == "__main__":
    run_and_exit(main)
