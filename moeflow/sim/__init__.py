"""EP traffic simulator for large clusters (pure Python + numpy; no torch import).

`routing` samples or loads top-k expert choices; `ep` counts the bytes each dispatch strategy sends,
exactly as docs/ep-bytes.md defines them, and turns them into link times with an alpha-beta model.
"""
