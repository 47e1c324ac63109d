"""Turning a config into training: checks, the build recipe, the trainer, the worker loop and
the launchers."""
