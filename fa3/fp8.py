"""FP8 (float8_e4m3fn) forward of fa3: q, k, v in e4m3, out bf16, LSE fp32.

The kernel is `Fa3Forward` with the FP8-specific steps overridden (its hook methods: smem
layouts, V's view and tiles, PV's B major mode, P conversion, O scale); the warp roles, loads,
pipelines, ping-pong, intra-WG overlap, masking, online softmax and epilogue are the 16-bit
kernel's own code:

- Both wgmma operands must be K-major for FP8 (an MN-major fp8 B is rejected at trace time),
  so the B operand of O += P·V, Vᵀ (D x keys), must have the keys contiguous. The host makes
  that copy before the launch: V (B, Nk, Hkv, D) -> Vt (B, Hkv, D, Nk_pad), one extra read and
  write of V (2·B·Nk·Hkv·D bytes: ~64 MiB, ~20 us on an H200 at B·N = 16k, Hkv·D = 2048; about
  1 % of a 16k-token forward, but up to a third of the time at N = 512; an in-kernel transpose
  by the producer warpgroup would remove it).
- P leaves the softmax as the fp32 C fragment of S; the fp8 A fragment of the PV wgmma wants
  other columns per thread (`quad_exchange`): convert to e4m3, two `shfl.sync` within each quad
  and two `prmt` per 32-bit word.
- descale_q·descale_k (per batch and kv head, read in the kernel) multiplies the softmax scale;
  descale_v multiplies O with 1/l in the epilogue. P stays in [0, 1] before its fp8 rounding.
- Epilogue: O is bf16 (its own smem buffer: sO is twice as big as the fp8 sQ it cannot alias).
- The shipped fp8 tiles (`FP8_CONFIGS`, `FP8_CAUSAL_CONFIGS` below) run one CTA per tile. The
  kernel also builds on the persistent scheduler (v2, per-WG epilogue: `fp8_variants`'
  "persistent_v2"), reading each tile's descales in `tile_scales`, and with three consumer
  warpgroups; both compile for sm_90a in CI and wait for an H200 run (`fp8_check --ablate`).

Status: validated on the H200 (2026-11-29: 142 oracle cases with descales, causal, GQA, odd
sizes, window and softcap, every head dim; `fp8_check`), compiled for sm_90a in CI
(tests/test_fa3_fp8_compile.py).

GPU check (correctness against the oracle with descales, then TFLOP/s next to cuDNN bf16 at
the same shapes, in one run): `python -m benchmarks.fa3_fp8_check --out DIR`.
"""

# No `from __future__ import annotations`: the CuTe DSL reads kernel annotations as objects.
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from flashsuite.common.validation import AttnParams
from flashsuite.fa3.compile import cached, check_storage, compile_options, kernel_scalars
from flashsuite.fa3.configs import REG_SPLIT, SMEM_CAPACITY, Fa3Config
from flashsuite.fa3.kernels import Fa3Forward

FP8_HEAD_DIMS = (64, 96, 128, 192, 256)
# wgmma K for 8-bit operands: P's columns (keys) come in blocks of 32.
MMA_K_FP8 = 32
_MAX_GRID_YZ = 65_535
# Registers a consumer thread needs beyond the fragments (as configs._REG_OVERHEAD[2]).
_REG_OVERHEAD = 40


def _cfg(tile_n: int, stages: int = 2) -> Fa3Config:
    # 2 consumer WGs, non-persistent; sO is bf16 (2 bytes) and cannot live on the fp8 sQ.
    return Fa3Config(tile_m=128, tile_n=tile_n, stages=stages, o_alias_q=False, persistent=False)


