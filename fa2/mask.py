"""Pieces shared by the fa2 forward and backward kernels: the score transform (softcap) and
the masking (bottom-right causal, sliding window, sequence tails).

Masking splits each K/V (forward, dQ) or Q (dK/dV) loop into three stages: masked blocks
before, unmasked blocks (no `tl.where`), masked blocks after; `_key_range` and
`_query_range` give the stage boundaries of one tile, `_visible` the element mask inside a
masked stage. Blocks that nobody in the tile can see are never visited.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Specialising seqlens / window sizes on divisibility would only multiply the binaries: the
# kernels never use those hints (strides, which do matter for vector loads, stay specialised).
_NO_SPEC = ["seqlen_q", "seqlen_k", "shift", "window_left", "window_right"]


@triton.jit
def _tanh(x):
    """tanh with exp2 only (identical on the interpreter and the GPU), ~1e-7 relative."""
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)  # exp(-2|x|), never overflows
    big = (1.0 - e) / (1.0 + e)
    # Near 0, 1 - e cancels: a short Taylor series is exact to fp32 there.
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333 + x2 * (0.1333333333 + x2 * -0.0539682540)))
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(qk, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """Raw q·k (fp32) -> (score in the log2 domain, tanh value for the softcap backward)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)  # qk_scale = scale / softcap
        return t * softcap_log2, t  # softcap_log2 = softcap * log2(e)
    else:
        return qk * qk_scale, qk  # qk_scale = scale * log2(e)


@triton.jit
def _visible(
    q_idx,
    k_idx,
    seqlen_k,
    shift,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Bool, broadcast of q_idx and k_idx: key in range, and inside the (bottom-right) window."""
    ok = k_idx < seqlen_k
    if HAS_RIGHT:
        ok = ok & (k_idx <= q_idx + shift + window_right)
    if HAS_LEFT:
        ok = ok & (k_idx >= q_idx + shift - window_left)
    return ok


@triton.jit
def _key_range(
    start_m,
    seqlen_q,
    seqlen_k,
    shift,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Key blocks for the Q rows [start_m, start_m + BLOCK_M): lo <= full_lo <= full_hi <= hi.

    [lo, full_lo) and [full_hi, hi) need a mask; [full_lo, full_hi) is visible to every row
    and inside seqlen_k. Key blocks outside [lo, hi) are invisible to every row and skipped.
    Divisions only see non-negative numerators (integer division truncates on the GPU).
    """
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = start_m * 0
    hi = start_m * 0 + seqlen_k
    full_lo = lo
    full_hi = hi // BLOCK_N * BLOCK_N  # the key tail is always masked
    if HAS_LEFT:
        lo = tl.maximum(start_m + shift - window_left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_m + shift - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last_m + shift + window_right + 1, 0), seqlen_k)
        full_hi = tl.minimum(
            full_hi, tl.maximum(start_m + shift + window_right + 1, 0) // BLOCK_N * BLOCK_N
        )
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(
    start_n,
    seqlen_q,
    seqlen_k,
    shift,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Q blocks that see the keys [start_n, start_n + BLOCK_N): lo <= full_lo <= full_hi <= hi.

    Query i sees key j iff j - shift - right <= i <= j - shift + left. [full_lo, full_hi) are
    Q blocks inside seqlen_q where every row sees every key of a block inside seqlen_k.
    """
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    lo = start_n * 0
    hi = start_n * 0 + seqlen_q
    full_lo = lo
    full_hi = hi // BLOCK_M * BLOCK_M  # the query tail is always masked
    if HAS_RIGHT:
        lo = tl.maximum(start_n - shift - window_right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last_n - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(tl.maximum(last_n - shift + window_left + 1, 0), seqlen_q)
        full_hi = tl.minimum(
            full_hi, tl.maximum(start_n - shift + window_left + 1, 0) // BLOCK_M * BLOCK_M
        )
    # A key block that runs past seqlen_k is masked for every Q block.
    full_hi = tl.where(start_n + BLOCK_N <= seqlen_k, full_hi, lo)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
