"""How the suite compares fp32 results that differ only in summation order (docs/design.md, "Tolerances").

Another BLAS blocking (padded shapes, another CPU's vector width), another split over ranks or micro-batches: the
same sums, added in another order. A sum of n fp32 terms, in any order, is within (n - 1) u sum|terms| of the
exact sum (u = eps / 2; Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4), so two orders
differ by at most (n - 1) eps sum|terms|. Along a chain of matmuls these first-order terms add up, so the bound
for a result is `reduction` x eps, with `reduction` the summed lengths of the reductions on its path.

The comparison is in the norm of the whole tensor: an element that is a near-cancelling sum (a gradient entry of
1e-3 made of terms of 1e-1) has a relative error no elementwise tolerance covers, while the tensor's norm is as
large as its terms. A wrong shard, scale or slice moves a tensor by a fraction of its norm, far above the bound.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2^-23


def order_bound(reduction: int) -> float:
    """The largest relative difference (in norm) of two fp32 evaluations that differ in the order of sums whose
    lengths add up to `reduction` along the result's path."""
    return max(1, reduction) * EPS32


def assert_same_up_to_order(got: torch.Tensor, want: torch.Tensor, reduction: int, what: str = "") -> None:
    """||got - want|| <= order_bound(reduction) x ||want|| (and the same shape and dtype; or both None)."""
    if got is None or want is None:
        assert got is want, (what, got, want)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    err = float((got.detach().double() - want.detach().double()).norm())
    scale = float(want.detach().double().norm())
    assert err <= order_bound(reduction) * scale, (
        f"{what}: |got - want| = {err:.3g} > {order_bound(reduction):.3g} x |want| ({scale:.3g}), "
        f"the bound for reductions of {reduction} in fp32")


def forward_reduction(cfg, seq_len: int) -> int:
    """The summed reduction lengths on a logit's path through a moeflow Transformer (a `ModelConfig`): per layer,
    the norms, the query/key/value and output projections and the MLP's input over dim, the scores over a head's
    width, the values over the sequence, the MLP's output over its hidden width (plus the combine over top_k);
    then the final norm and the head over dim. Widths are bounded by the largest a config names."""
    width = max(cfg.dim, cfg.n_heads * max(cfg.head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim))
    hidden = max(cfg.ffn_dim, cfg.moe.ffn_dim * max(1, cfg.moe.num_shared_experts))
    per_layer = 5 * width + width + seq_len + hidden + cfg.moe.top_k
    return cfg.n_layers * per_layer + 2 * width
