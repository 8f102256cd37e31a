"""Masking of score blocks: key bounds, causal (a window with right == 0) and sliding windows.

Query row i sees key j iff j < seqlen_k and i + shift - left <= j <= i + shift + right, with
shift = seqlen_k - seqlen_q (bottom-right alignment); `has_right` / `has_left` say at compile
time which window edge exists. `mask_phases` splits a tile's block range into the blocks that
need the mask and those that do not; `apply_mask` writes -inf into one S block. Both take the
tile geometry as arguments, so a kernel that walks the other direction reuses them.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


@cute.jit
def apply_mask(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    n_block: Int32,
    m_block: Int32,
    seqlen_k: Int32,
    shift: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    has_right: cutlass.Constexpr[bool],
    has_left: cutlass.Constexpr[bool],
    query_of=None,
):
    """-inf where the key is past seqlen_k or outside the (causal / local) window.

    `query_of` (optional): the query index of each of the thread's two rows, a tuple indexed
    by r, for tiles whose rows are not consecutive queries (the decode kernel's GQA-packed
    rows, several heads per query token); by default row m_block * tile_m + tile row.

    Element i = 4j + 2r + c of the m64nNk16 C fragment sits in row r of the thread's two
    rows and column col0 + 8j + c. Comparing the compile-time offset 8j + c against one
    per-row limit keeps the column indices out of registers (computing 64 of them per
    thread costs registers the intra-WG overlap needs).
    """
    col0 = n_block * tile_n + tScS[0][1]  # this thread's first column in the block
    for r in cutlass.range_constexpr(2):
        row = m_block * tile_m + tScS[2 * r][0]
        if const_expr(query_of is not None):
            row = query_of[r]
        col_end = seqlen_k
        if const_expr(has_right):
            col_end = cutlass.min(col_end, row + shift + window_right + 1)
        limit_hi = col_end - col0  # offsets >= limit_hi are masked
        limit_lo = Int32(0)
        if const_expr(has_left):
            limit_lo = row + shift - window_left - col0  # offsets < limit_lo are masked
        for j in cutlass.range_constexpr(cute.size(acc_S) // 4):
            for c in cutlass.range_constexpr(2):
                i = 4 * j + 2 * r + c
                off = 8 * j + c
                if const_expr(has_left):
                    out = (limit_hi <= off) | (limit_lo > off)
                    acc_S[i] = Float32(-math.inf) if out else acc_S[i]
                else:
                    acc_S[i] = Float32(-math.inf) if limit_hi <= off else acc_S[i]


@cute.jit
def mask_phases(
    m_block: Int32,
    n_block_min: Int32,
    n_block_max: Int32,
    n_blocks: Int32,  # n_block_max - n_block_min, > 0
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    has_right: cutlass.Constexpr[bool],
    has_left: cutlass.Constexpr[bool],
):
    """The masked-unmasked split of Q tile `m_block`'s blocks [n_block_min, n_block_max) (at
    least one), walked newest first: [n_block_max - 1] masked, then `n_masked_hi` masked blocks,
    `n_unmasked` unmasked ones and `n_masked_lo` masked ones to the end.

    Returns (shift, first_row, n_masked_hi, n_unmasked, n_masked_lo).
    """
    shift = seqlen_k - seqlen_q
    first_row = m_block * tile_m
    last_row = cutlass.min(first_row + tile_m, seqlen_q) - 1
    # Blocks below n_right_free need no right-side (causal/window/seqlen) mask; blocks
    # at or above n_left_free no left-window mask.
    n_right_free = seqlen_k // tile_n
    if const_expr(has_right):
        n_right_free = cutlass.min(
            n_right_free,
            cutlass.max(first_row + shift + window_right + 1, 0) // tile_n,
        )
    n_left_free = n_block_min
    if const_expr(has_left):
        n_left_free = (cutlass.max(last_row + shift - window_left, 0) + tile_n - 1) // tile_n
    # Loop phases, newest block first: [n_block_max-1] masked, then masked blocks
    # down to n_right_free, unmasked ones down to n_left_free, masked ones to the end.
    n_masked_hi = cutlass.max(n_block_max - 1 - cutlass.max(n_right_free, n_block_min), 0)
    n_after = n_blocks - 1 - n_masked_hi
    n_unmasked = cutlass.max(cutlass.min(n_after, n_block_max - 1 - n_masked_hi - n_left_free), 0)
    n_masked_lo = n_after - n_unmasked
    return shift, first_row, n_masked_hi, n_unmasked, n_masked_lo
