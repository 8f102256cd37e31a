"""The online softmax of FlashAttention in base 2, on wgmma C fragments (either direction).

A thread holds two rows of an m64nNk16 C fragment: element i = 4j + 2r + c sits in row r of its
two rows and column 8j + c of the block; a row's four owners are one quad of lanes. Scores are
raw (unscaled): `scale_log2` = log2(e) x softmax scale is folded into one FMA per element. Row
statistics: `row_max` (raw-score max) and `row_sum` (this thread's partial sum of P), two each.

`exp2_poly` computes 2^x on the FMA pipe (a cubic for the fraction, the integer part added to
the exponent bits), so a share of a block's exponentials can leave the MUFU unit (16 per clock
and SM, which at D = 64 in 16 bits and D = 128 in e4m3 is exactly the rate at which the tensor
cores consume scores): `Fa3Config.ex2_emu` picks the share.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from flashsuite.fa3.utils import LN2, nanosleep_zero, ptx

# 2^f ~ 1 + f (C1 + f (C2 + f C3)) on f in [-1/2, 1/2]: fp32 coefficients fitted to the
# relative error (max 1.02e-4 after fp32 rounding, tests/test_fa3_softmax_options.py), with the
# constant term exactly 1 so that 2^-127 comes out as +0 (`exp2_poly`).
EXP2_POLY = (0.6932829022407532, 0.24221037328243256, 0.05500858649611473)
# exp2_poly's input floor: -inf (a masked score) and anything below give +0 exactly.
EXP2_POLY_FLOOR = -127.0
_ROUND_MAGIC = 12582912.0  # 1.5 x 2^23: x + it rounds x to an integer in the low mantissa bits


def _f32_hex(x: float) -> str:
    """PTX's exact spelling of an fp32 constant (0fXXXXXXXX)."""
    import struct

    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return f"0f{bits:08X}"


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and integer pipes, no MUFU: x clamped to >= -127, split as n + f with n =
    round(x) by the 1.5 x 2^23 trick (n lands in the low mantissa bits of x + 1.5 x 2^23) and
    f in [-1/2, 1/2], the cubic EXP2_POLY for 2^f, and n << 23 added to its bits (the
    exponent). At x = -127 (and -inf) n = -127 and f = 0, so 1.0's bits minus 127 << 23 are
    +0 exactly: a masked score gives P = 0, and a fully masked row's sum stays 0. Between
    -127 and -126 the result is a subnormal below 2^-126 (f >= 0 there, so the bits never
    wrap). Nine PTX instructions (max, 3 add / sub, 3 fma, shl, add; ptxas fuses the last two
    into one IMAD: 8 in SASS) against one MUFU.EX2; relative error <= 1.02e-4 for x in
    [-126, 0]."""
    c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    magic, floor, one = _f32_hex(_ROUND_MAGIC), _f32_hex(EXP2_POLY_FLOOR), _f32_hex(1.0)
    return Float32(
        ptx(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "{ .reg .f32 xc, t, r, f, p;\n"
            ".reg .b32 n, b;\n"
            f"max.f32 xc, $1, {floor};\n"
            f"add.rn.f32 t, xc, {magic};\n"
            f"sub.rn.f32 r, t, {magic};\n"
            "sub.rn.f32 f, xc, r;\n"
            f"fma.rn.f32 p, f, {c3}, {c2};\n"
            f"fma.rn.f32 p, p, f, {c1};\n"
            f"fma.rn.f32 p, p, f, {one};\n"
            "mov.b32 n, t;\n"
            "shl.b32 n, n, 23;\n"
            "mov.b32 b, p;\n"
            "add.s32 b, b, n;\n"
            "mov.b32 $0, b; }",
            "=f,f",
            side_effects=False,
        )
    )


def exp2_poly_model(x):
    """`exp2_poly` on the CPU (numpy float32, the same operations in the same order): the
    tests' model of the device function."""
    import numpy as np

    f32 = np.float32
    xc = np.maximum(np.asarray(x, dtype=f32), f32(EXP2_POLY_FLOOR))
    t = (xc + f32(_ROUND_MAGIC)).astype(f32)
    f = (xc - (t - f32(_ROUND_MAGIC)).astype(f32)).astype(f32)
    c1, c2, c3 = (f32(c) for c in EXP2_POLY)

    def fma(a, b, c):  # one rounding, as fma.rn (the fp32 product is exact in float64)
        return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(f32)

    p = fma(f, c3, c2)
    p = fma(p, f, c1)
    p = fma(p, f, 1.0)
    n = (t.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    return (p.view(np.uint32) + n).astype(np.uint32).view(f32)


def emulated(k: int, every: int) -> bool:
    """Whether element k of a thread's row takes `exp2_poly` under Fa3Config.ex2_emu = every:
    the last of each run of `every` (k = every - 1, 2 every - 1, ...); 0: none."""
    return every > 0 and k % every == every - 1


@cute.jit
def online_softmax(
    acc_S: cute.Tensor,
    row_max,
    row_sum,
    scale_log2: Float32,
    probs=None,
    ex2_emu: cutlass.Constexpr[int] = 0,
    rescale_threshold: cutlass.Constexpr[int] = 0,
    skip_unit_rescale: cutlass.Constexpr[bool] = False,
    chains: cutlass.Constexpr[bool] = False,
    row_scale=None,
    pv_wait_after_max: cutlass.Constexpr[bool] = False,
    exps_before_wait: cutlass.Constexpr[int] = 0,
):
    """Online softmax of one S block (S -> P); returns the O rescale per row.

    `pv_wait_after_max` (Fa3Config.pv_wait_after_max, the overlapped loop's softmax of S(n)
    with P·V(n - 1) in flight): both rows' max, rescale and exponents (s * scale - max, into
    registers apart from acc_S) first, then a never-taken branch (a basic block ends there, so
    ptxas cannot raise what follows above it), then the wait for every wgmma of the warpgroup
    (P·V), then the exponentials and sums. Off, each row's max is followed by its own
    exponentials, and no wgmma is waited for here.

    `row_scale` (fp8 block scales): a pair of positive Float32, what multiplies each of the
    thread's two rows of raw scores in this block in place of `scale_log2` (scale_log2 times
    the row's descale of q and the block's descale of k). The scale then changes from block to
    block, so `row_max` is kept in scaled (log2) units: a block's max is its raw max times the
    row's scale (positive, so the max commutes with it), and the LSE takes scale_log2 = 1.

    `rescale_threshold` t > 0 (Fa3Config.rescale_threshold): a row keeps its running max while
    the block's max exceeds it by at most t in log2 units (P then stays <= 2^t), and its
    rescale is exactly 1.0, so O needs no rescale (`needs_rescale`) unless some row's max grew
    by more. The row sum and the LSE use the max actually subtracted, so the result is the
    same up to rounding. `skip_unit_rescale` (Fa3Config.skip_unit_rescale, threshold 0): a
    row whose max did not move gets a rescale of exactly 1.0 by a select rather than exp2 of
    max * scale_log2 - max * scale_log2 (which ptxas contracts into an FFMA whose rounding
    residual is not 0), so `needs_rescale` can skip O's rescale.

    `ex2_emu` (Fa3Config.ex2_emu): every ex2_emu-th P of a row by `exp2_poly` (`emulated`),
    the rest by MUFU.EX2; 0: all by MUFU.

    Without `probs`: in place (P over S), each row's max and sum one dependency chain, or four
    with `chains` (Fa3Config.row_chains). With `probs` (a fragment like acc_S): P goes there,
    acc_S is only read, and the max and sum run as four chains (`Fa3Config.softmax_apart`:
    ptxas treats a write to the Q·Kᵀ accumulator as a hazard with the P·V wgmma still in
    flight and waits for it first).
    """
    corr = cute.make_rmem_tensor((2,), Float32)
    cols = cute.size(acc_S) // 2  # this thread's elements of one row
    xs = [None, None]  # pv_wait_after_max: each row's exponents, from phase 0 to phase 1
    for phase in cutlass.range_constexpr(2 if pv_wait_after_max else 1):
        for r in cutlass.range_constexpr(2):
            if const_expr(not pv_wait_after_max or phase == 0):
                scale = scale_log2  # what multiplies a raw score of this row
                unit = scale_log2  # what takes row_max to log2 units
                m_new = row_max[r]
                if const_expr(row_scale is not None):
                    scale, unit = row_scale[r], Float32(1.0)
                    row = [acc_S[_col(k, r)] for k in range(cols)]
                    m_raw = cute.arch.warp_reduction_max(
                        _chains(row, cute.arch.fmax), threads_in_group=4
                    )
                    m_new = cute.arch.fmax(m_raw * scale, row_max[r])
                else:
                    m_blk = row_max[r]
                    if const_expr(probs is None and not chains):
                        for k in cutlass.range_constexpr(cols):
                            m_blk = cute.arch.fmax(m_blk, acc_S[_col(k, r)])
                    else:
                        row = [acc_S[_col(k, r)] for k in range(cols)]
                        m_blk = cute.arch.fmax(_chains(row, cute.arch.fmax), m_blk)
                    m_new = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)  # the quad
                kept = False
                if const_expr(rescale_threshold > 0):
                    # False where the old max is -inf (growth +inf, or NaN when both are -inf).
                    kept = (m_new - row_max[r]) * unit <= Float32(rescale_threshold)
                    m_new = row_max[r] if kept else m_new
                # A row that has seen only masked keys keeps m = -inf; use 0 so exp2 gives 0,
                # not NaN.
                m_safe = Float32(0.0) if m_new == Float32(-math.inf) else m_new
                m_scaled = m_safe * unit
                corr[r] = cute.math.exp2(row_max[r] * unit - m_scaled, fastmath=True)
                if const_expr(rescale_threshold > 0):
                    corr[r] = Float32(1.0) if kept else corr[r]
                elif const_expr(skip_unit_rescale):
                    # Both -inf (no key seen yet) counts as unmoved: O and the row sum are 0.
                    corr[r] = Float32(1.0) if m_new == row_max[r] else corr[r]
                row_max[r] = m_new
                if const_expr(pv_wait_after_max):  # the exponents too, before P·V's wait
                    xs[r] = [acc_S[_col(k, r)] * scale - m_scaled for k in range(cols)]
                    for k in cutlass.range_constexpr(min(exps_before_wait, cols)):
                        xs[r][k] = _exp2(xs[r][k], emulated(k, ex2_emu))
            if const_expr(not pv_wait_after_max or phase == 1):
                s = Float32(0.0)
                ps = []
                for k in cutlass.range_constexpr(cols):
                    # The scale folded into one FMA: s * scale_log2 - max * scale_log2.
                    x = (
                        xs[r][k]
                        if const_expr(pv_wait_after_max)
                        else acc_S[_col(k, r)] * scale - m_scaled
                    )
                    early = pv_wait_after_max and k < exps_before_wait  # x is P already
                    p = x if early else _exp2(x, emulated(k, ex2_emu))
                    if const_expr(probs is None):
                        acc_S[_col(k, r)] = p
                        if const_expr(chains):
                            ps.append(p)
                        else:
                            s += p
                    else:
                        probs[_col(k, r)] = p
                        ps.append(p)
                if const_expr(probs is not None or chains):
                    s = _chains(ps, lambda a, b: a + b)
                row_sum[r] = row_sum[r] * corr[r] + s
        if const_expr(pv_wait_after_max and phase == 0):
            # corr is never NaN: the branch never runs, but a basic block ends here.
            if corr[0] != corr[0]:
                nanosleep_zero()
            warpgroup.wait_group(0)
    return corr


