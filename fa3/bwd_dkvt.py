"""The "dkv_t" layout of the fa3 backward (`BwdConfig.layout`), for D = 192 and 256, where the
"sdp_t" layout's D x 64 keys of fp32 dK and dV per warpgroup do not fit the registers.
`bwd_kernel.Fa3Backward` mixes `BwdDkvT` in; the producer, the dQ writer warp, the
elementwise steps (`bwd_pointwise.BwdSteps`) and the dQ routes (`bwd_dq.BwdDq`) are shared.

Per row block (TILE_M = 64 query rows against the CTA's TILE_N keys), per MMA warpgroup:
    S    = Q K^T       SS wgmma, M = the 64 rows, N = this WG's TILE_N / NUM_MMA_WGS keys
    dP   = dO V^T      SS wgmma, the same split
    P    = exp2(S * scale_log2 - LSE_log2), dS = P * (dP - D) * scale, 16-bit, to sP and sdS
    dV^T += dO^T P     SS wgmma, A = sdO as an MN-major (D, TILE_M) view, B = sP as an MN-major
                       (TILE_N, TILE_M) view; M = D
    dQ    = dS K       SS wgmma, A = sdS, B = sK as an MN-major (D, TILE_N) view; the WGs split D
    dK^T += Q^T dS     SS wgmma, like dV^T
dK^T and dV^T are split between the WGs by D ("d": D / NUM_MMA_WGS rows each, every key) or by
keys ("keys": every row of D, TILE_N / NUM_MMA_WGS keys each), `BwdConfig.dkv_split`.

Q / LSE and dO / D come through two TMA rings (`pipe_q`, STAGES deep, released when dK^T has
retired; `pipe_do`, DO_STAGES deep, released as soon as dV^T has retired). sP and sdS
(DS_STAGES buffers) are published by the named barrier DS_READY after the writes and the
async-proxy fence; with one buffer DS_FREE comes before the writes (every WG has retired the
previous block's dV^T, dQ and dK^T, the wgmmas that read them). The elementwise steps see the
fragment through a (key, row) coordinate view, so they are the "sdp_t" layout's own.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from flashsuite.fa3.bwd_dq import Barrier
from flashsuite.fa3.fwd_layouts import ForwardLayouts


class BwdDkvT:
    """Layouts, MMAs and the MMA warpgroups' loop of the "dkv_t" layout. Uses the kernel's
    TILE_M, TILE_N, HEAD_DIM, STAGES, DO_STAGES, DS_STAGES, NUM_MMA_WGS, MMA_THREADS, dtype,
    DKV_SPLIT_D, OVERLAP and the shared steps."""

    def _pds_layout(self) -> cute.ComposedLayout:
        """sP and sdS (TILE_M, TILE_N, DS_STAGES), keys contiguous. Each WG writes its S
        columns (TILE_N / NUM_MMA_WGS keys) from the accumulator, and dV^T / dK^T read their N
        keys as an MN-major B operand: the swizzle atom must divide both (D = 256, TILE_N = 48:
        24 and 48 keys, no swizzle; D = 192, TILE_N = 96: 48 keys, 32-byte atoms)."""
        width = self.dtype.width // 8
        w = self.NUM_MMA_WGS
        n_dkv = self.TILE_N if const_expr(self.DKV_SPLIT_D) else self.TILE_N // w
        row_bytes = math.gcd(self.TILE_N // w, n_dkv) * width
        kind = warpgroup.SmemLayoutAtomKind
        if row_bytes % 32 == 0:
            atom = ForwardLayouts._k_major_atom(row_bytes, self.dtype)
        else:  # 8 x 8 core matrices: a warp's 4-byte stores still fill 128 contiguous bytes
            atom = warpgroup.make_smem_layout_atom(kind.K_INTER, self.dtype)
        return cute.tile_to_shape(atom, (self.TILE_M, self.TILE_N, self.DS_STAGES), order=(0, 1, 2))

    def _dkvt_mmas(self):
        """S / dP (rows on M, the WGs split the keys), dK^T / dV^T (D on M, both operands from
        smem and MN-major), dQ (the WGs split D, as in "sdp_t"; with DQ_SLICES each slice of
        D / DQ_SLICES columns split the same way)."""
        major = cute.nvgpu.OperandMajorMode
        dt, w = self.dtype, self.NUM_MMA_WGS
        mma_sdp = sm90.make_trivial_tiled_mma(
            dt, dt, major.K, major.K, Float32, (1, w, 1), (64, self.TILE_N // w)
        )
        if const_expr(self.DKV_SPLIT_D):
            atoms, tiler = (w, 1, 1), (64, self.TILE_N)
        else:
            atoms, tiler = (1, w, 1), (64, self.TILE_N // w)
        mma_dkv = sm90.make_trivial_tiled_mma(dt, dt, major.MN, major.MN, Float32, atoms, tiler)
        mma_dq = sm90.make_trivial_tiled_mma(
            dt,
            dt,
            major.K,
            major.MN,
            Float32,
            (1, w, 1),
            (64, self.HEAD_DIM // w // self.DQ_SLICES),
        )
        return mma_sdp, mma_dkv, mma_dq

    def _dkvt_storage(self, sQ_l, sdO_l, sK_l, sdS_l, sLSE_l, sD_l):
        """The shared-memory struct: mbarriers of K/V, the Q ring and the dO ring, sLSE, sD, sQ,
        sdO, sK, sV, sP, sdS, sdQ (bwd_smem_bytes mirrors it)."""
        dt = self.dtype
        mrange, align = cute.struct.MemRange, cute.struct.Align
        n_q, n_do, n_k, n_ds = (cute.cosize(x) for x in (sQ_l, sdO_l, sK_l, sdS_l))
        n_lse, n_d = cute.cosize(sLSE_l), cute.cosize(sD_l)
        n_dq = self.SDQ_FLOATS
        st, dst = self.STAGES, self.DO_STAGES

        @cute.struct
        class Storage:
            mbar_kv: mrange[cutlass.Int64, 2]
            mbar_qdo: mrange[cutlass.Int64, 2 * st]
            mbar_do: mrange[cutlass.Int64, 2 * dst]
            sLSE: align[mrange[Float32, n_lse], 128]
            sD: align[mrange[Float32, n_d], 128]
            sQ: align[mrange[dt, n_q], 1024]
            sdO: align[mrange[dt, n_do], 1024]
            sK: align[mrange[dt, n_k], 1024]
            sV: align[mrange[dt, n_k], 1024]
            sP: align[mrange[dt, n_ds], 1024]
            sdS: align[mrange[dt, n_ds], 1024]
            sdQ: align[mrange[Float32, n_dq], 128]

        return Storage

    @staticmethod
    def _stage_view(s: cute.Tensor, stage: Int32, rows: int) -> cute.Tensor:
        """(rows, 1) view of stage `stage` of a compact (rows, stages) sLSE / sD: the stage
        index the elementwise steps take is then 0 for both, whatever ring each came from."""
        return cute.make_tensor(s.iterator + stage * rows, cute.make_layout((rows, 1)))

    @cute.jit
    def mma_t(
        self,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        smem: tuple,
        pipes: tuple,
        mdQacc: cute.Tensor,
        dkv_tmas: tuple,  # (atom, coordinates) of the dK and dV TMA stores
        mtid: Int32,  # 0 .. MMA_THREADS - 1
        n_block: Int32,
        head_kv: Int32,
        rows,  # bwd_varlen.DenseRowsBwd / SeqRowsBwd: the column block's sequence
        group: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
        scale: Float32,
        mSem: cute.Tensor | None,
        softcap_pre: Float32 | None,
        win: tuple | None,  # (window_left, window_right): local builds
    ):
        """MMA warpgroups, "dkv_t": the five GEMMs of every row block, dQ to the accumulator,
        then dK and dV."""
        sQ, sdO, sK, sV, sP, sdS, sLSE, sD, sdQ = smem
        pipe_kv, pipe_q, pipe_do = pipes
        m_block_min, n_m, n_iter = self.row_blocks(n_block, seqlen_q, seqlen_k, group, win)
        D, TM, TN = self.HEAD_DIM, self.TILE_M, self.TILE_N
        thr_sdp = mma_sdp.get_slice(mtid)
        thr_dkv = mma_dkv.get_slice(mtid)
        thr_dq = mma_dq.get_slice(mtid)
        # WG_SLICE: the shared-memory operands partitioned with the slice of the warpgroup's
        # first thread, made warp-uniform, so their descriptors live in uniform registers (as
        # in BwdSdpT.mma; without it ptxas rebuilds each one per wgmma and moves it by R2UR).
        wg_sdp, wg_dkv, wg_dq = thr_sdp, thr_dkv, thr_dq
        if const_expr(self.WG_SLICE):
            wg_first = cute.arch.make_warp_uniform(mtid // 128) * 128
            wg_sdp = mma_sdp.get_slice(wg_first)
            wg_dkv = mma_dkv.get_slice(wg_first)
            wg_dq = mma_dq.get_slice(wg_first)
        # S = Q K^T and dP = dO V^T.
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))  # (MMA, 1, D/16, STAGES)
        tSrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))  # (MMA, 1, D/16, DO_STAGES)
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))  # (MMA, 1, D/16)
        tSrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))  # (MMA, 1, D/16)
        acc_S = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((TM, TN)))  # 2 rows a thread
        acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((TM, TN)))
        # dV^T += dO^T P and dK^T += Q^T dS: (D, TILE_M) views of sdO / sQ as A, (TILE_N, TILE_M)
        # views of sP / sdS as B, all MN-major.
        sdOt = self._transposed(sdO, TM, D, self.DO_STAGES)  # (D, TILE_M, DO_STAGES)
        sQt = self._transposed(sQ, TM, D, self.STAGES)  # (D, TILE_M, STAGES)
        sPt = self._transposed(sP, TM, TN, self.DS_STAGES)  # (TILE_N, TILE_M, DS_STAGES)
        sdSt = self._transposed(sdS, TM, TN, self.DS_STAGES)
        tdVrdO = wg_dkv.make_fragment_A(wg_dkv.partition_A(sdOt))  # (MMA, M, TM/16, DO_ST)
        tdVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(sPt))  # (MMA, N, TM/16, DS_ST)
        tdKrQ = wg_dkv.make_fragment_A(wg_dkv.partition_A(sQt))  # (MMA, M, TM/16, ST)
        tdKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdSt))  # (MMA, N, TM/16, DS_ST)
        acc_dV = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((D, TN)))  # dV^T
        acc_dK = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((D, TN)))  # dK^T
        # dQ = dS K: A = sdS (TILE_M, TILE_N), B = K as a (D, TILE_N) MN-major view (in
        # DQ_SLICES row slices of D / DQ_SLICES, the slices' dQ columns).
        sKt = self._transposed(sK, TN, D)  # (D, TILE_N)
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (MMA, 1, TN/16, DS_ST)
        dq_cols = D // self.DQ_SLICES
        if const_expr(self.DQ_SLICES == 1):
            tdQrK = [wg_dq.make_fragment_B(wg_dq.partition_B(sKt))]  # (MMA, 1, TN/16)
        else:
            tdQrK = [
                wg_dq.make_fragment_B(
                    wg_dq.partition_B(cute.local_tile(sKt, (dq_cols, TN), (c, 0)))
                )
                for c in range(self.DQ_SLICES)
            ]  # (MMA, 1, TN/16) each
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((TM, dq_cols)))
        # (key, row) coordinates of each S element: the "sdp_t" steps index them that way.
        key_row = cute.composition(
            cute.make_identity_tensor((TN, TM)), cute.make_layout((TM, TN), stride=(TN, 1))
        )
        tScS = thr_sdp.partition_C(key_row)
        tPsP = thr_sdp.partition_C(sP)  # (MMA, 1, 1, DS_STAGES): where this thread's P goes
        tPsdS = thr_sdp.partition_C(sdS)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        if n_iter > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
            do_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.DO_STAGES
            )
            shift = seqlen_k - seqlen_q
            edges = self.key_edges(n_block, seqlen_k, shift, win)
            for i in cutlass.range(n_iter, unroll=1):
                head, m_block = self.row_block(i, m_block_min, n_m, head_kv, group)
                masked = self.block_masked(m_block, n_block, shift, edges, win)
                s, sd = q_state.index, do_state.index
                ds_i = 0  # the sP / sdS buffer of this row block
                if const_expr(self.DS_STAGES > 1):
                    ds_i = i % self.DS_STAGES
                lse_i = self._stage_view(sLSE, s, TM)  # (TILE_M, 1)
                d_i = self._stage_view(sD, sd, TM)  # (TILE_M, 1)
                pipe_q.consumer_wait(q_state, pipe_q.consumer_try_wait(q_state))
                self.gemm_ss(mma_sdp, acc_S, tSrQ[None, None, None, s], tSrK, False)
                pipe_do.consumer_wait(do_state, pipe_do.consumer_try_wait(do_state))
                self.gemm_ss(mma_sdp, acc_dP, tSrdO[None, None, None, sd], tSrV, False)
                probs_args = (tScS, lse_i, 0, masked, n_block, m_block, seqlen_k, shift,
                              scale_log2, win)  # fmt: skip
                self.probs_and_dscores(acc_S, acc_dP, probs_args, d_i, scale, softcap_pre, rP, rdS)
                # One buffer: every WG has retired the previous block's dV^T, dQ and dK^T (the
                # readers of sP and sdS) before either is rewritten. Two: the previous block's
                # DS_READY already ordered it.
                if const_expr(self.DS_STAGES == 1):
                    cute.arch.barrier(
                        barrier_id=int(Barrier.DS_FREE), number_of_threads=self.MMA_THREADS
                    )
                cute.autovec_copy(rP, tPsP[None, None, None, ds_i])
                cute.autovec_copy(rdS, tPsdS[None, None, None, ds_i])
                # Generic-proxy smem writes must be visible to the wgmma (async proxy) reads.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(
                    barrier_id=int(Barrier.DS_READY), number_of_threads=self.MMA_THREADS
                )
                self.gemm_ss(mma_dkv, acc_dV, tdVrdO[None, None, None, sd],
                             tdVrP[None, None, None, ds_i], True)  # fmt: skip
                self.gemm_ss(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_i], tdQrK[0], False)
                self.gemm_ss(mma_dkv, acc_dK, tdKrQ[None, None, None, s],
                             tdKrdS[None, None, None, ds_i], True)  # fmt: skip
                warpgroup.wait_group(2)  # dV^T retired: the dO stage is read
                pipe_do.consumer_release(do_state)
                warpgroup.wait_group(1)  # dQ (its first slice) retired; dK^T runs on
                if const_expr(self.DQ_SLICES == 1):
                    self.dq_out(thr_dq, acc_dQ, sdQ, mdQacc, mSem, mtid, n_block, head, rows,
                                m_block, seqlen_q)  # fmt: skip
                    warpgroup.wait_group(0)  # dK^T retired: the Q stage is read
                else:  # the next slice into the same registers once this one has left
                    self.red_dq(thr_dq, acc_dQ, mdQacc, head, rows, m_block, 0)
                    self.gemm_ss(mma_dq, acc_dQ, tdQrdS[None, None, None, ds_i], tdQrK[1], False)
                    warpgroup.wait_group(1)  # dK^T retired: the Q stage is read
                pipe_q.consumer_release(q_state)
                if const_expr(self.DQ_SLICES > 1):
                    warpgroup.wait_group(0)
                    self.red_dq(thr_dq, acc_dQ, mdQacc, head, rows, m_block, dq_cols)
                q_state.advance()
                do_state.advance()
        self.store_dkv_tma(
            thr_dkv, acc_dK, acc_dV, sK, sV, dkv_tmas, mtid, n_block, head_kv, rows, True
        )
