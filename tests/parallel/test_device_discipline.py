"""Every tensor the EP, MoE, parallel and training code creates is on the device of the data it works on.

On a CPU any device is the CPU, so a factory call that forgets `device=` passes every other test and fails only
on the first GPU run (a CPU index tensor used to index CUDA data). This test reads the source instead: every
call of a torch tensor factory (torch.arange, zeros, empty, ones, full, tensor, randn, ...) must pass `device=`,
or be derived from a tensor (`*_like`, `x.new_*`, which it does not list), or be on the allow-list below with the
reason it belongs on the host.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.cli import REPO

ROOT = REPO
SCANNED = ["moeflow/ep", "moeflow/models/moe.py", "moeflow/parallel", "moeflow/train"]
FACTORIES = {"arange", "zeros", "empty", "ones", "full", "tensor", "randn", "rand", "randint", "eye", "linspace",
             "as_tensor", "randperm", "empty_strided"}

# (file, enclosing function, factory) -> why it is created where it is.
ALLOWED = {
    ("moeflow/ep/counts.py", "copies", "arange"):
        "byte accounting on the host: `copies` moves topk_idx to the CPU first (docs/ep-bytes.md counts)",
    ("moeflow/models/moe.py", "__init__", "zeros"):
        "a module buffer made at construction; modules move to their device with model.to / to_empty",
    ("moeflow/models/moe.py", "__init__", "empty"):
        "module parameters made at construction; modules move to their device with model.to / to_empty",
    ("moeflow/train/hf_sharded.py", "load_owned", "empty"):
        "a host staging buffer for a tensor read from a safetensors file, copied into the device shard after",
    ("moeflow/train/state_dict.py", "placeholders", "zeros"):
        "the DCP placeholder of AdamW's `step`, which torch's AdamW keeps as a CPU scalar (not fused/capturable)",
}


def factory_calls(path: Path, root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(file, line, enclosing function, factory) of each torch.<factory>(...) call without device=."""
    rel = str(path.relative_to(root))
    found, stack = [], []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            stack.append(node.name)
            self.generic_visit(node)
            stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node):
            fn = node.func
            if (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "torch"
                    and fn.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords)):
                found.append((rel, node.lineno, stack[0] if stack else "<module>", fn.attr))
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text()))
    return found


def scanned_files() -> list[Path]:
    out = []
    for entry in SCANNED:
        path = ROOT / entry
        out += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return out


def test_the_scanner_finds_a_call_without_device(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("import torch\n\ndef f(x):\n    return torch.arange(3), torch.zeros(2, device=x.device)\n")
    assert factory_calls(src, tmp_path) == [("probe.py", 4, "f", "arange")]


def test_every_tensor_factory_names_its_device():
    calls = [c for f in scanned_files() for c in factory_calls(f)]
    bad = [f"{file}:{line} torch.{name}(...) in {fn}() has no device=" for file, line, fn, name in calls
           if (file, fn, name) not in ALLOWED]
    assert bad == [], "\n".join(bad)
    used = {(file, fn, name) for file, _, fn, name in calls}
    assert set(ALLOWED) <= used, f"allow-list entries that match nothing any more: {set(ALLOWED) - used}"


def test_host_sync_counter_sees_each_kind():
    """tests/support/host_syncs.py (which guards the static EP path at zero) counts each kind of host sync, and nothing
    for work that stays on the device."""
    import torch

    from tests.support.host_syncs import count_host_syncs

    x = torch.arange(6.0)
    with count_host_syncs() as quiet:
        (x * 2).sum()
        x.new_full((1,), 3)
    assert sum(quiet.values()) == 0, dict(quiet)
    with count_host_syncs() as counts:
        x.sum().item()
        x.tolist()
        torch.tensor([len(x)])
        x.nonzero()
        x[x > 2]
        bool(x[0])
    # (item and bool are also seen as aten._local_scalar_dense underneath: one sync, two layers)
    want = {"Tensor.item", "Tensor.tolist", "torch.tensor(host data)", "aten.nonzero.default", "boolean indexing",
            "Tensor.__bool__"}
    assert set(counts) - {"aten._local_scalar_dense.default"} == want, dict(counts)
    assert all(counts[k] == 1 for k in want), dict(counts)
