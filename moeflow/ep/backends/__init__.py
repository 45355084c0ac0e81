"""EP backends: how rows move between ranks. All return identical tensors (see base.py for the order)."""

from __future__ import annotations

from moeflow.ep.backends.allgather import AllgatherBackend
from moeflow.ep.backends.alltoall import AlltoallBackend
from moeflow.ep.backends.base import Topology
from moeflow.ep.backends.hierarchical import HierarchicalBackend

BACKENDS = {"alltoall": AlltoallBackend, "hierarchical": HierarchicalBackend, "allgather": AllgatherBackend}


def make_backend(name: str, topo: Topology):
    return BACKENDS[name](topo)