# head_dim -> tile config (non-causal and causal unless FP8_CAUSAL_CONFIGS says otherwise).
# Rnnn: highest register of the SASS (nvdisasm), budget 240; all 0 spills. D = 64, 128, 256
# from the H200 ablation of 2026-11-29 (commit 8867277, `fp8_check --ablate`, B·N = 16k,
# Hq·D = 2048, N = 8k, fp8 TFLOP/s with the Vᵀ copy, non-causal / causal); D = 96, 192 are
# not measured (smem and register arithmetic).
FP8_CONFIGS: dict[int, Fa3Config] = {
    # tile_n 192: 499 / 421 (128: 473 / 419, 256: 489 / 441, 3 stages 476 / 420).
    # Q 8 + K/V 2 x 2 x 12 + sO 16 KiB = 72 KiB; S 96 + O 32 + P 24 registers.
    64: _cfg(192),
    # Q 12 + K/V 2 x 2 x 12 + sO 24 KiB = 84 KiB; S 64 + O 48 + P 16. R165.
    96: _cfg(128),
    # tile_n 192: 760 / 630 (128: 726 / 619, 3 stages 737 / 613, no ping-pong 747 / 618).
    # Q 16 + K/V 2 x 2 x 24 + sO 32 KiB = 144 KiB; S 96 + O 64 + P 24.
    128: _cfg(192),
    # Q 24 + K/V 2 x 2 x 24 + sO 48 KiB = 168 KiB; S 64 + O 96 + P 16. R207.
    192: _cfg(128),
    # acc_O alone is 128 registers: S stays narrow. tile_n 96: 914 / 712 (64: 837 / 644,
    # 3 stages 886 / 680, no ping-pong 851 / 684). Q 32 + K/V 2 x 2 x 24 + sO 64 KiB = 192 KiB.
    256: _cfg(96),
}
# Causal entries that differ: at D = 64 the widest S (256: 441 vs 421 causal TFLOP/s).
FP8_CAUSAL_CONFIGS: dict[int, Fa3Config] = {64: _cfg(256)}


def fp8_smem_bytes(cfg: Fa3Config, head_dim: int) -> int:
    """Shared memory of `Fp8Forward._storage`: mbarriers, fp8 sQ/sK/sVt, bf16 sO (1 KiB-aligned)."""

    def align(n: int) -> int:
        return (n + 1023) // 1024 * 1024

    mbar = 8 * (2 + 4 * cfg.stages)
    kv = cfg.tile_n * head_dim * cfg.stages  # 1 byte per element
    return (
        align(mbar)
        + align(cfg.tile_m * head_dim)
        + 2 * align(kv)
        + align(cfg.tile_m * head_dim * 2)
    )


def fp8_can_implement(cfg: Fa3Config, head_dim: int) -> tuple[bool, str]:
    """Whether the fp8 kernel can be built for `cfg`: tile legality, smem and registers."""
    if head_dim not in FP8_HEAD_DIMS:
        dims = ", ".join(map(str, FP8_HEAD_DIMS))
        return False, f"fa3: fp8 head_dim {head_dim} not in {{{dims}}}"
    if cfg.num_consumer_wgs not in (2, 3) or cfg.tile_m != 64 * cfg.num_consumer_wgs:
        return False, "fa3: fp8 runs two or three consumer warpgroups (tile_m 128 or 192)"
    if cfg.o_alias_q:
        return False, "fa3: fp8 needs its own sO buffer (bf16 O does not fit on the fp8 sQ)"
    if (cfg.overlap_tiles or cfg.balanced_order) and not cfg.persistent:
        return False, "fa3: overlap_tiles / balanced_order need persistent=True"
    # P is the K operand of PV (blocks of 32 keys); Vᵀ's smem rows are tile_n bytes and need a
    # swizzle width (32, 64 or 128 bytes) that divides them.
    if not (MMA_K_FP8 <= cfg.tile_n <= 256 and cfg.tile_n % MMA_K_FP8 == 0):
        return False, f"fa3: fp8 tile_n {cfg.tile_n} must be a multiple of 32 in [32, 256]"
    if cfg.stages < 2:
        return False, f"fa3: stages {cfg.stages} < 2 (the K/V ring needs double buffering)"
    smem = fp8_smem_bytes(cfg, head_dim)
    if smem > SMEM_CAPACITY:
        return False, f"fa3: fp8 {smem} B of shared memory > {SMEM_CAPACITY} B"
    acc_s = 64 * cfg.tile_n // 128
    regs = acc_s + 64 * head_dim // 128 + acc_s // 4 + _REG_OVERHEAD
    budget = REG_SPLIT[cfg.num_consumer_wgs][1]
    if regs > budget:
        return False, f"fa3: fp8 ~{regs} registers per consumer thread > {budget}"
    return True, ""


