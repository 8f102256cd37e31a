"""The backward's preprocess, shared by fa2 and fa3: delta = rowsum(dO * O) and
lse2 = LSE * log2(e), float32, padded to whole row blocks, in one memory-bound Triton kernel
(no float32 copies of O and dO, one launch). Given fa3's float32 dQ accumulator in row blocks
(one row of D per padded row), the same launch zeroes it, instead of a fill kernel of its own.

`bwd_preprocess` is the launcher; `_bwd_preprocess` the kernel (fa2 launches it directly with
its own row padding). `varlen_bwd_preprocess` does the same for packed sequences into the
padded row layout of fa3's varlen backward (`varlen_pad_rows`: sequence b from row
((cu_seqlens_q[b] + b·tile_m) // tile_m)·tile_m on, whole tile_m blocks of its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
BLOCK_M = 64  # rows per program: memory-bound, any tile that vectorises


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_pad"])
def _bwd_preprocess(
    Out,  # (B, Nq, Hq, Dv)
    dOut,  # (B, Nq, Hq, Dv)
    Lse,  # (B, Hq, Nq) fp32, natural log
    Delta,  # (B, Hq, Nq_pad) fp32 out, contiguous
    Lse2,  # (B, Hq, Nq_pad) fp32 out, contiguous
    stride_ob,
    stride_on,
    stride_oh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_lb,
    stride_lh,
    stride_lm,
    seqlen_q,
    seqlen_pad,  # Nq rounded up to a multiple of every backward BLOCK_M
    num_heads,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DqAcc=None,  # (B, Hq, Nq_pad, ZERO_D) fp32 contiguous, zeroed here (ZERO_D > 0)
    ZERO_D: tl.constexpr = 0,
    ZERO_PAD: tl.constexpr = 1,  # next_power_of_2(ZERO_D)
):
    """delta = rowsum(dO * O) (the softmax-Jacobian term of dS = P * (dP - delta)) and
    lse2 = LSE * log2(e), both fp32 and padded to seqlen_pad rows; with ZERO_D > 0 also the
    ZERO_D floats of every one of those rows in DqAcc set to 0.

    lse2 is +inf for rows that saw no key (LSE = -inf) and for padding rows, so that
    P = exp2(S - lse2) is exactly 0 there; delta is 0 on padding rows. The main kernels then
    load both without masks: masked vector loads in their pipelined loops cost ~1 KB of spills.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) local rows
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = (start_m + offs_m) < seqlen_q  # (BLOCK_M,)
    mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # (BLOCK_M, DV_PAD)
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    o_ptrs = o_ptrs + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + offs_m[:, None] * stride_on + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    do_ptrs = dOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    do_ptrs = do_ptrs + start_m.to(tl.int64) * stride_don
    do_ptrs = do_ptrs + offs_m[:, None] * stride_don + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, DV_PAD)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, DV_PAD)
    delta = tl.sum(o * do, 1)  # (BLOCK_M,)
    l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
    lse = tl.load(l_ptrs + (start_m + offs_m) * stride_lm, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # (BLOCK_M,)
    row = (off_b.to(tl.int64) * num_heads + off_h) * seqlen_pad + start_m + offs_m  # (BLOCK_M,)
    tl.store(Delta + row, delta)
    tl.store(Lse2 + row, lse2)
    if ZERO_D > 0:
        _zero_rows(DqAcc, row, ZERO_D, ZERO_PAD, BLOCK_M)


@triton.jit
def _zero_rows(Acc, row, ZERO_D: tl.constexpr, ZERO_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Acc[row, :ZERO_D] = 0 for the BLOCK_M rows `row` of a (rows, ZERO_D) fp32 buffer: a
    row block of dQ in any in-block order is ZERO_D times its rows of contiguous floats."""
    offs = tl.arange(0, ZERO_PAD)  # (ZERO_PAD,)
    ptrs = Acc + row[:, None] * ZERO_D + offs[None, :]  # (BLOCK_M, ZERO_PAD)
    zeros = tl.zeros([BLOCK_M, ZERO_PAD], dtype=tl.float32)
    tl.store(ptrs, zeros, mask=(offs < ZERO_D)[None, :])


def _check_acc(acc: torch.Tensor | None, rows: tuple[int, ...], what: str) -> dict:
    """The zeroing arguments of a preprocess launch for accumulator `acc` (rows..., D) float32
    contiguous on the rows of delta (their defaults, named, without one: a launch that names
    every parameter is memoised); a clear error for any other."""
    if acc is None:
        return {"DqAcc": None, "ZERO_D": 0, "ZERO_PAD": 1}
    if acc.dtype != torch.float32 or acc.dim() != len(rows) + 1 or tuple(acc.shape[:-1]) != rows:
        raise ValueError(
            f"{what}: dq_acc expected float32 of shape {(*rows, 'D')}, got "
            f"{str(acc.dtype).removeprefix('torch.')} {tuple(acc.shape)}"
        )
    if not acc.is_contiguous():
        raise ValueError(f"{what}: dq_acc expected contiguous, got strides {acc.stride()}")
    d = acc.shape[-1]
    return {"DqAcc": acc, "ZERO_D": d, "ZERO_PAD": next_power_of_2(d)}


def bwd_preprocess(
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    seqlen_pad: int,
    dq_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, lse2), both (B, Hq, seqlen_pad) float32 contiguous, for out and dout
    (B, Nq, Hq, Dv) with unit last stride and lse (B, Hq, Nq) float32 (natural log).

    delta = rowsum(dO * O) (0 on padding rows); lse2 = LSE * log2(e), +inf where LSE = -inf (a
    row that sees no key) and on the padding rows, so that P = exp2(S - lse2) is exactly 0
    there. `seqlen_pad` must be a multiple of BLOCK_M and >= Nq. `dq_acc`, (B, Hq, seqlen_pad,
    D) float32 contiguous (fa3's accumulator in row blocks), is zeroed by the same launch."""
    b, nq, hq, dv = out.shape
    if seqlen_pad % BLOCK_M or seqlen_pad < nq:
        raise ValueError(
            f"bwd_preprocess: seqlen_pad expected a multiple of {BLOCK_M} >= {nq}, got {seqlen_pad}"
        )
    zero = _check_acc(dq_acc, (b, hq, seqlen_pad), "bwd_preprocess")
    delta = torch.empty(b, hq, seqlen_pad, dtype=torch.float32, device=out.device)
    lse2 = torch.empty(b, hq, seqlen_pad, dtype=torch.float32, device=out.device)
    if b * hq == 0 or seqlen_pad == 0:
        return delta, lse2
    launch(_bwd_preprocess, (seqlen_pad // BLOCK_M, hq, b), (
        out, dout, lse, delta, lse2, *out.stride()[:3], *dout.stride()[:3], *lse.stride(),
        nq, seqlen_pad, hq,
    ), dict(HEAD_DIM_V=dv, DV_PAD=next_power_of_2(dv), BLOCK_M=BLOCK_M, **zero))  # fmt: skip
    return delta, lse2


@triton.jit
def first_pad_row(CuQ, b, TILE_M: tl.constexpr):
    """The first padded row of sequence b: ((cu_seqlens_q[b] + b * TILE_M) // TILE_M) * TILE_M."""
    return (tl.load(CuQ + b) + b * TILE_M) // TILE_M * TILE_M


@triton.jit
def sequence_of_pad_row(CuQ, row, batch, TILE_M: tl.constexpr):
    """The sequence whose padded rows hold padded row `row`: the largest b < batch whose first
    padded row is <= row (binary search; sequence 0 starts at row 0)."""
    lo = 0
    hi = batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if first_pad_row(CuQ, mid, TILE_M) <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["batch", "rows_pad"])
def _varlen_bwd_preprocess(
    Out,  # (total_q, Hq, Dv)
    dOut,  # (total_q, Hq, Dv)
    Lse,  # (Hq, total_q) fp32, natural log
    Delta,  # (Hq, rows_pad) fp32 out, contiguous
    Lse2,  # (Hq, rows_pad) fp32 out, contiguous
    CuQ,  # (B + 1,) int32
    stride_on,
    stride_oh,
    stride_don,
    stride_doh,
    stride_lh,
    batch,
    rows_pad,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_M: tl.constexpr,
    DqAcc=None,  # (Hq, rows_pad, ZERO_D) fp32 contiguous, zeroed here (ZERO_D > 0)
    ZERO_D: tl.constexpr = 0,
    ZERO_PAD: tl.constexpr = 1,
):
    """delta and lse2 (as `_bwd_preprocess`) of padded rows [pid·BLOCK_M, +BLOCK_M), which lie
    in one tile_m block and so in one sequence's padded rows: every padded row is written,
    +inf / 0 past the sequence's end, whatever max_seqlen_q says; with ZERO_D > 0 those rows
    of DqAcc zeroed."""
    start = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    lo = sequence_of_pad_row(CuQ, start, batch, TILE_M)
    q0 = tl.load(CuQ + lo).to(tl.int64)
    seqlen_q = tl.load(CuQ + lo + 1) - q0
    offs_m = start - first_pad_row(CuQ, lo, TILE_M) + tl.arange(0, BLOCK_M)  # sequence rows
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q  # (BLOCK_M,)
    mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # (BLOCK_M, DV_PAD)
    rows = q0 + offs_m  # (BLOCK_M,) packed rows (masked where past the sequence)
    o = tl.load(Out + off_h * stride_oh + rows[:, None] * stride_on + offs_dv[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    do = tl.load(dOut + off_h * stride_doh + rows[:, None] * stride_don + offs_dv[None, :],
                 mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    lse = tl.load(Lse + off_h * stride_lh + rows, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), LOG2E * lse)  # (BLOCK_M,)
    dst = off_h * rows_pad + start + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    tl.store(Delta + dst, tl.sum(o * do, 1))
    tl.store(Lse2 + dst, lse2)
    if ZERO_D > 0:
        _zero_rows(DqAcc, dst, ZERO_D, ZERO_PAD, BLOCK_M)


def varlen_pad_rows(total_q: int, batch: int, tile_m: int) -> int:
    """rows_pad of the padded row layout: ((total_q + B·tile_m) // tile_m)·tile_m rows, the
    first padded row of a sequence B past the last."""
    return (total_q + batch * tile_m) // tile_m * tile_m


def varlen_pad_index(cu_seqlens_q: torch.Tensor, total_q: int, tile_m: int) -> torch.Tensor:
    """(total_q,) int64: the padded row of every packed row (on cu_seqlens_q's device, no
    host copy): row i of sequence b, packed at cu_seqlens_q[b] + i, is padded row
    ((cu_seqlens_q[b] + b·tile_m) // tile_m)·tile_m + i."""
    cu = cu_seqlens_q.to(torch.int64)
    rows = torch.arange(total_q, dtype=torch.int64, device=cu.device)  # (total_q,)
    seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)  # (total_q,) sequence b
    start = cu[seq]  # (total_q,) cu_seqlens_q[b]
    return rows - start + (start + seq * tile_m) // tile_m * tile_m


def varlen_bwd_preprocess(
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    tile_m: int,
    dq_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, lse2), both (Hq, rows_pad) float32 contiguous in the padded row layout
    (`varlen_pad_index`), for out and dout (total_q, Hq, Dv) with unit last stride, lse
    (Hq, total_q) float32 (natural log) and cu_seqlens_q (B + 1,) int32. As `bwd_preprocess`:
    delta 0 and lse2 +inf on every padding row. `tile_m` must be a multiple of BLOCK_M.
    `dq_acc`, (Hq, rows_pad, D) float32 contiguous, is zeroed by the same launch."""
    total_q, hq, dv = out.shape
    batch = cu_seqlens_q.shape[0] - 1
    if tile_m % BLOCK_M:
        raise ValueError(
            f"varlen_bwd_preprocess: tile_m expected a multiple of {BLOCK_M}, got {tile_m}"
        )
    rows_pad = varlen_pad_rows(total_q, batch, tile_m)
    zero = _check_acc(dq_acc, (hq, rows_pad), "varlen_bwd_preprocess")
    delta = torch.empty(hq, rows_pad, dtype=torch.float32, device=out.device)
    lse2 = torch.empty(hq, rows_pad, dtype=torch.float32, device=out.device)
    if hq * rows_pad == 0:
        return delta, lse2
    launch(_varlen_bwd_preprocess, (rows_pad // BLOCK_M, hq), (
        out, dout, lse, delta, lse2, cu_seqlens_q, *out.stride()[:2], *dout.stride()[:2],
        lse.stride(0), batch, rows_pad,
    ), dict(
        HEAD_DIM_V=dv, DV_PAD=next_power_of_2(dv), BLOCK_M=BLOCK_M, TILE_M=tile_m, **zero,
    ))  # fmt: skip
    return delta, lse2
