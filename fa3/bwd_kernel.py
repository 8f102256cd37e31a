"""FA3-style attention backward for Hopper (sm_90a) in the CuTe DSL.

One CTA owns one K/V column block (TILE_N key rows) of one (kv head, batch) and walks the query
row blocks (TILE_M rows) of every query head of its GQA group that can see the block. The grid
is (n_blocks, Hkv, B); 128 + 128 x NUM_MMA_WGS threads. Two layouts (`BwdConfig.layout`): the
"sdp_t" one below (D <= 128, TILE_N = 64 x NUM_MMA_WGS; its loop is `bwd_sdpt.BwdSdpT`), and
"dkv_t" (D = 192, 256:
`bwd_dkvt.BwdDkvT`, S not transposed, P and dS through smem, dK^T / dV^T with D on wgmma's M,
dK and dV stored through sK / sV by TMA), which share this launcher, the producer
(`bwd_load.BwdLoad`), the dQ routes and the elementwise steps.

Roles (`WarpRole`):
- WG0, the producer (24 registers): warp 0 loads K and V once (`pipe_kv`, one stage, never
  released) and then, per row block, Q, dO, LSE (base 2) and D = rowsum(dO * O) into a
  STAGES-deep TMA ring (`pipe_qdo`: the four copies complete one mbarrier per stage). In the
  "warp" dq_mode (shipped) warp 1 is the dQ writer (`bwd_dq.BwdDq.write_dq`).
- WG1.., the MMA warpgroups (240 registers), 64 key rows each. Per row block:
    S^T  = K Q^T       SS wgmma: A = sK (K-major), B = sQ stage (K-major)
    dP^T = V dO^T      SS wgmma: A = sV, B = sdO stage
    P^T  = exp2(S^T * scale_log2 - LSE_log2), dS^T = P^T * (dP^T - D) * scale, in registers
    dV  += P^T dO      RS wgmma: A = P^T (registers, 16-bit), B = sdO stage as an MN-major
                       (D, TILE_M) view
    dK  += dS^T Q      RS wgmma: A = dS^T (registers), B = sQ stage as an MN-major view
    dQ   = dS K        SS wgmma: A = sdS (dS^T written to smem by both WGs), B = sK as an
                       MN-major (D, TILE_N) view; the WGs split dQ's D columns (atom (1, 2, 1));
                       BwdConfig.dq_split "dt" (TILE_M = 80): dQ^T = K^T dS^T, the same
                       operands swapped, D on M (atom (2, 1, 1)), the fragment holding dQ^T
  and send dQ to the float32 accumulator in global memory: BwdConfig.dq_mode "warp" stores the
  fragment to an fp32 sdQ tile in fragment order for the writer warp's one bulk reduce per row
  block; "atomic" adds it with `atom.global.add.f32` per element from registers (REDG in SASS);
  "red" adds it from registers to the tile-ordered accumulator with `red.global.add.v4.f32`,
  one per 4 registers (no sdQ; "dkv_t" may issue and add dQ in two column slices,
  BwdConfig.dq_slices). BwdConfig.dq_handoff "turn" shrinks sdQ to one warpgroup's chunk.
  BwdConfig.ds_store picks stmatrix.trans or scalar 16-bit stores for dS^T -> sdS,
  BwdConfig.overlap the order of wgmmas and waits (docs/design.md).
  Computing S^T and dP^T (K and V as the A operand) puts P^T and dS^T in the accumulator
  layout, which is the A-fragment layout of the RS wgmmas for dV and dK: no transpose through
  shared memory for those two.
- Epilogue: dK and dV (fp32, scale already folded into dS; with BwdConfig.scale_out dK is
  scaled here and dQ by the host) converted to the input dtype and stored from registers with
  a bounds test per key row.

Barriers. `pipe_qdo`: full barriers complete on the producer's arrive_and_expect_tx (count 1)
plus the TMA bytes of Q, dO, LSE and D; empty barriers on one arrival per MMA warp after the
warp's dV/dK/dQ wgmmas (the last readers of sQ/sdO) have retired and its LSE/D smem reads are
done. `pipe_kv` is waited for once. Named barriers on the 128 x NUM_MMA_WGS MMA threads, each
synced once per row block by every MMA thread: DS_READY after the dS^T write and the
async-proxy fence (sdS is complete before either WG's dQ wgmma reads it), and with one sdS
buffer DS_FREE before the write (every WG has retired the previous block's dQ wgmma). dS^T
goes to sdS before the dK wgmma is issued (a wgmma's register operands may not be read until
it has retired). DQ_FULL / DQ_EMPTY (MMA threads + the writer warp) hand sdQ over in the "warp"
dq_mode. With BwdConfig.deterministic a per-(batch, head, row block) int32 counter in global
memory, which the host starts at the row block's first column block (`bwd_host.turn_counters`),
makes the column blocks add in n_block order, so dQ is bitwise reproducible: the writer
warp waits for its turn in the "warp" dq_mode; in the "atomic" one DQ_TURN and DQ_ADDED
bracket the MMA threads' adds (`add_dq_in_order`).

Masking: the row blocks [m_block_min, m_block_max) of a column block are those with a row that
sees one of its keys (causal, bottom-right: query i sees key j iff j <= i + Nk - Nq); fully
masked blocks are never visited (`bwd_blocks.BwdBlocks`). Blocks on the causal diagonal or
holding keys past Nk set S = -inf there. An infinite LSE (a row that sees no key, and the
padding rows past Nq) gives P = exp2(s - inf) = 0: zero gradients, no NaN.

Global tensors arrive in the API layout (B, N, H, D) and are viewed as (N, D, H, B) for 4-D
TMA descriptors (tail row blocks load zeros); LSE and D as (Nq_pad, H, B).

Packed sequences (`varlen`, bwd_varlen.py): q, dO (total_q, Hq, D), k, v, dK, dV (total_k, Hkv,
D), cu_seqlens_q / cu_seqlens_k (B + 1,) int32, LSE and D (Hq, rows_pad) and the "warp" dQ
accumulator (Hq, rows_pad, D) in the padded row layout of bwd_varlen.py. The grid is the
virtual column blocks (bwd_varlen.VarlenColumns); each CTA takes its sequence's lengths, so
the masking, the row-block ranges and the bounds above are per sequence (causal bottom-right
aligned in each). The row-block loops are the dense ones: only the views differ
(`DenseRowsBwd` / `SeqRowsBwd`).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as objects.
import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from flashsuite.fa3.bwd_blocks import BwdBlocks, section_tile
from flashsuite.fa3.bwd_configs import (
    BWD_REG_SPLIT,
    BwdConfig,
    dq_tiled,
    sdq_floats,
    stats_stage_rows,
)
from flashsuite.fa3.bwd_dkvt import BwdDkvT
from flashsuite.fa3.bwd_dq import BwdDq, dq_tile_layout
from flashsuite.fa3.bwd_load import BwdLoad
from flashsuite.fa3.bwd_pointwise import BwdSteps
from flashsuite.fa3.bwd_sdpt import BwdSdpT
from flashsuite.fa3.bwd_varlen import DenseRowsBwd, VarlenColumns, packed_view
from flashsuite.fa3.fwd_layouts import ForwardLayouts


class WarpRole(enum.IntEnum):
    """Warpgroup index -> role (NUM_THREADS = (1 + NUM_MMA_WGS) x 128 threads)."""

    PRODUCER = 0
    MMA0 = 1
    MMA1 = 2


class Fa3Backward(BwdLoad, BwdDq, BwdSteps, BwdSdpT, BwdDkvT, BwdBlocks):
    """Static configuration of one compiled backward; `__call__` is the host-side launcher."""

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        cfg: BwdConfig,
        causal: bool,
        softcap: bool = False,
        local: bool = False,
        varlen: bool = False,
    ) -> None:
        self.dtype = dtype
        self.HEAD_DIM = head_dim
        self.TILE_M = cfg.tile_m
        self.TILE_N = cfg.tile_n
        self.STAGES = cfg.stages
        self.NUM_MMA_WGS = cfg.num_mma_wgs
        self.DKV_T = cfg.layout == "dkv_t"  # bwd_dkvt.BwdDkvT; else the "sdp_t" loop (mma)
        self.DKV_TMA = self.DKV_T or cfg.dkv_tma  # dK, dV by TMA stores through sK / sV
        self.DKV_SPLIT_D = cfg.dkv_split == "d"
        self.DO_STAGES = cfg.do_stages or cfg.stages
        self.PRODUCER_REGS, self.MMA_REGS = BWD_REG_SPLIT[cfg.num_mma_wgs]
        self.MMA_THREADS = 128 * cfg.num_mma_wgs
        self.NUM_THREADS = 128 + self.MMA_THREADS
        self.CAUSAL = causal
        # Sliding window (runtime window_left / window_right, as the forward's mask.py): the
        # right edge bounds the keys a row sees (causal is right == 0), the left edge too.
        self.LOCAL = local
        self.HAS_RIGHT = causal or local
        self.DQ_WARP = cfg.dq_mode == "warp"
        self.DQ_RED = cfg.dq_mode == "red"  # red.global.add.v4.f32 from the MMA threads
        self.DQ_TILED = dq_tiled(cfg)  # the accumulator in dq_tile_layout row blocks
        # "d": the WGs split dQ's columns, "m": its rows, "dt": D of dQ^T = K^T dS^T
        self.DQ_SPLIT = cfg.dq_split
        self.DQ_HANDOFF_WG = cfg.dq_handoff == "wg"  # sdQ handed over per warpgroup
        self.DQ_HANDOFF_TURN = cfg.dq_handoff == "turn"  # ... through one chunk, in turn
        self.SDQ_FLOATS = sdq_floats(cfg, head_dim)
        self.DQ_SLICES = cfg.dq_slices  # "dkv_t", "red": dQ issued and added in column slices
        if cfg.dq_slices > 1 and not (self.DKV_T and self.DQ_RED):
            raise ValueError("Fa3Backward: dq_slices > 1 needs layout 'dkv_t' and dq_mode 'red'")
        self.DS_STAGES = cfg.ds_stages
        self.OVERLAP = cfg.overlap
        self.DV_EARLY = cfg.dv_early  # dV issued once P^T is packed, before dP^T retires
        self.DV_BEFORE_FENCE = cfg.dv_before_fence  # dV issued between the sdS stores and fence
        self.LPT = cfg.lpt
        self.PDL = cfg.pdl  # programmatic dependent launch: wait for the preprocess in-kernel
        self.HEAD_SECTION = cfg.head_section  # sectioned grid order (bwd_blocks.section_tile)
        if cfg.head_section < 0 or (cfg.head_section and (cfg.lpt or cfg.deterministic)):
            raise ValueError(
                f"Fa3Backward: head_section expected >= 0 and not with lpt or deterministic, "
                f"got {cfg.head_section} (lpt={cfg.lpt}, deterministic={cfg.deterministic})"
            )
        self.DS_STMATRIX = cfg.ds_store == "stmatrix"
        self.DETERMINISTIC = cfg.deterministic
        self.SCALE_OUT = cfg.scale_out  # dS without the scale; dK (and the host's dQ) take it
        self.STATS_REGS = cfg.stats_regs  # LSE and D rows in registers, loaded under the GEMMs
        self.LSE_REGS = cfg.lse_regs  # LSE rows in registers, loaded before S^T's wgmma
        self.STATS_SHFL = cfg.stats_shfl  # LSE and D rows by warp shuffle (bwd_pointwise)
        self.WG_SLICE = cfg.wg_slice  # smem operands sliced per warpgroup: uniform descriptors
        self.LSE_GUARD = cfg.lse_guard  # -inf LSE read as +inf (the preprocess writes +inf)
        self.SOFTCAP = softcap  # scores softcap * tanh(s * scale / softcap), as the forward
        if softcap and cfg.overlap:
            raise ValueError("Fa3Backward: softcap needs overlap False (dS uses tanh' in place)")
        # Packed sequences (bwd_varlen.py): the virtual column-block grid in launch order.
        self.VARLEN = varlen
        if varlen and (self.LPT or self.HEAD_SECTION):
            raise ValueError("Fa3Backward: varlen takes neither lpt nor head_section configs")
        if varlen and self.DETERMINISTIC and cfg.dq_mode != "atomic":
            # The MMA threads' ordered atomics index the turn counters by (sequence, head,
            # row block); the writer warp's ordered bulk adds are built for dense rows only.
            raise ValueError(
                f"Fa3Backward: varlen deterministic needs dq_mode 'atomic', not {cfg.dq_mode!r}"
            )
        self.varlen_cols = VarlenColumns(cfg.tile_m, cfg.tile_n)
        if self.DETERMINISTIC and cfg.dq_mode not in ("atomic", "warp"):
            raise ValueError(
                f"Fa3Backward: deterministic needs dq_mode 'atomic', not {cfg.dq_mode!r}"
            )
        if cfg.dq_handoff != "cta" and (not self.DQ_WARP or self.DETERMINISTIC):
            raise ValueError(
                f"Fa3Backward: dq_handoff {cfg.dq_handoff!r} needs dq_mode 'warp', not "
                "deterministic"
            )
        if self.DQ_RED and (self.DETERMINISTIC or cfg.dq_split == "dt"):
            raise ValueError(
                "Fa3Backward: dq_mode 'red' needs dq_split 'd' or 'm', not deterministic"
            )
        if self.DKV_T and (cfg.scale_out or cfg.stats_regs or cfg.lse_regs or cfg.stats_shfl):
            raise ValueError(
                "Fa3Backward: scale_out, stats_regs, lse_regs and stats_shfl need layout 'sdp_t'"
            )
        if cfg.tile_m == 80 and (local or varlen or cfg.dq_split != "dt"):
            # bwd_configs._tile_m80_ok says why.
            raise ValueError(
                "Fa3Backward: tile_m 80 needs dq_split 'dt' and a dense problem without a window"
            )
        if cfg.dq_split == "m" and (self.DKV_T or cfg.tile_m != 64 * cfg.num_mma_wgs):
            raise ValueError(
                f"Fa3Backward: dq_split 'm' needs layout 'sdp_t' and tile_m "
                f"{64 * cfg.num_mma_wgs}, not {cfg.layout!r} and {cfg.tile_m}"
            )

    # ----------------------------------------------------------------------------------------
    # layouts, MMAs, shared storage (trace-time helpers)
    # ----------------------------------------------------------------------------------------
    def _make_layouts(self):
        """sQ (TILE_M, D, STAGES), sdO (TILE_M, D, DO_STAGES), sK and sV (TILE_N, D), sdS (and
        sP, "dkv_t") (TILE_M, TILE_N, DS_STAGES), sLSE (TILE_M, STAGES), sD (TILE_M,
        DO_STAGES). Rows are contiguous along D (along TILE_N for sdS)."""
        width = self.dtype.width // 8
        d_atom = ForwardLayouts._k_major_atom(self.HEAD_DIM * width, self.dtype)
        sQ_l = cute.tile_to_shape(
            d_atom, (self.TILE_M, self.HEAD_DIM, self.STAGES), order=(0, 1, 2)
        )
        # sK is also dQ's MN-major B operand, D split between the warpgroups: each one's
        # D / NUM_MMA_WGS columns must be whole swizzle atoms or a whole fraction of one (D = 96:
        # 48 columns, so 32-byte atoms rather than the 64-byte ones of sQ).
        wg_bytes = self.HEAD_DIM // self.NUM_MMA_WGS * width
        row_bytes = self.HEAD_DIM * width
        atom_bytes = next(b for b in (128, 64, 32) if row_bytes % b == 0)  # d_atom's width
        k_atom = d_atom
        if wg_bytes % atom_bytes and atom_bytes % wg_bytes:
            k_atom = ForwardLayouts._k_major_atom(wg_bytes, self.dtype)
        sK_l = cute.tile_to_shape(k_atom, (self.TILE_N, self.HEAD_DIM), order=(0, 1))
        n_atom = ForwardLayouts._k_major_atom(self.TILE_N * width, self.dtype)
        sdS_l = cute.tile_to_shape(
            n_atom, (self.TILE_M, self.TILE_N, self.DS_STAGES), order=(0, 1, 2)
        )
        # Each stage a 128-byte-aligned TMA destination (80 rows: a 96-float stride).
        sLSE_l = cute.make_layout(
            (self.TILE_M, self.STAGES), stride=(1, stats_stage_rows(self.TILE_M))
        )
        if const_expr(not self.DKV_T):  # one Q / dO ring
            return sQ_l, sQ_l, sK_l, sdS_l, sLSE_l, sLSE_l
        sdO_l = cute.tile_to_shape(
            d_atom, (self.TILE_M, self.HEAD_DIM, self.DO_STAGES), order=(0, 1, 2)
        )
        sD_l = cute.make_layout((self.TILE_M, self.DO_STAGES))
        return sQ_l, sdO_l, sK_l, self._pds_layout(), sLSE_l, sD_l

    def _sdq_layout(self) -> cute.Layout:
        """sdQ (TILE_M, D) fp32 in `dq_tile_layout`'s fragment order ("warp" dq_mode; with
        dq_handoff "turn" every warpgroup's chunk on one chunk of smem; "atomic" and "red"
        allocate a single word and never touch it)."""
        return dq_tile_layout(
            self.TILE_M, self.HEAD_DIM, self.NUM_MMA_WGS, self.DQ_SPLIT, self.DQ_HANDOFF_TURN
        )

    def _make_mmas(self):
        if const_expr(self.DKV_T):
            return self._dkvt_mmas()
        major = cute.nvgpu.OperandMajorMode
        dt = self.dtype
        # S^T and dP^T: the MMA warpgroups stacked along the key rows (64 each).
        mma_sdp = sm90.make_trivial_tiled_mma(
            dt, dt, major.K, major.K, Float32, (self.NUM_MMA_WGS, 1, 1), (64, self.TILE_M)
        )
        # dV and dK: same rows, A (P^T or dS^T) from registers, B = dO or Q (D contiguous).
        mma_dkv = sm90.make_trivial_tiled_mma(
            dt,
            dt,
            major.K,
            major.MN,
            Float32,
            (self.NUM_MMA_WGS, 1, 1),
            (64, self.HEAD_DIM),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # dQ (TILE_M x D): the warpgroups split the D columns, TILE_M / 64 m64 atoms each
        # (dq_split "d"), or the rows, one m64nD atom each ("m"). "dt": dQ^T (D x TILE_M) =
        # K^T dS^T, one m64 atom of D per warpgroup, N = TILE_M; A = sK as an MN-major
        # (D, TILE_N) view, B = sdS (K-major).
        dq_atoms, dq_tiler = (1, self.NUM_MMA_WGS, 1), (64, self.HEAD_DIM // self.NUM_MMA_WGS)
        dq_major = (major.K, major.MN)
        if const_expr(self.DQ_SPLIT == "m"):
            dq_atoms, dq_tiler = (self.NUM_MMA_WGS, 1, 1), (64, self.HEAD_DIM)
        if const_expr(self.DQ_SPLIT == "dt"):
            dq_atoms, dq_tiler = (self.NUM_MMA_WGS, 1, 1), (64, self.TILE_M)
            dq_major = (major.MN, major.K)
        mma_dq = sm90.make_trivial_tiled_mma(dt, dt, *dq_major, Float32, dq_atoms, dq_tiler)
        return mma_sdp, mma_dkv, mma_dq

    def _storage(self, sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l):
        """The shared-memory struct: mbarriers, sQ, sdO, sK, sV, sdS, sLSE, sD ("dkv_t":
        `_dkvt_storage`)."""
        if const_expr(self.DKV_T):
            return self._dkvt_storage(sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l)
        dt = self.dtype
        mrange, align = cute.struct.MemRange, cute.struct.Align
        n_q, n_k, n_ds, n_lse = (cute.cosize(x) for x in (sQ_l, sK_l, sdS_l, sLSE_l))
        n_dq = self.SDQ_FLOATS
        st = self.STAGES

        @cute.struct
        class Storage:
            mbar_kv: mrange[cutlass.Int64, 2]
            mbar_qdo: mrange[cutlass.Int64, 2 * st]
            sLSE: align[mrange[Float32, n_lse], 128]
            sD: align[mrange[Float32, n_lse], 128]
            sQ: align[mrange[dt, n_q], 1024]
            sdO: align[mrange[dt, n_q], 1024]
            sK: align[mrange[dt, n_k], 1024]
            sV: align[mrange[dt, n_k], 1024]
            sdS: align[mrange[dt, n_ds], 1024]
            sdQ: align[mrange[Float32, n_dq], 128]

        return Storage

    @staticmethod
    def _transposed(s: cute.Tensor, rows: int, cols: int, stages: int = 0) -> cute.Tensor:
        """(cols, rows[, stages]) view of a (rows, cols[, stages]) smem tensor: the MN-major
        B operand of a GEMM that contracts over `rows`."""
        if stages:
            return cute.composition(
                s, cute.make_ordered_layout((cols, rows, stages), order=(1, 0, 2))
            )
        return cute.composition(s, cute.make_ordered_layout((cols, rows), order=(1, 0)))

    # ----------------------------------------------------------------------------------------
    # host side
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Nq, Hq, D)
        mK: cute.Tensor,  # (B, Nk, Hkv, D)
        mV: cute.Tensor,  # (B, Nk, Hkv, D)
        mdO: cute.Tensor,  # (B, Nq, Hq, D)
        mLSE: cute.Tensor,  # (B, Hq, Nq_pad) fp32, LSE * log2(e), -inf for empty/padding rows
        mDsum: cute.Tensor,  # (B, Hq, Nq_pad) fp32, rowsum(dO * O), 0 on padding rows
        mdQacc: cute.Tensor,  # (B, Nq, Hq, D) fp32, zeroed; dQ (scale folded in) is added here;
        # "warp" dq_mode: (B, Hq, Nq_pad, D), each TILE_M x D block in dq_tile_layout order
        mdK: cute.Tensor,  # (B, Nk, Hkv, D) input dtype
        mdV: cute.Tensor,  # (B, Nk, Hkv, D) input dtype
        scale_log2: Float32,  # softmax_scale * log2(e)
        scale: Float32,  # softmax_scale
        stream,
        mSem: cute.Tensor | None = None,  # (B, Hq, ceil(Nq / TILE_M)) int32, zeroed: deterministic
        softcap_pre: Float32 | None = None,  # softmax_scale / softcap: softcap builds only
        window_left: Int32 | None = None,  # local builds: >= 0 (unbounded: a far value)
        window_right: Int32 | None = None,  # local builds: >= 0, 0 when causal
        mCuSeqlensQ: cute.Tensor | None = None,  # (B + 1,) int32: varlen builds
        mCuSeqlensK: cute.Tensor | None = None,  # (B + 1,) int32: varlen builds
    ):
        """Varlen builds take the packed tensors of the module docstring in the same places."""
        if const_expr(self.VARLEN):
            total_k = mK.shape[0]
            mQ, mK, mV, mdO = (packed_view(t, True) for t in (mQ, mK, mV, mdO))  # (R, D, H, L)
            # dK / dV: TMA stores through the ragged view (DKV_TMA), else (total_k, D, Hkv).
            mdK, mdV = (packed_view(t, self.DKV_TMA) for t in (mdK, mdV))
            if const_expr(not self.DQ_TILED):
                mdQacc = packed_view(mdQacc, False)  # (total_q, D, Hq)
            mLSE, mDsum = (
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))
                for t in (mLSE, mDsum)
            )  # (rows_pad, Hq)
        else:
            to_ndhb = [1, 3, 2, 0]  # (B, N, H, D) -> (N, D, H, B)
            mQ, mK, mV, mdO, mdK, mdV = (
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=to_ndhb))
                for t in (mQ, mK, mV, mdO, mdK, mdV)
            )
            if const_expr(not self.DQ_TILED):
                mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=to_ndhb))
            mLSE, mDsum = (
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                for t in (mLSE, mDsum)
            )  # (Nq_pad, Hq, B)
        sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l = self._make_layouts()
        mma_sdp, mma_dkv, mma_dq = self._make_mmas()
        self.storage = self._storage(sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        row_tile = (self.TILE_M, self.HEAD_DIM)
        q_stage = cute.select(sQ_l, mode=[0, 1])
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, q_stage, row_tile)
        tma_do, tdO = cpasync.make_tiled_tma_atom(g2s, mdO, q_stage, row_tile)
        col_tile = (self.TILE_N, self.HEAD_DIM)
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, sK_l, col_tile)
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, sK_l, col_tile)
        lse_stage = cute.make_layout((self.TILE_M,))  # LSE and D have no bound (padded rows)
        tma_lse, tLSE = cpasync.make_tiled_tma_atom(g2s, mLSE, lse_stage, (self.TILE_M,))
        tma_dsum, tDsum = cpasync.make_tiled_tma_atom(g2s, mDsum, lse_stage, (self.TILE_M,))
        dkv_tmas = None  # DKV_TMA: dK and dV leave through sK / sV by TMA stores
        if const_expr(self.DKV_TMA):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_dk, tdK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_l, col_tile)
            tma_dv, tdV = cpasync.make_tiled_tma_atom(s2g, mdV, sK_l, col_tile)
            dkv_tmas = (tma_dk, tdK, tma_dv, tdV)

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]  # query heads per kv head (GQA/MQA)
        n_blocks = (seqlen_k + self.TILE_N - 1) // self.TILE_N
        grid = (n_blocks, mK.shape[2], mK.shape[3])
        if const_expr(self.LPT):
            grid = (mK.shape[2], mK.shape[3], n_blocks)
        if const_expr(self.HEAD_SECTION):
            grid = (n_blocks * mK.shape[2] * mK.shape[3], 1, 1)
        if const_expr(self.VARLEN):  # lengths per sequence, in the kernel
            seqlen_q, seqlen_k = 0, 0
            batch_n = mCuSeqlensQ.shape[0] - 1
            grid = (self.varlen_cols.grid_blocks(total_k, batch_n), mK.shape[2], 1)
        self.kernel(
            (tma_q, tQ, tma_do, tdO, tma_k, tK, tma_v, tV, tma_lse, tLSE, tma_dsum, tDsum),
            dkv_tmas,
            mdQacc,
            mdK,
            mdV,
            mma_sdp,
            mma_dkv,
            mma_dq,
            (sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l),
            Int32(seqlen_q),
            Int32(seqlen_k),
            Int32(group),
            scale_log2,
            scale,
            mSem,
            softcap_pre,
            (window_left, window_right) if const_expr(self.LOCAL) else None,
            mCuSeqlensQ,
            mCuSeqlensK,
        ).launch(
            grid=grid,
            block=[self.NUM_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # gives ptxas the entry register count setmaxnreg needs
            use_pdl=self.PDL,
        )

    # ----------------------------------------------------------------------------------------
    # device side
    # ----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tmas: tuple,  # (atom, coordinates) of Q, dO, K, V, LSE, D
        dkv_tmas: tuple | None,  # DKV_TMA: (atom, coordinates) of the dK and dV stores
        mdQacc: cute.Tensor,  # (Nq, D, Hq, B) fp32; "warp": (B, Hq, Nq_pad, D) in tiles
        mdK: cute.Tensor,  # (Nk, D, Hkv, B)
        mdV: cute.Tensor,  # (Nk, D, Hkv, B)
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        layouts: tuple,  # sQ, sdO, sK, sdS (and sP), sLSE, sD: `_make_layouts`
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        scale_log2: Float32,
        scale: Float32,
        mSem: cute.Tensor | None,  # (B, Hq, row blocks) int32: dQ turn counters, deterministic
        softcap_pre: Float32 | None,  # softmax_scale / softcap (scale_log2 = softcap * log2 e)
        win: tuple | None,  # (window_left, window_right) Int32: local builds
        mCuSeqlensQ: cute.Tensor | None,  # (B + 1,) int32: varlen builds
        mCuSeqlensK: cute.Tensor | None,  # (B + 1,) int32: varlen builds
    ):
        """The CTA's column block and sequence, then `cta`. Varlen: a virtual block past its
        sequence's keys does nothing (every thread takes that branch)."""
        tidx, _, _ = cute.arch.thread_idx()
        args = (tmas, dkv_tmas, mdQacc, mdK, mdV, mma_sdp, mma_dkv, mma_dq, layouts)
        scalars = (group, scale_log2, scale, mSem, softcap_pre, win)
        if const_expr(self.VARLEN):
            batch_n = mCuSeqlensQ.shape[0] - 1
            n_block, head_kv, valid, rows = self.varlen_cols.tile(mCuSeqlensQ, mCuSeqlensK, batch_n)
            if valid:
                self.cta(
                    tidx, n_block, head_kv, rows, rows.seqlen_q, rows.seqlen_k, *args, *scalars
                )
        else:
            if const_expr(self.LPT):
                head_kv, batch, n_block = cute.arch.block_idx()
            elif const_expr(self.HEAD_SECTION):
                bid, _, _ = cute.arch.block_idx()
                heads_kv = mdK.shape[2]
                n_blocks = (seqlen_k + self.TILE_N - 1) // self.TILE_N
                n_block, pair = section_tile(
                    bid, n_blocks, heads_kv * mdK.shape[3], self.HEAD_SECTION
                )
                batch = pair // heads_kv
                head_kv = pair - batch * heads_kv
            else:
                n_block, head_kv, batch = cute.arch.block_idx()
            rows = DenseRowsBwd(batch)
            self.cta(tidx, n_block, head_kv, rows, seqlen_q, seqlen_k, *args, *scalars)

    @cute.jit
    def cta(
        self,
        tidx: Int32,
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd: the column block's sequence
        seqlen_q: Int32,
        seqlen_k: Int32,
        tmas: tuple,
        dkv_tmas: tuple | None,
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        layouts: tuple,
        group: Int32,
        scale_log2: Float32,
        scale: Float32,
        mSem: cute.Tensor | None,
        softcap_pre: Float32 | None,
        win: tuple | None,
    ):
        """One column block of one kv head: shared memory, pipelines, the role split."""
        sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l = layouts
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            for i in cutlass.range_constexpr(0, len(tmas), 2):
                cpasync.prefetch_descriptor(tmas[i])

        st = SmemAllocator().allocate(self.storage)
        pipe_kv, pipe_qdo, pipe_do = self._make_pipelines(st, sQ_l, sK_l)
        sQ = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)  # (TILE_M, D, STAGES)
        sdO = st.sdO.get_tensor(sdO_l.outer, swizzle=sdO_l.inner)  # (TILE_M, D, DO_STAGES)
        sK = st.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)  # (TILE_N, D)
        sV = st.sV.get_tensor(sK_l.outer, swizzle=sK_l.inner)  # (TILE_N, D)
        sdS = st.sdS.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)  # (TILE_M, TILE_N, DS_ST)
        sLSE = st.sLSE.get_tensor(sLSE_l)  # (TILE_M, STAGES)
        sD = st.sD.get_tensor(sD_l)  # (TILE_M, DO_STAGES)
        sP = None
        if const_expr(self.DKV_T):
            sP = st.sP.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)  # (TILE_M, TILE_N, DS_ST)
        sdQ = st.sdQ.get_tensor(self._sdq_layout())  # (TILE_M, D) fp32; one word if "atomic"
        pipeline.pipeline_init_wait()
        if const_expr(self.PDL):
            # The launch before (the preprocess) writes LSE, D and the zeroed dQ accumulator:
            # every warp but the loader waits for it here; the loader issues K and V first
            # (`load`). The dQ postprocess may launch once every CTA got this far.
            if warp != 0:
                cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        if wg == WarpRole.PRODUCER:
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
            if warp == 0:
                self.load(
                    tmas,
                    (sQ, sdO, sK, sV, sLSE, sD),
                    (pipe_kv, pipe_qdo, pipe_do),
                    n_block,
                    head_kv,
                    rows,
                    group,
                    seqlen_q,
                    seqlen_k,
                    win,
                )
            if const_expr(self.DQ_WARP):  # noqa: SIM102 (a trace-time test, then a runtime one)
                if warp == 1:
                    self.write_dq(
                        sdQ, mdQacc, mSem, n_block, head_kv, rows, group, seqlen_q, seqlen_k, win
                    )
        else:
            cute.arch.setmaxregister_increase(self.MMA_REGS)
            # dK and dV leave by TMA stores through sK / sV (DKV_TMA) or from registers.
            dkv_out = dkv_tmas if const_expr(self.DKV_TMA) else (mdK, mdV)
            args = (
                mma_sdp,
                mma_dkv,
                mma_dq,
                (sQ, sdO, sK, sV, sP, sdS, sLSE, sD, sdQ),
                (pipe_kv, pipe_qdo, pipe_do),
                mdQacc,
                dkv_out,
                tidx - 128,
                n_block,
                head_kv,
                rows,
                group,
                seqlen_q,
                seqlen_k,
                scale_log2,
                scale,
                mSem,
                softcap_pre,
                win,
            )
            if const_expr(self.DKV_T):
                self.mma_t(*args)
            else:
                self.mma(*args)
