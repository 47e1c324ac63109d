#!/usr/bin/env python
"""Same as `python -m dit_train.tools.sample` (see its --help); kept so the tool also runs as a script."""
import sys

from dit_train.tools.sample import main

if __name__ == "__main__":
    sys.exit(main())
