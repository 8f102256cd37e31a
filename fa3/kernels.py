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
  `TileScheduler.tile_coords` order (heaviest causal tiles first, heads grouped so their K/V
  stay in L2).
  Pipeline states carry their phases from tile to tile; Q is loaded and released once per tile
  (released after the main loop, or after the O store where sO aliases sQ). BALANCED_ORDER
  (Fa3Config.balanced_order) evens out the CTAs' causal work (tile_scheduler.py).
- Epilogue: O scaled by 1/l (0 for empty rows), LSE (natural log, -inf for empty rows) stored
  in fp32, O via stmatrix into smem, fence, named barrier, TMA store.
- FP8 (dtype e4m3, O in bf16): the same roles, pipelines, masking, softmax and epilogue, with
  four branches. V arrives transposed (Vᵀ (B, Hkv, D, Nk), keys contiguous, made by the host:
  fp8 wgmma takes no MN-major operand) and is loaded as K-major (D, TILE_N) blocks
  (fwd_layouts.py). P goes to e4m3 with a register exchange within each quad (fp8_ops.py). The
  descales are kernel arguments, (B, Hkv) fp32 tensors: each tile's consumer reads those of its
  (batch, kv head) (`tile_scales`); descale_q·descale_k multiplies the softmax scale (after the
  raw-score max, so P stays in [0, 1] before its e4m3 rounding) and descale_v the final 1/l.
  With FP8_BLOCKS the descales are per block instead (q per block of query rows, k and v per
  block of keys, a whole number of K/V blocks): each row's scale takes its q descale once per
  tile and each K/V block's k descale; the row max is kept in log2 units, and O in units of
  the current block's v descale, its rescale taking the ratio between blocks (fwd_consumer.py
  `block_scales`, fwd_mainloop.py `scores_to_probs`).
  sO is bf16, its own buffer (it does not fit on the fp8 sQ). Fa3Config.v_transpose="smem"
  (VT_SMEM) takes V as it lies instead: warps 1-3 of the producer WG transpose each loaded V
  block into a Vᵀ ring that P·V reads (fwd_layouts.py, pipeline.transpose_blocks).

