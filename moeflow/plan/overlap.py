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


def moe_layer_seconds(dispatch_s: float, experts_s: float, combine_s: float, shared_s: float, chunks: int,
                      counts_s: float | None = None) -> float:
    """Wall seconds of one pass over an MoE layer's experts: `dispatch_s`, `experts_s` and `combine_s` are one
    chunk's, `shared_s` the shared experts' (all tokens). chunks = 0: nothing overlaps (the trainer's
    `parallel.ep_overlap = false`), one chunk's work run back to back. `counts_s`: each dispatch first exchanges
    its counts and the host waits for them (exact receive sizes, `parallel.ep_num_worst_tokens = 0`), behind
    whatever the communication engine has queued, before it issues anything more; None for static sizes."""
    if chunks <= 0:
        return (counts_s or 0.0) + dispatch_s + shared_s + experts_s + combine_s
    comm_free = 0.0  # when the communication engine is next idle
    host = 0.0  # when the host issues its next operation

    def communicate(ready: float, seconds: float) -> float:
        nonlocal comm_free
        comm_free = max(comm_free, ready) + seconds
        return comm_free

    def dispatch() -> float:
        nonlocal host
        if counts_s is not None:
            host = communicate(host, counts_s)  # the host sync: the split sizes must reach the host
        return communicate(host, dispatch_s)

    arrived = [dispatch()]
    compute_free = host + shared_s  # the shared experts run while the first dispatch is in flight
    last_combine = 0.0
    for i in range(chunks):
        if i + 1 < chunks:
            arrived.append(dispatch())
        compute_free = max(compute_free, arrived[i], host) + experts_s
        last_combine = communicate(compute_free, combine_s)
    return max(compute_free, last_combine)


def exposed_ep_seconds(dispatch_s: float, chunk_experts_s: float, combine_s: float, shared_s: float, chunks: int,
                       experts_s: float, counts_s: float | None = None,
                       backward_factor: float = 2.0) -> tuple[float, float]:
    """(forward, backward) seconds one MoE layer takes beyond its unchunked compute: `dispatch_s`, `combine_s`
    and `chunk_experts_s` per chunk (a chunk's expert matmuls read all the weights again, so chunks cost compute
    too), `experts_s` / `shared_s` the forward's whole-layer compute. The backward moves the same bytes the other
    way with no count exchange (the handle has the sizes) and `backward_factor` times the compute (2: input and
    weight gradients; 1 under a zero-bubble schedule, which runs the weight gradients later)."""
    k = backward_factor
    forward = (moe_layer_seconds(dispatch_s, chunk_experts_s, combine_s, shared_s, chunks, counts_s)
               - experts_s - shared_s)
    backward = (moe_layer_seconds(combine_s, k * chunk_experts_s, dispatch_s, k * shared_s, chunks)
                - k * (experts_s + shared_s))
    return forward, backward