def fp8_config(head_dim: int, causal: bool = False) -> Fa3Config:
    """The fp8 tile config for (`head_dim`, `causal`)."""
    if causal and head_dim in FP8_CAUSAL_CONFIGS:
        return FP8_CAUSAL_CONFIGS[head_dim]
    return FP8_CONFIGS[head_dim]


def supports(p: AttnParams) -> tuple[bool, str]:
    """Whether the fp8 kernel takes `p` (the caller has checked the arch).

    Descales are taken as positive (amax / 448 by construction): the kernel folds
    descale_q·descale_k into the softmax scale after the row max, which a negative product
    would flip. Checking their values would cost a device sync per call, so it is not done.
    """
    if p.head_dim not in FP8_HEAD_DIMS:
        dims = ", ".join(map(str, FP8_HEAD_DIMS))
        return False, f"fa3: fp8 head_dim {p.head_dim} not in {{{dims}}}"
    if p.head_dim_v != p.head_dim:
        return False, f"fa3: head_dim_v {p.head_dim_v} != head_dim {p.head_dim}"
    if p.scale <= 0 and p.softcap == 0:
        return False, f"fa3: softmax_scale must be > 0 (got {p.scale:g})"
    if p.heads_q > _MAX_GRID_YZ or p.batch > _MAX_GRID_YZ:
        return False, f"fa3: heads ({p.heads_q}) and batch ({p.batch}) must be <= {_MAX_GRID_YZ}"
    if max(p.seqlen_q, p.seqlen_k) >= 2**31 // 2:
        return False, "fa3: sequence lengths must be < 2^30 (32-bit TMA coordinates)"
    cfg = fp8_config(p.head_dim, p.causal)
    ok, reason = fp8_can_implement(cfg, p.head_dim)
    if not ok:
        return False, reason
    return True, (
        f"fa3: fp8 e4m3 forward (bf16 out, Vᵀ copied on the host), {cfg.tile_m}x{cfg.tile_n} "
        f"tiles, {cfg.stages} stages, 2 consumer WGs"
    )