This file holds the kernel class: its static configuration, the host launch, the kernel entry
and the role split (`warp_roles`, the producer's loads). The concerns it composes live next to
it: fwd_consumer.py (the consumer's per-tile work and the epilogue), tile_scheduler.py
(persistent order, block ranges), pipeline.py (producer loads, ping-pong), mask.py,
softmax.py, epilogue.py (O stores), fwd_layouts.py (smem layouts, MMAs, TMA atoms,
pipelines), fwd_mainloop.py (the per-block steps), utils.py (warp roles, named barriers,
16-bit packing, the two wgmma issues).

Persistent tile overlap (Fa3Config.overlap_tiles, persistent only). Per CTA the tiles run
t = 0, 1, ... in the schedule order; n_t = n_block_max - n_block_min K/V blocks (may be 0).
W = consumer warps (4 x NUM_CONSUMER_WGS), every mbarrier below is a `PipelineTmaAsync` one:
full barriers complete on the producer's arrive_and_expect_tx (count 1) + the TMA bytes, empty
barriers on W consumer-warp arrivals; a state's phase flips each time its index wraps.

  barrier          arrivals per tile t                     who waits, on which parity
  Q full  (Q_ST.)  1 + bytes_q, once per tile (also n_t=0)  consumers: q_state, advances per tile
  Q empty (Q_ST.)  W: after each warp's last QK has retired  producer: before Q of tile t+1
                   (intra-WG overlap, separate sO; n_t = 0: before the epilogue; without
                   intra-WG overlap: after the main loop; O_ALIAS_Q: after the O store read sQ;
                   Q_IN_REGS with a separate sO: once the warp has loaded Q into registers)
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
Q_STAGES (Fa3Config.q_stages) is 1 or 2: with 2, tile t's Q lands in buffer t % 2 and the
producer's acquire before Q of tile t+1 waits for tile t-1's release, long past.
Producer order per tile: K(first block) -> Q -> V(first block) -> K, V of the other blocks
(with two Q buffers Q first: Q -> K(first block) -> V(first block) -> ...).
The first K load of tile t+1 needs a free K stage (2 stages: freed by tile t's next-to-last
QK), not the consumers' Q release, so it lands while tile t's last PV and epilogue run, and
Q(t+1) follows as soon as both WGs' last QK of tile t retired. Neither wait can deadlock: what the
producer waits for (a K stage, sQ) is released by consumer work on blocks it already loaded.
Separate sO: sO is TILE_M x D in NUM_CONSUMER_WGS slabs of 64 rows, slab c written and
TMA-stored by WG c alone (its first warp issues the store), so a WG that finishes its tile
starts the next one without waiting for the other WG. The store's smem reads are waited for
(cp.async.bulk.wait_group.read 0) by that warp right before WG c writes its slab again, and
once after the last tile; never right after the store.

Tile counter (Fa3Config.tile_counter, persistent, dense). CTA b's first tile is the order's
position b; each next one is grid + an int32 counter's old value, which the producer warp's
lane 0 takes with an atomic add before it issues the current tile's loads. The producer hands
every position (and finally one past the last tile) to the consumers on a two-slot shared-memory
ring (`PipelineAsync`: full barrier 1 arrival, lane 0's; empty barrier every consumer thread's),
so each role walks the same positions; the order is tile_coords' without the snake rounds
(sections heaviest first), handed out as SMs free up. The counters, (next, CTAs done) in
cu_seqlens_k's slot, are zero at launch: the CTA whose "done" add returns grid - 1 has seen every
other CTA take its last position and stores both back to 0 (benchmarks/fwd_l2_model --dynamic
models this order).

Global tensors arrive in the API layout (B, N, H, D) and are viewed as (N, D, H, B), so TMA
uses a 4-D descriptor and its bounds are per sequence: tail tiles load zeros and stores clip.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from flashsuite.fa3 import trace
from flashsuite.fa3.configs import TRANSPOSE_WARPS, Fa3Config, reg_split
from flashsuite.fa3.fwd_consumer import ForwardConsumer
from flashsuite.fa3.fwd_layouts import ForwardLayouts
from flashsuite.fa3.fwd_mainloop import ForwardMainloop
from flashsuite.fa3.pipeline import PingPong, load_tile, transpose_blocks
from flashsuite.fa3.tile_scheduler import TileScheduler
from flashsuite.fa3.utils import WarpRole, atom_add_gpu_s32, st_relaxed_gpu_s32
from flashsuite.fa3.varlen import DenseRows, VarlenTiles

__all__ = ["Fa3Forward"]


class Fa3Forward(ForwardLayouts, ForwardMainloop, ForwardConsumer):
    """Static configuration of one compiled forward; `__call__` is the host-side launcher."""

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        cfg: Fa3Config,
        causal: bool,
        local: bool,
        softcap: bool,
        varlen: bool = False,
        fp8_blocks: bool = False,
    ) -> None:
        self.dtype = dtype
        self.FP8 = dtype is Float8E4M3FN
        # fp8 descales per block of rows (q) and of keys (k, v) rather than per (batch, kv
        # head): `block_scales`, `block_descales`.
        self.FP8_BLOCKS = fp8_blocks
        assert self.FP8 or not fp8_blocks, "fp8_blocks: float8_e4m3fn only"
        # fp8: Vᵀ made by the host (VT_HOST) or in shared memory by the producer WG (VT_SMEM).
        self.VT_SMEM = self.FP8 and cfg.v_transpose == "smem"
        self.VT_HOST = self.FP8 and not self.VT_SMEM
        assert not (self.VT_SMEM and cfg.persistent), "v_transpose='smem': plain grid only"
        self.o_dtype = BFloat16 if self.FP8 else dtype  # O's dtype in smem and gmem
        self.HEAD_DIM = head_dim
        self.TILE_M = cfg.tile_m
        self.TILE_N = cfg.tile_n
        self.STAGES = cfg.stages
        self.PINGPONG = cfg.pingpong
        self.K_AHEAD = cfg.k_ahead
        self.RESCALE_BEFORE_PV = cfg.rescale_before_pv
        self.INTRA_WG_OVERLAP = cfg.intra_wg_overlap
        self.SOFTMAX_APART = cfg.softmax_apart
        self.EX2_EMU = cfg.ex2_emu
        self.RESCALE_THRESHOLD = cfg.rescale_threshold
        self.SKIP_UNIT_RESCALE = cfg.skip_unit_rescale
        self.ROW_CHAINS = cfg.row_chains
        self.SPEC_EXPS = cfg.spec_exps
        self.PERMUTE_V_KEYS = cfg.permute_v_keys
        self.WG_SLICE = cfg.wg_slice
        self.STAGE_DESC = cfg.stage_desc
        self.LOOP_MASK_TEST = cfg.loop_mask_test
        self.SPLIT_LOOPS = cfg.split_loops
        self.PIN_PV_WAIT = cfg.pin_pv_wait
        self.PV_WAIT_AFTER_MAX = cfg.pv_wait_after_max
        self.PV_WAIT_EXPS = cfg.pv_wait_exps
        self.O_ZERO_INIT = cfg.o_zero_init
        self.O_ALIAS_Q = cfg.o_alias_q
        # sQ buffers: 2 lets the producer load the next tile's Q under the current one.
        self.Q_STAGES = cfg.q_stages
        self.NUM_CONSUMER_WGS = cfg.num_consumer_wgs
        self.PRODUCER_REGS, self.CONSUMER_REGS = reg_split(cfg)
        self.CONSUMER_THREADS = 128 * cfg.num_consumer_wgs
        self.NUM_THREADS = 128 + self.CONSUMER_THREADS
        self.PERSISTENT = cfg.persistent
        # Packed sequences (varlen.py): one tile per CTA on the virtual-block grid; 16-bit only.
        self.VARLEN = varlen
        if cfg.head_section and not varlen:
            raise ValueError(
                f"Fa3Forward: head_section {cfg.head_section} orders packed sequences' plain grid; "
                "dense builds take 0"
            )
        assert not (varlen and (cfg.persistent or self.FP8)), "varlen: 16-bit, plain grid only"
        # An L2 prefetch of the next wave's Q (dense plain grid; Fa3Config.prefetch_next_q).
        assert not (cfg.prefetch_next_q and (cfg.persistent or varlen)), "prefetch_next_q: dense"
        self.PREFETCH_NEXT_Q = cfg.prefetch_next_q
        # O by the consumer threads' own stores (Fa3Config.o_direct_store; dense plain grid).
        assert not (cfg.o_direct_store and (cfg.persistent or varlen)), "o_direct_store: dense"
        self.O_DIRECT_STORE = cfg.o_direct_store
        # The LSE by TMA from sLSE (Fa3Config.lse_tma; per-WG epilogue builds).
        self.LSE_TMA = cfg.lse_tma
        # Q·Kᵀ with Q in registers (Fa3Config.q_in_regs): 16-bit, D <= 128.
        self.Q_IN_REGS = cfg.q_in_regs
        assert not (cfg.q_in_regs and (self.FP8 or head_dim > 128 or cfg.num_consumer_wgs != 2)), (
            "q_in_regs: 16-bit, D <= 128, 2 consumer WGs"
        )
        # Per-tile clock stamps (Fa3Config.trace, fa3/trace.py): 16-bit dense builds only.
        self.TRACE = cfg.trace
        assert not (cfg.trace and (varlen or self.FP8)), "trace: 16-bit dense builds"
        self.OVERLAP_TILES = cfg.persistent and cfg.overlap_tiles
        self.BALANCED_ORDER = cfg.persistent and cfg.balanced_order
        # Tiles from a global counter (Fa3Config.tile_counter; dense persistent builds): see
        # `load_counted` and `next_tile`. The order is the unbalanced one (no snake rounds).
        self.TILE_COUNTER = cfg.persistent and cfg.tile_counter
        assert not (self.TILE_COUNTER and varlen), "tile_counter: dense persistent builds"
        # Each consumer WG stores its own 64-row slab of a separate sO (not possible on sQ: the
        # other WG's Q·Kᵀ may still read sQ). Q is then released right after the last Q·Kᵀ.
        self.PER_WG_EPILOGUE = self.OVERLAP_TILES and not cfg.o_alias_q
        # Q in registers (persistent, separate sO): sQ is free once every consumer warp has
        # loaded it, so the next tile's Q may land under this tile's whole K/V loop.
        self.Q_RELEASE_AT_LOAD = self.Q_IN_REGS and self.PER_WG_EPILOGUE
        self.EARLY_Q_RELEASE = (
            self.PER_WG_EPILOGUE and cfg.intra_wg_overlap and not self.Q_RELEASE_AT_LOAD
        )
        # sLSE lives in the storage of a separate sO without the Vᵀ ring (fwd_layouts).
        assert not (self.LSE_TMA and (varlen or not self.PER_WG_EPILOGUE or self.VT_SMEM)), (
            "lse_tma: the dense per-WG epilogue, V not transposed in smem"
        )
        # A consumer WG whose 64 rows see none of the tile's newest K/V block passes that
        # block by without products (Fa3Config.skip_masked_wg; causal / right window only).
        self.SKIP_MASKED_WG = cfg.skip_masked_wg and (causal or local)
        # K and V rows (both tensors) of the (batch, head) pairs that the persistent order
        # keeps in flight together: by default ~32 MiB of the H200's 50 MiB L2.
        self.L2_KV_ROWS = (cfg.l2_section_mib << 20) // (2 * head_dim * (dtype.width // 8))
        # Right edge of the window bounded (causal is a window with right == 0) / left edge.
        self.HAS_RIGHT = causal or local
        self.HAS_LEFT = local
        self.SOFTCAP = softcap
        self.scheduler = TileScheduler(
            cfg.tile_m,
            cfg.tile_n,
            balanced=self.BALANCED_ORDER and not self.TILE_COUNTER,
            longest_first=self.HAS_RIGHT,
            has_right=self.HAS_RIGHT,
            has_left=self.HAS_LEFT,
            l2_kv_rows=self.L2_KV_ROWS,
            lpt_grid=cfg.lpt_grid and not varlen,
        )
        self.pingpong = PingPong(cfg.pingpong, cfg.num_consumer_wgs)
        self.varlen_tiles = VarlenTiles(
            cfg.tile_m, longest_first=self.HAS_RIGHT, head_section=cfg.head_section
        )

    # ----------------------------------------------------------------------------------------
    # host side
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Nq, Hq, D)
        mK: cute.Tensor,  # (B, Nk, Hkv, D)
        mV: cute.Tensor,  # (B, Nk, Hkv, D); fp8: Vᵀ (B, Hkv, D, Nk), keys contiguous
        mO: cute.Tensor,  # (B, Nq, Hq, D); bf16 for fp8
        mLSE: cute.Tensor,  # (B, Hq, Nq) fp32
        # (B, Hkv) fp32 for fp8 (FP8_BLOCKS: (B, H, nblocks, block), last stride 0), else None
        mDescaleQ: cute.Tensor | None,
        mDescaleK: cute.Tensor | None,
        mDescaleV: cute.Tensor | None,
        mCuSeqlensQ: cute.Tensor | None,  # (B + 1,) int32 with VARLEN, else None
        mCuSeqlensK: cute.Tensor | None,  # (B + 1,) int32 with VARLEN, else None
        scale_log2: Float32,  # log2(e) * scale (or * softcap with SOFTCAP)
        softcap_pre: Float32,  # scale / softcap, applied before tanh (unused without SOFTCAP)
        window_left: Int32,  # >= 0 (the host maps "unbounded" to a large value)
        window_right: Int32,  # >= 0; 0 when causal
        max_ctas: Int32,  # persistent grid size (the SM count); unused otherwise
        stream,
    ):
        total_q = mQ.shape[0] if const_expr(self.VARLEN) else 0  # packed q: (total_q, Hq, D)
        mQ, mK, mV, mO, mLSE = self._kernel_views(mQ, mK, mV, mO, mLSE)
        sQ_l, sK_l, sV_l, sO_l = self._make_layouts()
        mma_qk, mma_pv = self._make_mmas()
        self.storage = self._storage(sQ_l, sK_l, sV_l, sO_l)
        tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO = self._make_tmas(
            mQ, mK, mV, mO, sQ_l, sK_l, sV_l, sO_l
        )
        if const_expr(self.O_DIRECT_STORE):
            tO = mO  # the consumer threads store O themselves (epilogue.store_o_direct)
        tma_lse = None
        if const_expr(self.LSE_TMA):  # mLSE becomes the TMA's coordinates, 64 rows a box
            tma_lse, mLSE = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mLSE, cute.make_layout(64), (64,)
            )

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        heads_q = mQ.shape[2]
        group = heads_q // mK.shape[2]  # query heads per kv head (GQA/MQA)
        batch_n = mQ.shape[3]
        if const_expr(self.VARLEN):
            # Per-sequence lengths come from cu_seqlens in the kernel; the views' extents are
            # the ragged constants (varlen.py).
            batch_n = mCuSeqlensQ.shape[0] - 1
            seqlen_q, seqlen_k = 0, 0
        m_blocks = (seqlen_q + self.TILE_M - 1) // self.TILE_M
        grid = (m_blocks, heads_q, batch_n)
        if const_expr(self.PERSISTENT):
            grid = (cutlass.min(m_blocks * heads_q * mQ.shape[3], max_ctas), 1, 1)
        if const_expr(self.scheduler.LPT_GRID):
            grid = (m_blocks * heads_q * batch_n, 1, 1)
        if const_expr(self.VARLEN):
            grid = (self.varlen_tiles.grid_blocks(total_q, batch_n), heads_q, 1)
            if const_expr(self.varlen_tiles.HEAD_SECTION):
                grid = (grid[0] * heads_q, 1, 1)
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
            tma_lse,
            mDescaleQ,
            mDescaleK,
            mDescaleV,
            mCuSeqlensQ,
            mCuSeqlensK,
            mma_qk,
            mma_pv,
            sQ_l,
            sK_l,
            sV_l,
            sO_l,
            Int32(seqlen_q),
            Int32(seqlen_k),
            Int32(group),
            scale_log2,
            softcap_pre,
            window_left,
            window_right,
            Int32(heads_q),
            Int32(batch_n),
            max_ctas,
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
        tV: cute.Tensor,  # (Nk, D, Hkv, B); fp8: (D, Nk, Hkv, B)
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,  # (Nq, D, Hq, B); O_DIRECT_STORE: O itself, else TMA coordinates
        mLSE: cute.Tensor,  # (Nq, Hq, B) fp32; LSE_TMA: its TMA coordinates
        tma_lse: cute.CopyAtom | None,  # LSE_TMA: the LSE's TMA store, else None
        mDescaleQ: cute.Tensor | None,  # (B, Hkv) fp32 for fp8, else None
        mDescaleK: cute.Tensor | None,
        mDescaleV: cute.Tensor | None,
        mCuSeqlensQ: cute.Tensor | None,  # (B + 1,) int32 with VARLEN, else None
        mCuSeqlensK: cute.Tensor | None,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_l: cute.ComposedLayout,  # (TILE_M, D)
        sK_l: cute.ComposedLayout,  # (TILE_N, D, STAGES)
        sV_l: cute.ComposedLayout,  # sK_l; fp8: (D, TILE_N, STAGES)
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
        sm_count: Int32,  # CTAs of one wave on the plain grid (PREFETCH_NEXT_Q)
    ):
        """Packed tensors (VARLEN): Q, K, V, O in the ragged (R, D, H, L) views and mLSE
        (total_q, Hq); the CTA's tile and its sequence come from cu_seqlens (varlen.py), and a
        CTA on a sequence's spare virtual block does nothing (every thread takes that branch)."""
        tidx, _, _ = cute.arch.thread_idx()
        t_cta = (trace.now(), trace.now_ns()) if const_expr(self.TRACE) else None
        if const_expr(self.VARLEN):
            m_block, head, valid, rows = self.varlen_tiles.tile(
                mCuSeqlensQ, mCuSeqlensK, batch_n, heads_q
            )
            sched = SimpleNamespace(
                tile0=(m_block, head, rows.batch),
                rows0=rows,
                seqlen_q=rows.seqlen_q,
                seqlen_k=rows.seqlen_k,
                group=group,
                window_left=window_left,
                window_right=window_right,
            )
            if valid:
                self.cta(
                    tidx, sched, tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO, mLSE, None, None,
                    None, mma_qk, mma_pv, sQ_l, sK_l, sV_l, sO_l, scale_log2, softcap_pre,
                )  # fmt: skip
        else:
            sched = self.scheduler.problem(
                seqlen_q, seqlen_k, group, window_left, window_right, heads_q, batch_n
            )
            sched.rows0 = DenseRows(sched.tile0[2])
            sched.sm_count = sm_count
            # TILE_COUNTER: (next tile, CTAs done) int32 in cu_seqlens_k's slot.
            sched.counters = mCuSeqlensK if const_expr(self.TILE_COUNTER) else None
            sched.trace = None
            if const_expr(self.TRACE):  # the trace comes in descale_q's slot (fa3/trace.py)
                sched.trace = (mDescaleQ, *t_cta)
                mDescaleQ = None
            if const_expr(self.LSE_TMA):
                mLSE = (tma_lse, mLSE)  # the consumer adds sLSE (`cta`)
            self.cta(
                tidx, sched, tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO, mLSE, mDescaleQ,
                mDescaleK, mDescaleV, mma_qk, mma_pv, sQ_l, sK_l, sV_l, sO_l, scale_log2,
                softcap_pre,
            )  # fmt: skip

    @cute.jit
    def cta(
        self,
        tidx: Int32,
        sched: SimpleNamespace,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE,  # (Nq, Hq, B) fp32; LSE_TMA: (TMA atom, coordinates)
        mDescaleQ: cute.Tensor | None,
        mDescaleK: cute.Tensor | None,
        mDescaleV: cute.Tensor | None,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_l: cute.ComposedLayout,
        sK_l: cute.ComposedLayout,
        sV_l: cute.ComposedLayout,
        sO_l: cute.ComposedLayout,
        scale_log2: Float32,
        softcap_pre: Float32,
    ):
        """One CTA's work after its schedule `sched` is known: shared memory and pipelines, then
        the roles (the kernel's arguments, as `kernel` receives them)."""
        seqlen_q, seqlen_k = sched.seqlen_q, sched.seqlen_k
        window_left, window_right = sched.window_left, sched.window_right
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        pipes, smem, vt = self._allocate_smem(sQ_l, sK_l, sV_l, sO_l)
        pipe_q, pipe_k, pipe_v, pipe_pv = pipes  # pipe_pv: what P·V waits on (VtPipe for VT_SMEM)
        sQ, sK, sV, sVt, sO, sLSE, sched.tiles = smem
        if const_expr(self.LSE_TMA):
            mLSE = (*mLSE, sLSE)  # (TMA atom, coordinates, staging smem)
        descales = None
        if const_expr(self.FP8):
            # Each tile's consumer reads its (batch, kv head) descales (`tile_scales`).
            descales = (mDescaleQ, mDescaleK, mDescaleV, sched.group)
            if const_expr(not self.PERSISTENT):
                # The CTA's one tile: its block range computed once here, for both roles. The
                # 16-bit branch computes it inside each role instead; each branch keeps the
                # code its H200 measurements were taken with.
                sched.blocks = self.scheduler.block_range(
                    sched.tile0[0], seqlen_q, seqlen_k, window_left, window_right
                )
        self.warp_roles(
            wg,
            warp,
            tidx,
            (tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, pipe_q, pipe_k, pipe_v),
            (tma_o, tO, mLSE, descales, mma_qk, mma_pv, sQ, sK, sVt, sO, pipe_q, pipe_k, pipe_pv),
            sched,
            scale_log2,
            softcap_pre,
            (vt, sV_l),
        )

    @cute.jit
    def warp_roles(
        self,
        wg: Int32,
        warp: Int32,
        tidx: Int32,
        load_args: tuple,  # `load_tile`'s TMA atoms and coordinates, smem tensors, pipelines
        cons_args: tuple,  # `consumer`'s: O store, LSE, MMAs, smem tensors and pipelines
        sched: SimpleNamespace,
        scale_log2: Float32,
        softcap_pre: Float32,
        vt_args: tuple,  # VT_SMEM: (_allocate_smem's vt, sV_l); (None, sV_l) otherwise
    ):
        """The role split: warp 0 of the producer WG loads, the consumer WGs compute (VT_SMEM:
        warps 1..TRANSPOSE_WARPS of the producer WG transpose V).

        `sched`: the problem (seqlen_q, seqlen_k, group, window_left, window_right; a packed
        tile's own sequence lengths with VARLEN) and tile0, this CTA's (m_block, head, batch)
        without PERSISTENT with rows0 its sequence (varlen.DenseRows / SeqRows), or the
        persistent schedule (bid_x, grid_x, num_tiles, m_blocks, heads_q, batch_n), read only
        with PERSISTENT.
        """
        m_block0, head0, _ = sched.tile0
        rows0 = sched.rows0
        seqlen_q, seqlen_k, group = sched.seqlen_q, sched.seqlen_k, sched.group
        window_left, window_right = sched.window_left, sched.window_right
        Producer, Consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer

        if wg == WarpRole.PRODUCER:
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
            if warp == 0:
                # Pipeline states live across tiles (persistent): their phases carry on.
                q_state = pipeline.make_pipeline_state(Producer, self.Q_STAGES)
                kv_state = pipeline.make_pipeline_state(Producer, self.STAGES)
                if const_expr(self.TILE_COUNTER):
                    self.load_counted(load_args, q_state, kv_state, sched, group)
                elif const_expr(self.PERSISTENT):
                    for k in cutlass.range(
                        self.scheduler.cta_tile_count(sched.bid_x, sched.grid_x, sched.num_tiles),
                        unroll=1,
                    ):
                        m_block, head, batch, n_block_min, n_block_max = self.scheduler.tile_work(
                            k, sched
                        )
                        t_load = trace.now() if const_expr(self.TRACE) else None
                        q_state, kv_state = self.load(
                            load_args, q_state, kv_state, m_block, head, DenseRows(batch), group,
                            n_block_min, n_block_max,
                        )  # fmt: skip
                        self.trace_loads(sched, m_block, head, batch, t_load)
                else:
                    n_block_min, n_block_max = self.scheduler.cta_blocks(sched)
                    if const_expr(self.PREFETCH_NEXT_Q):
                        self.prefetch_next_q(load_args[0], load_args[1], load_args[6], sched)
                    t_load = trace.now() if const_expr(self.TRACE) else None
                    self.load(
                        load_args, q_state, kv_state, m_block0, head0, rows0, group,
                        n_block_min, n_block_max,
                    )  # fmt: skip
                    self.trace_loads(sched, m_block0, head0, rows0.batch, t_load)
            if const_expr(self.VT_SMEM):  # noqa: SIM102
                if (warp > 0) & (warp <= TRANSPOSE_WARPS):
                    n_block_min, n_block_max = self.scheduler.cta_blocks(sched)
                    transpose_blocks(
                        vt_args[0], vt_args[1], self._vt_layout(),
                        pipeline.make_pipeline_state(Consumer, self.STAGES),
                        pipeline.make_pipeline_state(Producer, self.STAGES),
                        n_block_max - n_block_min, warp - 1, TRANSPOSE_WARPS, self.TILE_N,
                        self.HEAD_DIM, self.PERMUTE_V_KEYS,
                    )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.CONSUMER_REGS)
            cwg = wg - WarpRole.CONSUMER0
            self.pingpong.start(cwg)
            q_state = pipeline.make_pipeline_state(Consumer, self.Q_STAGES)
            kv_state = pipeline.make_pipeline_state(Consumer, self.STAGES)
            if const_expr(self.TILE_COUNTER):
                tile_state = pipeline.make_pipeline_state(Consumer, 2)
                tile, tile_state = self.next_tile(sched.tiles, tile_state)
                while tile < sched.num_tiles:
                    m_block, head, batch, n_block_min, n_block_max = self.scheduler.tile_at(
                        tile, sched
                    )
                    q_state, kv_state = self.consumer(
                        *cons_args, q_state, kv_state, tidx - 128, warp, cwg, m_block, head,
                        DenseRows(batch), seqlen_q, seqlen_k, scale_log2, softcap_pre,
                        window_left, window_right, n_block_min, n_block_max,
                        self.trace_at(sched, m_block, head, batch, cwg),
                    )  # fmt: skip
                    tile, tile_state = self.next_tile(sched.tiles, tile_state)
            elif const_expr(self.PERSISTENT):
                for k in cutlass.range(
                    self.scheduler.cta_tile_count(sched.bid_x, sched.grid_x, sched.num_tiles),
                    unroll=1,
                ):
                    m_block, head, batch, n_block_min, n_block_max = self.scheduler.tile_work(
                        k, sched
                    )
                    q_state, kv_state = self.consumer(
                        *cons_args,
                        q_state,
                        kv_state,
                        tidx - 128,
                        warp,
                        cwg,
                        m_block,
                        head,
                        DenseRows(batch),
                        seqlen_q,
                        seqlen_k,
                        scale_log2,
                        softcap_pre,
                        window_left,
                        window_right,
                        n_block_min,
                        n_block_max,
                        self.trace_at(sched, m_block, head, batch, cwg),
                    )
            else:
                n_block_min, n_block_max = self.scheduler.cta_blocks(sched)
                self.consumer(
                    *cons_args,
                    q_state,
                    kv_state,
                    tidx - 128,
                    warp,
                    cwg,
                    m_block0,
                    head0,
                    rows0,
                    seqlen_q,
                    seqlen_k,
                    scale_log2,
                    softcap_pre,
                    window_left,
                    window_right,
                    n_block_min,
                    n_block_max,
                    self.trace_at(sched, m_block0, head0, rows0.batch, cwg),
                )
            if const_expr(self.PER_WG_EPILOGUE):  # noqa: SIM102 (persistent builds only)
                if warp % 4 == 0:
                    # The last tile's O store must have read sO before the CTA exits.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def load_counted(self, load_args: tuple, q_state, kv_state, sched, group):
        """Producer warp with TILE_COUNTER ("Tile counter" above): the CTA's first tile is its
        block index, each next one grid + the counter's old value (lane 0's atomic add, issued
        before the current tile's loads so its latency lies under them). Every index, and
        finally one past the last tile, goes to the consumers on the tile ring. The CTA that
        finishes last (the second counter) sets both counters back to 0 for the next launch:
        every CTA has taken its last index by then."""
        tile_pipe, s_tile = sched.tiles
        counters = sched.counters.iterator
        lane = cute.arch.lane_idx()
        tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        tile = sched.bid_x
        while tile < sched.num_tiles:
            tile_state = self.publish_tile(tile_pipe, s_tile, tile_state, tile, lane)
            taken = Int32(0)
            if lane == 0:
                taken = atom_add_gpu_s32(counters, Int32(1))
            m_block, head, batch, n_block_min, n_block_max = self.scheduler.tile_at(tile, sched)
            t_load = trace.now() if const_expr(self.TRACE) else None
            q_state, kv_state = self.load(
                load_args, q_state, kv_state, m_block, head, DenseRows(batch), group,
                n_block_min, n_block_max,
            )  # fmt: skip
            self.trace_loads(sched, m_block, head, batch, t_load)
            tile = cute.arch.shuffle_sync(taken, 0) + sched.grid_x
        tile_state = self.publish_tile(tile_pipe, s_tile, tile_state, tile, lane)
        if lane == 0:
            # acq_rel: every CTA's last counter add happens before the last CTA's reset.
            done = atom_add_gpu_s32(counters + 1, Int32(1), "acq_rel")
            if done == sched.grid_x - 1:
                st_relaxed_gpu_s32(counters, Int32(0))
                st_relaxed_gpu_s32(counters + 1, Int32(0))

    @cute.jit
    def publish_tile(self, tile_pipe, s_tile: cute.Tensor, tile_state, tile: Int32, lane: Int32):
        """Producer warp: tile index `tile` into the ring's next slot (lane 0 writes it and
        arrives, once the consumers have read what the slot held before)."""
        tile_pipe.producer_acquire(tile_state)
        if lane == 0:
            s_tile[tile_state.index] = tile
            tile_pipe.producer_commit(tile_state)
        tile_state.advance()
        return tile_state

    @cute.jit
    def next_tile(self, tiles: tuple, tile_state):
        """Consumer thread: the next tile index from the ring (TILE_COUNTER), its slot released."""
        tile_pipe, s_tile = tiles
        tile_pipe.consumer_wait(tile_state)
        tile = s_tile[tile_state.index]
        tile_pipe.consumer_release(tile_state)
        tile_state.advance()
        return tile, tile_state

    def trace_at(self, sched: SimpleNamespace, m_block, head, batch, cwg):
        """TRACE: (trace tensor, CTA start, CTA start ns, this tile's row) for `consumer`."""
        if const_expr(not self.TRACE):
            return None
        row = trace.tile_row(sched, m_block, head, batch, cwg, self.NUM_CONSUMER_WGS)
        return (*sched.trace, row)

    @cute.jit
    def trace_loads(self, sched: SimpleNamespace, m_block, head, batch, t_load):
        """TRACE: the producer warp's stamps of one tile (lane 0, in consumer WG 0's row)."""
        if const_expr(self.TRACE):  # noqa: SIM102 (a const_expr test stays its own `if`)
            if cute.arch.lane_idx() == 0:
                row = trace.tile_row(sched, m_block, head, batch, 0, self.NUM_CONSUMER_WGS)
                fields = (trace.LOAD_START, trace.LOADS_ISSUED)
                trace.write(sched.trace[0], row, fields, (t_load, trace.now()))

    @cute.jit
    def prefetch_next_q(
        self, tma_q: cute.CopyAtom, tQ: cute.Tensor, sQ: cute.Tensor, sched: SimpleNamespace
    ):
        """Producer warp, plain dense grid: an L2 prefetch of the Q tile of the CTA one wave
        after this one (linear id + SM count in the (m_blocks, Hq, B) grid's launch order),
        if there is one."""
        m_block, head, batch = sched.tile0
        linear = m_block + sched.m_blocks * (head + sched.heads_q * batch)
        nxt = linear + sched.sm_count
        if nxt < sched.num_tiles:
            hb = nxt // sched.m_blocks
            rows = DenseRows(hb // sched.heads_q).q_rows(tQ, hb % sched.heads_q)
            gQ = cute.local_tile(rows, (self.TILE_M, self.HEAD_DIM), (nxt % sched.m_blocks, 0))
            _, tQg = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                cute.group_modes(gQ, 0, 2),
            )  # fmt: skip
            cute.prefetch(tma_q, tQg)

    @cute.jit
    def load(self, load_args: tuple, q_state, kv_state, m_block, head, rows, group, n_min, n_max):
        """The producer warp's loads of one tile (pipeline.load_tile with this kernel's tiles)."""
        return load_tile(
            *load_args, q_state, kv_state, m_block, head, rows, group, n_min, n_max,
            self.TILE_M, self.TILE_N, self.HEAD_DIM, self.PERSISTENT, self.OVERLAP_TILES,
            self._v_blocks, self.K_AHEAD, self.Q_STAGES,
        )  # fmt: skip
