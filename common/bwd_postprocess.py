"""dQ out of a backward's float32 accumulator, in one memory-bound Triton kernel.

A backward whose dQ is reduced into global memory tile by tile (fa3's writer warp) leaves an
accumulator of TILE_M x D blocks, one per (batch, head, row block), each in the order its MMA
fragments were stored (rows and columns interleaved for conflict-free shared-memory stores and
one bulk reduce per tile). That order is a linear layout: element (r, c) of a block sits at
row_off[r] + col_off[c]. `dq_postprocess` reads every block through those two offset tables and
writes dQ in the input dtype at its (token, head) place, times an optional scale, in one pass:
the block's 4 * TILE_M * D bytes are read once (a gather inside one contiguous block, which the
L1 serves) and dQ is written with row-contiguous, vectorised stores. Padding rows (past Nq, or
past a packed sequence's end) are never written, so dQ needs no slice copy afterwards.

Dense: accumulator (B, Hq, Nq_pad, D), dQ (B, Nq, Hq, D). Packed sequences: accumulator
(Hq, rows_pad, D) in the padded row layout of common.bwd_preprocess (`varlen_pad_rows`:
sequence b from padded row ((cu_seqlens_q[b] + b * TILE_M) // TILE_M) * TILE_M on), dQ
(total_q, Hq, D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_preprocess import first_pad_row, sequence_of_pad_row
from .triton_launch import launch, next_power_of_2


@triton.jit(do_not_specialize=["seqlen_q", "batch"])
def _dq_postprocess(
    Acc,  # dense (B, Hq, Nq_pad, D) / varlen (Hq, rows_pad, D) fp32, contiguous
    RowOff,  # (TILE_M,) int32: offset of row r inside a block
    ColOff,  # (D,) int32: offset of column c inside a block
    dQ,  # dense (B, Nq, Hq, D) / varlen (total_q, Hq, D), unit last stride
    CuQ,  # varlen: (B + 1,) int32 cumulative sequence lengths; dense: unused
    stride_ab,
    stride_ah,
    stride_qb,
    stride_qn,
    stride_qh,
    seqlen_q,  # dense: Nq (rows past it are padding)
    batch,  # varlen: B
    scale,
    TILE_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BM: tl.constexpr,  # TILE_M rounded up to a power of two
    BD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    VARLEN: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """Block (program 0) of head (program 1), batch (program 2) into dQ's rows."""
    start = tl.program_id(0) * TILE_M  # the block's first (padded) row
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BM)  # (BM,) rows of the block
    cols = tl.arange(0, BD)  # (BD,)
    r_ok = rows < TILE_M
    c_ok = cols < HEAD_DIM
    if VARLEN:  # a block lies in one sequence's padded rows
        seq = sequence_of_pad_row(CuQ, start, batch, TILE_M)
        q0 = tl.load(CuQ + seq).to(tl.int64)
        local = start - first_pad_row(CuQ, seq, TILE_M) + rows  # (BM,) rows of the sequence
        r_ok = r_ok & (local < tl.load(CuQ + seq + 1) - q0)
        dst_rows = q0 + local  # (BM,) packed rows
    else:
        dst_rows = start + rows  # (BM,)
        r_ok = r_ok & (dst_rows < seqlen_q)
    mask = r_ok[:, None] & c_ok[None, :]  # (BM, BD)
    row_off = tl.load(RowOff + rows, mask=r_ok, other=0)  # (BM,)
    col_off = tl.load(ColOff + cols, mask=c_ok, other=0)  # (BD,)
    block = Acc + off_b * stride_ab + off_h * stride_ah + start.to(tl.int64) * HEAD_DIM
    x = tl.load(block + row_off[:, None] + col_off[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        x = x * scale
    dst = dQ + off_b * stride_qb + off_h * stride_qh + dst_rows[:, None] * stride_qn
    tl.store(dst + cols[None, :], x.to(dQ.dtype.element_ty), mask=mask)


def dq_postprocess(
    acc: torch.Tensor,
    row_off: torch.Tensor,
    col_off: torch.Tensor,
    dq: torch.Tensor,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes `dq` (its dtype; the float32 product with `scale` first when given) from `acc`, a
    contiguous float32 (or float64) accumulator of TILE_M x D blocks (TILE_M = len(row_off), D =
    len(col_off)) whose element (r, c) of a block sits at row_off[r] + col_off[c]; returns dq.

    Dense: acc (B, Hq, Nq_pad, D), dq (B, Nq, Hq, D) with Nq <= Nq_pad, Nq_pad a multiple of
    TILE_M. Packed sequences (`cu_seqlens_q`, (B + 1,) int32): acc (Hq, rows_pad, D) in the
    padded row layout, dq (total_q, Hq, D). dq needs a unit last stride; the offset tables are
    int32 on acc's device and must address each of a block's TILE_M * D elements once (the
    caller's layout; not checked here)."""
    tile_m, d = row_off.numel(), col_off.numel()
    if not acc.is_floating_point():
        raise ValueError(f"dq_postprocess: acc expected a floating dtype, got {acc.dtype}")
    if not acc.is_contiguous() or acc.shape[-1] != d or acc.shape[-2] % tile_m:
        raise ValueError(
            f"dq_postprocess: acc expected contiguous (..., a multiple of {tile_m}, {d}), got "
            f"shape {tuple(acc.shape)} contiguous={acc.is_contiguous()}"
        )
    if dq.stride(-1) != 1 or dq.shape[-1] != d:
        raise ValueError(
            f"dq_postprocess: dq expected (..., {d}) with unit last stride, got shape "
            f"{tuple(dq.shape)} strides {dq.stride()}"
        )
    if row_off.dtype != torch.int32 or col_off.dtype != torch.int32:
        raise ValueError(
            f"dq_postprocess: offset tables expected int32, got {row_off.dtype}, {col_off.dtype}"
        )
    varlen = cu_seqlens_q is not None
    if varlen:
        hq, rows_pad, _ = acc.shape
        grid = (rows_pad // tile_m, hq, 1)
        strides = (0, acc.stride(0), 0, dq.stride(0), dq.stride(1))
        seqlen_q, batch = 0, cu_seqlens_q.shape[0] - 1
    else:
        b, hq, nq_pad, _ = acc.shape
        if dq.dim() != 4 or dq.shape[0] != b or dq.shape[2] != hq or dq.shape[1] > nq_pad:
            raise ValueError(
                f"dq_postprocess: dq expected (B {b}, Nq <= {nq_pad}, Hq {hq}, D {d}), got "
                f"{tuple(dq.shape)}"
            )
        grid = (nq_pad // tile_m, hq, b)
        strides = (acc.stride(0), acc.stride(1), *dq.stride()[:3])
        seqlen_q, batch = dq.shape[1], 1
    if dq.numel() == 0 or 0 in grid:
        return dq
    bm, bd = next_power_of_2(tile_m), next_power_of_2(d)
    launch(_dq_postprocess, grid, (
        acc, row_off, col_off, dq, cu_seqlens_q if varlen else row_off, *strides, seqlen_q,
        batch, 1.0 if scale is None else float(scale),
    ), dict(
        TILE_M=tile_m, HEAD_DIM=d, BM=bm, BD=bd, VARLEN=varlen, HAS_SCALE=scale is not None,
        num_warps=8 if bm * bd >= 16384 else 4,
    ))  # fmt: skip
    return dq
