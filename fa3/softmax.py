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
from cutlass import Float32, const_expr

from flashsuite.fa3.utils import LN2


@cute.jit
def online_softmax(acc_S: cute.Tensor, row_max, row_sum, scale_log2: Float32, probs=None):
    """Online softmax of one S block (S -> P); returns the O rescale per row.

    Without `probs`: in place (P over S), each row's max and sum one dependency chain. With
    `probs` (a fragment like acc_S): P goes there, acc_S is only read, and the max and sum run
    as four chains (`Fa3Config.softmax_apart`: ptxas treats a write to the Q·Kᵀ accumulator as
    a hazard with the P·V wgmma still in flight and waits for it first).
    """
    corr = cute.make_rmem_tensor((2,), Float32)
    cols = cute.size(acc_S) // 2  # this thread's elements of one row
    for r in cutlass.range_constexpr(2):
        m_blk = row_max[r]
        if const_expr(probs is None):
            for k in cutlass.range_constexpr(cols):
                m_blk = cute.arch.fmax(m_blk, acc_S[_col(k, r)])
        else:
            row = [acc_S[_col(k, r)] for k in range(cols)]
            m_blk = cute.arch.fmax(_chains(row, cute.arch.fmax), m_blk)
        m_new = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)  # the row's quad
        # A row that has seen only masked keys keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_safe = Float32(0.0) if m_new == Float32(-math.inf) else m_new
        m_scaled = m_safe * scale_log2
        corr[r] = cute.math.exp2(row_max[r] * scale_log2 - m_scaled, fastmath=True)
        row_max[r] = m_new
        s = Float32(0.0)
        ps = []
        for k in cutlass.range_constexpr(cols):
            # The scale folded into one FMA: s * scale_log2 - max * scale_log2.
            p = cute.math.exp2(acc_S[_col(k, r)] * scale_log2 - m_scaled, fastmath=True)
            if const_expr(probs is None):
                acc_S[_col(k, r)] = p
                s += p
            else:
                probs[_col(k, r)] = p
                ps.append(p)
        if const_expr(probs is not None):
            s = _chains(ps, lambda a, b: a + b)
        row_sum[r] = row_sum[r] * corr[r] + s
    return corr


def _col(k: int, r: int) -> int:
    """Index in the C fragment of the thread's k-th element of its row r (of two)."""
    return 4 * (k // 2) + 2 * r + k % 2


def _chains(values: list, op: Callable):
    """op over `values` (DSL scalars, at trace time) as four interleaved dependency chains,
    joined pairwise at the end: a quarter of one chain's latency."""
    lanes = list(values[:4])
    for k in range(len(lanes), len(values)):
        lanes[k % 4] = op(lanes[k % 4], values[k])
    while len(lanes) > 1:
        lanes = [op(*lanes[k : k + 2]) if k + 1 < len(lanes) else lanes[k]
                 for k in range(0, len(lanes), 2)]  # fmt: skip
    return lanes[0]


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
