"""The micro-batch and layout planner (`python -m dit_train.tools.plan`): ranks layouts by the
performance models of dit_train/perf/ (planner.py), finds the clips that fit (clips.py), and
verifies the best by running them (smoke runs through the engine)."""
