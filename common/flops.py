"""FLOP counting (causal- and window-aware) and the bytes a perfect kernel moves.

Conventions (docs/design.md, "Performance method"): the forward does two GEMMs per visible
(query, key) pair, 2·D FLOPs for S = QKᵀ and 2·Dv for O = PV, so 4·B·Hq·Nq·Nk·D without
masking. Masked pairs are not counted: causal is about half. The backward is 2.5× the
forward (five GEMMs instead of two), whatever a kernel recomputes on top.
"""

from __future__ import annotations

BWD_FACTOR = 2.5


def visible_pairs(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> int:
    """Number of (query, key) pairs that attend, bottom-right aligned, exactly."""
    left, right = window_size
    if causal:
        right = 0
    shift = seqlen_k - seqlen_q
    total = 0
    # Rows fall into at most a few linear pieces; summing per row is O(Nq) and exact.
    for i in range(seqlen_q):
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + shift + right)
        lo = 0 if left < 0 else max(0, i + shift - left)
        if hi >= lo:
            total += hi - lo + 1
    return total


def attention_flops(
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    backward: bool = False,
) -> float:
    """FLOPs of the forward (or backward) pass for the visible pairs."""
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = visible_pairs(seqlen_q, seqlen_k, causal, window_size)
    fwd = 2.0 * batch * heads_q * pairs * (head_dim + dv)
    return fwd * BWD_FACTOR if backward else fwd


def attention_min_bytes(
    batch: int,
    heads_q: int,
    heads_kv: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    head_dim_v: int | None = None,
    *,
    elem_size: int = 2,
    backward: bool = False,
) -> int:
    """Bytes a perfect kernel moves through device memory: each input read once, each output
    written once. Forward: q, k, v in; out and the fp32 LSE out. Backward: q, k, v, out, dout,
    LSE in; dq, dk, dv out."""
    dv = head_dim if head_dim_v is None else head_dim_v
    q = batch * seqlen_q * heads_q * head_dim
    k = batch * seqlen_k * heads_kv * head_dim
    v = batch * seqlen_k * heads_kv * dv
    o = batch * seqlen_q * heads_q * dv
    lse = batch * heads_q * seqlen_q * 4
    if not backward:
        return (q + k + v + o) * elem_size + lse
    return (2 * (q + k + v) + 2 * o) * elem_size + lse
