"""Parallelism applied to a single-device model from outside (DESIGN.md, principle 1)."""
