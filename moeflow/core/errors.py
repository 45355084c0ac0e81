"""Helpers for error messages that name the setting, the value and a fix (no torch import)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def divisors(n: int, limit: int | None = None) -> list[int]:
    out = [d for d in range(1, n + 1) if n % d == 0]
    return out if limit is None else [d for d in out if d <= limit]


def closest(name: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or '' when none is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def check_choice(setting: str, value: str, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(
            f"{setting} = {value!r} is not one of {choices}.{closest(str(value), choices)}"
        )
