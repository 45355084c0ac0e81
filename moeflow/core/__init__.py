"""The torch-free core: model and parallel-size configuration, presets, Hugging Face architecture specs, the
hardware table, error messages and figure helpers. Every other layer may import it; it imports nothing of theirs,
and nothing here imports torch, so the planner and config checks run without it."""
