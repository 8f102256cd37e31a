"""FA3-style attention forward for Hopper (sm_90a) in the CuTe DSL.

One CTA owns a TILE_M = 64 x NUM_CONSUMER_WGS-row query tile of one (batch, head) and runs
one producer and two (or three) consumer warpgroups:

- WG0, the producer (24 registers; 32 with three consumers): warp 0 loads Q once on its own
  mbarrier pipeline, then K and V per n-block into STAGES-deep TMA rings (`PipelineTmaAsync`),
  newest block first.
- WG1.. the consumers (240 registers; 160 with three), 64 query rows each: S = Q·Kᵀ (SS wgmma),
  mask, online softmax in base 2 (scale folded into one FMA), P converted to 16 bits in
  registers as the A operand of the RS wgmma O += P·V (Vᵀ is an MN-major view of sV).
- PINGPONG: one named barrier per consumer WG passes a token round the ring 0 -> 1 (-> 2) -> 0,
  so the WGs take turns on the tensor cores and one WG's softmax overlaps the others' GEMMs.
  INTRA_WG_OVERLAP: a WG issues QK(n+1) before PV(n) and runs the softmax of n+1 while PV(n)
  is still in flight.
- PERSISTENT: the grid is one CTA per SM and each CTA walks tiles bid, bid + grid, ... in
  `tile_coords` order (heaviest causal tiles first, heads grouped so their K/V stay in L2).
  Pipeline states carry their phases from tile to tile; Q is loaded and released once per tile
  (released after the main loop, or after the O store where sO aliases sQ). BALANCED_ORDER
  (Fa3Config.balanced_order) evens out the CTAs' causal work: see `tile_coords`, `cta_tile`.
- Epilogue: O scaled by 1/l (0 for empty rows), LSE (natural log, -inf for empty rows) stored
  in fp32, O via stmatrix into smem, fence, named barrier, TMA store.

Persistent tile overlap (Fa3Config.overlap_tiles, persistent only). Per CTA the tiles run
t = 0, 1, ... in the schedule order; n_t = n_block_max - n_block_min K/V blocks (may be 0).
W = consumer warps (4 x NUM_CONSUMER_WGS), every mbarrier below is a `PipelineTmaAsync` one:
full barriers complete on the producer's arrive_and_expect_tx (count 1) + the TMA bytes, empty
barriers on W consumer-warp arrivals; a state's phase flips each time its index wraps.

  barrier          arrivals per tile t                     who waits, on which parity
  Q full  (1 st.)  1 + bytes_q, once per tile (also n_t=0)  consumers: q_state, flips per tile
  Q empty (1 st.)  W: after each warp's last QK has retired  producer: before Q of tile t+1
                   (intra-WG overlap, separate sO; n_t = 0: before the epilogue; without
                   intra-WG overlap: after the main loop; O_ALIAS_Q: after the O store read sQ)
  K full/empty     n_t each, stage kv_state.index           K empty released after the QK
  V full/empty     n_t each, same stage as K                V empty released after the PV
  PINGPONG_WGc     intra-WG overlap: n_t - 1 syncs and n_t - 1 arrives per WG and tile, so
                   the token makes whole rounds and is back at WG0 when tile t+1 starts;
                   without overlap: 1 + n_t syncs, n_t + 1 arrives per WG
  EPILOGUE_WGc     separate sO: 2 syncs of the 128 threads of WG c per tile (before writing
                   its slab, after the fence), nothing across WGs; sO on sQ: EPILOGUE, 2 syncs
                   of every consumer thread per tile as without overlap
  bulk store group store warp of WG c: 1 commit per tile; wait_group.read 0 before the next
                   write of its slab and after the last tile (sO on sQ: right after the store,
                   before Q's release)

q_state and kv_state are carried from tile to tile by both sides (kv_state advances n_t times
per tile, q_state once), so the parities stay matched without any per-tile reset.
Producer order per tile: K(first block) -> Q -> V(first block) -> K, V of the other blocks.
The first K load of tile t+1 needs a free K stage (2 stages: freed by tile t's next-to-last
QK), not the consumers' Q release, so it lands while tile t's last PV and epilogue run, and
Q(t+1) follows as soon as both WGs' last QK of tile t retired. Neither wait can deadlock: what the
producer waits for (a K stage, sQ) is released by consumer work on blocks it already loaded.
Separate sO: sO is TILE_M x D in NUM_CONSUMER_WGS slabs of 64 rows, slab c written and
TMA-stored by WG c alone (its first warp issues the store), so a WG that finishes its tile
starts the next one without waiting for the other WG. The store's smem reads are waited for
(cp.async.bulk.wait_group.read 0) by that warp right before WG c writes its slab again, and
once after the last tile; never right after the store.

Global tensors arrive in the API layout (B, N, H, D) and are viewed as (N, D, H, B), so TMA
uses a 4-D descriptor and its bounds are per sequence: tail tiles load zeros and stores clip.
"""

# No `from __future__ import annotations`: cute.struct reads its field annotations as objects.
import enum
import math
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from flashsuite.fa3.configs import REG_SPLIT, Fa3Config

LN2 = math.log(2.0)


