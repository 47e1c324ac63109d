"""Same as `python -m dit_train.tools.plan` (kept so every tool runs as `python tools/<name>.py`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dit_train.tools.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
