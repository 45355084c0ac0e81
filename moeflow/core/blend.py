"""data.blend's syntax, checked before any process starts: "W1 SOURCE1 W2 SOURCE2 ..." (Megatron's --data-path)
or, in a TOML file, a list of tables (`[[data.blend]]` with `weight`, `source` and any of BLEND_SETTINGS for that
source alone); the sampler that follows the weights is moeflow/data/blend.py."""

from __future__ import annotations

from moeflow.core.errors import closest

# the data.* settings a source of a blend may set for itself (the others are the run's: seq_len, packing, ...)
BLEND_SETTINGS = ("format", "overlong", "chat_template", "tokenizer", "token_dtype", "val_fraction", "max_bytes")


def parse_blend(blend: str | list) -> list[tuple[float, str, dict]]:
    """[(weight, source, {data setting: value})] from either form; ValueError naming the setting on bad input."""
    if isinstance(blend, list):
        return [_table(i, t) for i, t in enumerate(blend)]
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
        out.append((_positive(weight, source, f"data.blend = {blend!r}"), source, {}))
    return out


def _table(i: int, table) -> tuple[float, str, dict]:
    where = f"data.blend[{i}]"
    if not isinstance(table, dict) or not isinstance(table.get("source"), str) or "weight" not in table:
        raise ValueError(f"{where} = {table!r}: each [[data.blend]] table needs weight = NUMBER and "
                         f"source = \"PATH\", e.g. {{weight = 0.7, source = \"data/web\"}}")
    weight = table["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"{where}: weight = {weight!r} is not a number; give e.g. weight = 0.7")
    settings = {k: v for k, v in table.items() if k not in ("weight", "source")}
    for key in settings:
        if key not in BLEND_SETTINGS:
            raise ValueError(f"{where}: '{key}' is not a setting a source of a blend takes."
                             f"{closest(key, BLEND_SETTINGS)} Per source: weight, source, {', '.join(BLEND_SETTINGS)}")
    return _positive(float(weight), table["source"], where), table["source"], settings


def _positive(weight: float, source: str, where: str) -> float:
    if not weight > 0:
        raise ValueError(f"{where}: the weight of {source!r} is {weight:g}; every weight must be positive (leave a "
                         f"source out rather than give it 0)")
    return weight
