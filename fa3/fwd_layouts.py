"""The fa3 forward's trace-time data layout: shared-memory layouts and storage, the two
wgmma tilings, the TMA atoms and the mbarrier pipelines, and the global-tensor views.

`ForwardLayouts` is a base of the kernel class (`kernels.Fa3Forward`). Reads the static
configuration set by the kernel's `__init__` (dtype, FP8, HEAD_DIM, TILE_M, TILE_N, STAGES,
NUM_CONSUMER_WGS, ...). V's side has three branches: 16-bit V is loaded as it lies in gmem
(keys x D blocks) and PV reads it as an MN-major Vᵀ view; fp8 wgmma takes no MN-major operand,
so with VT_HOST (v_transpose="host") the host hands the kernel Vᵀ (B, Hkv, D, Nk) with the keys
contiguous and the kernel loads K-major (D x keys) blocks of it (`_make_layouts`, `_pv_b_major`,
`_v_view`, `_v_box`, `_v_blocks`, `_v_operand`); with VT_SMEM (v_transpose="smem") V is loaded
as it lies, into sV with sK's layout, and the producer warpgroup's transposing warps write each
block into a Vᵀ ring sVt (the host Vᵀ path's smem layout) on a pipeline of its own (`pipe_vt`:
full when the transposing warps have written and fenced a stage, empty when P·V retired).
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as objects.
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from flashsuite.fa3.configs import TRANSPOSE_WARPS
from flashsuite.fa3.pipeline import VtPipe
from flashsuite.fa3.varlen import lse_view, rows_view


class ForwardLayouts:
    """Layouts, MMAs, shared storage, TMA atoms and pipelines of the forward (trace time)."""

    @staticmethod
    def _k_major_atom(row_bytes: int, dtype: type[cutlass.Numeric]):
        """Widest K-major swizzle atom whose row segment divides `row_bytes`."""
        kind = warpgroup.SmemLayoutAtomKind
        if row_bytes % 128 == 0:
            k = kind.K_SW128
        elif row_bytes % 64 == 0:
            k = kind.K_SW64
        else:
            k = kind.K_SW32
        return warpgroup.make_smem_layout_atom(k, dtype)

    def _smem_atom(self, dtype: type[cutlass.Numeric]):
        # Rows are D-contiguous for Q, K, 16-bit V and O.
        return self._k_major_atom(self.HEAD_DIM * dtype.width // 8, dtype)

    def _make_layouts(self):
        """Shared-memory layouts sQ (TILE_M, D; (TILE_M, D, Q_STAGES) with two Q buffers), sK
        (TILE_N, D, STAGES), sV, sO (`_o_layout`).

        16-bit V is loaded as it lies in gmem (keys x D): sV has sK's layout, and PV reads it
        as an MN-major Vᵀ view (`_v_operand`). fp8 loads Vᵀ blocks: sV is (D, TILE_N, STAGES),
        PV's K-major B operand, rows of TILE_N key bytes.
        """
        atom = self._smem_atom(self.dtype)
        sQ_l = cute.tile_to_shape(atom, (self.TILE_M, self.HEAD_DIM), order=(0, 1))
        if const_expr(self.Q_STAGES > 1):
            sQ_l = cute.tile_to_shape(
                atom, (self.TILE_M, self.HEAD_DIM, self.Q_STAGES), order=(0, 1, 2)
            )  # (TILE_M, D, Q_STAGES)
        sK_l = cute.tile_to_shape(
            atom, (self.TILE_N, self.HEAD_DIM, self.STAGES), order=(0, 1, 2)
        )  # (TILE_N, D, STAGES)
        sV_l = sK_l
        if self.VT_HOST:
            vt_atom = self._k_major_atom(self.TILE_N, self.dtype)
            sV_l = cute.tile_to_shape(
                vt_atom, (self.HEAD_DIM, self.TILE_N, self.STAGES), order=(0, 1, 2)
            )  # (D, TILE_N, STAGES)
        return sQ_l, sK_l, sV_l, self._o_layout()

    def _vt_layout(self):
        """VT_SMEM: the Vᵀ ring sVt (D, TILE_N, STAGES), PV's K-major B operand (the layout the
        host-Vᵀ build loads its blocks into)."""
        vt_atom = self._k_major_atom(self.TILE_N, self.dtype)
        return cute.tile_to_shape(
            vt_atom, (self.HEAD_DIM, self.TILE_N, self.STAGES), order=(0, 1, 2)
        )  # (D, TILE_N, STAGES)

    def _o_layout(self):
        """sO in O's dtype: (TILE_M, D), or (64, D, NUM_CONSUMER_WGS) slabs with PER_WG_EPILOGUE,
        each slab contiguous so a (64, D) TMA box stores it (sQ_l's atoms are stacked along all
        TILE_M rows first, so a 64-row slice of it is not one box)."""
        atom = self._smem_atom(self.o_dtype)
        if self.PER_WG_EPILOGUE:
            return cute.tile_to_shape(
                atom, (64, self.HEAD_DIM, self.NUM_CONSUMER_WGS), order=(0, 1, 2)
            )
        return cute.tile_to_shape(atom, (self.TILE_M, self.HEAD_DIM), order=(0, 1))

    def _pv_b_major(self):
        """Major mode of PV's B operand Vᵀ (D x keys) in smem."""
        if self.FP8:
            return cute.nvgpu.OperandMajorMode.K  # Vᵀ blocks with the keys contiguous
        return cute.nvgpu.OperandMajorMode.MN  # Vᵀ: the N mode (head_dim) is contiguous in sV

    def _make_mmas(self):
        major = cute.nvgpu.OperandMajorMode
        # The consumer warpgroups stacked along M: NUM_CONSUMER_WGS x 64 rows = TILE_M.
        wgs = (self.NUM_CONSUMER_WGS, 1, 1)
        mma_qk = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            major.K,
            major.K,
            Float32,
            wgs,
            (64, self.TILE_N),
            # Q_IN_REGS: Q from registers (loaded once a tile, utils.q_to_regs)
            a_source=warpgroup.OperandSource.RMEM
            if self.Q_IN_REGS
            else warpgroup.OperandSource.SMEM,
        )
        mma_pv = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            major.K,
            self._pv_b_major(),
            Float32,
            wgs,
            (64, self.HEAD_DIM),
            a_source=warpgroup.OperandSource.RMEM,  # P stays in registers
        )
        return mma_qk, mma_pv

    def _storage(self, sQ_l, sK_l, sV_l, sO_l):
        """The shared-memory struct: mbarriers, sQ, sK, sV and sO (none where sO aliases sQ);
        with a separate sO (and no Vᵀ ring) also sLSE, the LSE rows of a tile on their way to
        LSE_TMA's store, inside the barriers' 1 KiB."""
        dt, o_dt = self.dtype, self.o_dtype
        mrange, align = cute.struct.MemRange, cute.struct.Align
        n_q, n_k, n_v, n_o = (cute.cosize(x) for x in (sQ_l, sK_l, sV_l, sO_l))
        st, q_st = self.STAGES, self.Q_STAGES
        tiles = self.TILE_COUNTER

        if const_expr(self.VT_SMEM):
            n_vt = cute.cosize(self._vt_layout())

            @cute.struct
            class Storage:
                mbar_q: mrange[cutlass.Int64, 2 * q_st]
                mbar_k: mrange[cutlass.Int64, 2 * st]
                mbar_v: mrange[cutlass.Int64, 2 * st]
                mbar_vt: mrange[cutlass.Int64, 2 * st]
                sQ: align[mrange[dt, n_q], 1024]
                sK: align[mrange[dt, n_k], 1024]
                sV: align[mrange[dt, n_v], 1024]
                sVt: align[mrange[dt, n_vt], 1024]
                sO: align[mrange[o_dt, n_o], 1024]

        elif const_expr(self.O_ALIAS_Q):

            @cute.struct
            class Storage:
                mbar_q: mrange[cutlass.Int64, 2 * q_st]
                mbar_k: mrange[cutlass.Int64, 2 * st]
                mbar_v: mrange[cutlass.Int64, 2 * st]
                if tiles:  # TILE_COUNTER: the tile ring's 2 full + 2 empty mbarriers, its slots
                    mbar_tile: mrange[cutlass.Int64, 4]
                    sTile: mrange[Int32, 2]
                sQ: align[mrange[dt, n_q], 1024]
                sK: align[mrange[dt, n_k], 1024]
                sV: align[mrange[dt, n_v], 1024]

        else:

            @cute.struct
            class Storage:
                mbar_q: mrange[cutlass.Int64, 2 * q_st]
                mbar_k: mrange[cutlass.Int64, 2 * st]
                mbar_v: mrange[cutlass.Int64, 2 * st]
                if tiles:  # TILE_COUNTER, as above
                    mbar_tile: mrange[cutlass.Int64, 4]
                    sTile: mrange[Int32, 2]
                sLSE: align[mrange[Float32, self.TILE_M], 128]  # LSE_TMA's staging
                sQ: align[mrange[dt, n_q], 1024]
                sK: align[mrange[dt, n_k], 1024]
                sV: align[mrange[dt, n_v], 1024]
                sO: align[mrange[o_dt, n_o], 1024]

        return Storage

    # V's place in gmem, TMA and smem: (keys, D) blocks for 16-bit V, (D, keys) blocks of Vᵀ
    # for fp8.
    def _v_view(self) -> list[int]:
        """The modes of the V argument in the kernel's (rows, columns, Hkv, B) order: 16-bit V
        (B, Nk, Hkv, D) -> (Nk, D, Hkv, B); fp8 Vᵀ (B, Hkv, D, Nk) -> (D, Nk, Hkv, B)."""
        return [2, 3, 1, 0] if self.VT_HOST else [1, 3, 2, 0]

    def _v_box(self) -> tuple[int, int]:
        """The TMA box (and smem stage shape) of one V (VT_HOST: Vᵀ) block."""
        if self.VT_HOST:
            return (self.HEAD_DIM, self.TILE_N)
        return (self.TILE_N, self.HEAD_DIM)

    def _v_blocks(self, v_rows: cute.Tensor) -> cute.Tensor:
        """V of one (sequence, kv head), (Nk, D), tiled into blocks: (TILE_N, D, n_blocks); fp8:
        Vᵀ (D, Nk) into (D, TILE_N, n_blocks) with VT_HOST."""
        if self.VT_HOST:
            return cute.local_tile(v_rows, (self.HEAD_DIM, self.TILE_N), (0, None))
        return cute.local_tile(v_rows, (self.TILE_N, self.HEAD_DIM), (None, 0))

    def _v_operand(self, sV: cute.Tensor) -> cute.Tensor:
        """Vᵀ as the B operand of PV, (D, TILE_N, STAGES): an MN-major view of sV's bytes
        (16-bit), or sV itself (VT_HOST: the loaded Vᵀ blocks are already K-major)."""
        if self.VT_HOST:
            return sV
        return cute.composition(
            sV,
            cute.make_ordered_layout((self.HEAD_DIM, self.TILE_N, self.STAGES), order=(1, 0, 2)),
        )

    def _kernel_views(self, mQ, mK, mV, mO, mLSE):
        """Kernel views: (N, D, H, B) for TMA (4-D descriptors), V per `_v_view`, (N, H, B) LSE;
        packed inputs (VARLEN): the ragged (R, D, H, L) views and a (total_q, Hq) LSE
        (varlen.py)."""
        mQ, mK = rows_view(mQ, self.VARLEN), rows_view(mK, self.VARLEN)
        if const_expr(self.VARLEN):
            mV = rows_view(mV, True)
        else:
            mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=self._v_view()))
        mO = rows_view(mO, self.VARLEN)
        return mQ, mK, mV, mO, lse_view(mLSE, self.VARLEN)

    def _q_stage_layout(self, sQ_l):
        """One Q buffer's layout (TILE_M, D): sQ_l itself, or its first stage."""
        if const_expr(self.Q_STAGES > 1):
            return cute.select(sQ_l, mode=[0, 1])
        return sQ_l

    def _make_tmas(self, mQ, mK, mV, mO, sQ_l, sK_l, sV_l, sO_l):
        """TMA atoms and coordinate tensors: loads of Q, K, V (one stage each), store of O."""
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(
            g2s, mQ, self._q_stage_layout(sQ_l), (self.TILE_M, self.HEAD_DIM)
        )
        tma_k, tK = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_l, mode=[0, 1]), (self.TILE_N, self.HEAD_DIM)
        )
        tma_v, tV = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(sV_l, mode=[0, 1]), self._v_box()
        )
        o_rows = 64 if self.PER_WG_EPILOGUE else self.TILE_M
        tma_o, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            mO,
            cute.select(sO_l, mode=[0, 1]),
            (o_rows, self.HEAD_DIM),
        )
        return tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO

    def _make_pipelines(self, st, sQ_l, sK_l, sV_l):
        """The Q, K and V TMA pipelines on their mbarriers in `st` (init arrive included)."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # consumer_release arrives from one lane per warp: the count is consumer *warps*.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.CONSUMER_THREADS // 32)

        def make_pipe(stages, smem_l, mbar):
            return pipeline.PipelineTmaAsync.create(
                num_stages=stages,
                producer_group=producer,
                consumer_group=consumers,
                tx_count=cute.size_in_bytes(self.dtype, smem_l),  # the TMA bytes of one stage
                barrier_storage=mbar.data_ptr(),
                defer_sync=True,
            )

        pipe_q = make_pipe(self.Q_STAGES, self._q_stage_layout(sQ_l), st.mbar_q)
        pipe_k = make_pipe(self.STAGES, cute.select(sK_l, mode=[0, 1]), st.mbar_k)
        if const_expr(self.VT_SMEM):
            # sV is read by the transposing warps, whose lane 0 releases it; sVt is written
            # by them (lane 0 of each commits, after its warp's writes and fences) and read by
            # the consumers (lane 0 of each warp releases, `VtPipe`).
            transposers = pipeline.CooperativeGroup(pipeline.Agent.Thread, TRANSPOSE_WARPS)
            pipe_v = pipeline.PipelineTmaAsync.create(
                num_stages=self.STAGES,
                producer_group=producer,
                consumer_group=transposers,
                tx_count=cute.size_in_bytes(self.dtype, cute.select(sV_l, mode=[0, 1])),
                barrier_storage=st.mbar_v.data_ptr(),
                defer_sync=True,
            )
            pipe_vt = pipeline.PipelineAsync.create(
                num_stages=self.STAGES,
                producer_group=transposers,
                consumer_group=consumers,
                barrier_storage=st.mbar_vt.data_ptr(),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive()
            return pipe_q, pipe_k, pipe_v, pipe_vt
        pipe_v = make_pipe(self.STAGES, cute.select(sV_l, mode=[0, 1]), st.mbar_v)
        pipeline.pipeline_init_arrive()
        return pipe_q, pipe_k, pipe_v

    def _make_tile_pipe(self, st):
        """TILE_COUNTER: the two-slot ring on which the producer warp's lane 0 hands each tile
        index to every consumer thread (all of them release a slot once they have read it)."""
        return pipeline.PipelineAsync.create(
            num_stages=2,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.CONSUMER_THREADS),
            barrier_storage=st.mbar_tile.data_ptr(),
            defer_sync=True,
        )

    def _allocate_smem(self, sQ_l, sK_l, sV_l, sO_l):
        """Kernel prologue: the storage struct, its pipelines and smem tensors, then the wait
        for every thread's view of the initialised mbarriers. Returns (pipes, tensors, vt):
        pipes = (pipe_q, pipe_k, pipe_v, the pipeline P·V waits on: pipe_v, or with VT_SMEM the
        consumers' view of pipe_vt); tensors = `_smem_tensors`' and the tile ring (TILE_COUNTER:
        (its pipeline, its two int32 slots), else None); vt is None, or with VT_SMEM the
        transposing warps' (pipe_v, pipe_vt, sV address, sVt address)."""
        st = SmemAllocator().allocate(self.storage)
        tiles = None
        if const_expr(self.TILE_COUNTER):  # initialised before _make_pipelines' fence
            tiles = (self._make_tile_pipe(st), st.sTile.get_tensor(cute.make_layout(2)))
        pipes = self._make_pipelines(st, sQ_l, sK_l, sV_l)
        smem = (*self._smem_tensors(st, sQ_l, sK_l, sV_l, sO_l), tiles)
        vt = None
        if const_expr(self.VT_SMEM):
            pipe_q, pipe_k, pipe_v, pipe_vt = pipes
            pipes = (pipe_q, pipe_k, pipe_v, VtPipe(pipe_vt))
            addr = (st.sV.data_ptr().toint(), st.sVt.data_ptr().toint())
            vt = (pipe_v, pipe_vt, *addr)
        else:
            pipes = (*pipes, pipes[2])
        pipeline.pipeline_init_wait()
        return pipes, smem, vt

    def _smem_tensors(self, st, sQ_l, sK_l, sV_l, sO_l):
        """sQ (TILE_M, D), sK (TILE_N, D, STAGES), sV (the V TMA's destination), sVt (PV's
        B operand, (D, TILE_N, STAGES); sV itself for fp8), sO (on sQ with O_ALIAS_Q) and
        sLSE (LSE_TMA, else None)."""
        sQ = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)  # (TILE_M, D[, Q_STAGES])
        sK = st.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)  # (TILE_N, D, STAGES)
        sV = st.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)  # (TILE_N, D, STAGES); fp8 Vᵀ
        sVt = self._v_operand(sV)  # (D, TILE_N, STAGES)
        if const_expr(self.VT_SMEM):
            vt_l = self._vt_layout()
            sVt = st.sVt.get_tensor(vt_l.outer, swizzle=vt_l.inner)  # (D, TILE_N, STAGES)
        if const_expr(self.O_ALIAS_Q):
            sO = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)  # (TILE_M, D) on sQ
        else:
            sO = st.sO.get_tensor(sO_l.outer, swizzle=sO_l.inner)  # (TILE_M, D) or (64, D, WGS)
        sLSE = None
        if const_expr(self.LSE_TMA):
            sLSE = st.sLSE.get_tensor(cute.make_layout(self.TILE_M))  # (TILE_M,) fp32
        return sQ, sK, sV, sVt, sO, sLSE
