"""Performance models and measurement helpers: per-rank memory (memory.py), FLOPs (flops.py),
timing/counting/table utilities shared by the planner and the benchmark scripts (bench.py)."""
