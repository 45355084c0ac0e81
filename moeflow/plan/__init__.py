"""Pure-Python cost model for choosing a parallel layout (no torch import).

hardware (GPU table) -> memory (bytes per GPU) + time (seconds per step) -> search (rank layouts)
-> advice (a recommendation in words). `moeflow plan` is `moeflow.plan.cli.main`.
"""
