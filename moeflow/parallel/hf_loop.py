"""How a transformers base model's forward runs its layers, read from that forward's source (Python's ast).

A pipeline stage runs the architecture's own forward with the other stages' layers replaced by placeholders
(moeflow.parallel.hf_pipeline), so it needs to know what flows from one layer to the next beside the hidden states,
and what the forward reads of the model before and after its loop over the layers:

    loop = layer_loop(type(model.model))     # None where the forward has no single `layer(...)` call in a loop
    loop.carried    ('topk_indices',)        what each layer returns beside the hidden states, for the next one
    loop.slots      ('prev_topk_indices',)   where each goes into the next layer's call: a keyword or a position
    loop.unsupported                         why a stage boundary cannot carry what the layers share ('' if it can),
                                             but for an object they write into and read back, which is
    loop.shared     'shared_kv_states'       that object's name (a key-value sharing dict: whether a split must
    loop.sharing                             carry it depends on the config; moeflow.parallel.hf_pipeline), and why
    loop.reads_ids                           the layers take token ids (hash routing, per-layer embeddings)
    loop.before / loop.after                 attributes of the base model read only before / only after the loop
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerLoop:
    line: str  # the call's source, as far as its first line
    carried: tuple[str, ...] = ()
    slots: tuple[int | str, ...] = ()
    unsupported: str = ""
    shared: str = ""
    sharing: str = ""
    reads_ids: bool = False
    before: frozenset[str] = frozenset()
    after: frozenset[str] = frozenset()


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _self_attributes(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _assigned(nodes) -> dict[str, ast.AST]:
    """{name: the value assigned to it} over the assignments among `nodes`."""
    out = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _names(target):
                    out[name] = node.value
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node.value
    return out


@functools.cache  # read once per class: the refusals, the stage split and the tp / cp checks all ask
def layer_loop(model_class: type) -> LayerLoop | None:
    """The loop of `model_class.forward` over `self.layers` (module docstring); None where there is none to read."""
    try:
        source = textwrap.dedent(inspect.getsource(model_class.forward))
    except (OSError, TypeError):
        return None
    body = ast.parse(source).body[0]
    loops = [n for n in ast.walk(body) if isinstance(n, ast.For) and "layers" in _self_attributes(n.iter)]
    if len(loops) != 1:
        return None
    (loop,) = loops
    layer = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
             and isinstance(n.value.func, ast.Name) and isinstance(layer, ast.Name) and n.value.func.id == layer.id]
    if len(calls) != 1:
        return None
    (assign,) = calls
    call = assign.value
    line = ast.get_source_segment(source, assign).splitlines()[0]
    target = assign.targets[0]
    outputs = [e.id for e in target.elts if isinstance(e, ast.Name)] if isinstance(target, ast.Tuple) else []
    carried = tuple(outputs[1:])
    slots, unsupported, shared, sharing = [], "", "", ""
    for name in carried:
        slot = [i for i, a in enumerate(call.args) if isinstance(a, ast.Name) and a.id == name]
        slot += [k.arg for k in call.keywords if k.arg and isinstance(k.value, ast.Name) and k.value.id == name]
        if len(slot) != 1:
            unsupported = f"`{name}`, which one layer returns, goes back into the next one other than as an argument"
        slots.append(slot[0] if slot else 0)
    hidden_in = _names(call.args[0]) if call.args else set()
    passed = set().union(*(_names(a) for a in call.args), *(_names(k.value) for k in call.keywords))
    inside = _assigned(n for n in ast.walk(loop) if getattr(n, "lineno", 0) > assign.end_lineno)  # after the call
    before = _assigned(n for stmt in body.body if stmt.end_lineno < loop.lineno for n in ast.walk(stmt))
    arguments = {a.arg for a in (*body.args.args, *body.args.kwonlyargs)}  # (the caller's cache, not ours)
    states = hidden_in | set(outputs)
    for name in sorted(passed - states - set(carried) - arguments):
        if name in inside and _names(inside[name]) & (states | {name}):
            unsupported = unsupported or (f"its loop builds `{name}` from the layers' outputs and hands it to the "
                                          f"later layers")
        value = before.get(name)  # an object every layer writes into (keys and values shared across layers)
        if not shared and isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and \
                value.func.id[:1].isupper():
            shared, sharing = name, f"its layers share `{name}` ({value.func.id}), which they write into and read back"
    statements = [s for s in body.body if s is not loop]
    # read before the loop, into the hidden states (not into what the layers take beside them, which the placeholder
    # token ids of a later stage would change: per-layer inputs computed from the ids)
    feeds_layers = passed - hidden_in
    read_before = set().union(*(_self_attributes(s) for s in statements if s.end_lineno < loop.lineno
                                and not set(_assigned(ast.walk(s))) & feeds_layers))
    read_after = set().union(*(_self_attributes(s) for s in statements if s.lineno > loop.end_lineno))
    read_inside = _self_attributes(loop) | set().union(
        *(_self_attributes(s) for s in statements if s.lineno <= loop.lineno <= s.end_lineno))
    reads_ids = any(n.endswith("input_ids") for n in passed | {k.arg or "" for k in call.keywords})
    return LayerLoop(line.strip(), carried, tuple(slots), unsupported, shared, sharing, reads_ids,
                     frozenset(read_before - read_after - read_inside),
                     frozenset(read_after - read_before - read_inside))


def carried_state(model_class: type) -> str | None:
    """The call of the base model's forward whose layer returns more than the hidden states (state one layer passes
    to the next, such as an indexer's top-k selection); None where its layers return only the hidden states."""
    loop = layer_loop(model_class)
    return loop.line if loop is not None and loop.carried else None


def carries_state(model) -> bool:
    """Whether a transformers model's layers hand each other more than the hidden states (carried_state)."""
    base = getattr(model, "model", None)
    return base is not None and carried_state(type(base)) is not None