@cute.jit
def speculative_softmax(
    acc_S: cute.Tensor,
    row_max,
    row_sum,
    scale_log2: Float32,
    probs: cute.Tensor,
    ex2_emu: cutlass.Constexpr[int],
    rescale_threshold: cutlass.Constexpr[int],
    chains: cutlass.Constexpr[bool],
):
    """online_softmax's result (in place, `rescale_threshold` t > 0) with P in `probs`, its
    exponentials taken against each row's running max beside the block's max
    (Fa3Config.spec_exps). A row that keeps its max (the block's exceeds it by at most t) has
    exactly these P; where every row of the warp keeps it (a warp-uniform vote) they are the
    block's, their sums in online_softmax's order (`chains`: four chains, else one). Otherwise
    online_softmax itself runs on acc_S (unchanged until then) and P is copied to `probs`. So
    the output is online_softmax's bit for bit; the row max's latency leaves the exponentials'
    path, its instructions stay. A row that has seen no key yet (max -inf) counts as grown."""
    corr = cute.make_rmem_tensor((2,), Float32)
    cols = cute.size(acc_S) // 2
    kept = [None, None]
    for r in cutlass.range_constexpr(2):
        m_old = row_max[r]
        m_scaled = (Float32(0.0) if m_old == Float32(-math.inf) else m_old) * scale_log2
        for k in cutlass.range_constexpr(cols):
            x = acc_S[_col(k, r)] * scale_log2 - m_scaled
            probs[_col(k, r)] = _exp2(x, emulated(k, ex2_emu))
        row = [acc_S[_col(k, r)] for k in range(cols)]
        m_blk = cute.arch.fmax(_chains(row, cute.arch.fmax), m_old)
        m_new = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)  # the quad
        kept[r] = (m_new - m_old) * scale_log2 <= Float32(rescale_threshold)
    if cute.arch.vote_all_sync(kept[0] & kept[1]):
        for r in cutlass.range_constexpr(2):
            corr[r] = Float32(1.0)
            row_sum[r] = row_sum[r] + _row_sum([probs[_col(k, r)] for k in range(cols)], chains)
    else:
        c = online_softmax(
            acc_S, row_max, row_sum, scale_log2, None, ex2_emu, rescale_threshold, False, chains
        )
        corr[0], corr[1] = c[0], c[1]
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            probs[i] = acc_S[i]
    return corr


def _row_sum(ps: list, chains: bool):
    """The sum of a row's P (DSL scalars) in online_softmax's order: four chains, or one."""
    if chains:
        return _chains(ps, lambda a, b: a + b)
    s = Float32(0.0)
    for p in ps:
        s += p
    return s


def _exp2(x, poly: bool):
    """2^x by `exp2_poly` (poly, a Python bool) or MUFU.EX2."""
    return exp2_poly(x) if poly else cute.math.exp2(x, fastmath=True)


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
def needs_rescale(corr: cute.Tensor):
    """Whether any row of the warp has a rescale other than 1.0 (a warp-uniform Boolean, so a
    branch on it does not diverge)."""
    return cute.arch.vote_any_sync((corr[0] != Float32(1.0)) | (corr[1] != Float32(1.0)))


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
