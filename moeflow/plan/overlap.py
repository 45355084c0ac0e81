"""What the trainer's in-layer expert-parallel overlap hides: a two-engine schedule of one MoE layer.

The trainer's MoE layer (moeflow.models.moe.MoE.forward with moeflow.parallel.expert's dispatcher, settings
`parallel.ep_overlap` and `parallel.ep_overlap_chunks = N`) splits its tokens into N chunks and issues, in
program order: dispatch 0; the shared experts; then for each chunk i: dispatch i+1, wait for dispatch i, the
experts of chunk i, combine i. Backward runs the mirror image (the combine's backward moves gradients the way a
dispatch moves tokens, and the other way round), with twice the expert work (input and weight gradients).

The model gives communication and compute each an engine of its own, as on a GPU (a communication stream whose
kernels hold some SMs, or copy engines), each running its work in issue order; a chunk's experts wait for its
dispatch, its combine for its experts. On this project's CPU benchmark machine the two share the same cores, so
nothing is hidden there (bench/ep_overlap.py measures both). The per-chunk times include each collective's
latency, so more chunks pay it more often.
"""

from __future__ import annotations


def moe_layer_seconds(dispatch_s: float, experts_s: float, combine_s: float, shared_s: float,
                      chunks: int) -> float:
    """Wall seconds of one pass over an MoE layer's experts: `dispatch_s`, `experts_s` and `combine_s` are one
    chunk's, `shared_s` the shared experts' (all tokens). chunks = 0: nothing overlaps (the trainer's
    `parallel.ep_overlap = false`), one chunk's work run back to back."""
    if chunks <= 0:
        return dispatch_s + shared_s + experts_s + combine_s
    comm_free = 0.0  # when the communication engine is next idle

    def communicate(ready: float, seconds: float) -> float:
        nonlocal comm_free
        comm_free = max(comm_free, ready) + seconds
        return comm_free

    arrived = [communicate(0.0, dispatch_s)]
    compute_free = shared_s  # the shared experts run while the first dispatch is in flight
    last_combine = 0.0
    for i in range(chunks):
        if i + 1 < chunks:
            arrived.append(communicate(0.0, dispatch_s))
        compute_free = max(compute_free, arrived[i]) + experts_s
        last_combine = communicate(compute_free, combine_s)
    return max(compute_free, last_combine)


def exposed_ep_seconds(dispatch_s: float, experts_s: float, combine_s: float, shared_s: float,
                       chunks: int) -> tuple[float, float]:
    """(forward, backward) communication seconds one MoE layer adds to its compute: the layer's wall time less
    its expert compute. `dispatch_s` / `combine_s` per chunk; `experts_s` / `shared_s` the forward's whole-layer
    compute (the backward's is twice)."""
    n = max(chunks, 1)
    forward = moe_layer_seconds(dispatch_s, experts_s / n, combine_s, shared_s, chunks) - experts_s - shared_s
    backward = (moe_layer_seconds(combine_s, 2 * experts_s / n, dispatch_s, 2 * shared_s, chunks)
                - 2 * (experts_s + shared_s))
    return forward, backward
