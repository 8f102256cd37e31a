"""Split-KV attention against a KV cache (decode) for Hopper in the CuTe DSL, contiguous or paged.

Layout: q (B, Nq, Hq, D); the cache (B_cache, N_max, Hkv, D), or pages (num_pages, page_size,
Hkv, D) with block_table (B, max_pages) int32; cache_seqlens (B,) int32. Row b attends its first
seqlen_b = cache_seqlens[b] + n_new keys, bottom-right aligned (query token t sits at key
t + seqlen_b - Nq). The new keys are already in the cache (the host appends them first).

One CTA = one producer warpgroup (warp 0 issues the TMA loads) and one consumer warpgroup of 64
rows, on a grid (num_splits, Hkv x m_blocks, B):

- GQA packing. Row r of the 64-row tile is query token r // G, head hkv·G + r % G (G = Hq /
  Hkv): the G heads that share a K/V head, for every query token, so each K/V tile is read
  once per K/V head. Q is gathered into the swizzled sQ by the consumer warpgroup (16-byte
  loads, rows past Nq·G zero-filled): a TMA box cannot follow the (token, head) packing for
  a runtime G.
- Split-KV. The key blocks any row of the tile can see (after the window / causal bounds) are
  divided into num_splits contiguous ranges; split s streams its range newest block first
  through STAGES-deep K and V TMA rings, with the dense kernel's consumer steps (QK, mask,
  online softmax, PV, intra-WG overlap). With SPLIT each CTA writes its normalised partial O
  and its LSE in float32 for the combine; otherwise the final O (q's dtype) and LSE.
- K/V addressing (`kv_view`, `kv_tile`). The cache is viewed as a 5-D TMA tensor (R, D, Hkv,
  L, P) with strides (s_n, 1, s_h, s_n, s_p): the token stride twice and the base moved back
  R = 2^30 tokens, as fa3's varlen views do. Coordinate (R - len + i, d, h, len, p) is token
  i of page p (a contiguous cache: row p), inside the box bounds only for i < len. A key tile
  starting at token `start` of a page holding `len` valid tokens is therefore loaded with the
  tokens from len on zero-filled: never the unwritten slots past the row's length (whatever
  they hold, NaN included, cannot reach O through P·V), never another page. Paged: page
  block_table[b, j // page_size] holds key j, page_size a multiple of TILE_N so a tile lies in
  one page; contiguous: one "page" per row, page_size = N_max.
- O and LSE leave registers straight to global memory (a decode tile has at most Nq·G valid
  rows; the (token, head) packing is no TMA box either).
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import math
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from flashsuite.fa3.configs import Fa3Config
from flashsuite.fa3.decode_configs import DECODE_REG_SPLIT, DECODE_REG_SPLIT_2CTA
from flashsuite.fa3.fwd_layouts import ForwardLayouts
from flashsuite.fa3.fwd_mainloop import ForwardMainloop
from flashsuite.fa3.mask import apply_mask
from flashsuite.fa3.pipeline import PingPong
from flashsuite.fa3.softmax import finalize_row, rescale_rows
from flashsuite.fa3.utils import (
    LN2,
    Barrier,
    WarpRole,
    atom_add_acq_rel_gpu_s32,
    barrier_popc,
    ld_cg_f32,
    ld_cg_v4_f32,
)
from flashsuite.fa3.varlen import RAGGED_LAST, RAGGED_ROWS

__all__ = ["Fa3Decode"]

LOG2E = 1.0 / math.log(2.0)


def kv_view_layout(shape: tuple, stride: tuple) -> tuple[tuple, tuple]:
    """(shape, stride) of the 5-D ragged view (R, D, Hkv, L, P) of a cache of `shape` and
    `stride` (P, S, Hkv, D): the token stride on R and on L, the head and page strides on Hkv
    and P. The view's base is the cache's moved back R tokens (`kv_view`); coordinate
    (R - len + i, d, h, len, p) is then element (p, i, h, d), inside the box only for i < len.
    Plain tuples in, plain tuples out: the CPU tests check the addressing with integers."""
    s_p, s_n, s_h, _ = stride
    return (RAGGED_ROWS, shape[3], shape[2], RAGGED_LAST, shape[0]), (s_n, 1, s_h, s_n, s_p)


def page_box(first, seqlen_k, page_size: int, past_end: bool, lookup) -> tuple:
    """(page, start, valid) of the TMA box holding key `first` of a row of seqlen_k keys on
    page_size-token pages: the page `lookup` gives for the row's page index (its block_table
    column), the box's first token on that page, and the row's tokens on the page; the box's
    view row is R - valid + start.

    `past_end`: the box may start past the row's last key (a stage of several page boxes).
    Such a box starts at the row's last key instead: its page's block_table entry is the row's
    (a later one may not exist), its first row lies inside the view and the rest outside it
    (zeros), and its rows stand for keys past the row's end, which the mask removes. No box
    starts outside the view's extent: the H200 reported a fault at such a load
    (docs/inference.md, "Paged caches on full key tiles"). Integer arithmetic only, for the
    kernel's Int32 values and the CPU tests' ints alike."""
    key = first
    if past_end:
        key = cutlass.min(first, cutlass.max(seqlen_k - 1, 0))
    index = key // page_size
    page = lookup(index)
    return page, key - index * page_size, cutlass.min(page_size, seqlen_k - index * page_size)


def kv_view(t: cute.Tensor) -> cute.Tensor:
    """A cache (P, S, Hkv, D) as the 5-D ragged TMA view (R, D, Hkv, L, P) (host side)."""
    rows = cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2]))  # (S, D, Hkv)
    base = cute.domain_offset((-RAGGED_ROWS, 0, 0), rows).iterator  # R tokens back
    shape, stride = kv_view_layout(t.shape, t.stride)
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


# The L2 cache-policy operand of CUTLASS's TMA::CacheHintSm90::EVICT_FIRST.
L2_EVICT_FIRST = 0x12F0000000000000


class Fa3Decode(ForwardLayouts, ForwardMainloop):
    """Static configuration of one compiled decode kernel; `__call__` is the host launcher."""

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        cfg: Fa3Config,
        causal: bool,
        local: bool,
        softcap: bool,
        paged: bool,
        split: bool,
        fused_combine: bool = False,
        ctas_per_sm: int = 1,
        page_box: int = 0,
        kv_evict_first: bool = False,
        leftpad: bool = False,
    ) -> None:
        assert cfg.tile_m == 64 and cfg.num_consumer_wgs == 1 and cfg.o_alias_q
        assert not (leftpad and paged), "left padding is for a contiguous cache"
        assert split or not fused_combine, "the fused combine merges splits"
        self.dtype = dtype
        self.FP8 = False
        self.VT_SMEM = self.VT_HOST = False  # 16-bit V, read as it lies (fwd_layouts)
        self.SPLIT = split
        self.FUSED_COMBINE = fused_combine  # the last split of each warp's rows merges them
        self.o_dtype = Float32 if split else dtype  # partial O in fp32, final O in q's dtype
        self.HEAD_DIM = head_dim
        self.TILE_M = cfg.tile_m
        self.TILE_N = cfg.tile_n
        self.STAGES = cfg.stages
        self.Q_STAGES = 1  # one Q tile per CTA (fwd_layouts' storage and pipelines)
        self.LSE_TMA = False
        self.Q_IN_REGS = False  # Q·Kᵀ reads the gathered sQ (ForwardLayouts._make_mmas)
        self.TILE_COUNTER = False  # one tile a CTA (ForwardLayouts._storage, _allocate_smem)
        # Paged: keys per TMA box, a page's share of a stage (0: one box per stage). A stage of
        # TILE_N keys then spans TILE_N / BOX_N pages, one TMA load each.
        self.BOX_N = page_box or cfg.tile_n
        assert cfg.tile_n % self.BOX_N == 0 and (paged or cfg.tile_n == self.BOX_N)
        self.BOXES = cfg.tile_n // self.BOX_N
        # K and V with CUTLASS's L2 EVICT_FIRST policy (each block is read once per call).
        self.KV_EVICT_FIRST = kv_evict_first
        self.PINGPONG = False  # one consumer warpgroup
        self.INTRA_WG_OVERLAP = cfg.intra_wg_overlap
        self.SOFTMAX_APART = cfg.softmax_apart
        self.EX2_EMU = cfg.ex2_emu
        self.RESCALE_THRESHOLD = cfg.rescale_threshold
        self.SKIP_UNIT_RESCALE = cfg.skip_unit_rescale
        self.ROW_CHAINS = cfg.row_chains
        self.SPEC_EXPS = cfg.spec_exps
        self.PERMUTE_V_KEYS = cfg.permute_v_keys
        self.STAGE_DESC = cfg.stage_desc
        self.LOOP_MASK_TEST = cfg.loop_mask_test
        self.SPLIT_LOOPS = cfg.split_loops
        self.PIN_PV_WAIT = cfg.pin_pv_wait
        self.PV_WAIT_AFTER_MAX = cfg.pv_wait_after_max
        self.PV_WAIT_EXPS = cfg.pv_wait_exps
        self.O_ZERO_INIT = False  # acc_O zeroed before the loop (every split's tile)
        self.RESCALE_BEFORE_PV = cfg.rescale_before_pv
        self.O_ALIAS_Q = True  # no sO: O goes from registers to global memory
        self.NUM_CONSUMER_WGS = 1
        # Two CTAs per SM: ptxas gets 128 registers a thread at entry, setmaxnreg shares them.
        assert ctas_per_sm in (1, 2)
        self.CTAS_PER_SM = ctas_per_sm
        split_regs = DECODE_REG_SPLIT if ctas_per_sm == 1 else DECODE_REG_SPLIT_2CTA
        self.PRODUCER_REGS, self.CONSUMER_REGS = split_regs
        self.CONSUMER_THREADS = 128
        self.NUM_THREADS = 256
        self.PERSISTENT = False
        self.VARLEN = False
        self.PER_WG_EPILOGUE = False
        self.EARLY_Q_RELEASE = False
        self.HAS_RIGHT = causal or local
        self.HAS_LEFT = local
        self.SOFTCAP = softcap
        self.PAGED = paged
        # Rows of a contiguous cache start at a slot of their own: mCacheSeqlens is (2B,), the
        # lengths then each row's first key slot (cache_leftpad).
        self.LEFTPAD = leftpad
        self.pingpong = PingPong(False, 1)

    # ----------------------------------------------------------------------------------------
    # host side
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Nq, Hq, D)
        mK: cute.Tensor,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
        mV: cute.Tensor,  # like mK
        mO: cute.Tensor,  # (rows, D): rows (b, t, h) of out; SPLIT: (split, b, t, h) fp32
        mLSE: cute.Tensor,  # (B * Hq * Nq,) as (b, h, t); SPLIT: (splits * rows,) as mO's rows
        mBlockTable: cute.Tensor | None,  # (B, max_pages) int32 when paged, else None
        mCacheSeqlens: cute.Tensor,  # (B,) int32; LEFTPAD: (2B,), then each row's first key
        mOutF: cute.Tensor | None,  # FUSED_COMBINE: out (B·Nq·Hq, D) in q's dtype, else None
        mLseF: cute.Tensor | None,  # FUSED_COMBINE: lse (B·Hq·Nq,) as (b, h, t), else None
        mSem: cute.Tensor | None,  # FUSED_COMBINE: (B·Hkv·m_blocks·4,) int32 zeros, else None
        n_new: Int32,  # tokens appended to every row before attending
        num_splits: Int32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        atom = self._smem_atom(self.dtype)
        sQ_l = cute.tile_to_shape(atom, (self.TILE_M, self.HEAD_DIM), order=(0, 1))
        sK_l = cute.tile_to_shape(atom, (self.TILE_N, self.HEAD_DIM, self.STAGES), order=(0, 1, 2))
        mma_qk, mma_pv = self._make_mmas()
        self.storage = self._storage(sQ_l, sK_l, sK_l, sQ_l)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        box = (self.BOX_N, self.HEAD_DIM)
        box_l = cute.select(sK_l, mode=[0, 1])  # (TILE_N, D): one stage
        if const_expr(self.BOXES > 1):  # a stage's first BOX_N rows, as the stage lays them out
            box_l = cute.composition(
                box_l, cute.make_layout((self.BOX_N, self.HEAD_DIM), stride=(1, self.TILE_N))
            )
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, kv_view(mK), box_l, box)
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, kv_view(mV), box_l, box)
        batch_n, seqlen_q, heads_q, _ = mQ.shape
        heads_kv = mK.shape[2]
        group = heads_q // heads_kv
        m_blocks = (seqlen_q * group + self.TILE_M - 1) // self.TILE_M
        self.kernel(
            mQ, tma_k, tK, tma_v, tV, mO, mLSE, mBlockTable, mCacheSeqlens, mOutF, mLseF, mSem,
            mma_qk, mma_pv, sQ_l, sK_l, Int32(seqlen_q), Int32(heads_q), Int32(group),
            Int32(m_blocks), Int32(mK.shape[1]), n_new, num_splits, scale_log2, softcap_pre,
            window_left, window_right,
        ).launch(
            grid=(num_splits, heads_kv * m_blocks, batch_n),
            block=[self.NUM_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.CTAS_PER_SM,  # ptxas' entry register count for setmaxnreg
            # Two CTAs need the SM's whole shared memory (an explicit carve-out: the DSL would
            # otherwise query the device while compiling).
            preferred_smem_carveout=100 if self.CTAS_PER_SM == 2 else None,
        )  # fmt: skip

    # ----------------------------------------------------------------------------------------
    # device side
    # ----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,  # (R, D, Hkv, L, P) TMA coordinates
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mBlockTable: cute.Tensor | None,
        mCacheSeqlens: cute.Tensor,
        mOutF: cute.Tensor | None,
        mLseF: cute.Tensor | None,
        mSem: cute.Tensor | None,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_l: cute.ComposedLayout,  # (TILE_M, D)
        sK_l: cute.ComposedLayout,  # (TILE_N, D, STAGES), sV's too
        seqlen_q: Int32,
        heads_q: Int32,
        group: Int32,
        m_blocks: Int32,
        page_size: Int32,  # tokens per page; N_max for a contiguous cache
        n_new: Int32,
        num_splits: Int32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, hm, batch = cute.arch.block_idx()
        head_kv = hm // m_blocks
        m_block = hm - head_kv * m_blocks
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        if warp == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        pipes, smem, _ = self._allocate_smem(sQ_l, sK_l, sK_l, sQ_l)  # no Vᵀ ring (16-bit V)
        _, pipe_k, pipe_v, _ = pipes
        sQ, sK, sV, sVt, _, _, _ = smem

        seqlen_k = mCacheSeqlens[batch] + n_new
        first_key = Int32(0)  # the row's first key slot; keys are indexed from it
        if const_expr(self.LEFTPAD):
            # Clamped: unchecked metadata reads nothing before the row or past its length.
            pad = mCacheSeqlens[cute.arch.grid_dim()[2] + batch]
            first_key = cutlass.min(cutlass.max(pad, 0), cutlass.max(seqlen_k, 0))
            seqlen_k = seqlen_k - first_key
        tile = SimpleNamespace(
            batch=batch,
            head_kv=head_kv,
            first_key=first_key,
            m_block=m_block,
            group=group,
            rows=seqlen_q * group,  # packed rows of this (batch, kv head)
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            shift=seqlen_k - seqlen_q,
            page_size=page_size,
        )
        n_block_min, n_block_max = self.split_blocks(tile, split, num_splits, window_left,
                                                     window_right)  # fmt: skip
        if wg == WarpRole.PRODUCER:
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
            if warp == 0:
                self.load(tma_k, tK, tma_v, tV, sK, sV, pipe_k, pipe_v, mBlockTable, tile,
                          n_block_min, n_block_max)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.CONSUMER_REGS)
            self.consumer(
                mQ, mO, mLSE, mma_qk, mma_pv, sQ, sK, sVt, pipe_k, pipe_v, tidx - 128, tile,
                split, heads_q, scale_log2, softcap_pre, window_left, window_right, n_block_min,
                n_block_max, (mOutF, mLseF, mSem, num_splits),
            )  # fmt: skip

    @cute.jit
    def split_blocks(self, tile, split: Int32, num_splits: Int32, window_left, window_right):
        """[n_block_min, n_block_max) of this split: the key blocks any row of the tile sees
        (its first and last query tokens bound the window), cut into num_splits even ranges.
        Empty (max <= min) for a split past the end or a row without keys."""
        first_tok = tile.m_block * self.TILE_M // tile.group
        last_tok = (cutlass.min(tile.m_block * self.TILE_M + self.TILE_M, tile.rows) - 1) // (
            tile.group
        )
        lo = Int32(0)
        hi = tile.seqlen_k
        if const_expr(self.HAS_LEFT):
            lo = cutlass.max(first_tok + tile.shift - window_left, 0)
        if const_expr(self.HAS_RIGHT):
            hi = cutlass.min(cutlass.max(last_tok + tile.shift + window_right + 1, 0), hi)
        lo_blk = lo // self.TILE_N
        hi_blk = (hi + self.TILE_N - 1) // self.TILE_N
        per_split = (cutlass.max(hi_blk - lo_blk, 0) + num_splits - 1) // num_splits
        n_block_min = lo_blk + split * per_split
        return n_block_min, cutlass.min(n_block_min + per_split, hi_blk)

    # ----------------------------------------------------------------------------------------
    # producer
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def kv_tile(self, tX: cute.Tensor, mBlockTable, tile, first: Int32) -> cute.Tensor:
        """TMA coordinates of the BOX_N keys from key `first` of the tile's row and kv head:
        (BOX_N, D, 1), in bounds only for the row's keys (`kv_view`)."""
        page = tile.batch
        start = first + tile.first_key
        # Tokens of the page that belong to the row: a contiguous row holds at most N_max, so
        # even a cache_seqlens past the capacity (unchecked metadata) reads no other row.
        valid = cutlass.min(tile.seqlen_k + tile.first_key, tile.page_size)
        if const_expr(self.PAGED):
            page, start, valid = page_box(
                first, tile.seqlen_k, tile.page_size, self.BOXES > 1,
                lambda index: mBlockTable[tile.batch, index],
            )  # fmt: skip
        rows = cute.domain_offset(
            (RAGGED_ROWS - valid + start, 0), tX[None, None, tile.head_kv, valid, page]
        )  # (R, D): row 0 is key `first` (a box past the row's end: its last key)
        return cute.local_tile(rows, (self.BOX_N, self.HEAD_DIM), (None, 0))

    @cute.jit
    def load_block(self, tma, tX, sX, pipe, mBlockTable, tile, n_block: Int32, kv_state):
        """Wait for ring stage kv_state to be free, then TMA-load K or V block n_block: one
        box, or BOXES boxes of BOX_N keys (a page each) into the stage's row ranges, every
        page looked up before the wait."""
        boxes = []
        for i in cutlass.range_constexpr(self.BOXES):
            gX = self.kv_tile(tX, mBlockTable, tile, n_block * self.TILE_N + i * self.BOX_N)
            sXi = sX
            if const_expr(self.BOXES > 1):
                sXi = cute.local_tile(sX, (self.BOX_N, self.HEAD_DIM, self.STAGES), (i, 0, 0))
            boxes.append(
                cpasync.tma_partition(
                    tma, 0, cute.make_layout(1), cute.group_modes(sXi, 0, 2),
                    cute.group_modes(gX, 0, 2),
                )  # (TMA, STAGES), (TMA, 1)
            )  # fmt: skip
        hint = {}
        if const_expr(self.KV_EVICT_FIRST):
            hint["cache_policy"] = cutlass.Int64(cutlass.Int64(L2_EVICT_FIRST).ir_value())
        pipe.producer_acquire(kv_state)
        for tXs, tXg in boxes:
            cute.copy(
                tma, tXg[None, 0], tXs[None, kv_state.index],
                tma_bar_ptr=pipe.producer_get_barrier(kv_state), **hint,
            )  # fmt: skip

    @cute.jit
    def load(self, tma_k, tK, tma_v, tV, sK, sV, pipe_k, pipe_v, mBlockTable, tile,
             n_block_min: Int32, n_block_max: Int32):  # fmt: skip
        """Producer warp: K and V of blocks n_block_max - 1 down to n_block_min."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
        for i in cutlass.range(n_block_max - n_block_min, unroll=1):
            n_block = n_block_max - 1 - i
            self.load_block(tma_k, tK, sK, pipe_k, mBlockTable, tile, n_block, kv_state)
            self.load_block(tma_v, tV, sV, pipe_v, mBlockTable, tile, n_block, kv_state)
            kv_state.advance()

    # ----------------------------------------------------------------------------------------
    # consumer
    # ----------------------------------------------------------------------------------------
    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, ctid: Int32, tile, heads_q: Int32):
        """The tile's packed Q rows into sQ (16-byte loads, rows past Nq·G zero), then made
        visible to the wgmma (async proxy) of the whole consumer warpgroup."""
        vec = 128 // self.dtype.width
        chunks = self.HEAD_DIM // vec  # 16-byte chunks per row
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(self.TILE_M * chunks // 128):
            idx = ctid + 128 * i
            row = idx // chunks
            chunk = idx - row * chunks
            packed = tile.m_block * self.TILE_M + row
            tok = packed // tile.group
            head = tile.head_kv * tile.group + (packed - tok * tile.group)
            frag = cute.make_rmem_tensor((vec,), self.dtype)
            frag.fill(0.0)
            if packed < tile.rows:
                src = cute.local_tile(mQ[tile.batch, tok, head, None], (vec,), (chunk,))
                cute.copy(atom, src, frag)
            cute.copy(atom, frag, cute.local_tile(sQ[row, None], (vec,), (chunk,)))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=128)

    @cute.jit
    def _mask(self, ctx, n_block: Int32, scores: cute.Tensor):
        """mask.apply_mask on `scores` with each row's query token (the packed rows' tokens)."""
        apply_mask(
            scores, ctx.tScS, n_block, ctx.m_block, ctx.seqlen_k, ctx.shift, ctx.window_left,
            ctx.window_right, self.TILE_M, self.TILE_N, self.HAS_RIGHT, self.HAS_LEFT,
            query_of=ctx.tokens,
        )  # fmt: skip

    @cute.jit
    def mask_phases(self, tile, n_block_min, n_block_max, window_left, window_right):
        """(n_masked_hi, n_unmasked) of the split's blocks walked newest first after the
        first (always masked) one: masked blocks down to the first that every row sees whole
        on the right, unmasked ones down to the left window's edge, masked ones to the end."""
        first_tok = tile.m_block * self.TILE_M // tile.group
        last_tok = (cutlass.min(tile.m_block * self.TILE_M + self.TILE_M, tile.rows) - 1) // (
            tile.group
        )
        n_right_free = tile.seqlen_k // self.TILE_N
        if const_expr(self.HAS_RIGHT):
            n_right_free = cutlass.min(
                n_right_free,
                cutlass.max(first_tok + tile.shift + window_right + 1, 0) // self.TILE_N,
            )
        n_left_free = n_block_min
        if const_expr(self.HAS_LEFT):
            n_left_free = (
                cutlass.max(last_tok + tile.shift - window_left, 0) + self.TILE_N - 1
            ) // self.TILE_N
        n_masked_hi = cutlass.max(n_block_max - 1 - cutlass.max(n_right_free, n_block_min), 0)
        n_after = n_block_max - n_block_min - 1 - n_masked_hi
        n_unmasked = cutlass.max(
            cutlass.min(n_after, n_block_max - 1 - n_masked_hi - n_left_free), 0
        )
        return n_masked_hi, n_unmasked

    @cute.jit
    def consumer(
        self, mQ, mO, mLSE, mma_qk, mma_pv, sQ, sK, sVt, pipe_k, pipe_v, ctid: Int32, tile,
        split: Int32, heads_q: Int32, scale_log2: Float32, softcap_pre: Float32,
        window_left: Int32, window_right: Int32, n_block_min: Int32, n_block_max: Int32,
        fused: tuple,
    ):  # fmt: skip
        thr_qk = mma_qk.get_slice(ctid)
        thr_pv = mma_pv.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.TILE_M, self.TILE_N)))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.TILE_M, self.HEAD_DIM)))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((self.TILE_M, self.TILE_N)))
        assert cute.size(acc_S) == self.TILE_N // 2 and cute.size(acc_O) == self.HEAD_DIM // 2
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.TILE_M, self.TILE_N)))
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(Float32(-math.inf))
        row_sum.fill(0.0)
        acc_O.fill(0.0)
        self.load_q(mQ, sQ, ctid, tile, heads_q)

        n_blocks = n_block_max - n_block_min
        if n_blocks > 0:
            n_masked_hi, n_unmasked = self.mask_phases(
                tile, n_block_min, n_block_max, window_left, window_right
            )
            base = tile.m_block * self.TILE_M
            ctx = SimpleNamespace(
                mma_qk=mma_qk, mma_pv=mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, acc_S=acc_S,
                acc_O=acc_O, tOrP=tOrP, tScS=tScS, row_max=row_max, row_sum=row_sum,
                pipe_k=pipe_k, pipe_v=pipe_v, cwg=Int32(0), m_block=tile.m_block,
                seqlen_k=tile.seqlen_k, shift=tile.shift, scale_log2=scale_log2,
                softcap_pre=softcap_pre, window_left=window_left, window_right=window_right,
                tokens=tuple((base + tScS[2 * r][0]) // tile.group for r in range(2)),
                blk=None,  # no fp8 block descales (16-bit cache)
            )  # fmt: skip
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
            self.overlap_loop(
                ctx, kv_state, n_block_max - 1, 0, n_blocks, n_masked_hi, n_unmasked, None, None
            )
        self.epilogue(mO, mLSE, thr_pv, acc_O, tScS, row_max, row_sum, tile, split, heads_q,
                      scale_log2)  # fmt: skip
        if const_expr(self.FUSED_COMBINE):
            self.combine_if_last(mO, mLSE, fused, ctid, tile, heads_q)

    @cute.jit
    def out_index(self, tile, packed: Int32, split: Int32, heads_q: Int32):
        """(row of mO, index of mLSE) of packed row `packed`: out's rows are (b, t, h), the
        partials' (split, b, t, h) with their LSE alike; the final lse is (b, h, t)."""
        tok = packed // tile.group
        head = tile.head_kv * tile.group + (packed - tok * tile.group)
        o_row = (tile.batch * tile.seqlen_q + tok) * heads_q + head
        lse_at = (tile.batch * heads_q + head) * tile.seqlen_q + tok
        if const_expr(self.SPLIT):
            o_row = o_row + split * (cute.arch.grid_dim()[2] * tile.seqlen_q * heads_q)
            lse_at = o_row
        return o_row, lse_at

    @cute.jit
    def epilogue(self, mO, mLSE, thr_pv, acc_O, tScS, row_max, row_sum, tile, split: Int32,
                 heads_q: Int32, scale_log2: Float32):  # fmt: skip
        """O /= l (0 for a row without keys), then O and the LSE of each valid packed row
        straight to global memory (final or, with SPLIT, this split's partial)."""
        inv = cute.make_rmem_tensor((2,), Float32)
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.TILE_M, self.HEAD_DIM)))
        base = tile.m_block * self.TILE_M
        for r in cutlass.range_constexpr(2):
            inv[r], lse = finalize_row(row_max[r], row_sum[r], scale_log2, lambda rcp_l: rcp_l)
            packed = base + tScS[2 * r][0]
            # One lane of each quad owns the row's statistics; padding rows are not stored.
            if (tScS[0][1] == 0) & (packed < tile.rows):
                mLSE[self.out_index(tile, packed, split, heads_q)[1]] = lse
        rescale_rows(acc_O, inv)
        rO = cute.make_rmem_tensor_like(acc_O, self.o_dtype)
        rO.store(acc_O.load().to(self.o_dtype))
        for r in cutlass.range_constexpr(2):
            packed = base + tOcO[2 * r][0]
            if packed < tile.rows:
                gO = mO[self.out_index(tile, packed, split, heads_q)[0], None]  # (D,)
                for j in cutlass.range_constexpr(cute.size(acc_O) // 4):
                    for c in cutlass.range_constexpr(2):
                        i = 4 * j + 2 * r + c
                        gO[tOcO[i][1]] = rO[i]

    @cute.jit
    def combine_if_last(self, mO, mLSE, fused: tuple, ctid: Int32, tile, heads_q: Int32):
        """The split combine, fused: once this CTA's partial O and LSE are out, the consumer
        warpgroup publishes them (every thread fences, a barrier, thread 0 adds 1 to the
        (batch, kv head, m_block) counter with acquire-release at GPU scope) and learns by a
        counting barrier whether it was the last of the tile's splits. The last one merges
        all of them into out and lse (`merge_rows`) and sets the counter back to 0 for the
        next launch on the stream."""
        mOutF, mLseF, mSem, num_splits = fused
        _, hm, _ = cute.arch.block_idx()
        slot = tile.batch * cute.arch.grid_dim()[1] + hm
        cute.arch.fence_acq_rel_gpu()  # this thread's partial O and LSE, before the count
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=128)
        last = Int32(0)
        if ctid == 0:
            old = atom_add_acq_rel_gpu_s32(mSem.iterator + slot, Int32(1))
            last = Int32(1) if old == num_splits - 1 else Int32(0)
        if barrier_popc(int(Barrier.EPILOGUE), 128, last) > 0:
            cute.arch.fence_acq_rel_gpu()
            self.merge_rows(mO, mLSE, mOutF, mLseF, tile, ctid, num_splits, heads_q)
            if ctid == 0:
                mSem[slot] = Int32(0)

    @cute.jit
    def merge_rows(self, mO, mLSE, mOutF, mLseF, tile, ctid: Int32, num_splits: Int32,
                   heads_q: Int32):  # fmt: skip
        """out = sum_s exp(lse_s - lse) O_s, lse = logsumexp_s lse_s for the tile's valid
        packed rows, 4 columns per thread and step, one pass over the splits (in order 0 ..
        S-1, 4 in flight) with a running maximum, reading through L2 only; a row no split saw
        keys for gets out 0 and lse -inf (common.split_combine's arithmetic)."""
        quads = self.HEAD_DIM // 4
        first = tile.m_block * self.TILE_M
        n_rows = cutlass.min(tile.rows - first, self.TILE_M)
        total = cute.arch.grid_dim()[2] * tile.seqlen_q * heads_q  # rows of one split
        for i in cutlass.range(ctid, n_rows * quads, 128, unroll=1):
            r = i // quads
            col = (i - r * quads) * 4
            packed = first + r
            tok = packed // tile.group
            head = tile.head_kv * tile.group + (packed - tok * tile.group)
            o_row = (tile.batch * tile.seqlen_q + tok) * heads_q + head
            m = Float32(-math.inf)
            den = Float32(0.0)
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for s in cutlass.range(num_splits, unroll=4):
                row = o_row + s * total
                lse_s = ld_cg_f32(mLSE.iterator + row)
                o_s = ld_cg_v4_f32(mO.iterator + row * self.HEAD_DIM + col)
                m_new = cutlass.max(m, lse_s)
                m_use = Float32(0.0) if m_new == Float32(-math.inf) else m_new
                alpha = cute.math.exp2((m - m_use) * LOG2E, fastmath=True)
                w = cute.math.exp2((lse_s - m_use) * LOG2E, fastmath=True)
                den = den * alpha + w
                for j in cutlass.range_constexpr(4):
                    acc[j] = acc[j] * alpha + w * o_s[j]
                m = m_new
            seen = den > Float32(0.0)
            inv = cute.arch.rcp_approx(den) if seen else Float32(0.0)
            gO = mOutF[o_row, None]  # (D,)
            for j in cutlass.range_constexpr(4):
                gO[col + j] = self.dtype(acc[j] * inv)
            if col == 0:
                lse = (cute.math.log2(den, fastmath=True) * LN2 + m) if seen else Float32(-math.inf)
                mLseF[(tile.batch * heads_q + head) * tile.seqlen_q + tok] = lse
