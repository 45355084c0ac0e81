"""moeflow: PyTorch-native training of Mixture-of-Experts language models.

Importing `moeflow` is cheap (no torch); the heavy names load on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "parallelize", "ParallelDims", "ParallelOptions", "ParallelState"]


def __getattr__(name: str):
    # Lazy, so `moeflow plan` and `moeflow simulate` never import torch.
    if name == "parallelize":
        from moeflow.parallel.parallelize import parallelize

        return parallelize
    if name == "ParallelDims":
        from moeflow.core.parallel_dims import ParallelDims

        return ParallelDims
    if name == "ParallelOptions":
        from moeflow.parallel.options import ParallelOptions

        return ParallelOptions
    if name == "ParallelState":
        from moeflow.parallel.state import ParallelState

        return ParallelState
    raise AttributeError(f"module 'moeflow' has no attribute {name!r}")
