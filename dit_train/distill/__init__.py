"""DMD2 few-step distillation of a trained video run (docs/distillation.md)."""