@dsl_user_op
def cvt_pack_16x2(a: Float32, b: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one register of two 16-bit values (a in the low half): cvt.rn.{bf16,f16}x2.

    Written out because `TensorSSA.to()` only packs pairs for some fragment sizes; unpacked
    16-bit halves get merged with `mov` right before each RS wgmma, and ptxas then inserts a
    warpgroup.arrive per wgmma (remark C7519), which breaks the wgmma pipeline.
    """
    kind = "bf16x2" if bf16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",  # d = {hi: $2 (b), lo: $1 (a)}
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


class WarpRole(enum.IntEnum):
    """Warpgroup index -> role (NUM_THREADS = (1 + NUM_CONSUMER_WGS) x 128 threads)."""

    PRODUCER = 0
    CONSUMER0 = 1
    CONSUMER1 = 2
    CONSUMER2 = 3  # only with num_consumer_wgs == 3


class Barrier(enum.IntEnum):
    """Named barrier ids; 0 is __syncthreads."""

    EPILOGUE = 1  # all consumer threads, around the O smem tile
    # Consumer WG c's turn on the tensor cores is barrier PINGPONG_WG0 + c (256 threads: WG c
    # syncs, its predecessor in the ring c-1 -> c arrives).
    PINGPONG_WG0 = 2
    PINGPONG_WG1 = 3
    PINGPONG_WG2 = 4  # only with three consumer WGs
    # overlap_tiles with a separate sO: consumer WG c's own epilogue (128 threads).
    EPILOGUE_WG0 = 5
    EPILOGUE_WG1 = 6
    EPILOGUE_WG2 = 7


class Fa3Forward:
    """Static configuration of one compiled forward; `__call__` is the host-side launcher."""

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        cfg: Fa3Config,
        causal: bool,
        local: bool,
        softcap: bool,
    ) -> None:
        self.dtype = dtype
        self.o_dtype = dtype  # O's dtype in smem and gmem (the fp8 kernel writes bf16)
        self.HEAD_DIM = head_dim
        self.TILE_M = cfg.tile_m
        self.TILE_N = cfg.tile_n
        self.STAGES = cfg.stages
        self.PINGPONG = cfg.pingpong
        self.INTRA_WG_OVERLAP = cfg.intra_wg_overlap
        self.O_ALIAS_Q = cfg.o_alias_q
        self.NUM_CONSUMER_WGS = cfg.num_consumer_wgs
        self.PRODUCER_REGS, self.CONSUMER_REGS = REG_SPLIT[cfg.num_consumer_wgs]
        self.CONSUMER_THREADS = 128 * cfg.num_consumer_wgs
        self.NUM_THREADS = 128 + self.CONSUMER_THREADS
        self.PERSISTENT = cfg.persistent
        self.OVERLAP_TILES = cfg.persistent and cfg.overlap_tiles
        self.BALANCED_ORDER = cfg.persistent and cfg.balanced_order
        # Each consumer WG stores its own 64-row slab of a separate sO (not possible on sQ: the
        # other WG's Q·Kᵀ may still read sQ). Q is then released right after the last Q·Kᵀ.
        self.PER_WG_EPILOGUE = self.OVERLAP_TILES and not cfg.o_alias_q
        self.EARLY_Q_RELEASE = self.PER_WG_EPILOGUE and cfg.intra_wg_overlap
        # A consumer WG whose 64 rows see none of the tile's newest K/V block passes that
        # block by without products (Fa3Config.skip_masked_wg; causal / right window only).
        self.SKIP_MASKED_WG = cfg.skip_masked_wg and (causal or local)
        # K and V rows (both tensors, 16-bit) of the (batch, head) pairs that the persistent
        # order keeps in flight together: ~32 MiB of the H200's 50 MiB L2.
        self.L2_KV_ROWS = (32 << 20) // (2 * head_dim * 2)
        # Right edge of the window bounded (causal is a window with right == 0) / left edge.
        self.HAS_RIGHT = causal or local
        self.HAS_LEFT = local
        self.SOFTCAP = softcap

    # ----------------------------------------------------------------------------------------
    # layouts, MMAs, shared storage (trace-time helpers)
    # ----------------------------------------------------------------------------------------
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

    def _smem_atom(self):
        # Rows are D-contiguous everywhere (Q, K, V and O).
        return self._k_major_atom(self.HEAD_DIM * self.dtype.width // 8, self.dtype)

    def _make_layouts(self):
        """Shared-memory layouts sQ (TILE_M, D), sK and sV (TILE_N, D, STAGES), sO (`_o_layout`).

        V is loaded as it lies in gmem (keys x D): sV has sK's layout, and PV reads it as an
        MN-major Vᵀ view (`_v_operand`).
        """
        atom = self._smem_atom()
        sQ_l = cute.tile_to_shape(atom, (self.TILE_M, self.HEAD_DIM), order=(0, 1))
        sK_l = cute.tile_to_shape(
            atom, (self.TILE_N, self.HEAD_DIM, self.STAGES), order=(0, 1, 2)
        )  # (TILE_N, D, STAGES)
        return sQ_l, sK_l, sK_l, self._o_layout()

    def _o_layout(self):
        """sO: (TILE_M, D), or (64, D, NUM_CONSUMER_WGS) slabs with PER_WG_EPILOGUE, each slab
        contiguous so a (64, D) TMA box stores it (sQ_l's atoms are stacked along all TILE_M rows
        first, so a 64-row slice of it is not one box)."""
        if self.PER_WG_EPILOGUE:
            return cute.tile_to_shape(
                self._smem_atom(), (64, self.HEAD_DIM, self.NUM_CONSUMER_WGS), order=(0, 1, 2)
            )
        return cute.tile_to_shape(self._smem_atom(), (self.TILE_M, self.HEAD_DIM), order=(0, 1))

    def _pv_b_major(self):
        """Major mode of PV's B operand Vᵀ (D x keys) in smem."""
        return cute.nvgpu.OperandMajorMode.MN  # Vᵀ: the N mode (head_dim) is contiguous in sV

    def _make_mmas(self):
        major = cute.nvgpu.OperandMajorMode
        # The consumer warpgroups stacked along M: NUM_CONSUMER_WGS x 64 rows = TILE_M.
        wgs = (self.NUM_CONSUMER_WGS, 1, 1)
        mma_qk = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.K, major.K, Float32, wgs, (64, self.TILE_N)
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
        """The shared-memory struct: mbarriers, sQ, sK, sV and sO (none where sO aliases sQ)."""
        dt, o_dt = self.dtype, self.o_dtype
        mrange, align = cute.struct.MemRange, cute.struct.Align
        n_q, n_k, n_v, n_o = (cute.cosize(x) for x in (sQ_l, sK_l, sV_l, sO_l))
        st = self.STAGES

        if const_expr(self.O_ALIAS_Q):

            @cute.struct
            class Storage:
                mbar_q: mrange[cutlass.Int64, 2]
                mbar_k: mrange[cutlass.Int64, 2 * st]
                mbar_v: mrange[cutlass.Int64, 2 * st]
                sQ: align[mrange[dt, n_q], 1024]
                sK: align[mrange[dt, n_k], 1024]
                sV: align[mrange[dt, n_v], 1024]

        else:

            @cute.struct
            class Storage:
                mbar_q: mrange[cutlass.Int64, 2]
                mbar_k: mrange[cutlass.Int64, 2 * st]
                mbar_v: mrange[cutlass.Int64, 2 * st]
                sQ: align[mrange[dt, n_q], 1024]
                sK: align[mrange[dt, n_k], 1024]
                sV: align[mrange[dt, n_v], 1024]
                sO: align[mrange[o_dt, n_o], 1024]

        return Storage

    # V's place in gmem, TMA and smem: (keys, D) blocks here; the fp8 kernel loads Vᵀ blocks.
    V_VIEW = (1, 3, 2, 0)  # (B, Nk, Hkv, D) -> (Nk, D, Hkv, B)

    def _v_box(self) -> tuple[int, int]:
        """The TMA box (and smem stage shape) of one V block."""
        return (self.TILE_N, self.HEAD_DIM)

    def _v_blocks(self, tV: cute.Tensor, head_kv: Int32, batch: Int32) -> cute.Tensor:
        """V of one (batch, kv head) tiled into blocks: (TILE_N, D, n_blocks)."""
        return cute.local_tile(
            tV[None, None, head_kv, batch], (self.TILE_N, self.HEAD_DIM), (None, 0)
        )

    def _v_operand(self, sV: cute.Tensor) -> cute.Tensor:
        """Vᵀ as the MN-major B operand of PV: sV's bytes, a (D, TILE_N, STAGES) view."""
        return cute.composition(
            sV,
            cute.make_ordered_layout((self.HEAD_DIM, self.TILE_N, self.STAGES), order=(1, 0, 2)),
        )

    def _kernel_views(self, mQ, mK, mV, mO, mLSE):
        """Kernel views: (N, D, H, B) for TMA (4-D descriptors), V per `V_VIEW`, (N, H, B) LSE."""
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=list(self.V_VIEW)))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        return mQ, mK, mV, mO, mLSE

    def _make_tmas(self, mQ, mK, mV, mO, sQ_l, sK_l, sV_l, sO_l):
        """TMA atoms and coordinate tensors: loads of Q, K, V (one stage each), store of O."""
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_l, (self.TILE_M, self.HEAD_DIM))
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

        pipe_q = make_pipe(1, sQ_l, st.mbar_q)
        pipe_k = make_pipe(self.STAGES, cute.select(sK_l, mode=[0, 1]), st.mbar_k)
        pipe_v = make_pipe(self.STAGES, cute.select(sV_l, mode=[0, 1]), st.mbar_v)
        pipeline.pipeline_init_arrive()
        return pipe_q, pipe_k, pipe_v

    def _allocate_smem(self, sQ_l, sK_l, sV_l, sO_l):
        """Kernel prologue: the storage struct, its pipelines and smem tensors, then the wait
        for every thread's view of the initialised mbarriers. Returns (pipes, tensors)."""
        st = SmemAllocator().allocate(self.storage)
        pipes = self._make_pipelines(st, sQ_l, sK_l, sV_l)
        smem = self._smem_tensors(st, sQ_l, sK_l, sV_l, sO_l)
        pipeline.pipeline_init_wait()
        return pipes, smem

    def _smem_tensors(self, st, sQ_l, sK_l, sV_l, sO_l):
        """sQ (TILE_M, D), sK (TILE_N, D, STAGES), sV (the V TMA's destination), sVt (PV's
        B operand, (D, TILE_N, STAGES)) and sO (on sQ with O_ALIAS_Q)."""
        sQ = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)  # (TILE_M, D)
        sK = st.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)  # (TILE_N, D, STAGES)
        sV = st.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)  # (TILE_N, D, STAGES)
        sVt = self._v_operand(sV)  # (D, TILE_N, STAGES)
        if const_expr(self.O_ALIAS_Q):
            sO = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)  # (TILE_M, D) on sQ
        else:
            sO = st.sO.get_tensor(sO_l.outer, swizzle=sO_l.inner)  # (TILE_M, D) or (64, D, WGS)
        return sQ, sK, sV, sVt, sO

    # ----------------------------------------------------------------------------------------
    # host side
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Nq, Hq, D)
        mK: cute.Tensor,  # (B, Nk, Hkv, D)
        mV: cute.Tensor,  # (B, Nk, Hkv, D)
        mO: cute.Tensor,  # (B, Nq, Hq, D)
        mLSE: cute.Tensor,  # (B, Hq, Nq) fp32
        scale_log2: Float32,  # log2(e) * scale (or * softcap with SOFTCAP)
        softcap_pre: Float32,  # scale / softcap, applied before tanh (unused without SOFTCAP)
        window_left: Int32,  # >= 0 (the host maps "unbounded" to a large value)
        window_right: Int32,  # >= 0; 0 when causal
        max_ctas: Int32,  # persistent grid size (the SM count); unused otherwise
        stream,
    ):
        mQ, mK, mV, mO, mLSE = self._kernel_views(mQ, mK, mV, mO, mLSE)
        sQ_l, sK_l, sV_l, sO_l = self._make_layouts()
        mma_qk, mma_pv = self._make_mmas()
        self.storage = self._storage(sQ_l, sK_l, sV_l, sO_l)
        tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO = self._make_tmas(
            mQ, mK, mV, mO, sQ_l, sK_l, sV_l, sO_l
        )

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        heads_q = mQ.shape[2]
        group = heads_q // mK.shape[2]  # query heads per kv head (GQA/MQA)
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
            tV,
            tma_o,
            tO,
            mLSE,
            mma_qk,
            mma_pv,
            sQ_l,
            sK_l,
            sO_l,
            Int32(seqlen_q),
            Int32(seqlen_k),
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
        tV: cute.Tensor,  # (Nk, D, Hkv, B)
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,  # (Nq, D, Hq, B)
        mLSE: cute.Tensor,  # (Nq, Hq, B) fp32
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_l: cute.ComposedLayout,  # (TILE_M, D)
        sK_l: cute.ComposedLayout,  # (TILE_N, D, STAGES)
        sO_l: cute.ComposedLayout,  # (TILE_M, D) or (64, D, NUM_CONSUMER_WGS)
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
        sched = self._schedule(
            seqlen_q, seqlen_k, group, window_left, window_right, heads_q, batch_n
        )
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        # sV has sK's layout.
        pipes, smem = self._allocate_smem(sQ_l, sK_l, sK_l, sO_l)
        pipe_q, pipe_k, pipe_v = pipes
        sQ, sK, sV, sVt, sO = smem
        self.warp_roles(
            wg,
            warp,
            tidx,
            (tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, pipe_q, pipe_k, pipe_v),
            (tma_o, tO, mLSE, mma_qk, mma_pv, sQ, sK, sVt, sO, pipe_q, pipe_k, pipe_v),
            sched,
            scale_log2,
            softcap_pre,
        )

    def _schedule(
        self,
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        window_left: Int32,
        window_right: Int32,
        heads_q: Int32,
        batch_n: Int32,
    ) -> SimpleNamespace:
        """`warp_roles`' `sched`, built in the kernel's top region. One tile per CTA: the grid
        is (m_blocks, Hq, B). Persistent: the grid is (CTAs, 1, 1) and each CTA takes tiles
        bid_x, bid_x + grid_x, ... of the tile_coords order."""
        m_block0, head0, batch0 = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        m_blocks = (seqlen_q + self.TILE_M - 1) // self.TILE_M
        return SimpleNamespace(
            tile0=(m_block0, head0, batch0),
            bid_x=m_block0,
            grid_x=grid_x,
            num_tiles=m_blocks * heads_q * batch_n,
            m_blocks=m_blocks,
            heads_q=heads_q,
            batch_n=batch_n,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            group=group,
            window_left=window_left,
            window_right=window_right,
        )

    @cute.jit
    def warp_roles(
        self,
        wg: Int32,
        warp: Int32,
        tidx: Int32,
        load_args: tuple,  # `load`'s TMA atoms and coordinates, smem tensors and pipelines
        cons_args: tuple,  # `consumer`'s: O store, LSE, MMAs, smem tensors and pipelines
        sched: SimpleNamespace,
        scale_log2: Float32,
        softcap_pre: Float32,
    ):
        """The role split: warp 0 of the producer WG loads, the consumer WGs compute.

        `sched`: the problem (seqlen_q, seqlen_k, group, window_left, window_right) and
        tile0, this CTA's (m_block, head, batch) without PERSISTENT, or the persistent schedule
        (bid_x, grid_x, num_tiles, m_blocks, heads_q, batch_n), read only with PERSISTENT.
        """
        m_block0, head0, batch0 = sched.tile0
        seqlen_q, seqlen_k, group = sched.seqlen_q, sched.seqlen_k, sched.group
        window_left, window_right = sched.window_left, sched.window_right
        Producer, Consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer

        if wg == WarpRole.PRODUCER:
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
            if warp == 0:
                # Pipeline states live across tiles (persistent): their phases carry on.
                q_state = pipeline.make_pipeline_state(Producer, 1)
                kv_state = pipeline.make_pipeline_state(Producer, self.STAGES)
                if const_expr(self.PERSISTENT):
                    for k in cutlass.range(
                        self.cta_tile_count(sched.bid_x, sched.grid_x, sched.num_tiles), unroll=1
                    ):
                        m_block, head, batch, n_block_min, n_block_max = self.tile_work(k, sched)
                        q_state, kv_state = self.load(
                            *load_args,
                            q_state,
                            kv_state,
                            m_block,
                            head,
                            batch,
                            group,
                            n_block_min,
                            n_block_max,
                        )
                else:
                    n_block_min, n_block_max = self._cta_blocks(sched)
                    self.load(
                        *load_args,
                        q_state,
                        kv_state,
                        m_block0,
                        head0,
                        batch0,
                        group,
                        n_block_min,
                        n_block_max,
                    )
        else:
            cute.arch.setmaxregister_increase(self.CONSUMER_REGS)
            cwg = wg - WarpRole.CONSUMER0
            self.pingpong_start(cwg)
            q_state = pipeline.make_pipeline_state(Consumer, 1)
            kv_state = pipeline.make_pipeline_state(Consumer, self.STAGES)
            if const_expr(self.PERSISTENT):
                for k in cutlass.range(
                    self.cta_tile_count(sched.bid_x, sched.grid_x, sched.num_tiles), unroll=1
                ):
                    m_block, head, batch, n_block_min, n_block_max = self.tile_work(k, sched)
                    q_state, kv_state = self.consumer(
                        *cons_args,
                        q_state,
                        kv_state,
                        tidx - 128,
                        warp,
                        cwg,
                        m_block,
                        head,
                        batch,
                        seqlen_q,
                        seqlen_k,
                        scale_log2,
                        softcap_pre,
                        window_left,
                        window_right,
                        n_block_min,
                        n_block_max,
                    )
                if const_expr(self.PER_WG_EPILOGUE):  # noqa: SIM102
                    if warp % 4 == 0:
                        # The last tile's O store must have read sO before the CTA exits.
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                n_block_min, n_block_max = self._cta_blocks(sched)
                self.consumer(
                    *cons_args,
                    q_state,
                    kv_state,
                    tidx - 128,
                    warp,
                    cwg,
                    m_block0,
                    head0,
                    batch0,
                    seqlen_q,
                    seqlen_k,
                    scale_log2,
                    softcap_pre,
                    window_left,
                    window_right,
                    n_block_min,
                    n_block_max,
                )

    def tile_work(self, k: Int32, sched: SimpleNamespace):
        """Tile `k` of this persistent CTA (both roles walk the same sequence): its
        (m_block, head, batch) and its K/V block range [n_block_min, n_block_max)."""
        tile = self.cta_tile(k, sched.bid_x, sched.grid_x)
        m_block, head, batch = self.tile_coords(
            tile, sched.m_blocks, sched.heads_q, sched.batch_n, sched.seqlen_k
        )
        n_block_min, n_block_max = self.block_range(
            m_block, sched.seqlen_q, sched.seqlen_k, sched.window_left, sched.window_right
        )
        return m_block, head, batch, n_block_min, n_block_max

    def _cta_blocks(self, sched: SimpleNamespace):
        """[n_block_min, n_block_max) of a non-persistent CTA's tile: `sched.blocks` where the
        kernel computed it once in its top region (fp8), else here, in the role's branch."""
        blocks = getattr(sched, "blocks", None)
        if blocks is not None:
            return blocks
        m_block0 = sched.tile0[0]
        return self.block_range(
            m_block0, sched.seqlen_q, sched.seqlen_k, sched.window_left, sched.window_right
        )

    @cute.jit
    def cta_tile_count(self, bid: Int32, grid: Int32, num_tiles: Int32) -> Int32:
        """How many tiles persistent CTA `bid` of `grid` runs (grid <= num_tiles)."""
        count = (num_tiles - bid + grid - 1) // grid
        if const_expr(self.BALANCED_ORDER):
            # Only the last round can be partial; whether it reaches us depends on its direction.
            full = num_tiles // grid
            off = bid if full % 2 == 0 else grid - 1 - bid
            count = full + (1 if off < num_tiles - full * grid else 0)
        return count

    @cute.jit
    def cta_tile(self, k: Int32, bid: Int32, grid: Int32) -> Int32:
        """The position in the tile order of CTA `bid`'s k-th tile.

        Round-robin: bid + k * grid, so CTA 0 takes the heaviest tile of every round.
        BALANCED_ORDER (snake): odd rounds run backwards, a CTA's heavy tile of one round pairs
        with a light one of the next and the per-CTA sums even out.
        """
        off = bid
        if const_expr(self.BALANCED_ORDER):
            off = bid if k % 2 == 0 else grid - 1 - bid
        return k * grid + off

    @cute.jit
    def tile_coords(
        self, tile: Int32, m_blocks: Int32, heads_q: Int32, batch_n: Int32, seqlen_k: Int32
    ):
        """Persistent tile index -> (m_block, head, batch).

        (batch, head) pairs are taken in sections of L2_KV_ROWS // seqlen_k pairs whose
        K and V fit in L2 together, so the CTAs running at once share their K/V reads; inside a
        section the head is the fastest index. With a right window bound (causal) the m_blocks
        run from the last one down: the tiles that see the most keys start first (longest
        processing time first), the light ones fill the tail. BALANCED_ORDER: every other
        section, counted back from the last, runs from the first m_block up instead.
        """
        hb_total = heads_q * batch_n
        section = cutlass.max(cutlass.min(self.L2_KV_ROWS // seqlen_k, hb_total), 1)
        section_tiles = section * m_blocks
        sec = tile // section_tiles
        r = tile - sec * section_tiles
        in_sec = cutlass.min(section, hb_total - sec * section)  # the last section may be short
        m_block = r // in_sec
        if const_expr(self.HAS_RIGHT):
            if const_expr(self.BALANCED_ORDER):
                # Sections alternate direction, the last one heaviest first: a smooth cost
                # sequence that round-robin (snake) rounds split evenly, with LPT at the tail.
                n_sec = (hb_total + section - 1) // section
                flip = (n_sec - 1 - sec) % 2 == 0
                m_block = m_blocks - 1 - m_block if flip else m_block
            else:
                m_block = m_blocks - 1 - m_block
        hb = sec * section + r - (r // in_sec) * in_sec
        batch = hb // heads_q
        return m_block, hb - batch * heads_q, batch

    @cute.jit
    def block_range(
        self,
        m_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        """[n_block_min, n_block_max): the K/V blocks any row of this Q tile can see."""
        shift = seqlen_k - seqlen_q  # bottom-right alignment
        n_block_max = (seqlen_k + self.TILE_N - 1) // self.TILE_N
        if const_expr(self.HAS_RIGHT):
            last_row = cutlass.min((m_block + 1) * self.TILE_M, seqlen_q) - 1
            key_end = cutlass.max(last_row + shift + window_right + 1, 0)
            n_block_max = cutlass.min(n_block_max, (key_end + self.TILE_N - 1) // self.TILE_N)
        n_block_min = Int32(0)
        if const_expr(self.HAS_LEFT):
            key_start = cutlass.max(m_block * self.TILE_M + shift - window_left, 0)
            n_block_min = key_start // self.TILE_N
        return n_block_min, n_block_max

    @cute.jit
    def load(
        self,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        group: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
    ):
        """Producer warp: Q once, then K and V per n-block from n_block_max - 1 down.

        Returns the advanced (q_state, kv_state). Persistent: Q is loaded for every tile, even
        one with no K/V block, so that the consumers' Q wait/release (which guards sQ, and sO
        where it aliases sQ) stays in step with the producer.
        """
        head_kv = head // group
        gQ = cute.local_tile(
            tQ[None, None, head, batch], (self.TILE_M, self.HEAD_DIM), (m_block, 0)
        )  # (TILE_M, D)
        gK = cute.local_tile(
            tK[None, None, head_kv, batch], (self.TILE_N, self.HEAD_DIM), (None, 0)
        )  # (TILE_N, D, n_blocks)
        gV = self._v_blocks(tV, head_kv, batch)  # (TILE_N, D, n_blocks) (fp8: Vᵀ blocks)
        one = cute.make_layout(1)
        tQs, tQg = cpasync.tma_partition(
            tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKs, tKg = cpasync.tma_partition(
            tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )  # (TMA, STAGES), (TMA, n_blocks)
        tVs, tVg = cpasync.tma_partition(
            tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        if const_expr(self.OVERLAP_TILES):
            # K(first) -> Q -> V(first) -> the other blocks: the first K load only needs a free
            # K stage, so it is in flight before the consumers release sQ (protocol above).
            if n_block_max > n_block_min:
                self._load_block(pipe_k, tma_k, tKg, tKs, n_block_max - 1, kv_state)
            pipe_q.producer_acquire(q_state)  # both WGs' last Q·Kᵀ of the previous tile retired
            cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if n_block_max > n_block_min:
                self._load_block(pipe_v, tma_v, tVg, tVs, n_block_max - 1, kv_state)
                kv_state.advance()
                for i in cutlass.range(n_block_max - n_block_min - 1, unroll=1):
                    n_block = n_block_max - 2 - i
                    self._load_block(pipe_k, tma_k, tKg, tKs, n_block, kv_state)
                    self._load_block(pipe_v, tma_v, tVg, tVs, n_block, kv_state)
                    kv_state.advance()
        else:
            if const_expr(self.PERSISTENT):
                pipe_q.producer_acquire(q_state)  # the consumers released the previous tile's Q
                cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
            if n_block_max > n_block_min:
                if const_expr(not self.PERSISTENT):
                    pipe_q.producer_acquire(q_state)
                    cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                    n_block = n_block_max - 1 - i
                    self._load_block(pipe_k, tma_k, tKg, tKs, n_block, kv_state)
                    self._load_block(pipe_v, tma_v, tVg, tVs, n_block, kv_state)
                    kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def _load_block(
        self,
        pipe: pipeline.PipelineTmaAsync,
        tma: cute.CopyAtom,
        tXg: cute.Tensor,  # (TMA, n_blocks) global blocks of K or V
        tXs: cute.Tensor,  # (TMA, STAGES) their shared-memory ring
        n_block: Int32,
        kv_state: pipeline.PipelineState,
    ):
        """Wait for ring stage `kv_state` to be free, then TMA-load block n_block into it."""
        pipe.producer_acquire(kv_state)
        cute.copy(
            tma,
            tXg[None, n_block],
            tXs[None, kv_state.index],
            tma_bar_ptr=pipe.producer_get_barrier(kv_state),
        )

    # ----------------------------------------------------------------------------------------
    # consumer: main loop
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE: cute.Tensor,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sVt: cute.Tensor,
        sO: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        ctid: Int32,  # 0..CONSUMER_THREADS-1 over the consumer warpgroups
        warp: Int32,
        cwg: Int32,  # consumer warpgroup 0..NUM_CONSUMER_WGS-1
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
    ):
        scale_log2, softcap_pre = self.tile_scales(head, batch, scale_log2, softcap_pre)
        thr_qk = mma_qk.get_slice(ctid)
        thr_pv = mma_pv.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, STAGES)
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))  # (MMA, MMA_N, MMA_K, STAGES)
        acc_S = thr_qk.make_fragment_C(
            thr_qk.partition_shape_C((self.TILE_M, self.TILE_N))
        )  # ((2, 2, TILE_N/8), 1, 1) fp32: 2 rows per thread
        acc_O = thr_pv.make_fragment_C(
            thr_pv.partition_shape_C((self.TILE_M, self.HEAD_DIM))
        )  # ((2, 2, D/8), 1, 1) fp32
        tOrP = thr_pv.make_fragment_A(
            thr_pv.partition_shape_A((self.TILE_M, self.TILE_N))
        )  # ((2, 2, 2), 1, TILE_N/16) 16-bit
        # The softmax, mask and P conversion index fragments as i = c + 2r + 4j (m64nNk16 C
        # layout, one MMA tile per warpgroup): check the shapes that assumption rests on.
        assert cute.size(acc_S, mode=[1]) == 1 and cute.size(acc_S, mode=[2]) == 1
        assert cute.size(acc_O, mode=[1]) == 1 and cute.size(acc_O, mode=[2]) == 1
        assert cute.size(acc_S) == self.TILE_N // 2 and cute.size(acc_O) == self.HEAD_DIM // 2
        cS = cute.make_identity_tensor((self.TILE_M, self.TILE_N))
        tScS = thr_qk.partition_C(cS)  # (row, col) of each acc_S element within the tile
        row_max = cute.make_rmem_tensor((2,), Float32)  # raw-score max of this thread's 2 rows
        row_sum = cute.make_rmem_tensor((2,), Float32)  # thread-partial sum of P
        row_max.fill(Float32(-math.inf))
        row_sum.fill(0.0)
        acc_O.fill(0.0)

        n_blocks = n_block_max - n_block_min
        if const_expr(self.PERSISTENT):
            pipe_q.consumer_wait(q_state)  # every tile loads Q (see load)
        if n_blocks > 0:
            if const_expr(not self.PERSISTENT):
                pipe_q.consumer_wait(q_state)
            shift = seqlen_k - seqlen_q
            first_row = m_block * self.TILE_M
            last_row = cutlass.min(first_row + self.TILE_M, seqlen_q) - 1
            # Blocks below n_right_free need no right-side (causal/window/seqlen) mask; blocks
            # at or above n_left_free no left-window mask.
            n_right_free = seqlen_k // self.TILE_N
            if const_expr(self.HAS_RIGHT):
                n_right_free = cutlass.min(
                    n_right_free,
                    cutlass.max(first_row + shift + window_right + 1, 0) // self.TILE_N,
                )
            n_left_free = n_block_min
            if const_expr(self.HAS_LEFT):
                n_left_free = (
                    cutlass.max(last_row + shift - window_left, 0) + self.TILE_N - 1
                ) // self.TILE_N
            # Loop phases, newest block first: [n_block_max-1] masked, then masked blocks
            # down to n_right_free, unmasked ones down to n_left_free, masked ones to the end.
            n_masked_hi = cutlass.max(n_block_max - 1 - cutlass.max(n_right_free, n_block_min), 0)
            n_after = n_blocks - 1 - n_masked_hi
            n_unmasked = cutlass.max(
                cutlass.min(n_after, n_block_max - 1 - n_masked_hi - n_left_free), 0
            )
            n_masked_lo = n_after - n_unmasked

            ctx = SimpleNamespace(
                mma_qk=mma_qk,
                mma_pv=mma_pv,
                tSrQ=tSrQ,
                tSrK=tSrK,
                tOrVt=tOrVt,
                acc_S=acc_S,
                acc_O=acc_O,
                tOrP=tOrP,
                tScS=tScS,
                row_max=row_max,
                row_sum=row_sum,
                pipe_k=pipe_k,
                pipe_v=pipe_v,
                cwg=cwg,
                m_block=m_block,
                seqlen_k=seqlen_k,
                shift=shift,
                scale_log2=scale_log2,
                softcap_pre=softcap_pre,
                window_left=window_left,
                window_right=window_right,
            )
            n_block = n_block_max - 1
            if const_expr(self.INTRA_WG_OVERLAP):
                if const_expr(self.SKIP_MASKED_WG):
                    # The WG's rows end at first_row + 64 (cwg + 1) - 1 (padding rows past
                    # seqlen_q included, so all 64 are masked); they see keys below key_end.
                    key_end = first_row + 64 * (cwg + 1) + shift + window_right
                    i_first = Int32(0)
                    if key_end <= n_block * self.TILE_N:
                        kv_state = self.pass_block(ctx, kv_state, n_blocks > 1)
                        i_first = Int32(1)
                    if i_first < n_blocks:
                        kv_state = self.overlap_loop(
                            ctx, kv_state, n_block, i_first, n_blocks, n_masked_hi, n_unmasked,
                            pipe_q, q_state,
                        )  # fmt: skip
                    else:
                        if const_expr(self.EARLY_Q_RELEASE):
                            pipe_q.consumer_release(q_state)
                else:
                    kv_state = self.overlap_loop(
                        ctx, kv_state, n_block, 0, n_blocks, n_masked_hi, n_unmasked,
                        pipe_q, q_state,
                    )  # fmt: skip
            else:
                self.pingpong_sync(cwg)
                kv_state = self.step(ctx, kv_state, n_block, True)
                for i in cutlass.range(n_masked_hi, unroll=1):
                    kv_state = self.step(ctx, kv_state, n_block - 1 - i, True)
                n_block -= n_masked_hi
                for i in cutlass.range(n_unmasked, unroll=1):
                    kv_state = self.step(ctx, kv_state, n_block - 1 - i, False)
                n_block -= n_unmasked
                if const_expr(self.HAS_LEFT):
                    for i in cutlass.range(n_masked_lo, unroll=1):
                        kv_state = self.step(ctx, kv_state, n_block - 1 - i, True)
                # Hand the tensor cores to the other WG for its last PV.
                self.pingpong_arrive(cwg)

        if const_expr(self.PERSISTENT and not self.O_ALIAS_Q):
            if const_expr(self.EARLY_Q_RELEASE):
                if n_blocks <= 0:  # no main loop ran: release this tile's Q here
                    pipe_q.consumer_release(q_state)
            else:
                # Every wgmma reading sQ has retired: the producer may load the next tile's Q.
                pipe_q.consumer_release(q_state)
        self.epilogue(
            tma_o,
            tO,
            mLSE,
            mma_pv,
            sO,
            acc_O,
            tScS,
            row_max,
            row_sum,
            ctid,
            warp,
            cwg,
            m_block,
            head,
            batch,
            seqlen_q,
            scale_log2,
        )
        if const_expr(self.PERSISTENT):
            if const_expr(self.O_ALIAS_Q):
                # sO sits on sQ: free it once the TMA store has read it (warp 4 waited for that
                # before its release; the Q barrier completes only with every consumer warp).
                pipe_q.consumer_release(q_state)
            q_state.advance()
        return q_state, kv_state

    def tile_scales(self, head: Int32, batch: Int32, scale_log2: Float32, softcap_pre: Float32):
        """The score scales of the tile of (`head`, `batch`), at the top of `consumer`: the
        kernel's own for 16-bit inputs (fp8 folds in per-(batch, kv head) descales)."""
        return scale_log2, softcap_pre

    @cute.jit
    def pingpong_start(self, cwg: Int32):
        """Hand WG0 the "you start" token: it takes the first tensor-core turn.

        Each tile passes the token round the ring a whole number of times, so it is back at
        WG0 when the next tile starts (persistent).
        """
        if const_expr(self.PINGPONG):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if cwg == 0:
                cute.arch.barrier_arrive(
                    barrier_id=int(Barrier.PINGPONG_WG0), number_of_threads=256
                )

    @cute.jit
    def pingpong_sync(self, cwg: Int32):
        """Wait for this WG's tensor-core turn (a token passed round the ring of consumer WGs)."""
        if const_expr(self.PINGPONG):
            cute.arch.barrier(
                barrier_id=int(Barrier.PINGPONG_WG0) + cwg,
                number_of_threads=256,  # this WG syncs, its predecessor arrives
            )

    @cute.jit
    def pingpong_arrive(self, cwg: Int32):
        """Pass the turn to the next WG of the ring (it may issue once its softmax is done).

        Every WG of a tile runs the same number of syncs and arrives, alternating, so the
        token goes round 0 -> 1 (-> 2) -> 0 and each barrier completes with 128 + 128 threads.
        """
        if const_expr(self.PINGPONG):
            nxt = cwg + 1
            if const_expr(self.NUM_CONSUMER_WGS == 2):
                nxt = 1 - cwg
            else:
                nxt = Int32(0) if nxt == self.NUM_CONSUMER_WGS else nxt
            cute.arch.barrier_arrive(
                barrier_id=int(Barrier.PINGPONG_WG0) + nxt,
                number_of_threads=256,
            )

    @cute.jit
    def gemm_qk(self, mma_qk: cute.TiledMma, acc_S, tSrQ, tSrK, stage: Int32):
        """Issue S = Q·Kᵀ (SS wgmma) into acc_S and commit; the caller waits."""
        warpgroup.fence()
        # A fresh atom per issue: mutating the shared TiledMma's ACCUMULATE flag inside the
        # dynamic K/V loop leaks an SSA value out of its region.
        atom = cute.make_mma_atom(mma_qk.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)  # S = Q·Kᵀ overwrites
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def gemm_pv(self, mma_pv: cute.TiledMma, acc_O, tOrP, tOrVt, stage: Int32):
        """Issue O += P·V (RS wgmma, P from registers) and commit; the caller waits."""
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_pv.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)  # acc_O starts at 0 and is rescaled in place
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(atom, acc_O, tOrP[None, None, k], tOrVt[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def apply_mask(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        n_block: Int32,
        m_block: Int32,
        seqlen_k: Int32,
        shift: Int32,
        window_left: Int32,
        window_right: Int32,
    ):
        """-inf where the key is past seqlen_k or outside the (causal / local) window.

        Element i = 4j + 2r + c of the m64nNk16 C fragment sits in row r of the thread's two
        rows and column col0 + 8j + c. Comparing the compile-time offset 8j + c against one
        per-row limit keeps the column indices out of registers (computing 64 of them per
        thread costs registers the intra-WG overlap needs).
        """
        col0 = n_block * self.TILE_N + tScS[0][1]  # this thread's first column in the block
        for r in cutlass.range_constexpr(2):
            row = m_block * self.TILE_M + tScS[2 * r][0]
            col_end = seqlen_k
            if const_expr(self.HAS_RIGHT):
                col_end = cutlass.min(col_end, row + shift + window_right + 1)
            limit_hi = col_end - col0  # offsets >= limit_hi are masked
            limit_lo = Int32(0)
            if const_expr(self.HAS_LEFT):
                limit_lo = row + shift - window_left - col0  # offsets < limit_lo are masked
            for j in cutlass.range_constexpr(cute.size(acc_S) // 4):
                for c in cutlass.range_constexpr(2):
                    i = 4 * j + 2 * r + c
                    off = 8 * j + c
                    if const_expr(self.HAS_LEFT):
                        out = (limit_hi <= off) | (limit_lo > off)
                        acc_S[i] = Float32(-math.inf) if out else acc_S[i]
                    else:
                        acc_S[i] = Float32(-math.inf) if limit_hi <= off else acc_S[i]

    @cute.jit
    def softmax(self, acc_S: cute.Tensor, row_max, row_sum, scale_log2: Float32):
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
    def rescale_o(self, acc_O: cute.Tensor, corr: cute.Tensor):
        for j in cutlass.range_constexpr(cute.size(acc_O) // 4):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    acc_O[4 * j + 2 * r + c] = acc_O[4 * j + 2 * r + c] * corr[r]

    @cute.jit
    def scores_to_probs(self, ctx, n_block: Int32, mask: cutlass.Constexpr[bool], masked=None):
        """Softcap, mask and online softmax of ctx.acc_S in place; returns the O rescale.

        `mask` (compile time) applies the mask; otherwise a runtime Boolean `masked` may.
        """
        acc_S = ctx.acc_S
        if const_expr(self.SOFTCAP):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * ctx.softcap_pre, fastmath=True)
        if const_expr(masked is not None):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if masked:
                self.apply_mask(
                    acc_S,
                    ctx.tScS,
                    n_block,
                    ctx.m_block,
                    ctx.seqlen_k,
                    ctx.shift,
                    ctx.window_left,
                    ctx.window_right,
                )
        if const_expr(mask):
            self.apply_mask(
                acc_S,
                ctx.tScS,
                n_block,
                ctx.m_block,
                ctx.seqlen_k,
                ctx.shift,
                ctx.window_left,
                ctx.window_right,
            )
        return self.softmax(acc_S, ctx.row_max, ctx.row_sum, ctx.scale_log2)

    @cute.jit
    def probs_to_operand(self, ctx):
        """P (fp32, in acc_S) -> 16-bit A operand of PV, in registers.

        The C fragment of S and the A fragment of P have the same per-thread element order
        (m64nNk16), so this is a per-thread convert, no data moves between threads.
        """
        acc_S = ctx.acc_S
        n = cute.size(acc_S)
        p32 = cute.make_tensor(
            cute.recast_ptr(ctx.tOrP.iterator, dtype=Int32), cute.make_layout(n // 2)
        )  # (n/2,) 32-bit view of the P fragment's registers
        for j in cutlass.range_constexpr(n // 2):
            p32[j] = cvt_pack_16x2(acc_S[2 * j], acc_S[2 * j + 1], self.dtype is cutlass.BFloat16)

    @cute.jit
    def step(self, ctx, kv_state, n_block: Int32, mask: cutlass.Constexpr[bool]):
        """One K/V block without intra-WG overlap: QK, softmax, PV, each waited for."""
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        self.gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index)
        self.pingpong_arrive(ctx.cwg)  # the other WG may run its PV(n-1) and QK(n) meanwhile
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        corr = self.scores_to_probs(ctx, n_block, mask)
        self.probs_to_operand(ctx)
        self.rescale_o(ctx.acc_O, corr)
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        self.pingpong_sync(ctx.cwg)  # our turn: PV(n) now, QK(n+1) right after
        self.gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, kv_state.index)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def overlap_loop(
        self, ctx, kv_state, n_block: Int32, i_first, n_blocks: Int32, n_masked_hi: Int32,
        n_unmasked: Int32, pipe_q: pipeline.PipelineTmaAsync, q_state: pipeline.PipelineState,
    ):  # fmt: skip
        """The intra-WG-overlap main loop over blocks n_block - i, i = i_first .. n_blocks - 1.

        One loop with a uniform runtime mask test rather than one loop per phase: S, P and O
        are carried from iteration to iteration, and with several loops ptxas gives them
        different registers in each (R227 instead of ~R180 at D=128) and then serialises the
        wgmmas for lack of registers (C7512).
        """
        kv_state = self.first_half_block(ctx, kv_state, n_block - i_first)
        for i in cutlass.range(i_first, n_blocks - 1, unroll=1):
            masked = i < n_masked_hi
            if const_expr(self.HAS_LEFT):
                masked = masked | (i >= n_masked_hi + n_unmasked)
            kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, masked)
        if const_expr(self.EARLY_Q_RELEASE):
            # This WG's Q·Kᵀ wgmmas have all retired (wait_group(0) above): Q of the
            # next tile may land while the last P·V and the epilogue run.
            pipe_q.consumer_release(q_state)
        return self.last_half_block(ctx, kv_state)

    @cute.jit
    def pass_block(self, ctx, kv_state, take_turn):
        """SKIP_MASKED_WG: the newest block, which none of this WG's rows can see.

        Its S would be all -inf and its P all 0, so the softmax state and O would not change:
        the WG only waits for and releases the K and V stages (the other WGs use them) and,
        if more blocks follow (`take_turn`), takes one empty ping-pong turn, since the
        step_overlap it replaces syncs and arrives once (the token keeps making whole rounds).
        The products stay out of the main loop (a predicated wgmma inside it makes ptxas
        serialise every wgmma: C7515).
        """
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        ctx.pipe_k.consumer_release(kv_state)
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        if take_turn:
            self.pingpong_sync(ctx.cwg)
            self.pingpong_arrive(ctx.cwg)
        return kv_state

    @cute.jit
    def first_half_block(self, ctx, kv_state, n_block: Int32):
        """Intra-WG overlap prologue: S and P of the first (masked) block, no PV yet."""
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        self.gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index)
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        self.scores_to_probs(ctx, n_block, True)  # acc_O is still 0: nothing to rescale
        self.probs_to_operand(ctx)
        return kv_state

    @cute.jit
    def step_overlap(self, ctx, kv_state, n_block: Int32, masked):
        """QK(n) and PV(previous block) in flight together; the softmax of n overlaps PV."""
        v_state = kv_state.clone()  # the previous block, whose P sits in tOrP
        kv_state.advance()
        ctx.pipe_k.consumer_wait(kv_state, ctx.pipe_k.consumer_try_wait(kv_state))
        self.pingpong_sync(ctx.cwg)
        self.gemm_qk(ctx.mma_qk, ctx.acc_S, ctx.tSrQ, ctx.tSrK, kv_state.index)
        ctx.pipe_v.consumer_wait(v_state, ctx.pipe_v.consumer_try_wait(v_state))
        self.gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, v_state.index)
        self.pingpong_arrive(ctx.cwg)
        warpgroup.wait_group(1)  # groups retire in order: S(n) is ready, PV may still run
        ctx.pipe_k.consumer_release(kv_state)
        corr = self.scores_to_probs(ctx, n_block, False, masked)  # acc_S only, not tOrP/acc_O
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(v_state)
        self.probs_to_operand(ctx)  # tOrP and acc_O are free once PV has retired
        self.rescale_o(ctx.acc_O, corr)
        return kv_state

    @cute.jit
    def last_half_block(self, ctx, kv_state):
        """Intra-WG overlap tail of the loop: PV of the last block."""
        ctx.pipe_v.consumer_wait(kv_state, ctx.pipe_v.consumer_try_wait(kv_state))
        self.gemm_pv(ctx.mma_pv, ctx.acc_O, ctx.tOrP, ctx.tOrVt, kv_state.index)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ----------------------------------------------------------------------------------------
    # consumer: epilogue
    # ----------------------------------------------------------------------------------------
    def _o_scale(self, rcp_l: Float32) -> Float32:
        """What multiplies a row of O with softmax sum l (> 0): 1/l (fp8 adds descale_v)."""
        return rcp_l

    @cute.jit
    def epilogue(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE: cute.Tensor,
        mma_pv: cute.TiledMma,
        sO: cute.Tensor,
        acc_O: cute.Tensor,
        tScS: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        ctid: Int32,
        warp: Int32,
        cwg: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
        scale_log2: Float32,
    ):
        """O /= l (0 for empty rows), LSE to gmem, O -> sO (stmatrix) -> TMA store."""
        inv = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            l_tot = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            empty = l_tot == Float32(0.0)
            inv[r] = Float32(0.0) if empty else self._o_scale(cute.arch.rcp_approx(l_tot))
            lse = (row_max[r] * scale_log2 + cute.math.log2(l_tot, fastmath=True)) * LN2
            lse = Float32(-math.inf) if empty else lse
            row = m_block * self.TILE_M + tScS[2 * r][0]
            # One lane of each quad owns the row's statistics; tail rows are not stored.
            if (tScS[0][1] == 0) & (row < seqlen_q):
                mLSE[row, head, batch] = lse
        self.rescale_o(acc_O, inv)
        if const_expr(self.PER_WG_EPILOGUE):
            self.store_o_wg(tma_o, tO, sO, acc_O, ctid, warp, cwg, m_block, head, batch)
        else:
            self.store_o(tma_o, tO, mma_pv, sO, acc_O, ctid, warp, m_block, head, batch)

    @cute.jit
    def store_o(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mma_pv: cute.TiledMma,
        sO: cute.Tensor,
        acc_O: cute.Tensor,
        ctid: Int32,
        warp: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
    ):
        """The whole TILE_M x D tile through sO, one TMA store by warp 4 (all consumer WGs)."""
        if const_expr(self.O_ALIAS_Q or self.PERSISTENT):
            # sO overwrites sQ: every WG's QK wgmmas (which read sQ) must have retired.
            # Persistent: the previous tile's TMA store must have read sO (warp 4 waits for it
            # before it reaches this barrier).
            cute.arch.barrier(
                barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.CONSUMER_THREADS
            )
        rO = cute.make_rmem_tensor_like(acc_O, self.o_dtype)
        rO.store(acc_O.load().to(self.o_dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.o_dtype), mma_pv
        )
        thr_r2s = r2s.get_slice(ctid)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
        # Generic-proxy smem writes must be visible to the TMA (async proxy) store.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.CONSUMER_THREADS)
        if warp == 4:
            gO = cute.local_tile(
                tO[None, None, head, batch], (self.TILE_M, self.HEAD_DIM), (m_block, 0)
            )  # (TILE_M, D)
            self._tma_store(tma_o, sO, gO)
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _tma_store(self, tma_o: cute.CopyAtom, sO: cute.Tensor, gO: cute.Tensor):
        """One thread: TMA-store the (rows, D) smem tile sO to gO and commit the bulk group."""
        tOs, tOg = cpasync.tma_partition(
            tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
        )
        cute.copy(tma_o, tOs, tOg)
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_o_wg(
        self,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        sO: cute.Tensor,
        acc_O: cute.Tensor,
        ctid: Int32,
        warp: Int32,
        cwg: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
    ):
        """This WG's 64 rows through its own sO slab and its own TMA store (PER_WG_EPILOGUE).

        Only the 128 threads of WG c sync here, so a WG done with its tile moves on to the next
        while the other WG still runs its last P·V. The previous tile's store of this slab is
        waited for (smem reads only) just before the slab is written again.
        """
        bar = int(Barrier.EPILOGUE_WG0) + cwg
        store_warp = warp % 4 == 0  # the first warp of each consumer WG
        if store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        sO_wg = sO[None, None, cwg]  # (64, D) slab
        # One warpgroup's P·V tiling: its C fragment is the same per-thread acc_O layout.
        mma_wg = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            cute.nvgpu.OperandMajorMode.K,
            self._pv_b_major(),
            Float32,
            (1, 1, 1),
            (64, self.HEAD_DIM),
            a_source=warpgroup.OperandSource.RMEM,
        )
        rO = cute.make_rmem_tensor_like(acc_O, self.o_dtype)
        rO.store(acc_O.load().to(self.o_dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.o_dtype), mma_wg
        )
        thr_r2s = r2s.get_slice(ctid % 128)
        cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO_wg))
        # Generic-proxy smem writes must be visible to the TMA (async proxy) store.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        if store_warp:
            gO = cute.local_tile(
                tO[None, None, head, batch],
                (64, self.HEAD_DIM),
                (m_block * self.NUM_CONSUMER_WGS + cwg, 0),
            )  # (64, D)
            self._tma_store(tma_o, sO_wg, gO)
