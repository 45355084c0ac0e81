"""The parallel layout as data, with every rule it must satisfy (no torch import).

`ParallelDims` holds the sizes of one run and checks them, against the world size, the model and the batch,
once, before any process group exists. The trainer, `moeflow.parallelize`, the dry run and the planner all use
this one object, so they accept and refuse the same layouts. `schedules` describes the pipeline schedules
and the split of layers into stages.
"""

from moeflow.layout.dims import BatchSplit, ParallelDims

__all__ = ["BatchSplit", "ParallelDims"]
