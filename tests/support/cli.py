"""Running moeflow's command line from a test, and what this torch refuses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (tests/support/ is two below it)


def run_cli(args, env=None, timeout=300):
    """Run `python -m moeflow ...` in a subprocess; returns CompletedProcess with text output."""
    import subprocess

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "moeflow", *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# moeflow also runs on torch 2.11, where moeflow/parallel/torch_compat.py refuses some pipelines; the suite leaves
# those cases out there (on 2.13, what `make test` installs, it runs every case).


def old_torch() -> bool:
    from moeflow.parallel.torch_compat import torch_minor

    return torch_minor() < (2, 13)


def refused_on_old_torch(argv: list[str]) -> bool:
    """Whether moeflow refuses these training flags on this torch before launching on the CPU (gloo)."""
    from moeflow.cli import _refuse_what_this_torch_cannot_run
    from moeflow.config import load_config, parse_overrides

    try:
        _refuse_what_this_torch_cannot_run(load_config(None, parse_overrides(argv)), "cpu")
    except ValueError:
        return True
    return False


def assert_one_line(check, message: str | None) -> None:
    """`check()` passes when `message` is None; otherwise it raises one ValueError line matching `message`."""
    import pytest

    if message is None:
        check()
        return
    with pytest.raises(ValueError, match=message) as e:
        check()
    assert "\n" not in str(e.value)
