"""The online softmax of FlashAttention in base 2, on wgmma C fragments (either direction).

A thread holds two rows of an m64nNk16 C fragment: element i = 4j + 2r + c sits in row r of its
two rows and column 8j + c of the block; a row's four owners are one quad of lanes. Scores are
raw (unscaled): `scale_log2` = log2(e) x softmax scale is folded into one FMA per element. Row
statistics: `row_max` (raw-score max) and `row_sum` (this thread's partial sum of P), two each.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flashsuite.fa3.utils import LN2


@cute.jit
def online_softmax(acc_S: cute.Tensor, row_max, row_sum, scale_log2: Float32):
    """Online softmax of one S block in place (S -> P); returns the O rescale per row."""
    corr = cute.make_rmem_tensor((2,), Float32)
    for r in cutlass.range_constexpr(2):
        m_blk = row_max[r]
        for j in cutlass.range_constexpr(cute.size(acc_S) // 4):
            for c in cutlass.range_constexpr(2):
                m_blk = cute.arch.fmax(m_blk, acc_S[4 * j + 2 * r + c])
        m_new = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)  # the row's quad
        # A row that has seen only masked keys keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = Float32(0.0) if m_new == Float32(-math.inf) else m_new
        m_scaled = m_safe * scale_log2
        corr[r] = cute.math.exp2(row_max[r] * scale_log2 - m_scaled, fastmath=True)
        row_max[r] = m_new
        s = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(acc_S) // 4):
            for c in cutlass.range_constexpr(2):
                i = 4 * j + 2 * r + c
                # The scale folded into one FMA: s * scale_log2 - max * scale_log2.
                p = cute.math.exp2(acc_S[i] * scale_log2 - m_scaled, fastmath=True)
                acc_S[i] = p
                s += p
        row_sum[r] = row_sum[r] * corr[r] + s
    return corr


@cute.jit
def rescale_rows(acc: cute.Tensor, corr: cute.Tensor):
    """acc (a C fragment, e.g. acc_O) times corr[r] in each of the thread's two rows."""
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for r in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(2):
                acc[4 * j + 2 * r + c] = acc[4 * j + 2 * r + c] * corr[r]


@cute.jit
def finalize_row(
    row_max: Float32, row_sum: Float32, scale_log2: Float32, o_scale: Callable
) -> tuple:
    """(what multiplies the row of O, its LSE in natural log) once every block is done.

    `o_scale(1/l)` gives the O factor of a row with softmax sum l > 0 (1/l, or times the fp8
    descale of V); an empty row (l = 0: it saw no key) gets 0 and LSE -inf, never NaN.
    """
    l_tot = cute.arch.warp_reduction_sum(row_sum, threads_in_group=4)
    empty = l_tot == Float32(0.0)
    inv = Float32(0.0) if empty else o_scale(cute.arch.rcp_approx(l_tot))
    lse = (row_max * scale_log2 + cute.math.log2(l_tot, fastmath=True)) * LN2
    lse = Float32(-math.inf) if empty else lse
    return inv, lse
