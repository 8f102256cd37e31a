"""Packed sequences (varlen) in the fa3 forward: where a tile's rows live, which tile a CTA runs.

Dense inputs are (B, N, H, D) and the kernel views them as (N, D, H, B): a tile's sequence is
`t[None, None, head, batch]` and TMA's bounds are that sequence's. Packed inputs are
(total, H, D), sequence b being rows cu_seqlens[b] .. cu_seqlens[b+1] - 1. A plain offset view of
the packed tensor would let a tail tile read the next sequence's rows and, worse, let the O store
write them. `ragged_view` gives every packed tensor a 4-D TMA view whose bound on the rows is the
sequence's own length, so packed tiles behave as dense ones: loads past a sequence's end are
zero-filled and stores past it are dropped by the TMA unit.

The ragged view (the construction flash-attention's CuTe kernels use for their varlen O store):
shape (R, D, H, L) with strides (s, 1, s_h, s): the row stride s twice, R = 2^30, L = 2^31 - 1,
and the base pointer moved back by R rows. Coordinate (R - len + i, d, h, off + len) addresses
base - R·s + (R - len + i)·s + (off + len)·s = base + (off + i)·s, row i of the sequence that
starts at row `off`, and TMA keeps it only if R - len + i < R, i.e. i < len. `SeqRows` applies
that to a tile's (batch, offset, length); `DenseRows` is the dense case's one index.

`VarlenTiles` maps a CTA to its tile without a host-side pass over cu_seqlens: sequence b owns
the "virtual" m-blocks [P_b, P_b+1) with P_b = (cu_seqlens_q[b] + b·TILE_M) // TILE_M. P is
strictly increasing and P_b+1 - P_b = 1 + floor(cu[b+1] / T) - floor(cu[b] / T) >= ceil(L_b / T),
so every m-block of every sequence has a virtual block, at most one per sequence is spare (it
exits at once), and the grid, P_B = total_q // TILE_M + B blocks per head, is known on the host
from shapes alone. Each warp finds its block's sequence with one load of 32 cu_seqlens entries
and a ballot per 32 sequences (P_b <= v for b <= batch).
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from flashsuite.fa3.bwd_blocks import section_tile

RAGGED_ROWS = 2**30  # R: the ragged view's row extent (larger than any sequence)
RAGGED_LAST = 2**31 - 1  # L: the extent of the mode that carries offset + length


def ragged_view(t: cute.Tensor) -> cute.Tensor:
    """A packed kernel view (total, D, H) as the 4-D ragged TMA view (R, D, H, L) (host side)."""
    shape = (RAGGED_ROWS, t.shape[1], t.shape[2], RAGGED_LAST)
    stride = (*t.stride, t.stride[0])
    base = cute.domain_offset((-RAGGED_ROWS, 0, 0), t).iterator
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


class _Values:
    """Int32 fields carried through the DSL's dynamic regions (`if`, loops) as run-time values:
    the fields named in FIELDS, in that order."""

    FIELDS: tuple[str, ...] = ()

    def __extract_mlir_values__(self) -> list:
        return [v for f in self.FIELDS for v in cutlass.extract_mlir_values(getattr(self, f))]

    def __new_from_mlir_values__(self, values: list):
        new = object.__new__(type(self))
        for f in self.FIELDS:
            n = len(cutlass.extract_mlir_values(getattr(self, f)))
            setattr(new, f, cutlass.new_from_mlir_values(getattr(self, f), values[:n]))
            values = values[n:]
        return new


class DenseRows(_Values):
    """A dense tile's sequence: batch index `batch` of the (N, D, H, B) views."""

    FIELDS = ("batch",)

    def __init__(self, batch: Int32) -> None:
        self.batch = batch

    def q_rows(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """Rows of Q or O of this sequence, one head: (Nq, D) (TMA coordinates)."""
        return t[None, None, head, self.batch]

    def k_rows(self, t: cute.Tensor, head_kv: Int32) -> cute.Tensor:
        """Rows of K or V of this sequence, one kv head: (Nk, D) (fp8 Vᵀ: (D, Nk))."""
        return t[None, None, head_kv, self.batch]


class SeqRows(_Values):
    """A packed tile's sequence: rows [offset, offset + length) of the ragged views, for Q/O and
    for K/V each. `batch` is the sequence index."""

    FIELDS = ("batch", "offset_q", "seqlen_q", "offset_k", "seqlen_k")

    def __init__(
        self, batch: Int32, offset_q: Int32, seqlen_q: Int32, offset_k: Int32, seqlen_k: Int32
    ) -> None:
        self.batch = batch
        self.offset_q, self.seqlen_q = offset_q, seqlen_q
        self.offset_k, self.seqlen_k = offset_k, seqlen_k

    @staticmethod
    def _rows(t: cute.Tensor, head: Int32, offset: Int32, length: Int32) -> cute.Tensor:
        # (R, D) at last coordinate offset + length, then R - length rows on: row i is the
        # sequence's row i, in bounds iff i < length.
        return cute.domain_offset((RAGGED_ROWS - length, 0), t[None, None, head, offset + length])

    def q_rows(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """Rows of Q or O of this sequence, one head: (R, D), TMA bound = seqlen_q."""
        return self._rows(t, head, self.offset_q, self.seqlen_q)

    def k_rows(self, t: cute.Tensor, head_kv: Int32) -> cute.Tensor:
        """Rows of K or V of this sequence, one kv head: (R, D), TMA bound = seqlen_k."""
        return self._rows(t, head_kv, self.offset_k, self.seqlen_k)

    def lse_rows(self, mLSE: cute.Tensor, head: Int32) -> cute.Tensor:
        """The LSE of this sequence and head: mLSE (total_q, Hq) -> rows from offset_q on
        (only rows < seqlen_q are written)."""
        return cute.domain_offset((self.offset_q,), mLSE[None, head])


class VarlenTiles:
    """The packed grid: (virtual m-blocks, Hq, 1), virtual block -> (sequence, m_block)."""

    def __init__(self, tile_m: int, longest_first: bool, head_section: int = 0) -> None:
        self.TILE_M = tile_m
        self.HEAD_SECTION = head_section
        # Causal: the grid runs each head's virtual blocks from the last one down, so a
        # sequence's heavier (later) m-blocks start first, as the persistent order does.
        self.LONGEST_FIRST = longest_first

    def grid_blocks(self, total_q: Int32, batch_n: Int32) -> Int32:
        """P_B: virtual m-blocks per head (host side, from shapes)."""
        return (total_q + batch_n * self.TILE_M) // self.TILE_M

    @cute.jit
    def _first_block(self, mCuSeqlensQ: cute.Tensor, b: Int32) -> Int32:
        """P_b, the first virtual block of sequence b."""
        return (mCuSeqlensQ[b] + b * self.TILE_M) // self.TILE_M

    @cute.jit
    def find_batch(self, mCuSeqlensQ: cute.Tensor, batch_n: Int32, vblock: Int32) -> Int32:
        """The sequence whose virtual blocks hold `vblock`: the largest b < B with P_b <= vblock
        (every lane of the warp gets it). P_0 = 0, so there is one."""
        lane = cute.arch.lane_idx()
        batch = Int32(0)
        base = Int32(0)
        more = cutlass.Boolean(True)
        while more:
            b = base + lane
            below = cutlass.Boolean(False)
            if b < batch_n:
                below = self._first_block(mCuSeqlensQ, b) <= vblock
            count = cute.arch.popc(cute.arch.vote_ballot_sync(below))
            if count > 0:
                batch = base + count - 1
            base += 32
            more = (count == 32) & (base < batch_n)
        return batch

    @cute.jit
    def tile(
        self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, batch_n: Int32, heads_q=None
    ):
        """This CTA's tile: (m_block, head, valid, SeqRows). `valid` is False for the spare
        virtual block of a sequence (its rows start at or past the sequence's end; every warp
        of the CTA computes the same value and the CTA does nothing). HEAD_SECTION > 0: the
        one-dimensional grid over P_B x `heads_q` CTAs in sections of HEAD_SECTION heads
        (bwd_blocks.section_tile: each virtual block of the section's heads in turn)."""
        if const_expr(self.HEAD_SECTION):
            bid, _, _ = cute.arch.block_idx()
            p_blocks = self._first_block(mCuSeqlensQ, batch_n)  # P_B: cu_seqlens_q[B] = total
            vblock, head = section_tile(bid, p_blocks, heads_q, self.HEAD_SECTION)
            if const_expr(self.LONGEST_FIRST):
                vblock = p_blocks - 1 - vblock
        else:
            vblock, head, _ = cute.arch.block_idx()
            if const_expr(self.LONGEST_FIRST):
                grid_x, _, _ = cute.arch.grid_dim()
                vblock = grid_x - 1 - vblock
        batch = self.find_batch(mCuSeqlensQ, batch_n, vblock)
        m_block = vblock - self._first_block(mCuSeqlensQ, batch)
        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        valid = m_block * self.TILE_M < seqlen_q
        return m_block, head, valid, SeqRows(batch, offset_q, seqlen_q, offset_k, seqlen_k)


def lse_view(mLSE: cute.Tensor, varlen: bool) -> cute.Tensor:
    """The LSE's kernel view: dense (B, Hq, Nq) -> (Nq, Hq, B); packed (Hq, total_q) ->
    (total_q, Hq)."""
    if const_expr(varlen):
        return cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0]))
    return cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))


def rows_view(t: cute.Tensor, varlen: bool) -> cute.Tensor:
    """Q, K, (16-bit) V or O in the kernel's (rows, D, H, B) view: dense (B, N, H, D) permuted,
    packed (total, H, D) as the ragged (R, D, H, L) view."""
    if const_expr(varlen):
        return ragged_view(cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


__all__ = ["DenseRows", "SeqRows", "VarlenTiles", "lse_view", "ragged_view", "rows_view"]
