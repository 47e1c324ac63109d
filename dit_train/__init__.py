"""dit_train: layout-invariant training of packed video DiTs and causal LMs."""
import os

# Set before torch loads libgomp (any dit_train entry point imports this first). An OpenMP
# thread that finishes a parallel region spins waiting for the next one; by default for so long
# that on a busy machine (other jobs, the local workers of a multi-process run, a test suite) the
# spinning threads take the cores the working ones need. A short spin keeps quiet runs as fast
# and stops the waste (measured, docs/development.md: the quickstart's step 238 -> 217 ms quiet,
# 2702 -> 1610 ms beside 4 busy processes on 2 cores). A value set outside is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
