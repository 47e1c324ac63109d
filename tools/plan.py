#!/usr/bin/env python
"""Same as `python -m dit_train.tools.plan` (see its --help); kept so the tool also runs as a script."""
import sys

from dit_train.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
