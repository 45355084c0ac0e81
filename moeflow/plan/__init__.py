"""Pure-Python cost model for choosing a parallel layout (no torch import).

moeflow.core.hardware (the GPU table, shared with sim and train) -> memory (bytes per GPU) + time (seconds
per step: compute per operation, schedule for the pipeline bubble) -> search (rank layouts) -> advice (a
recommendation in words). `moeflow plan` is `moeflow.plan.cli.main`.
"""