# ------------------------------------------------------------------------------------------------
# P: fp32 C fragment of S -> e4m3 A fragment of PV
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# kernel
# ------------------------------------------------------------------------------------------------
class Fp8Forward(Fa3Forward):
    """`Fa3Forward` for e4m3 q/k/v: K-major Vᵀ, fp8 P exchange, descales, bf16 out.

    Overrides only the steps that differ: the smem layouts (`_make_layouts`), PV's B operand
    (`_pv_b_major`, `V_VIEW`, `_v_box`, `_v_blocks`, `_v_operand`), the P conversion
    (`probs_to_operand`), the O scale (`_o_scale`), and the host launch and kernel entry
    (descale arguments; per-tile descales with the persistent scheduler, `tile_scales`).
    """

    # Vᵀ (B, Hkv, D, Nk) -> (D, Nk, Hkv, B): the host's transpose, loaded as (D, TILE_N) blocks.
    V_VIEW = (2, 3, 1, 0)

    def __init__(self, head_dim: int, cfg: Fa3Config, causal: bool, local: bool, softcap: bool):
        ok, reason = fp8_can_implement(cfg, head_dim)
        if not ok:
            raise ValueError(reason)
        super().__init__(Float8E4M3FN, head_dim, cfg, causal, local, softcap)
        self.o_dtype = BFloat16
        # descale_v of the tile's (batch, kv head): set while tracing by `tile_scales`, read by
        # `_o_scale` in the base class's epilogue.
        self._descale_v = None
        self._descales = None  # (mDescaleQ, mDescaleK, mDescaleV, group), set by `kernel`

    # ----------------------------------------------------------------------------------------
    # layouts, MMAs, V's place (the base class's hooks)
    # ----------------------------------------------------------------------------------------
    def _make_layouts(self):
        """sQ (TILE_M, D), sK (TILE_N, D, STAGES), sVt (D, TILE_N, STAGES), sO (TILE_M, D) bf16."""
        d, tn, st = self.HEAD_DIM, self.TILE_N, self.STAGES
        qk_atom = self._k_major_atom(d, Float8E4M3FN)  # rows of D bytes
        sQ_l = cute.tile_to_shape(qk_atom, (self.TILE_M, d), order=(0, 1))
        sK_l = cute.tile_to_shape(qk_atom, (tn, d, st), order=(0, 1, 2))
        # Vᵀ is PV's B operand (N = D, K = keys), K-major: rows of TILE_N key bytes.
        vt_atom = self._k_major_atom(tn, Float8E4M3FN)
        sVt_l = cute.tile_to_shape(vt_atom, (d, tn, st), order=(0, 1, 2))
        o_atom = self._k_major_atom(2 * d, BFloat16)
        if self.PER_WG_EPILOGUE:  # one contiguous (64, D) slab per consumer WG (`_o_layout`)
            sO_l = cute.tile_to_shape(o_atom, (64, d, self.NUM_CONSUMER_WGS), order=(0, 1, 2))
        else:
            sO_l = cute.tile_to_shape(o_atom, (self.TILE_M, d), order=(0, 1))
        return sQ_l, sK_l, sVt_l, sO_l

    def _pv_b_major(self):
        # Vᵀ with the keys contiguous: fp8 wgmma takes no MN-major operand.
        return cute.nvgpu.OperandMajorMode.K

    def _v_box(self) -> tuple[int, int]:
        return (self.HEAD_DIM, self.TILE_N)

    def _v_blocks(self, tVt: cute.Tensor, head_kv: Int32, batch: Int32) -> cute.Tensor:
        """Vᵀ of one (batch, kv head) tiled into blocks: (D, TILE_N, n_blocks)."""
        return cute.local_tile(
            tVt[None, None, head_kv, batch], (self.HEAD_DIM, self.TILE_N), (0, None)
        )

    def _v_operand(self, sVt: cute.Tensor) -> cute.Tensor:
        return sVt  # already PV's K-major B operand (D, TILE_N, STAGES)

    def _o_scale(self, rcp_l: Float32) -> Float32:
        """O = descale_v · P·V / l."""
        return rcp_l * self._descale_v

    def tile_scales(self, head: Int32, batch: Int32, scale_log2: Float32, softcap_pre: Float32):
        """The descales of this tile's (batch, kv head), read at the top of its consumer work
        (one tile per CTA, or each tile of a persistent CTA). Scores are (q·descale_q)·
        (k·descale_k) = descale_q·descale_k·(q·k): the product scales what multiplies the raw
        fp32 score (the exp2 scale, or tanh's argument). descale_v is kept for `_o_scale` in
        the same tile's epilogue (same trace region): O = descale_v · P·V / l."""
        m_dq, m_dk, m_dv, group = self._descales
        head_kv = head // group
        qk_descale = m_dq[batch, head_kv] * m_dk[batch, head_kv]
        self._descale_v = m_dv[batch, head_kv]
        if const_expr(self.SOFTCAP):
            return scale_log2, softcap_pre * qk_descale
        return scale_log2 * qk_descale, softcap_pre

    @cute.jit
    def probs_to_operand(self, ctx):
        """P (fp32 C fragment in acc_S) -> e4m3 A fragment of PV (tOrP), see `quad_exchange`.

        acc_S element 4j + 2r + c is (row half r, column 8j + 2t + c); tOrP's 32-bit word
        4kb + r + 2h holds row half r, keys 32kb + 16h + 4t' .. + 3 (m64nNk32 A layout).
        """
        acc_S, tOrP = ctx.acc_S, ctx.tOrP
        # ((4, 2, 2), 1, TILE_N / 32) bytes: (byte, row half, k half) x k-blocks.
        assert cute.size(tOrP) == cute.size(acc_S)
        assert cute.size(tOrP, mode=[2]) == self.TILE_N // MMA_K_FP8
        words = cute.make_tensor(
            cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(tOrP) // 4)
        )  # (TILE_N / 8,) 32-bit view of P's registers
        lane = cute.arch.lane_idx()
        t = lane % 4
        src1, src2, sel_lo, sel_hi = quad_exchange(t)
        quad0 = lane - t
        even = (t & 1) == 0
        for kb in cutlass.range_constexpr(self.TILE_N // MMA_K_FP8):
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

    # ----------------------------------------------------------------------------------------
    # host side
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Nq, Hq, D) e4m3
        mK: cute.Tensor,  # (B, Nk, Hkv, D) e4m3
        mVt: cute.Tensor,  # (B, Hkv, D, Nk) e4m3, keys contiguous (the host's transpose)
        mO: cute.Tensor,  # (B, Nq, Hq, D) bf16
        mLSE: cute.Tensor,  # (B, Hq, Nq) fp32
        mDescaleQ: cute.Tensor,  # (B, Hkv) fp32
        mDescaleK: cute.Tensor,  # (B, Hkv) fp32
        mDescaleV: cute.Tensor,  # (B, Hkv) fp32
        scale_log2: Float32,  # log2(e) * scale (or * softcap with SOFTCAP)
        softcap_pre: Float32,  # scale / softcap (unused without SOFTCAP)
        window_left: Int32,
        window_right: Int32,
        max_ctas: Int32,  # persistent grid size (the SM count); unused otherwise
        stream,
    ):
        mQ, mK, mVt, mO, mLSE = self._kernel_views(mQ, mK, mVt, mO, mLSE)
        sQ_l, sK_l, sVt_l, sO_l = self._make_layouts()
        mma_qk, mma_pv = self._make_mmas()
        self.storage = self._storage(sQ_l, sK_l, sVt_l, sO_l)
        tma_q, tQ, tma_k, tK, tma_v, tVt, tma_o, tO = self._make_tmas(
            mQ, mK, mVt, mO, sQ_l, sK_l, sVt_l, sO_l
        )

        seqlen_q = mQ.shape[0]
        heads_q = mQ.shape[2]
        group = heads_q // mK.shape[2]
        m_blocks = (seqlen_q + self.TILE_M - 1) // self.TILE_M
        grid = (m_blocks, heads_q, mQ.shape[3])
        if const_expr(self.PERSISTENT):
            grid = (cutlass.min(m_blocks * heads_q * mQ.shape[3], max_ctas), 1, 1)
        self.kernel(
            tma_q,
            tQ,
            tma_k,
            tK,
            tma_v,
            tVt,
            tma_o,
            tO,
            mLSE,
            mDescaleQ,
            mDescaleK,
            mDescaleV,
            mma_qk,
            mma_pv,
            sQ_l,
            sK_l,
            sVt_l,
            sO_l,
            Int32(seqlen_q),
            Int32(mK.shape[0]),
            Int32(group),
            scale_log2,
            softcap_pre,
            window_left,
            window_right,
            Int32(heads_q),
            Int32(mQ.shape[3]),
        ).launch(
            grid=grid,
            block=[self.NUM_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # gives ptxas the entry register count setmaxnreg needs
        )

    # ----------------------------------------------------------------------------------------
    # device side
    # ----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,  # (Nq, D, Hq, B) TMA coordinates
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,  # (Nk, D, Hkv, B)
        tma_v: cute.CopyAtom,
        tVt: cute.Tensor,  # (D, Nk, Hkv, B)
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,  # (Nq, D, Hq, B) bf16
        mLSE: cute.Tensor,  # (Nq, Hq, B) fp32
        mDescaleQ: cute.Tensor,  # (B, Hkv) fp32
        mDescaleK: cute.Tensor,  # (B, Hkv) fp32
        mDescaleV: cute.Tensor,  # (B, Hkv) fp32
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_l: cute.ComposedLayout,  # (TILE_M, D)
        sK_l: cute.ComposedLayout,  # (TILE_N, D, STAGES)
        sVt_l: cute.ComposedLayout,  # (D, TILE_N, STAGES)
        sO_l: cute.ComposedLayout,  # (TILE_M, D) bf16
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        heads_q: Int32,
        batch_n: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        sched = self.scheduler.problem(
            seqlen_q, seqlen_k, group, window_left, window_right, heads_q, batch_n
        )
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        pipes, smem = self._allocate_smem(sQ_l, sK_l, sVt_l, sO_l)
        pipe_q, pipe_k, pipe_v = pipes
        sQ, sK, sVt, _, sO = smem  # the loaded sVt is already PV's B operand
        if const_expr(not self.PERSISTENT):  # the CTA's one tile: computed once, for both roles
            sched.blocks = self.scheduler.block_range(
                sched.tile0[0], seqlen_q, seqlen_k, window_left, window_right
            )
        # Each tile's consumer reads its (batch, kv head) descales (`tile_scales`).
        self._descales = (mDescaleQ, mDescaleK, mDescaleV, group)

        self.warp_roles(
            wg,
            warp,
            tidx,
            (tma_q, tQ, tma_k, tK, tma_v, tVt, sQ, sK, sVt, pipe_q, pipe_k, pipe_v),
            (tma_o, tO, mLSE, mma_qk, mma_pv, sQ, sK, sVt, sO, pipe_q, pipe_k, pipe_v),
            sched,
            scale_log2,
            softcap_pre,
        )


# ------------------------------------------------------------------------------------------------
# compile cache and host launch
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8CompileKey:
    """Everything that changes the generated code of one fp8 forward kernel."""

    head_dim: int
    causal: bool
    local: bool
    softcap: bool
    cfg: Fa3Config
    arch: str = "sm_90a"
    tvm_ffi: bool = True


def _fake_inputs(head_dim: int) -> tuple:
    """Fake q, k, vt, out, lse and the three descales; symbolic sizes and 16-byte strides."""
    d = head_dim
    b, nq, nk, hq, hkv = (cute.sym_int() for _ in range(5))

    def strided(dt, shape):  # any 16-byte-aligned outer strides, the last dim contiguous
        stride = (*(cute.sym_int64(divisibility=16 * 8 // dt.width) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    q = strided(Float8E4M3FN, (b, nq, hq, d))
    k = strided(Float8E4M3FN, (b, nk, hkv, d))
    vt = strided(Float8E4M3FN, (b, hkv, d, nk))  # (B, Hkv, D, Nk)
    o = cute.runtime.make_fake_compact_tensor(
        BFloat16, (b, nq, hq, d), stride_order=(3, 2, 1, 0), assumed_align=16
    )  # (B, Nq, Hq, D)
    lse = cute.runtime.make_fake_compact_tensor(
        Float32, (b, hq, nq), stride_order=(2, 1, 0), assumed_align=4
    )  # (B, Hq, Nq)
    descales = tuple(
        cute.runtime.make_fake_compact_tensor(
            Float32, (b, hkv), stride_order=(1, 0), assumed_align=4
        )  # (B, Hkv)
        for _ in range(3)
    )
    return (q, k, vt, o, lse, *descales)


def compile_fp8_forward(key: Fp8CompileKey, extra_options: str = "") -> Any:
    """Build one fp8 forward binary (no cache). `extra_options` go to cute.compile."""
    kernel = Fp8Forward(key.head_dim, key.cfg, key.causal, key.local, key.softcap)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    options = compile_options(key.arch, key.tvm_ffi, extra_options)
    compiled = cute.compile(
        kernel,
        *_fake_inputs(key.head_dim),
        Float32(1.0),
        Float32(1.0),
        Int32(0),
        Int32(0),
        Int32(1),  # max_ctas (a runtime scalar)
        stream,
        options=options,
    )
    check_storage(kernel, fp8_smem_bytes(key.cfg, key.head_dim), f"fp8 {key.cfg}")
    return compiled


def get_fp8_forward(key: Fp8CompileKey) -> Any:
    """The cached binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_fp8_forward)


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """V (B, Nk, Hkv, D) -> Vᵀ (B, Hkv, D, Nk) with the keys contiguous, for PV's K-major B.

    The key stride is padded to 16 bytes (TMA); the view stops at Nk, so TMA zero-fills the
    tail block and the padding is never read. Copied through uint8 views (a byte permutation).
    """
    b, nk, hkv, d = v.shape
    nk_pad = (nk + 15) // 16 * 16
    vt = torch.empty((b, hkv, d, nk_pad), dtype=torch.uint8, device=v.device)  # (B, Hkv, D, Nk')
    vt = vt[..., :nk]  # (B, Hkv, D, Nk)
    vt.copy_(v.view(torch.uint8).permute(0, 2, 3, 1))
    return vt.view(v.dtype)


_sms: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    if device not in _sms:
        _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[device]


_ones: dict[tuple, torch.Tensor] = {}


def _descale(t: torch.Tensor | None, b: int, hkv: int, device: torch.device) -> torch.Tensor:
    """A (B, Hkv) contiguous fp32 descale; None -> a cached tensor of ones."""
    if t is not None:
        return t.contiguous()
    key = (device, b, hkv)
    ones = _ones.get(key)
    if ones is None:
        if len(_ones) > 256:
            _ones.clear()
        ones = _ones[key] = torch.ones((b, hkv), dtype=torch.float32, device=device)
    return ones


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnParams,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    *,
    cfg: Fa3Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) float8_e4m3fn on an sm90 GPU, q and k TMA-ready
    (16-byte base and outer strides: interface._tma_ready); descales (B, Hkv) fp32 or None.

    Returns out (B, Nq, Hq, D) bf16 contiguous and lse (B, Hq, Nq) fp32 (natural log, -inf for
    rows that see no key).
    """
    b, hkv, dev = p.batch, p.heads_kv, q.device
    out = torch.empty(
        (b, p.seqlen_q, p.heads_q, p.head_dim), dtype=torch.bfloat16, device=dev
    )  # (B, Nq, Hq, D)
    lse = torch.empty((b, p.heads_q, p.seqlen_q), dtype=torch.float32, device=dev)  # (B, Hq, Nq)
    if out.numel() == 0:
        return out, lse
    if p.seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    key = Fp8CompileKey(
        head_dim=p.head_dim,
        causal=p.causal,
        local=p.is_local,
        softcap=p.softcap > 0,
        cfg=cfg if cfg is not None else fp8_config(p.head_dim, p.causal),
    )
    scalars = kernel_scalars(
        p.scale, p.softcap, (p.window_left, p.window_right), p.causal, p.seqlen_q, p.seqlen_k
    )
    ds = (_descale(t, b, hkv, dev) for t in (descale_q, descale_k, descale_v))
    sms = _sm_count(dev)  # the persistent grid's CTA count
    get_fp8_forward(key)(q, k, transpose_v(v), out, lse, *ds, *scalars, sms)
    return out, lse
