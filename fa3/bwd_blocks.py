"""Which query row blocks a column block of the fa3 backward visits, in which order, and which
of them need the per-element mask (`bwd_kernel.Fa3Backward` mixes `BwdBlocks` in; the
producer, the MMA warpgroups and the dQ writer walk the same sequence).

Row i sees key j iff i + shift - left <= j <= i + shift + right (shift = seqlen_k - seqlen_q,
causal bottom-right: right = 0; a sliding window's (left, right) are runtime values). The row
blocks [m_block_min, m_block_max) of a column block are those with a row that sees one of its
keys; fully masked blocks are never visited. Blocks on the causal diagonal or the window's
edges, or holding keys past Nk, take the per-element mask (`BwdSteps`, bwd_pointwise.py).
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def section_tile(bid, n_blocks, pairs, section):
    """CTA `bid` of the sectioned grid order (BwdConfig.head_section = `section`) over
    `n_blocks` column blocks and `pairs` (kv head, batch) pairs -> (n_block, pair): sections of
    `section` pairs (the last may be narrower), within one column block 0 of each pair, then
    column block 1, ... Python ints or DSL Int32 alike."""
    per_section = section * n_blocks
    sec = bid // per_section
    r = bid - sec * per_section
    width = cutlass.min(section, pairs - sec * section)  # pairs in this section
    n_block = r // width
    return n_block, sec * section + r - n_block * width


class BwdBlocks:
    """Row-block ranges and mask tests of a column block. Uses the kernel's TILE_M, TILE_N,
    CAUSAL, LOCAL and HAS_RIGHT."""

    @cute.jit
    def row_blocks(
        self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, group: Int32, win: tuple | None
    ):
        """(m_block_min, n_m, n_iter): the row blocks [m_block_min, m_block_min + n_m) with a
        row that sees a key of n_block, and n_iter = n_m * group steps over the query heads.
        Row i sees key j iff i + shift - left <= j <= i + shift + right (shift = seqlen_k -
        seqlen_q; causal: right = 0; `win` = (left, right) in local builds).

        Called inside each role's branch, after setmaxnreg: values computed in the kernel's
        top region live through the register reallocation and ptxas spilled one there."""
        m_block_max = (seqlen_q + self.TILE_M - 1) // self.TILE_M
        m_block_min = Int32(0)
        shift = seqlen_k - seqlen_q
        if const_expr(self.LOCAL):
            window_left, window_right = win
            # The first row that sees the block's first key, the last that sees its last key.
            first_row = cutlass.max(n_block * self.TILE_N - shift - window_right, 0)
            last_key = cutlass.min((n_block + 1) * self.TILE_N, seqlen_k) - 1
            row_end = cutlass.max(last_key - shift + window_left + 1, 0)  # past the last row
            m_block_max = cutlass.min(m_block_max, (row_end + self.TILE_M - 1) // self.TILE_M)
            m_block_min = cutlass.min(first_row // self.TILE_M, m_block_max)
        elif const_expr(self.CAUSAL):
            # Row i sees key j iff i >= j - (seqlen_k - seqlen_q): the first row that sees the
            # block's first key.
            first_row = cutlass.max(n_block * self.TILE_N - shift, 0)
            m_block_min = cutlass.min(first_row // self.TILE_M, m_block_max)
        n_m = m_block_max - m_block_min
        return m_block_min, n_m, n_m * group

    @cute.jit
    def row_block(self, i: Int32, m_block_min: Int32, n_m: Int32, head_kv: Int32, group: Int32):
        """(query head, row block) of step i of the row-block loop: the heads of the GQA group
        one after another, each over its row blocks [m_block_min, m_block_min + n_m). The
        producer, the MMA warpgroups and the dQ writer walk the same sequence."""
        hq = i // n_m
        return head_kv * group + hq, m_block_min + i - hq * n_m

    @cute.jit
    def key_edges(self, n_block: Int32, seqlen_k: Int32, shift: Int32, win: tuple | None):
        """(key_tail, first_free_row) of column block n_block, before the row-block loop: whether
        it holds keys past seqlen_k, and the first row that sees all of its keys on the right
        (causal / window edge; rows >= it need no right-side mask)."""
        key_tail = (n_block + 1) * self.TILE_N > seqlen_k
        right_edge = 0  # the window's right edge: 0 when causal
        if const_expr(self.LOCAL):
            right_edge = win[1]
        return key_tail, (n_block + 1) * self.TILE_N - 1 - shift - right_edge

    @cute.jit
    def block_masked(
        self, m_block: Int32, n_block: Int32, shift: Int32, edges: tuple, win: tuple | None
    ):
        """Whether row block m_block needs the per-element mask against column block n_block:
        keys past seqlen_k, rows above the right edge's first_free_row (`key_edges`), or (window)
        rows below the last one that sees the block's first key."""
        key_tail, first_free_row = edges
        masked = key_tail
        if const_expr(self.HAS_RIGHT):
            masked = masked | (m_block * self.TILE_M < first_free_row)
        if const_expr(self.LOCAL):  # rows <= last_free_row see the block's first key
            last_free_row = n_block * self.TILE_N - shift + win[0]
            masked = masked | ((m_block + 1) * self.TILE_M - 1 > last_free_row)
        return masked
