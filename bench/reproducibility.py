"""Is training reproducible? Every layout of the layout matrix (tests/parallel/test_layouts.py), trained twice.

    .venv/bin/python bench/reproducibility.py

Each world size's layouts run in one launch of local gloo processes (tests/parallel/layout_worker.py), and the whole
launch is repeated: the second launch is the same job started again from nothing, as a user would. Per layout:
the losses and global gradient norms of the 3 steps, and the final parameters (each rank's checkpoint read into
one process), compared bit for bit between the two launches. `tests/train/test_faults.py` runs two of these layouts
twice in `make test`. Prints a table and writes bench/out/reproducibility.json; there is no chart (a column of
zeros is the result).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"


def main() -> None:
    from tests.parallel.layout_worker import BASE, LAYOUTS, launch
    from tests.parallel.test_layouts import _cfg, _final_params, _losses

    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in LAYOUTS.items():
            for attempt in ("first", "second"):
                cases = [(name, [*BASE, *extra], f"{tmp}/{attempt}/{name}", False) for name, extra in layouts.items()]
                bad = {name: out for name, out in launch(world, cases).items() if out != "ok"}
                assert not bad, bad
            for name in layouts:
                a, b = (Path(tmp) / attempt / name for attempt in ("first", "second"))
                pa, pb = (_final_params(run, _cfg(run)) for run in (a, b))
                rows.append({
                    "layout": name, "ranks": world,
                    "losses_equal": _losses(a) == _losses(b),
                    "grad_norms_equal": _losses(a, "grad_norm") == _losses(b, "grad_norm"),
                    "max_param_diff": max(float((pa[k] - pb[k]).abs().max()) for k in pa),
                })
    print(f"\n{'layout':<16} {'ranks':>5} {'losses equal':>12} {'grad norms equal':>16} {'max |param diff|':>16}")
    for r in rows:
        print(f"{r['layout']:<16} {r['ranks']:>5} {r['losses_equal']!s:>12} {r['grad_norms_equal']!s:>16} "
              f"{r['max_param_diff']:>16.3g}")
    same = sum(r["losses_equal"] and r["grad_norms_equal"] and r["max_param_diff"] == 0 for r in rows)
    print(f"\n{same} of {len(rows)} layouts bit-identical across two launches")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "reproducibility.json").write_text(json.dumps({"machine": platform.platform(), "torch": torch.__version__,
                                                          "rows": rows}, indent=1))
    print(f"wrote {OUT / 'reproducibility.json'}")


if __name__ == "__main__":
    main()
