"""Packed sequences (varlen) in the fa3 backward: which column block a CTA owns, and where its
sequence's rows live in every tensor the backward reads or writes.

The dense backward's grid is (n_blocks, Hkv, B) and its tensors are (B, N, H, D) views
indexed by `batch`. The packed one runs on a virtual grid of key blocks, as the varlen forward
does with query blocks (varlen.py): sequence b owns the virtual column blocks [K_b, K_b+1) with
K_b = (cu_seqlens_k[b] + b·TILE_N) // TILE_N, so the grid, (total_k // TILE_N + B, Hkv, 1), is
known from shapes, and a CTA whose block starts at or past its sequence's keys does nothing.

Where a sequence's rows are, per tensor (`SeqRowsBwd`; `DenseRowsBwd` is the dense index):
- Q, dO, K, V (loads) and dK, dV of the "dkv_t" layout (TMA stores): the ragged 4-D TMA views of
  varlen.py, bounded by the sequence's own length (tails zero-filled on load, dropped on store).
- dK, dV of the "sdp_t" layout (stores from registers, bounds tested per key row) and the
  "atomic" dQ accumulator (total_q, Hq, D): plain views moved to the sequence's first row.
- LSE (base 2), D = rowsum(dO·O), the "warp" dQ accumulator and the deterministic build's dQ
  turn counters (one per row block): a padded row layout shared by them, sequence b from row
  Q_b·TILE_M on with Q_b = (cu_seqlens_q[b] + b·TILE_M) // TILE_M (the varlen forward's
  first virtual query block). Row block m of sequence b is block
  Q_b + m of (Hq, rows_pad) with rows_pad = Q_B·TILE_M, whole TILE_M blocks that no other
  sequence touches (Q_b+1 - Q_b >= ceil(L_b / TILE_M)), so the TMA loads of LSE and D need no
  bound (the preprocess writes +inf and 0 on the padding rows), and every TILE_M x D block of
  the dQ accumulator is one bulk reduce in tile order, as in the dense (B, Hq, Nq_pad, D) one.
"""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import cutlass.cute as cute
from cutlass import Int32, const_expr

from flashsuite.fa3.varlen import DenseRows, SeqRows, VarlenTiles, ragged_view


