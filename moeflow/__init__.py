"""moeflow: PyTorch-native training of Mixture-of-Experts language models.

Importing `moeflow` is cheap (no torch); the heavy names load on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
