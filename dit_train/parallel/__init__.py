"""Mesh, parallelize(), context parallelism and the SUM gradient backbone."""
from dit_train.parallel.mesh import ParallelContext, ParallelDims, init_parallel
from dit_train.parallel.parallelize import parallelize

__all__ = ["ParallelContext", "ParallelDims", "init_parallel", "parallelize"]
