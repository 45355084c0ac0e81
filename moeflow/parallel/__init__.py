"""Parallelism applied to a single-device model from outside (docs/design.md, principle 1)."""
