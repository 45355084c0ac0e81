"""data.blend's syntax: "W1 SOURCE1 W2 SOURCE2 ..." (Megatron's --data-path), checked before any process starts;
the sampler that follows the weights is moeflow/data/blend.py."""

from __future__ import annotations


def parse_blend(blend: str) -> list[tuple[float, str]]:
    """[(weight, source)] from "W1 SOURCE1 W2 SOURCE2 ..."; ValueError naming the setting on bad input."""
    parts = blend.split()
    if not parts or len(parts) % 2:
        raise ValueError(f"data.blend = {blend!r}: give pairs of a weight and a source, e.g. "
                         f"'0.7 data/web 0.3 data/code'")
    out = []
    for w, source in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"data.blend = {blend!r}: {w!r} is not a weight (a positive number) before "
                             f"{source!r}") from None
        if not weight > 0:
            raise ValueError(f"data.blend = {blend!r}: the weight of {source!r} is {w}; every weight must be "
                             f"positive (leave a source out rather than give it 0)")
        out.append((weight, source))
    return out
