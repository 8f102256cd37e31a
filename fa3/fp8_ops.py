"""Device helpers of the fa3 forward's float8 (e4m3) branch: P from the fp32 C fragment of S to
the e4m3 A fragment of the P·V wgmma, and (v_transpose="smem") V blocks transposed in shared
memory into the K-major Vᵀ blocks that P·V's fp8 wgmma needs (`transpose_block`).

The m64nNk16 fp32 C fragment of S and the m64nNk32 e4m3 A fragment of P give a thread other
columns (`quad_exchange`), so unlike the 16-bit branch (a per-thread convert) P is converted
to e4m3 and moved within each quad: two `shfl.sync` and two `prmt` per pair of 32-bit words.
`Fa3Forward` (fwd_mainloop.py `probs_to_operand`) calls `probs_to_operand` below when its
dtype is e4m3.
"""

# No `from __future__ import annotations`: the CuTe DSL reads kernel annotations as objects.
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
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


def slot_key(s):
    """The key (0..31 within its 32-key block) that A-operand slot `s` of P·V holds when V's
    keys are permuted (Fa3Config.permute_v_keys).

    Lane t of a quad owns the C-fragment columns {8j + 2t + c} of S and the A-fragment slots
    {16h + 4t + i} of P (i < 4). Giving slot 16h + 4t + 2a + c the key 16h + 8a + 2t + c (a, c
    in {0, 1}) makes the lane's own four columns of key half h its four slots there: P goes
    from the C fragment to the A fragment inside each thread, and V's rows (Vᵀ's columns) are
    put in the same slot order, so P·V sums the same products. In key-index bits the map
    swaps the fields (t, a) of s = (h, t, a, c) into (h, a, t, c): a transpose of two axes
    (`interface.transpose_v` copies V through that view). Plain integer arithmetic (kernel
    Int32, tests int)."""
    h, t, a, c = s // 16, (s // 4) % 4, (s // 2) % 2, s % 2
    return 16 * h + 8 * a + 2 * t + c


