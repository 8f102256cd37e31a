"""Which tile a CTA runs, and which blocks of the other operand that tile sees.

A tile is (m_block, head, batch): TILE_M query rows of one (batch, head). Without persistence
the grid is (m_blocks, Hq, B), one tile per CTA. Persistent: the grid is one CTA per SM and CTA
`bid` of `grid` walks tiles cta_tile(k) for k = 0 .. cta_tile_count - 1 of the `tile_coords`
order (heaviest causal tiles first, heads grouped so their K/V stay in L2). `balanced` (snake
order, alternating sections) evens out the CTAs' causal work. `block_range` is the range of
K/V blocks a Q tile can see. Everything static is an argument, so a backward kernel that
schedules K/V tiles reuses the same order with its own tile sizes.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


class TileScheduler:
    """The static schedule of one kernel: tile sizes, persistent order and window edges.

    `l2_kv_rows`: K and V rows (both tensors) of the (batch, head) pairs that the persistent
    order keeps in flight together. `longest_first`: tiles with more blocks start first (a
    right window bound, i.e. causal, makes later m_blocks heavier).
    """

    def __init__(
        self,
        tile_m: int,
        tile_n: int,
        *,
        balanced: bool,
        longest_first: bool,
        has_right: bool,
        has_left: bool,
        l2_kv_rows: int,
        lpt_grid: bool = False,
    ) -> None:
        self.TILE_M = tile_m
        self.TILE_N = tile_n
        self.BALANCED = balanced
        self.LONGEST_FIRST = longest_first
        self.HAS_RIGHT = has_right
        self.HAS_LEFT = has_left
        self.L2_KV_ROWS = l2_kv_rows
        self.LPT_GRID = lpt_grid  # the plain grid is one-dimensional, in tile_coords order

    def problem(
        self,
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        window_left: Int32,
        window_right: Int32,
        heads_q: Int32,
        batch_n: Int32,
    ) -> SimpleNamespace:
        """The schedule of this CTA, built in the kernel's top region: `tile0`, its (m_block,
        head, batch) on the plain grid; `bid_x`, `grid_x`, `num_tiles` for the persistent walk;
        and the problem (sequence lengths, GQA group, window)."""
        m_block0, head0, batch0 = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        m_blocks = (seqlen_q + self.TILE_M - 1) // self.TILE_M
        if const_expr(self.LPT_GRID):
            m_block0, head0, batch0 = self.tile_coords(
                m_block0, m_blocks, heads_q, batch_n, seqlen_k
            )
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

    def tile_work(self, k: Int32, sched: SimpleNamespace):
        """Tile `k` of this persistent CTA (every role walks the same sequence): its
        (m_block, head, batch) and its K/V block range [n_block_min, n_block_max)."""
        return self.tile_at(self.cta_tile(k, sched.bid_x, sched.grid_x), sched)

    def tile_at(self, tile: Int32, sched: SimpleNamespace):
        """`tile_work` of the tile at position `tile` of the order (a tile counter's value)."""
        m_block, head, batch = self.tile_coords(
            tile, sched.m_blocks, sched.heads_q, sched.batch_n, sched.seqlen_k
        )
        n_block_min, n_block_max = self.block_range(
            m_block, sched.seqlen_q, sched.seqlen_k, sched.window_left, sched.window_right
        )
        return m_block, head, batch, n_block_min, n_block_max

    def cta_blocks(self, sched: SimpleNamespace):
        """[n_block_min, n_block_max) of a non-persistent CTA's tile: `sched.blocks` where the
        kernel computed it once in its top region (the fp8 branch), else here, in the role's
        branch."""
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
        if const_expr(self.BALANCED):
            # Only the last round can be partial; whether it reaches us depends on its direction.
            full = num_tiles // grid
            off = bid if full % 2 == 0 else grid - 1 - bid
            count = full + (1 if off < num_tiles - full * grid else 0)
        return count

    @cute.jit
    def cta_tile(self, k: Int32, bid: Int32, grid: Int32) -> Int32:
        """The position in the tile order of CTA `bid`'s k-th tile.

        Round-robin: bid + k * grid, so CTA 0 takes the heaviest tile of every round.
        BALANCED (snake): odd rounds run backwards, a CTA's heavy tile of one round pairs
        with a light one of the next and the per-CTA sums even out.
        """
        off = bid
        if const_expr(self.BALANCED):
            off = bid if k % 2 == 0 else grid - 1 - bid
        return k * grid + off

    @cute.jit
    def tile_coords(
        self, tile: Int32, m_blocks: Int32, heads_q: Int32, batch_n: Int32, seqlen_k: Int32
    ):
        """Persistent tile index -> (m_block, head, batch).

        (batch, head) pairs are taken in sections of L2_KV_ROWS // seqlen_k pairs whose
        K and V fit in L2 together, so the CTAs running at once share their K/V reads; inside a
        section the head is the fastest index. LONGEST_FIRST (causal): the m_blocks run from
        the last one down, so the tiles that see the most keys start first (longest processing
        time first) and the light ones fill the tail. BALANCED: every other section, counted
        back from the last, runs from the first m_block up instead.
        """
        hb_total = heads_q * batch_n
        section = cutlass.max(cutlass.min(self.L2_KV_ROWS // seqlen_k, hb_total), 1)
        section_tiles = section * m_blocks
        sec = tile // section_tiles
        r = tile - sec * section_tiles
        in_sec = cutlass.min(section, hb_total - sec * section)  # the last section may be short
        m_block = r // in_sec
        if const_expr(self.LONGEST_FIRST):
            if const_expr(self.BALANCED):
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
