"""One launch of `world` local gloo processes that run a list of test cases in order.

Process start-up (each rank imports torch) dominates on CPU, so every multi-process test file spawns its
ranks once per world size and runs many cases there. Every rank runs the same cases in the same order (so
collectives match), stops at its first failure (its peers may now wait in a collective it skipped), and
writes {case name: "ok" | traceback} to a file the parent reads back.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist


def launch(world: int, cases: list[tuple], run_case, setup=None, timeout_s: float | None = None) -> list[dict]:
    """Run `cases` (tuples whose first item is the name) on `world` ranks: each rank calls
    `setup(rank, world)` once (its result is the context) and then `run_case(context, case)` per case.
    `run_case` and `setup` must be module-level functions (they travel to the spawned processes).
    Returns each rank's {name: "ok" | traceback}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, cases, run_case, setup, tmp, timeout_s), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def _worker(rank: int, world: int, cases, run_case, setup, tmp: str, timeout_s: float | None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, **kwargs)
    if os.environ.get("FH"):  # FH=seconds: dump every rank's stack to /tmp/fhR.txt after that long (hangs)
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["FH"]), file=open(f"/tmp/fh{rank}.txt", "w"))
    context = setup(rank, world) if setup is not None else None
    results = {}
    for case in cases:
        try:
            run_case(context, case)
            results[case[0]] = "ok"
        except Exception:
            results[case[0]] = traceback.format_exc()
            break  # the peers may now wait in a collective this rank skipped: stop rather than cascade
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    os._exit(0)  # no destroy_process_group: after a failure a peer may still hold an unmatched collective


def check_results(results: list[dict[str, str]], cases: list[tuple] | None = None) -> None:
    """Fail the test with the first failing case's traceback (and the names of all that failed), or if a rank did
    not run every case (every case of `cases`, or without it every case some rank ran)."""
    import pytest

    failures = [(rank, name, tb) for rank, res in enumerate(results) for name, tb in res.items() if tb != "ok"]
    if failures:
        rank, name, tb = failures[0]
        names = sorted({f"{n} (rank {r})" for r, n, _ in failures})
        pytest.fail(f"{len(failures)} failed: {names[:20]}\nfirst, {name} on rank {rank}:\n{tb}")
    wanted = [case[0] for case in cases] if cases is not None else sorted({n for res in results for n in res})
    missing = [f"{n} (rank {r})" for r, res in enumerate(results) for n in wanted if n not in res]
    assert not missing, f"cases that did not run: {missing[:20]}"
