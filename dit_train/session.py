"""The session API's first home, kept importable: everything now lives in dit_train.posttrain
(datums.py: the caller's data; losses.py: SFT / GRPO / DPO; session.py: TrainingSession)."""
from dit_train.posttrain import *  # noqa: F401,F403
from dit_train.posttrain import __all__  # noqa: F401