@cute.jit
def probs_to_operand(
    acc_S: cute.Tensor,
    tOrP: cute.Tensor,
    tile_n: cutlass.Constexpr[int],
    keys_permuted: cutlass.Constexpr[bool] = False,
):
    """P (fp32 C fragment in acc_S) -> e4m3 A fragment of PV (tOrP), see `quad_exchange`.

    acc_S element 4j + 2r + c is (row half r, column 8j + 2t + c); tOrP's 32-bit word
    4kb + r + 2h holds row half r, keys 32kb + 16h + 4t' .. + 3 (m64nNk32 A layout).
    `keys_permuted` (V's keys in `slot_key` order): word 4kb + r + 2h is the lane's own
    columns 8(2h) + 2t + (0, 1) and 8(2h + 1) + 2t + (0, 1), packed in place: no shuffle.
    """
    # ((4, 2, 2), 1, TILE_N / 32) bytes: (byte, row half, k half) x k-blocks.
    assert cute.size(tOrP) == cute.size(acc_S)
    assert cute.size(tOrP, mode=[2]) == tile_n // MMA_K_FP8
    words = cute.make_tensor(
        cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(tOrP) // 4)
    )  # (TILE_N / 8,) 32-bit view of P's registers
    if const_expr(keys_permuted):
        for kb in cutlass.range_constexpr(tile_n // MMA_K_FP8):
            for r in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    i0 = 4 * (4 * kb + 2 * h) + 2 * r  # column group j = 2h, then 2h + 1
                    words[4 * kb + r + 2 * h] = cvt_pack_e4m3x4(
                        acc_S[i0], acc_S[i0 + 1], acc_S[i0 + 4], acc_S[i0 + 5]
                    )
        return
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


# ------------------------------------------------------------------------------------------------
# V -> Vᵀ in shared memory (Fa3Config.v_transpose = "smem")
# ------------------------------------------------------------------------------------------------
# One warp instruction pair moves a unit of 32 keys x 16 bytes of D: ldmatrix.x4.trans reads
# four 8 x 8 matrices of 16-bit pairs from sV (keys x D, D contiguous), two prmt per pair of
# registers regroup the bytes, stmatrix.x4 writes four 8 x 8 matrices into sVt (D x keys,
# keys contiguous). Each lane gives one 16-byte row address to each instruction.
VT_UNIT_KEYS = 32
VT_UNIT_D = 16
# prmt selectors: bytes 0, 2 of each word (the even D byte of 4 keys), and bytes 1, 3.
VT_SEL_EVEN = 0x6420
VT_SEL_ODD = 0x7531


def vt_load_row(lane, keys_permuted: bool = False):
    """The sV row (key within the unit; D offset 0) whose 16 bytes lane `lane` addresses for
    ldmatrix.x4.trans.

    Matrix m = lane / 8 takes row r = lane % 8 from here. With .trans, lane (p, q) = (t / 4,
    t % 4) receives of matrix m the 16-bit column p of rows 2q and 2q + 1: bytes (2p, 2p + 1)
    of those two keys. Matrix m = 2g + h holds keys 16g + 4(r / 2) + 2h + r % 2, so rows 2q,
    2q + 1 are keys 16g + 4q + 2h + (0, 1), and the registers of matrices 2g and 2g + 1 hold
    the four consecutive keys 16g + 4q .. 16g + 4q + 3 at D bytes 2p and 2p + 1.
    Plain integer arithmetic: the kernel (Int32) and its CPU model in the tests (int).
    `keys_permuted`: the lane reads the key `slot_key` puts in that place instead, so sVt
    holds V's keys in slot order (Fa3Config.permute_v_keys).
    """
    m = lane // 8
    r = lane % 8
    slot = 16 * (m // 2) + 4 * (r // 2) + 2 * (m % 2) + r % 2
    return slot_key(slot) if keys_permuted else slot


def vt_store_row(lane):
    """(D row, first key) of the sVt row segment (16 keys) lane `lane` addresses for stmatrix.x4.

    After the prmt, lane (p, q)'s word 2g + c is D byte 2p + c of keys 16g + 4q .. + 3;
    stmatrix puts register m of lane t at row t / 4 = p, bytes 4q .. 4q + 3 = those keys, of
    matrix m, whose row p is D row 2p + m % 2 at keys 16(m / 2) .. + 15.
    """
    m = lane // 8
    r = lane % 8
    return 2 * r + m % 2, 16 * (m // 2)


@dsl_user_op
def ldmatrix_x4_trans(addr: Int32, *, loc=None, ip=None) -> tuple:
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: four 32-bit registers. Volatile, so it
    stays after the mbarrier wait that made the TMA's bytes visible."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def stmatrix_x4(addr: Int32, r0: Int32, r1: Int32, r2: Int32, r3: Int32, *, loc=None, ip=None):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16 of four 32-bit registers."""
    llvm.inline_asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def transpose_block(
    sV_base: Int32,  # shared address of sV (1 KiB aligned)
    sVt_base: Int32,  # shared address of sVt (1 KiB aligned)
    sV_l: cute.ComposedLayout,  # (TILE_N, D, STAGES) fp8, D contiguous (swizzled)
    sVt_l: cute.ComposedLayout,  # (D, TILE_N, STAGES) fp8, keys contiguous (swizzled)
    v_stage: Int32,
    vt_stage: Int32,
    warp: Int32,  # 0 .. num_warps - 1 among the transposing warps
    num_warps: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    head_dim: cutlass.Constexpr[int],
    keys_permuted: cutlass.Constexpr[bool] = False,
):
    """sVt[:, :, vt_stage] = sV[:, :, v_stage]ᵀ by `num_warps` warps, unit u = warp,
    warp + num_warps, ... (units: keys 32 kb, D bytes 16 db, kb fastest). Byte offsets come
    from the swizzled layouts (the 16-byte segments every lane addresses stay contiguous under
    the 16-byte-granular swizzles). `keys_permuted`: each 32-key unit's keys in `slot_key`
    order."""
    lane = cute.arch.lane_idx()
    key_ld = vt_load_row(lane, keys_permuted)
    d_st, key_st = vt_store_row(lane)
    kbs = tile_n // VT_UNIT_KEYS
    units = kbs * (head_dim // VT_UNIT_D)
    for i in cutlass.range_constexpr((units + num_warps - 1) // num_warps):
        u = warp + i * num_warps
        args = (sV_base, sVt_base, sV_l, sVt_l, v_stage, vt_stage, u, kbs, key_ld, d_st, key_st)
        if const_expr((i + 1) * num_warps <= units):
            _transpose_unit(*args)
        else:
            if u < units:  # the last round, when the units do not split evenly
                _transpose_unit(*args)


@cute.jit
def _transpose_unit(
    sV_base, sVt_base, sV_l, sVt_l, v_stage, vt_stage, u, kbs, key_ld, d_st, key_st
):
    """One 32-key x 16-byte unit u of `transpose_block` (this lane's rows: key_ld, d_st, key_st)."""
    k0 = (u % kbs) * VT_UNIT_KEYS
    d0 = (u // kbs) * VT_UNIT_D
    r = ldmatrix_x4_trans(sV_base + sV_l((k0 + key_ld, d0, v_stage)))
    words = []
    for g in cutlass.range_constexpr(2):
        words.append(byte_perm(r[2 * g], r[2 * g + 1], Int32(VT_SEL_EVEN)))
        words.append(byte_perm(r[2 * g], r[2 * g + 1], Int32(VT_SEL_ODD)))
    stmatrix_x4(sVt_base + sVt_l((d0 + d_st, k0 + key_st, vt_stage)), *words)
