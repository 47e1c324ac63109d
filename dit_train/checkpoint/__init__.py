"""Checkpoints made of stateful parts (parts.py), their folders (store.py), integrity checks
(integrity.py), loading that never runs code from files (safe_load.py), and full-weight export
(export.py)."""
from dit_train.checkpoint.export import (
    checkpoint_weights,
    export_checkpoint,
    export_diffusers,
    export_weights,
    full_state_dict,
    save_safetensors,
)
from dit_train.checkpoint.parts import JSONState, ModelState, OptimizerState, Part, training_parts
from dit_train.config.errors import UnsafeCheckpoint, CheckpointError
from dit_train.checkpoint.store import (
    checkpoint_root,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_info,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = ["CheckpointError", "JSONState", "ModelState", "OptimizerState", "Part", "checkpoint_root", "checkpoint_weights",
           "export_checkpoint", "export_diffusers", "export_weights", "find_checkpoint", "full_state_dict", "list_checkpoints",
           "load_checkpoint", "read_checkpoint_info", "resolve_checkpoint", "save_checkpoint", "save_safetensors", "verify_checkpoint",
           "training_parts", "UnsafeCheckpoint"]
