"""A fake `deep_ep` package (deep_ep/ here) that asserts DeepEP V1's Buffer contract and moves tokens with gloo."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent / "deep_ep"


def install() -> ModuleType:
    """Put the fake in sys.modules as `deep_ep`, where `import deep_ep` looks first; returns it."""
    spec = importlib.util.spec_from_file_location("deep_ep", PACKAGE / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_ep"] = module
    spec.loader.exec_module(module)
    return module


def uninstall() -> None:
    for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
        del sys.modules[name]
