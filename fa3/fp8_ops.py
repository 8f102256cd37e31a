"""Device helpers of the fa3 forward's float8 (e4m3) branch: P from the fp32 C fragment of S to
the e4m3 A fragment of the P·V wgmma.

The m64nNk16 fp32 C fragment of S and the m64nNk32 e4m3 A fragment of P give a thread other
columns (`quad_exchange`), so unlike the 16-bit branch (a per-thread convert) P is converted
to e4m3 and moved within each quad: two `shfl.sync` and two `prmt` per pair of 32-bit words.
`Fa3Forward` (fwd_mainloop.py `probs_to_operand`) calls `probs_to_operand` below when its
dtype is e4m3.
"""

# No `from __future__ import annotations`: the CuTe DSL reads kernel annotations as objects.
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flashsuite.fa3.configs import MMA_K

MMA_K_FP8 = MMA_K[1]  # P's columns (keys) come in blocks of 32 for 8-bit operands


def quad_exchange(t):
    """Where lane t (0..3 of its quad) gets P from, for one 32-key block of one of its rows.

    The m64nNk16 fp32 C fragment gives lane t the columns {8j + 2t, 8j + 2t + 1 : j < 4} of a
    32-column block; the m64nNk32 e4m3 A fragment wants {4t .. 4t+3} (register k-half 0) and
    {16 + 4t .. 16 + 4t + 3} (k-half 1). Every lane packs its own columns as two words,
    X = (j=0 pair, j=2 pair) and Y = (j=1 pair, j=3 pair), 4 bytes each, low byte first. Lanes
    t' < 2 need the X words of lanes 2(t'&1) and 2(t'&1)+1, lanes t' >= 2 their Y words; so in
    the first shuffle even lanes offer X and odd lanes Y, in the second the other way round, and
    lane t' reads (src1, src2) below. Then `prmt(w1, w2, sel_lo)` is k-half 0 and
    `prmt(w1, w2, sel_hi)` k-half 1. Plain integer arithmetic, so the same function serves the
    kernel (Int32 lanes) and its CPU model in the tests (Python ints).

    Returns (src1, src2, sel_lo, sel_hi): source lanes within the quad and prmt selectors.
    """
    hi = t >> 1  # 0: wants the X words (j = 0, 2); 1: the Y words (j = 1, 3)
    odd = t & 1  # which pair of source lanes: (0, 1) or (2, 3)
    src1 = 2 * odd + hi  # t' < 2 read the even source first, t' >= 2 the odd one
    src2 = 2 * odd + 1 - hi
    # prmt byte ids: 0-3 are w1's bytes, 4-7 w2's. The even source's pair goes low:
    # t' < 2: (w1.b0 w1.b1 w2.b0 w2.b1) = 0x5410; t' >= 2 (w1 came from the odd lane): 0x1054.
    # k-half 1 takes the upper halves: 0x7632 / 0x3276 (both differ by 0x43BC).
    sel_lo = 0x5410 - hi * 0x43BC
    sel_hi = 0x7632 - hi * 0x43BC
    return src1, src2, sel_lo, sel_hi


@dsl_user_op
def cvt_pack_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four fp32 -> one register of four e4m3 bytes, a in the low byte (cvt.rn.satfinite)."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Int32(
        llvm.inline_asm(
            T.i32(),
            args,
            # cvt puts its first source in the upper byte of the pair: (b, a) -> {b: hi, a: lo}.
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def byte_perm(a: Int32, b: Int32, sel: Int32, *, loc=None, ip=None) -> Int32:
    """prmt.b32 without side effects (cute.arch.prmt's asm is marked side-effecting)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, sel)],
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def probs_to_operand(acc_S: cute.Tensor, tOrP: cute.Tensor, tile_n: cutlass.Constexpr[int]):
    """P (fp32 C fragment in acc_S) -> e4m3 A fragment of PV (tOrP), see `quad_exchange`.

    acc_S element 4j + 2r + c is (row half r, column 8j + 2t + c); tOrP's 32-bit word
    4kb + r + 2h holds row half r, keys 32kb + 16h + 4t' .. + 3 (m64nNk32 A layout).
    """
    # ((4, 2, 2), 1, TILE_N / 32) bytes: (byte, row half, k half) x k-blocks.
    assert cute.size(tOrP) == cute.size(acc_S)
    assert cute.size(tOrP, mode=[2]) == tile_n // MMA_K_FP8
    words = cute.make_tensor(
        cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(tOrP) // 4)
    )  # (TILE_N / 8,) 32-bit view of P's registers
    lane = cute.arch.lane_idx()
    t = lane % 4
    src1, src2, sel_lo, sel_hi = quad_exchange(t)
    quad0 = lane - t
    even = (t & 1) == 0
    for kb in cutlass.range_constexpr(tile_n // MMA_K_FP8):
        for r in cutlass.range_constexpr(2):

            def pair(j: int, kb=kb, r=r):
                i = 4 * (4 * kb + j) + 2 * r
                return acc_S[i], acc_S[i + 1]

            x = cvt_pack_e4m3x4(*pair(0), *pair(2))
            y = cvt_pack_e4m3x4(*pair(1), *pair(3))
            w1 = cute.arch.shuffle_sync(x if even else y, quad0 + src1)
            w2 = cute.arch.shuffle_sync(y if even else x, quad0 + src2)
            words[4 * kb + r] = byte_perm(w1, w2, sel_lo)
            words[4 * kb + 2 + r] = byte_perm(w1, w2, sel_hi)