class DenseRowsBwd(DenseRows):
    """A dense column block's sequence: index `batch` of every (rows, D, H, B) view."""

    def q_out(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """dQ accumulator rows ("atomic": (Nq, D, Hq, B)), one head: (Nq, D)."""
        return t[None, None, head, self.batch]

    def k_out(self, t: cute.Tensor, head_kv: Int32) -> cute.Tensor:
        """dK or dV rows ((Nk, D, Hkv, B)), one kv head: (Nk, D)."""
        return t[None, None, head_kv, self.batch]

    def stat_rows(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """LSE or D ((Nq_pad, Hq, B) TMA coordinates), one head: (Nq_pad,)."""
        return t[None, head, self.batch]

    def dq_tile(self, t: cute.Tensor, head: Int32, row: Int32):
        """The "warp" dQ accumulator (B, Hq, Nq_pad, D) at (head, row): a pointer."""
        return t.iterator + cute.crd2idx((self.batch, head, row, 0), t.layout)

    def turn_counter(self, t: cute.Tensor, head: Int32, m_block: Int32, tile_m: int):
        """The deterministic build's dQ turn counter of row block m_block of `head`, in the
        (B, Hq, row blocks) int32 counters: a pointer."""
        return t.iterator + cute.crd2idx((self.batch, head, m_block), t.layout)


class SeqRowsBwd(SeqRows):
    """A packed column block's sequence (SeqRows' rows of Q/dO and K/V) and `pad_row`, the first
    row of its padded LSE / D / dQ-accumulator rows (Q_b · TILE_M)."""

    FIELDS = (*SeqRows.FIELDS, "pad_row")

    def __init__(
        self,
        batch: Int32,
        offset_q: Int32,
        seqlen_q: Int32,
        offset_k: Int32,
        seqlen_k: Int32,
        pad_row: Int32,
    ) -> None:
        super().__init__(batch, offset_q, seqlen_q, offset_k, seqlen_k)
        self.pad_row = pad_row

    def q_out(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """dQ accumulator rows ("atomic": (total_q, D, Hq)) of this sequence, one head."""
        return cute.domain_offset((self.offset_q, 0), t[None, None, head])

    def k_out(self, t: cute.Tensor, head_kv: Int32) -> cute.Tensor:
        """dK or dV rows ((total_k, D, Hkv)) of this sequence, one kv head: (rows, D)."""
        return cute.domain_offset((self.offset_k, 0), t[None, None, head_kv])

    def stat_rows(self, t: cute.Tensor, head: Int32) -> cute.Tensor:
        """LSE or D ((rows_pad, Hq) TMA coordinates) of this sequence, one head."""
        return cute.domain_offset((self.pad_row,), t[None, head])

    def dq_tile(self, t: cute.Tensor, head: Int32, row: Int32):
        """The "warp" dQ accumulator (Hq, rows_pad, D) at (head, row of this sequence)."""
        return t.iterator + cute.crd2idx((head, self.pad_row + row, 0), t.layout)

    def turn_counter(self, t: cute.Tensor, head: Int32, m_block: Int32, tile_m: int):
        """The deterministic build's dQ turn counter of this sequence's row block m_block of
        `head`, in the (Hq, rows_pad / TILE_M) int32 counters, one per padded row block (the
        padded rows' layout above: a sequence's row blocks are whole and its own): a pointer.
        Q_b is offset_q // TILE_M + batch, from values the MMA threads hold anyway (pad_row
        kept live through their loop for this spilled 4 bytes at D = 96)."""
        block = self.offset_q // tile_m + self.batch + m_block  # Q_b + m_block
        return t.iterator + cute.crd2idx((head, block), t.layout)


class VarlenColumns:
    """The packed backward's grid: (virtual column blocks, Hkv, 1), virtual block ->
    (sequence, n_block), by the varlen forward's sequence search over cu_seqlens_k."""

    def __init__(self, tile_m: int, tile_n: int) -> None:
        self.TILE_M = tile_m
        self.TILE_N = tile_n
        self.keys = VarlenTiles(tile_n, longest_first=False)  # blocks over cu_seqlens_k
        self.rows = VarlenTiles(tile_m, longest_first=False)  # Q_b over cu_seqlens_q

    def grid_blocks(self, total_k: Int32, batch_n: Int32) -> Int32:
        """Virtual column blocks per kv head (host side, from shapes)."""
        return self.keys.grid_blocks(total_k, batch_n)

    @cute.jit
    def tile(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, batch_n: Int32):
        """This CTA's (n_block, head_kv, valid, SeqRowsBwd). `valid` is False on a block that
        starts at or past its sequence's last key (every thread computes the same value)."""
        vblock, head_kv, _ = cute.arch.block_idx()
        batch = self.keys.find_batch(mCuSeqlensK, batch_n, vblock)
        n_block = vblock - self.keys._first_block(mCuSeqlensK, batch)
        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        pad_row = self.rows._first_block(mCuSeqlensQ, batch) * self.TILE_M
        valid = n_block * self.TILE_N < seqlen_k
        rows = SeqRowsBwd(batch, offset_q, seqlen_q, offset_k, seqlen_k, pad_row)
        return n_block, head_kv, valid, rows


def packed_view(t: cute.Tensor, ragged: bool) -> cute.Tensor:
    """A packed (total, H, D) tensor as (total, D, H), or as the ragged (R, D, H, L) TMA view."""
    t = cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))
    return ragged_view(t) if const_expr(ragged) else t


__all__ = ["DenseRowsBwd", "SeqRowsBwd", "VarlenColumns", "packed_view"]
